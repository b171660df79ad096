"""Tiny torch CPU calls (issue 16): the per-signature runner stays exact.

A repeat call of a signature goes straight to anynorm's packed kernels (:mod:`anynorm._torch_direct`,
small calls with nothing for autograd to record) or to torch's kernel and a conditioning
check chosen once per signature (``route="torch"``: the direct path off,
as for larger calls and recorded ones).  These tests change the data, the parameters' dtypes
and NaN placement between calls of one signature, so that a check or a dtype decision taken
once for the signature rather than per call would fail them.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference

torch = pytest.importorskip("torch")
import anynorm  # noqa: E402
from anynorm import _torch_direct  # noqa: E402

F32_EPS = float(np.finfo(np.float32).eps)
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (op, shape, keyword arguments): the asv small-call shapes and a few other tiny layouts
CASES = [
    ("layer_norm", (4, 8), {}),
    ("layer_norm", (2, 3, 8), {}),
    ("layer_norm", (8,), {}),
    ("layer_norm", (4, 8), {"axis": 0}),
    ("rms_norm", (4, 8), {}),
    ("group_norm", (3, 30, 7, 9), {"num_groups": 5}),
    ("instance_norm", (2, 3, 5), {}),
]
IDS = [f"{op} {'x'.join(map(str, shape))} {kw}" for op, shape, kw in CASES]


def _eps(op, dtype):
    return float(torch.finfo(dtype).eps) if op == "rms_norm" else 1e-5


def _call(op, x, w=None, b=None, **kw):
    kw = dict(kw)
    if op == "group_norm":
        return anynorm.group_norm(x, kw.pop("num_groups"), w, b, **kw)
    if op == "rms_norm":
        return anynorm.rms_norm(x, w, **kw)
    return getattr(anynorm, op)(x, w, b, **kw)


def _params(op, shape, kw, seed=3):
    rng = np.random.default_rng(seed)
    if op in ("layer_norm", "rms_norm"):
        axis = kw.get("axis", -1)
        pshape = tuple(shape[a % len(shape)] for a in sorted(
            a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,))))
    else:
        pshape = (shape[1],)
    return rng.random(pshape) + 0.5, rng.random(pshape) - 0.5


def _offsets(shape, kind, seed):
    """Data far from zero: one offset for all, or a different offset per leading index."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if kind == "near":
        return x
    if kind == "1e4":
        return x + 1e4
    if kind == "1e6":
        return x + 1e6
    # "per slice": offsets 0, 1e2, 1e4, 1e6 (then 1e6 again) along axis 0
    return x + (10.0 ** np.minimum(2 * np.arange(shape[0]), 6) - 1).reshape((-1,) + (1,) * (len(shape) - 1))


def _torch_kernel_route(monkeypatch):
    """Small calls on torch's kernel and the check: the direct path's limits at 0, short rows
    not given to anynorm's kernels (the plans made again: they memoize the rule)."""
    from anynorm import _plan, _torch

    for name in ("DIRECT_MAX_ELEMENTS", "DIRECT_MAX_COLUMN_ELEMENTS", "DIRECT_MAX_SEGMENTED_ELEMENTS",
                 "DIRECT_MAX_THREADED_ELEMENTS"):
        monkeypatch.setattr(_torch_direct, name, 0)
    monkeypatch.setattr(_torch, "SHORT_ROW_MAX", 0)
    _plan.plan_for.cache_clear()
    anynorm._calls.clear()


@pytest.fixture(params=["direct", "torch"])
def route(request, monkeypatch):
    """The small-call route: anynorm's row kernel, or torch's kernel and the check."""
    if request.param == "torch":
        _torch_kernel_route(monkeypatch)
    anynorm._calls.clear()
    yield request.param
    anynorm._calls.clear()


@pytest.fixture(autouse=True)
def _plans_made_again():
    """No plan keeps a rule a test patched (plans memoize their routes)."""
    yield
    from anynorm import _plan

    _plan.plan_for.cache_clear()


@pytest.mark.parametrize("stats", [False, True], ids=["y", "stats"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op,shape,kw", CASES, ids=IDS)
def test_repeat_calls_stay_exact_as_the_data_moves(op, shape, kw, dtype, stats, route):
    """One signature, data near zero first (the check passes), then far from zero (1e4, 1e6,
    a different offset per slice): every call exact, with and without the statistics."""
    w64, b64 = _params(op, shape, kw)
    w, b = torch.from_numpy(w64).to(dtype), torch.from_numpy(b64).to(dtype)
    bias = None if op == "rms_norm" else b
    half = dtype in HALF_ULP
    for i, kind in enumerate(["near", "1e4", "near", "1e6", "per slice", "near"]):
        if half and kind in ("1e4", "1e6", "per slice"):
            # half dtypes hold no unit-scale detail at 1e4: far data with a scale to match
            x64 = _offsets(shape, "near", i) * 8 + (300.0 if kind != "per slice" else 0.0)
            if kind == "per slice":  # offsets 1, 16, 256, 4096 (then 4096 again)
                x64 += (2.0 ** np.minimum(4 * np.arange(shape[0]), 12)).reshape((-1,) + (1,) * (len(shape) - 1))
        else:
            x64 = _offsets(shape, kind, i)
        xt = torch.from_numpy(x64).to(dtype)
        x_in = xt.double().numpy()  # the rounded input the reference sees
        y_ref, mean_ref, rstd_ref = reference.forward(
            op, x_in, w.double().numpy(), None if bias is None else bias.double().numpy(),
            eps=_eps(op, dtype), **kw)
        with torch.no_grad():
            out = _call(op, xt, w, bias, return_stats=stats, **kw)
        y = (out[0] if stats else out).double().numpy()
        scale = np.max(np.abs(y_ref))
        bound = 2 * HALF_ULP[dtype] * scale if half else 32 * F32_EPS * scale
        assert np.max(np.abs(y - y_ref)) <= bound, (kind, np.max(np.abs(y - y_ref)), bound)
        if stats:
            rstd = out[-1]
            assert rstd.dtype == (torch.float32 if half else dtype)
            np.testing.assert_allclose(rstd.double().numpy(), rstd_ref, rtol=1e-5 if half else 64 * F32_EPS)
            if mean_ref is not None:
                far = np.max(np.abs(mean_ref))
                assert np.max(np.abs(out[1].double().numpy() - mean_ref)) <= 8 * F32_EPS * max(far, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op,shape,kw", [c for c in CASES if c[0] != "rms_norm"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] != "rms_norm"])
def test_parameter_dtypes_change_between_calls(op, shape, kw, dtype, route):
    """x's signature fixed, the parameters' dtypes changing call to call (float64 with float32
    x, float32 with half x, mixed): each result as its float64 reference, far from zero."""
    w64, b64 = _params(op, shape, kw)
    x64 = _offsets(shape, "1e4" if dtype is torch.float32 else "near", 7)
    if dtype is not torch.float32:
        x64 = x64 * 8 + 300.0
    xt = torch.from_numpy(x64).to(dtype)
    combos = [(dtype, dtype), (torch.float64, torch.float64), (torch.float32, torch.float32),
              (dtype, torch.float32), (torch.float32, dtype), (dtype, dtype)]
    for wd, bd in combos:
        w, b = torch.from_numpy(w64).to(wd), torch.from_numpy(b64).to(bd)
        y_ref = reference.forward(op, xt.double().numpy(), w.double().numpy(), b.double().numpy(),
                                  eps=1e-5, **kw)[0]
        y = _call(op, xt, w, b, **kw)
        assert y.dtype == dtype
        scale = np.max(np.abs(y_ref))
        bound = 2 * HALF_ULP[dtype] * scale if dtype in HALF_ULP else 32 * F32_EPS * scale
        assert np.max(np.abs(y.double().numpy() - y_ref)) <= bound, (wd, bd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op,shape,kw", [c for c in CASES if c[0] != "rms_norm"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] != "rms_norm"])
def test_half_parameters_changed_in_place_between_stats_calls(op, shape, kw, dtype, route):
    """Half x, half parameters, the statistics asked for (torch's kernels then take float32
    copies of the parameters): parameters changed in place between calls without a version
    bump (``p.data.copy_``, a write through a NumPy view) or with one; every result follows
    the parameters' current values, with and without a weight or a bias."""
    w64, b64 = _params(op, shape, kw)
    xt = torch.from_numpy(_offsets(shape, "near", 5)).to(dtype)
    w = torch.nn.Parameter(torch.from_numpy(w64).to(dtype))
    b = torch.nn.Parameter(torch.from_numpy(b64).to(dtype))
    x = xt.double().numpy()
    rng = np.random.default_rng(11)
    for step in range(4):
        with torch.no_grad():
            for args in ((w, b), (w, None), (None, b)):
                got = _call(op, xt, *args, return_stats=True, **kw)
                want = reference.forward(op, x, *(None if p is None else p.double().numpy() for p in args),
                                         eps=1e-5, **kw)
                scale = np.max(np.abs(want[0]))
                assert np.max(np.abs(got[0].double().numpy() - want[0])) <= HALF_ULP[dtype] * scale, (step, args is None)
                assert got[1].dtype == got[2].dtype == torch.float32
                np.testing.assert_allclose(got[2].numpy(), want[2], rtol=1e-5)
        new_w, new_b = rng.random(w.shape) + 0.5, rng.random(b.shape) - 0.5
        if step == 0:
            w.data.copy_(torch.from_numpy(new_w))
            b.data.copy_(torch.from_numpy(new_b))
        elif step == 1 and dtype is torch.float16:  # NumPy has float16 only
            w.detach().numpy()[...] = new_w
            b.detach().numpy()[...] = new_b
        else:
            with torch.no_grad():
                w.copy_(torch.from_numpy(new_w))
                b.copy_(torch.from_numpy(new_b))


@pytest.mark.parametrize("nan_at", ["first", "middle"])
@pytest.mark.parametrize("op,shape,kw", [("group_norm", (3, 30, 7, 9), {"num_groups": 5}),
                                          ("layer_norm", (4, 8), {}),
                                          ("layer_norm", (2, 3, 8), {})],
                         ids=["gn (N, groups)", "ln (rows, 1)", "ln 3-d"])
def test_nan_slice_does_not_hide_a_far_slice_in_small_calls(op, shape, kw, nan_at, route):
    """The Python-float checks: a NaN slice (first or in the middle) gives NaN, and the check
    still sees the last slice far from zero."""
    x = np.random.default_rng(5).standard_normal(shape)
    flat = x.reshape(shape[0], -1)
    flat[-1] += 1e4  # the last sample: far from zero (all its slices)
    nan_sample = 0 if nan_at == "first" else shape[0] // 2
    flat[nan_sample, 0] = np.nan
    xt = torch.from_numpy(x.astype(np.float32))
    _call(op, torch.randn(shape), **kw)  # the signature's runner made on well-conditioned data
    y = _call(op, xt, **kw).double().numpy()
    assert np.isnan(y.reshape(shape[0], -1)[nan_sample]).any()
    keep = [i for i in range(shape[0]) if i != nan_sample]
    sub = x.astype(np.float32)[keep].astype(np.float64)
    y_ref = reference.forward(op, sub, eps=1e-5, **kw)[0]
    assert np.max(np.abs(y[keep] - y_ref)) <= 32 * F32_EPS * np.max(np.abs(y_ref))


@pytest.mark.parametrize("op,shape,kw", [c for c in CASES if c[0] != "rms_norm"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] != "rms_norm"])
def test_small_call_gradients_far_from_zero(op, shape, kw):
    """Autograd through the small-call runner at offset 1e4: dx, dweight, dbias as the float64
    reference's backward."""
    w64, b64 = _params(op, shape, kw)
    x64 = _offsets(shape, "1e4", 11).astype(np.float32).astype(np.float64)
    dy64 = np.random.default_rng(12).standard_normal(shape)
    grads_ref = reference.backward(op, dy64, x64, w64.astype(np.float32).astype(np.float64),
                                   eps=1e-5, **kw)
    for _ in range(2):  # the second call is a cache hit
        xt = torch.from_numpy(x64).float().requires_grad_(True)
        w = torch.from_numpy(w64).float().requires_grad_(True)
        b = torch.from_numpy(b64).float().requires_grad_(True)
        _call(op, xt, w, b, **kw).backward(torch.from_numpy(dy64).float())
        for got, ref, name in zip((xt.grad, w.grad, b.grad), grads_ref, ("dx", "dweight", "dbias")):
            scale = max(np.max(np.abs(ref)), 1.0)
            err = np.max(np.abs(got.double().numpy() - ref))
            assert err <= 1e-4 * scale, (name, err)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("stats", [False, True], ids=["y", "stats"])
@pytest.mark.parametrize("op,shape,kw", [c for c in CASES if c[0] != "rms_norm"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] != "rms_norm"])
def test_signature_that_meets_far_data_shifts_first_and_stays_exact(op, shape, kw, stats, grad,
                                                                     monkeypatch):
    """float32: after two reruns a signature shifts first (torch's kernel on x - shift, no
    rerun for far data any more); far, per-slice, near and NaN data all stay exact (the
    direct path off: it serves unrecorded small calls without a check)."""
    from anynorm import _torch

    _torch_kernel_route(monkeypatch)
    reruns = []
    rerun = _torch._shift_and_rerun
    monkeypatch.setattr(_torch, "_shift_and_rerun", lambda *a: reruns.append(1) or rerun(*a))
    anynorm._calls.clear()
    w64, b64 = _params(op, shape, kw)
    w, b = torch.from_numpy(w64).float(), torch.from_numpy(b64).float()
    kinds = ["1e4", "1e6", "1e4", "1e6", "per slice", "near", "1e6", "nan"]
    for i, kind in enumerate(kinds):
        x64 = _offsets(shape, "1e4" if kind == "nan" else kind, 20 + i)
        if kind == "nan":
            x64.reshape(-1)[0] = np.nan
        x32 = x64.astype(np.float32)
        xt = torch.from_numpy(x32).requires_grad_(grad)
        y_ref, mean_ref, rstd_ref = reference.forward(op, x32.astype(np.float64), w64.astype(np.float32),
                                                      b64.astype(np.float32), eps=1e-5, **kw)
        out = _call(op, xt, w, b, return_stats=stats, **kw)
        y = (out[0] if stats else out).detach().double().numpy()
        ok = ~np.isnan(y_ref)
        assert np.isnan(y[~ok]).all(), kind
        if not ok.any():  # one slice, NaN
            continue
        scale = np.max(np.abs(y_ref[ok]))
        assert np.max(np.abs(y[ok] - y_ref[ok])) <= 32 * F32_EPS * scale, (kind, np.max(np.abs(y[ok] - y_ref[ok])))
        if stats and mean_ref is not None:
            mean = out[1].detach().double().numpy()
            good = ~np.isnan(mean_ref)
            far = np.max(np.abs(mean_ref[good]))
            assert np.max(np.abs(mean[good] - mean_ref[good])) <= 8 * F32_EPS * max(far, 1.0), kind
            np.testing.assert_allclose(out[2].detach().double().numpy()[good], rstd_ref[good], rtol=64 * F32_EPS)
    # the first two far calls reran; from then on the signature shifted first
    assert len(reruns) == 2, reruns


@pytest.mark.parametrize("op,shape,kw", [("layer_norm", (16, 64), {}), ("layer_norm", (8, 2048), {}),
                                          ("group_norm", (4, 16, 8, 8), {"num_groups": 4})],
                         ids=["ln 16x64", "ln 8x2048", "gn 4x16x8x8"])
def test_float32_limit_serves_moderate_ratios_and_reruns_beyond(op, shape, kw, monkeypatch):
    """float32 slices with |mean| * rstd up to the row-kernel limit (8) take torch's kernel
    once, within 4 float32 eps of max|y| (the measurement where ``_LIMITS`` is defined); a
    ratio of 12 reruns on the shifted data (the direct path off)."""
    from anynorm import _torch

    _torch_kernel_route(monkeypatch)
    assert _torch._LIMITS[torch.float32][0] == 8.0
    reruns = []
    real = _torch._shift_and_rerun

    def counting(*args):
        reruns.append(1)
        return real(*args)

    monkeypatch.setattr(_torch, "_shift_and_rerun", counting)
    anynorm._calls.clear()
    for ratio, want_rerun in ((3.0, False), (7.0, False), (12.0, True)):
        rng = np.random.default_rng(int(ratio))
        base = rng.standard_normal(shape)
        axes = tuple(range(1, len(shape)))
        if op == "layer_norm":
            axes = (len(shape) - 1,)
        groups = kw.get("num_groups")
        if groups:  # standardize each group
            b = base.reshape(shape[0], groups, -1)
            b = (b - b.mean(-1, keepdims=True)) / b.std(-1, keepdims=True)
            base = b.reshape(shape)
        else:
            base = (base - base.mean(axes, keepdims=True)) / base.std(axes, keepdims=True)
        x64 = 0.5 * base + 0.5 * ratio * (1 - 2 * (np.arange(shape[0]) % 2)).reshape((-1,) + (1,) * (len(shape) - 1))
        xt = torch.from_numpy(x64).float()
        reruns.clear()
        y, mean, rstd = _call(op, xt, return_stats=True, **kw)
        y_ref, _, rstd_ref = reference.forward(op, xt.double().numpy(), eps=1e-5, **kw)
        assert bool(reruns) == want_rerun, ratio
        scale = np.max(np.abs(y_ref))
        assert np.max(np.abs(y.double().numpy() - y_ref)) <= 4 * F32_EPS * scale, ratio
        np.testing.assert_allclose(rstd.double().numpy(), rstd_ref, rtol=4 * F32_EPS)
