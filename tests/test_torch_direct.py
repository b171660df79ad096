"""Small torch CPU calls on anynorm's packed kernels (``anynorm._torch_direct``, issue 16).

Small calls that autograd does not record run the packed row or column kernel on the
tensors' memory: layer/RMS norm over trailing axes, group/instance norm of contiguous NCHW
(NCDHW) tensors, channels-first layer norm, group/instance norm with channels last;
float32/float64 and half x with float32 parameters or parameters of x's dtype.  These tests check that those calls reach the kernel, that they are exact far
from zero where torch's kernel is not, and that every call it must not serve (autograd,
torch.func, other layouts, subclasses, mixed or strided parameters) still gets its result.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from support import PACKED_COLUMN_CASES, PACKED_SEGMENTED_CASES, call, count_packed_kernel_calls

torch = pytest.importorskip("torch")
import anynorm  # noqa: E402
from anynorm import _native, _torch_direct, _torch_openmp  # noqa: E402

pytestmark = pytest.mark.skipif(_native.rows_packed_kernel(np.float32) is None,
                                reason="anynorm's CPU kernels are not built here")

F32_EPS = float(np.finfo(np.float32).eps)
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# (op, shape, keyword arguments, parameter shape)
CASES = [
    ("layer_norm", (4, 8), {}, (8,)),
    ("layer_norm", (3, 37), {}, (37,)),
    ("layer_norm", (2, 5, 6, 7), {"axis": (-2, -1)}, (6, 7)),
    ("layer_norm", (1, 8192), {}, (8192,)),
    ("rms_norm", (4, 8), {}, (8,)),
    ("rms_norm", (6, 100), {}, (100,)),
    ("group_norm", (3, 30, 7, 9), {"num_groups": 5}, (30,)),
    ("group_norm", (2, 8, 3, 4, 5), {"num_groups": 2}, (8,)),
    ("instance_norm", (2, 3, 5), {}, (3,)),
    ("instance_norm", (4, 6, 7, 7), {}, (6,)),
] + PACKED_SEGMENTED_CASES + PACKED_COLUMN_CASES
IDS = [f"{op} {'x'.join(map(str, shape))}" for op, shape, _, _ in CASES]


def _eps(op, dtype):
    return float(torch.finfo(dtype).eps) if op == "rms_norm" else 1e-5


@pytest.fixture
def kernel_calls(monkeypatch):
    """A list that grows by one for every packed-kernel call made from now on."""
    yield count_packed_kernel_calls(monkeypatch)
    anynorm._calls.clear()


def _inputs(shape, pshape, dtype, pdtype, offset, seed=0):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(shape) + offset).to(dtype)
    w = torch.from_numpy(rng.random(pshape) + 0.5).to(pdtype)
    b = torch.from_numpy(rng.random(pshape) - 0.5).to(pdtype)
    return x, w, b


@pytest.mark.parametrize("stats", [False, True], ids=["y", "stats"])
@pytest.mark.parametrize("dtype,pdtype", [(torch.float32, torch.float32), (torch.float64, torch.float64),
                                          (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float16, torch.float16), (torch.float16, torch.float32)],
                         ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("op,shape,kw,pshape", CASES, ids=IDS)
def test_small_calls_reach_the_kernel_and_match_the_reference(op, shape, kw, pshape, dtype, pdtype, stats,
                                                              kernel_calls):
    """Each small call runs the kernel once (the half-parameter kernel for half parameters),
    with weight and bias, one of them or none, and matches the float64 reference of its
    rounded inputs: y to float32 rounding (half: one ulp of x's dtype), the statistics too."""
    if dtype is torch.float16 and _native.rows_packed_kernel(np.float16) is None:
        pytest.skip("no float16 kernel on this CPU")
    x, w, b = _inputs(shape, pshape, dtype, pdtype, 3.0)
    half = dtype in HALF_ULP
    for params in ((w, b), (w, None), (None, b), (None, None)):
        if op == "rms_norm" and params[1] is not None:
            continue
        wp, bp = params
        args = (wp,) if op == "rms_norm" else params
        before = len(kernel_calls)
        with torch.no_grad():
            out = call(op, x, *args, return_stats=stats, **kw)
            out_again = call(op, x, *args, return_stats=stats, **kw)  # the cached runner
        assert len(kernel_calls) == before + 2, "the direct path was not taken"
        want_half_params = half and (wp if wp is not None else bp) is not None and pdtype is dtype
        assert kernel_calls[-1] == want_half_params
        y_ref, mean_ref, rstd_ref = reference.forward(
            op, x.double().numpy(), *(None if p is None else p.double().numpy() for p in args),
            eps=_eps(op, dtype), **kw)
        for got in (out, out_again):
            y = got[0] if stats else got
            assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
            scale = np.max(np.abs(y_ref))
            bound = HALF_ULP[dtype] * scale if half else (4e-15 if dtype is torch.float64 else 8 * F32_EPS) * scale
            assert np.max(np.abs(y.double().numpy() - y_ref)) <= bound
            if stats:
                acc = torch.float32 if half else dtype
                tol = 4e-15 if dtype is torch.float64 else 8 * F32_EPS
                rstd = got[-1]
                assert rstd.dtype == acc and tuple(rstd.shape) == rstd_ref.shape
                np.testing.assert_allclose(rstd.double().numpy(), rstd_ref, rtol=tol)
                if mean_ref is not None:
                    mean = got[1]
                    assert mean.dtype == acc and tuple(mean.shape) == mean_ref.shape
                    np.testing.assert_allclose(mean.double().numpy(), mean_ref, rtol=tol, atol=tol)
                else:
                    assert len(got) == 2


def _torch_functional(op, x, w, b, kw):
    """The call by torch.nn.functional, its axes moved where F needs them (as users write it)."""
    import torch.nn.functional as F

    ndim = x.dim()
    if op == "layer_norm":
        axis = kw.get("axis", -1)
        axes = sorted(a % ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
        order = [a for a in range(ndim) if a not in axes] + axes
        inverse = sorted(range(ndim), key=order.__getitem__)
        return F.layer_norm(x.permute(order), [x.shape[a] for a in axes], w, b, 1e-5).permute(inverse)
    c = kw.get("channel_axis", 1) % ndim
    order = [0, c] + [a for a in range(1, ndim) if a != c]
    inverse = sorted(range(ndim), key=order.__getitem__)
    xt = x.permute(order)
    if op == "group_norm":
        return F.group_norm(xt, kw["num_groups"], w, b, 1e-5).permute(inverse)
    return F.instance_norm(xt, weight=w, bias=b, eps=1e-5).permute(inverse)


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("op,shape,kw,pshape", [c for c in CASES if c[0] != "rms_norm"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] != "rms_norm"])
def test_small_float32_calls_far_from_zero_beat_torch(op, shape, kw, pshape, offset, kernel_calls):
    """float32 data offset by 1e4 and 1e6: the direct path's error is float32 rounding of y,
    at most half torch's own error on the same data (torch.nn.functional's one-pass kernels)."""
    x, w, b = _inputs(shape, pshape, torch.float32, torch.float32, offset, seed=4)
    with torch.no_grad():
        y = call(op, x, w, b, **kw)
        y_torch = _torch_functional(op, x, w, b, kw)
    assert kernel_calls
    y_ref = reference.forward(op, x.double().numpy(), w.double().numpy(), b.double().numpy(), eps=1e-5, **kw)[0]
    scale = np.max(np.abs(y_ref))
    err = np.max(np.abs(y.double().numpy() - y_ref))
    err_torch = np.max(np.abs(y_torch.double().numpy() - y_ref))
    assert err <= 8 * F32_EPS * scale
    assert err <= 0.5 * err_torch, (err, err_torch)


@pytest.mark.parametrize("op,shape,kw,pshape", [c for c in CASES if c[1][0] > 1],
                         ids=[i for i, c in zip(IDS, CASES) if c[1][0] > 1])
def test_nan_stays_in_its_slice(op, shape, kw, pshape, kernel_calls):
    """A NaN in one slice of a direct call: that slice's y is NaN, no other's."""
    x, w, b = _inputs(shape, pshape, torch.float32, torch.float32, 0.0, seed=6)
    x.view(-1)[x.numel() // 2] = float("nan")
    args = (w,) if op == "rms_norm" else (w, b)
    with torch.no_grad():
        y = call(op, x, *args, **kw)
    assert kernel_calls
    y_ref = reference.forward(op, x.double().numpy(), *(p.double().numpy() for p in args), eps=_eps(op, x.dtype),
                              **kw)[0]
    assert np.array_equal(np.isnan(y.numpy()), np.isnan(y_ref))
    assert np.isnan(y_ref).any() and not np.isnan(y_ref).all()


def test_half_parameters_give_the_float32_parameters_bits(kernel_calls):
    """bfloat16/float16 x: parameters of x's dtype (the half-parameter kernel) and the same
    values as float32 (the other) give the same bits: both widen exactly."""
    for dtype in (torch.bfloat16, torch.float16):
        if dtype is torch.float16 and _native.rows_packed_kernel(np.float16) is None:
            continue
        for op, shape, kw, pshape in CASES:
            x, w, b = _inputs(shape, pshape, dtype, dtype, 1.0, seed=8)
            args = (w,) if op == "rms_norm" else (w, b)
            with torch.no_grad():
                y_half = call(op, x, *args, **kw)
                y_float = call(op, x, *(p.float() for p in args), **kw)
            assert torch.equal(y_half, y_float), (dtype, op, shape)
    assert True in kernel_calls and False in kernel_calls


def test_calls_it_must_not_serve_still_get_their_results(kernel_calls):
    """Autograd recording, torch.func.vmap, a tensor subclass, strided or mixed-dtype
    parameters, a moved axis, channels-last memory and a residual take the other paths: no
    kernel call from here, and the results agree with the reference (gradients with
    torch.nn.functional's)."""
    import torch.nn.functional as F

    x, w, b = _inputs((4, 8), (8,), torch.float32, torch.float32, 0.0, seed=9)
    y_ref = torch.from_numpy(reference.forward("layer_norm", x.double().numpy(), w.double().numpy(),
                                               b.double().numpy(), eps=1e-5)[0]).float()

    def close(y):
        return torch.allclose(y, y_ref, atol=1e-5)

    xg, wg, bg = (t.clone().requires_grad_(True) for t in (x, w, b))
    y = anynorm.layer_norm(xg, wg, bg)
    assert y.grad_fn is not None and close(y.detach())
    y.backward(torch.ones_like(y) * torch.arange(8.0))
    xf, wf, bf = (t.clone().requires_grad_(True) for t in (x, w, b))
    F.layer_norm(xf, (8,), wf, bf, 1e-5).backward(torch.ones(4, 8) * torch.arange(8.0))
    for got, want in ((xg.grad, xf.grad), (wg.grad, wf.grad), (bg.grad, bf.grad)):
        assert torch.allclose(got, want, atol=1e-5)
    with torch.no_grad():  # requires_grad without grad mode: the kernel serves it
        before = len(kernel_calls)
        assert close(anynorm.layer_norm(xg, wg, bg)) and len(kernel_calls) == before + 1
    with torch.no_grad():
        anynorm.layer_norm(x[:2], w, b)  # the (2, 8) signature's runner, direct, cached
    count = len(kernel_calls)
    batched = torch.func.vmap(lambda t: anynorm.layer_norm(t, w, b))(x.reshape(2, 2, 8))
    assert close(batched.reshape(4, 8))

    class Tagged(torch.Tensor):
        pass

    assert close(torch.Tensor(anynorm.layer_norm(x.as_subclass(Tagged), w, b)))
    wide = torch.stack([w, w], 1)[:, 0]  # stride 2
    assert not wide.is_contiguous() and close(anynorm.layer_norm(x, wide, b))
    assert close(anynorm.layer_norm(x, w.double(), b.double()))
    assert close(anynorm.layer_norm(x, w, b.double()))
    assert close(anynorm.layer_norm(x.t().contiguous().t(), w, b))
    assert kernel_calls[count:] == []
    xs = torch.from_numpy(np.random.default_rng(2).standard_normal((2, 6, 3, 3))).float()
    xs_last = xs.contiguous(memory_format=torch.channels_last)
    gn_ref = anynorm.group_norm(xs, 2)
    count = len(kernel_calls)
    assert torch.allclose(anynorm.group_norm(xs_last, 2), gn_ref, atol=1e-5)
    y, h = anynorm.layer_norm(x, w, b, residual=torch.zeros_like(x))
    assert close(y) and torch.equal(h, x)
    assert kernel_calls[count:] == []


def test_inputs_unchanged_and_outputs_new(kernel_calls):
    """The call writes only its fresh outputs; inference-mode tensors take the path too."""
    x, w, b = _inputs((3, 30, 7, 9), (30,), torch.float32, torch.float32, 2.0, seed=10)
    saved = [t.clone() for t in (x, w, b)]
    with torch.no_grad():
        y, mean, rstd = anynorm.group_norm(x, 5, w, b, return_stats=True)
    with torch.inference_mode():
        y_inf = anynorm.group_norm(x, 5, w, b)
    assert len(kernel_calls) == 2
    assert torch.equal(y, y_inf)
    for t, s in zip((x, w, b), saved):
        assert torch.equal(t, s)
    pointers = {t.data_ptr() for t in (x, w, b)}
    assert not pointers & {y.data_ptr(), mean.data_ptr(), rstd.data_ptr()}
    assert mean.shape == rstd.shape == (3, 5)


@pytest.fixture
def call_threads(monkeypatch):
    """A list that grows by the ``threads`` of every packed-kernel call from now on."""
    threads = count_packed_kernel_calls(monkeypatch, lambda half_params, sizes: sizes.threads)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield threads
    torch.set_num_threads(saved)
    anynorm._calls.clear()


@pytest.mark.parametrize("found", [True, False], ids=["team", "no team"])
def test_larger_row_calls_run_on_torchs_team(found, call_threads, monkeypatch):
    """Up to DIRECT_MAX_ELEMENTS (half that in bfloat16) the row kernel serves a call on one
    thread; past it on torch.get_num_threads() threads of torch's OpenMP team where the
    kernels have its entry points (else torch's kernel, on all its threads, is the faster),
    up to DIRECT_MAX_THREADED_ELEMENTS; past that torch's route."""
    limit = _torch_direct.DIRECT_MAX_ELEMENTS
    monkeypatch.setattr(_torch_direct, "DIRECT_MAX_THREADED_ELEMENTS", 4 * limit)
    if not found:
        monkeypatch.setattr(_torch_openmp, "_KERNELS", False)
    team = 2 if _torch_openmp.kernels_on_team() else None
    with torch.no_grad():
        for dtype, elements, threads in ((torch.float32, limit, 1), (torch.float32, limit + 2, team),
                                         (torch.float32, 4 * limit + 2, None),
                                         (torch.bfloat16, limit // 2, 1), (torch.bfloat16, limit // 2 + 2, team)):
            call_threads.clear()
            anynorm.layer_norm(torch.randn(2, elements // 2, dtype=dtype))
            assert call_threads == ([] if threads is None else [threads]), (dtype, elements)
        torch.set_num_threads(1)  # a caller who limits torch's threads limits ours
        call_threads.clear()
        anynorm.layer_norm(torch.randn(2, limit // 2 + 1))
        assert call_threads == ([1] if team else [])


def test_channels_last_group_norm_in_half_dtypes_keeps_torchs_kernel(call_threads, monkeypatch):
    """Past one thread's share the column kernel's calls run on the team too, but for
    channels-last group norm in half dtypes where torch's kernel serves the signature (its
    half channels-last kernel is the faster: (8, 64, 64, 320) bfloat16 1.00-1.06x F against
    1.68x on the column kernel)."""
    from anynorm import _torch
    from anynorm._plan import make_plan

    if not _torch_openmp.kernels_on_team():
        pytest.skip("torch's OpenMP team not found here")
    monkeypatch.setattr(_torch_direct, "DIRECT_MAX_COLUMN_ELEMENTS", 0)
    with torch.no_grad():
        for dtype, threads in ((torch.float32, [2]), (torch.bfloat16, []), (torch.float16, [])):
            x = torch.randn(2, 32, 32, 16, dtype=dtype)  # 1024 pixels: torch's kernel serves
            w = torch.ones(16, dtype=dtype)
            assert _torch._prefers_native(make_plan("group_norm", x, w, w, num_groups=4, channel_axis=-1), x)
            call_threads.clear()
            anynorm.group_norm(x, 4, w, w, channel_axis=-1)
            assert call_threads == threads, dtype
            call_threads.clear()
            anynorm.instance_norm(x, w, w, channel_axis=-1)
            assert call_threads == [2], dtype


@pytest.mark.parametrize("stats", [False, True], ids=["y", "stats"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("op,shape,kw,pshape", [
    ("layer_norm", (37, 40), {}, (40,)),
    ("rms_norm", (5, 3, 16), {"axis": (1, 2)}, (3, 16)),
    ("layer_norm", (3, 13, 16), {"axis": (0, 2)}, (3, 16)),  # segmented rows
    ("instance_norm", (3, 5, 7, 7), {}, (5,)),  # a parameter a row, modulo the channels
    ("group_norm", (3, 12, 5, 5), {"num_groups": 4}, (12,)),  # runs of 25 in rows of 75
    ("group_norm", (5, 6, 4, 4), {"num_groups": 3}, (6,)),
    ("layer_norm", (3, 6, 5, 7), {"axis": 1}, (6,)),  # the column kernel's, by samples
    ("instance_norm", (3, 4, 5, 6), {"channel_axis": -1}, (6,)),
    ("group_norm", (5, 3, 3, 12), {"num_groups": 4, "channel_axis": -1}, (12,)),
], ids=["rows", "rms rows", "segmented", "instance nchw", "group nchw 4", "group nchw 3", "channels-first",
        "instance nhwc", "group nhwc"])
def test_calls_on_the_team_match_one_thread_bit_for_bit(op, shape, kw, pshape, dtype, stats, call_threads,
                                                       monkeypatch):
    """The rows (samples) cut among the team's threads (the rows' bounds at multiples of the
    parameters' period where parameters repeat by row) give the bits one thread gives, and
    the reference's values far from zero."""
    if not _torch_openmp.kernels_on_team():
        pytest.skip("torch's OpenMP team not found here")
    for name in ("DIRECT_MAX_ELEMENTS", "DIRECT_MAX_SEGMENTED_ELEMENTS", "DIRECT_MAX_COLUMN_ELEMENTS"):
        monkeypatch.setattr(_torch_direct, name, 0)  # every call past one thread's share
    x, w, b = _inputs(shape, pshape, dtype, dtype, 1e4, seed=5)
    args = (w,) if op == "rms_norm" else (w, b)
    kw = {**kw, "eps": 1e-5, "return_stats": stats}
    with torch.no_grad():
        if op == "group_norm":
            g = kw.pop("num_groups")
            run = lambda: anynorm.group_norm(x, g, *args, **kw)  # noqa: E731
        else:
            run = lambda: getattr(anynorm, op)(x, *args, **kw)  # noqa: E731
        on_team = run()
        torch.set_num_threads(1)
        alone = run()
    assert call_threads == [2, 1]
    on_team, alone = (out if stats else (out,) for out in (on_team, alone))
    for a, b_ in zip(on_team, alone):
        assert torch.equal(a, b_)
    where = {k: v for k, v in kw.items() if k not in ("return_stats",)}
    if op == "group_norm":
        where["num_groups"] = g
    ref = reference.forward(op, x.double().numpy(), *(p.double().numpy() for p in args), **where)[0]
    tol = 64 * float(np.finfo(np.float32).eps) if dtype is torch.float32 else (
        1e-12 if dtype is torch.float64 else 2.0 ** -7)
    assert np.max(np.abs(on_team[0].double().numpy() - ref)) <= tol * max(1.0, np.max(np.abs(ref)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op,shape,kw,pshape", [
    ("layer_norm", (2, 96, 40, 40), {"axis": 1}, (96,)),  # channels-first: the executor's kernel
    ("rms_norm", (640, 1024), {}, (1024,)),  # RMS rows of 512K and up: likewise
], ids=["channels-first 2x96x40x40", "rms 640x1024"])
def test_calls_the_executor_would_run_on_the_kernels_go_straight(op, shape, kw, pshape, dtype, kernel_calls):
    """Calls torch's route hands to anynorm's kernels anyway, below the executor's threading
    size, take the packed kernel straight: outputs of 1 MiB and up from the executor's reused
    blocks, statistics as their own tensors, as the reference's."""
    x, w, b = _inputs(shape, pshape, dtype, dtype, 5.0, seed=12)
    args = (w,) if op == "rms_norm" else (w, b)
    with torch.no_grad():
        outs = [call(op, x, *args, return_stats=True, eps=1e-5, **kw) for _ in range(3)]
    assert len(kernel_calls) == 3
    ref = reference.forward(op, x.double().numpy(), *(p.double().numpy() for p in args), eps=1e-5, **kw)
    half = dtype in HALF_ULP
    for out in outs:
        assert out[0].shape == x.shape and out[-1].shape == ref[2].shape and out[-1].dtype == torch.float32
        scale = np.max(np.abs(ref[0]))
        bound = HALF_ULP[dtype] if half else 8 * F32_EPS
        assert np.max(np.abs(out[0].double().numpy() - ref[0])) <= bound * scale
        np.testing.assert_allclose(out[-1].double().numpy(), ref[2], rtol=8 * F32_EPS)
        if op == "layer_norm":
            np.testing.assert_allclose(out[1].double().numpy(), ref[1], rtol=8 * F32_EPS)
    assert outs[0][0].data_ptr() != outs[1][0].data_ptr()  # each call's y its own while alive



def test_channels_last_images_under_torchs_split_take_the_kernels(kernel_calls):
    """Group/instance norm with channels last on images of fewer than
    TORCH_CHANNELS_LAST_SPLIT_MIN pixels (torch's kernel reads each (sample, group) strided
    there, up to 65x the time in bfloat16) take anynorm's kernels when nothing is recorded, from
    that size on torch's; recorded small calls keep torch's autograd graph."""
    from anynorm import _torch
    from anynorm._plan import make_plan

    limit = _torch.TORCH_CHANNELS_LAST_SPLIT_MIN
    side = int(limit ** 0.5)
    assert side * side == limit
    for shape, kernels in (((2, side - 1, side, 64), True), ((2, side, side, 64), False)):
        plan = make_plan("group_norm", torch.empty(shape), num_groups=8, channel_axis=-1)
        assert _torch._native_first(plan) is not kernels
    x, w, b = _inputs((4, 28, 28, 64), (64,), torch.bfloat16, torch.bfloat16, 1e3, seed=13)
    with torch.no_grad():
        y = anynorm.instance_norm(x, w, b, channel_axis=-1)
    assert len(kernel_calls) == 1
    ref = reference.forward("instance_norm", x.double().numpy(), w.double().numpy(), b.double().numpy(),
                            channel_axis=-1, eps=1e-5)[0]
    assert np.max(np.abs(y.double().numpy() - ref)) <= HALF_ULP[torch.bfloat16] * np.max(np.abs(ref))
    xg = x[:1, :8, :8].contiguous().requires_grad_(True)
    y = anynorm.instance_norm(xg, w, b, channel_axis=-1)
    assert "_KernelNorm" not in type(y.grad_fn).__name__
