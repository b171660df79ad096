"""Rows far from zero (issue 16): every path is exact where torch's one-pass kernels are not.

Data ``x = offset + randn`` in float32, offsets 1e4 and 1e6: torch's CPU kernels lose
``|mean| * rstd`` ulps (1e-3 at 1e4, 0.1 at 1e6), its channels-last group-norm kernel all
digits.  anynorm must give at most half torch's error on the same data (in practice float32
rounding: a few ulps of the output), on every backend and layout, with gradients to match.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import reference
from support import call, get_backend

torch = pytest.importorskip("torch")
F = torch.nn.functional

OFFSETS = [1e4, 1e6]
# (name, op, shape, keyword arguments)
CASES = [
    ("ln rows", "layer_norm", (16, 1024), dict(axis=-1)),
    ("ln axes (0,2)", "layer_norm", (6, 10, 40), dict(axis=(0, 2))),
    ("ln channels-first", "layer_norm", (2, 96, 7, 7), dict(axis=1)),
    ("rms rows", "rms_norm", (16, 1024), dict(axis=-1)),
    ("in nchw", "instance_norm", (2, 8, 12, 12), dict(channel_axis=1)),
    ("in nhwc", "instance_norm", (2, 12, 12, 8), dict(channel_axis=-1)),
    ("gn nchw", "group_norm", (2, 32, 8, 8), dict(channel_axis=1, num_groups=8)),
    ("gn nhwc", "group_norm", (2, 8, 8, 32), dict(channel_axis=-1, num_groups=8)),
]
# the CUDA variants skip without a GPU (tests/gpu runs them on one)
BACKENDS = ["numpy", "torch", "torch-autograd", "array-api-strict", "dask", "jax", "torch-cuda", "cupy"]
F32_EPS = float(np.finfo(np.float32).eps)


def _eps(op):
    return F32_EPS if op == "rms_norm" else 1e-5


def _data(shape, offset, seed=0):
    return (offset + np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _reference(op, x, kw):
    return reference.forward(op, x.astype(np.float64), eps=_eps(op), **kw)


def _torch_functional(op, x, kw):
    """torch.nn.functional on the same float32 data, in x's layout (axes moved as users do)."""
    xt = torch.from_numpy(x)
    ndim = x.ndim
    if op in ("layer_norm", "rms_norm"):
        axis = kw["axis"]
        axes = sorted(a % ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
        order = [a for a in range(ndim) if a not in axes] + axes
        fn = F.layer_norm if op == "layer_norm" else F.rms_norm
        y = fn(xt.permute(order), [x.shape[a] for a in axes], eps=_eps(op))
    else:
        c = kw["channel_axis"] % ndim
        order = [0, c] + [a for a in range(1, ndim) if a != c]
        xt = xt.permute(order)
        if op == "instance_norm":
            y = F.instance_norm(xt, eps=1e-5)
        else:
            y = F.group_norm(xt, kw["num_groups"], eps=1e-5)
    return y.permute(sorted(range(ndim), key=order.__getitem__)).numpy()


def _ulp_bound(ref):
    """A few float32 ulps of the largest output: what an exact float32 computation gives
    (summation over strided axes in float32 included)."""
    return 32 * F32_EPS * float(np.max(np.abs(ref)))


def check_error(got, ref, torch_err, what):
    err = float(np.max(np.abs(np.asarray(got, dtype=np.float64) - ref)))
    assert err <= _ulp_bound(ref), f"{what}: error {err:.3g}, float32 rounding allows {_ulp_bound(ref):.3g} (torch: {torch_err:.3g})"
    if torch_err > 4 * _ulp_bound(ref):  # where torch is inexact, at most half its error
        assert err <= 0.5 * torch_err, f"{what}: error {err:.3g} vs torch's {torch_err:.3g}"
    return err


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("name,op,shape,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_offset_rows_are_exact(backend_name, name, op, shape, kw, offset):
    backend = get_backend(backend_name)
    x = _data(shape, offset)
    y_ref, mean_ref, rstd_ref = _reference(op, x, kw)
    torch_err = float(np.max(np.abs(_torch_functional(op, x, kw) - y_ref)))
    out = call(op, backend.asarray(x, "float32"), return_stats=True, **kw)
    y = backend.to_numpy(out[0])
    check_error(y, y_ref, torch_err, f"{backend_name} {name} at {offset:g}")
    # the statistics: the mean to float32 rounding of the offset, rstd to a few ulps
    if mean_ref is not None:
        mean = backend.to_numpy(out[1])
        assert np.max(np.abs(mean - mean_ref)) <= 4 * F32_EPS * offset
    rstd = backend.to_numpy(out[-1])
    np.testing.assert_allclose(rstd, rstd_ref, rtol=64 * F32_EPS)


def _channels_last_nhwc(x):
    """An NHWC tensor over channels-last memory: (N, H, W, C) contiguous, as a channels_last
    NCHW tensor permuted to NHWC gives it."""
    nchw = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    t = nchw.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
    assert t.is_contiguous()
    return t


GN_OFFSETS = [10.0, 100.0, 1e3, 1e4, 1e6]


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return name


@pytest.mark.parametrize("offset", GN_OFFSETS)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_channels_last_group_norm_on_torch(offset, grad, device):
    """torch's channels-last group-norm kernel computes E[x^2] - E[x]^2 (error 1e-4 at offset 10,
    1e3 at 1e4); anynorm must never hand it such data."""
    import anynorm

    device = _device(device)
    shape = (2, 8, 8, 64)
    x = _data(shape, offset, seed=1)
    kw = dict(channel_axis=-1, num_groups=8)
    y_ref, mean_ref, _ = _reference("group_norm", x, kw)
    torch_err = float(np.max(np.abs(_torch_functional("group_norm", x, kw) - y_ref)))
    for channels_first in (False, True):
        xt = _channels_last_nhwc(x).to(device)
        if channels_first:  # the same memory as a channels_last NCHW tensor, channel_axis=1
            xt = xt.permute(0, 3, 1, 2)
            assert xt.is_contiguous(memory_format=torch.channels_last)
        xt.requires_grad_(grad)
        y, mean, _ = anynorm.group_norm(xt, 8, channel_axis=1 if channels_first else -1, return_stats=True)
        y = y.detach().cpu()
        if channels_first:
            y = y.permute(0, 2, 3, 1)
        check_error(y.numpy(), y_ref, torch_err, f"channels-last group norm at {offset:g}")
        assert np.max(np.abs(mean.detach().cpu().numpy() - mean_ref)) <= 4 * F32_EPS * offset


# channels_last (NCHW and NCDHW) torch tensors, channel_axis=1: every op whose torch route
# sees their memory (ConvNeXt's channels-first layer norm included)
CL_CASES = [
    ("ln channels-first", "layer_norm", (2, 32, 6, 7), dict(axis=1)),
    ("rms channels-first", "rms_norm", (2, 32, 6, 7), dict(axis=1)),
    ("in", "instance_norm", (2, 16, 6, 7), dict(channel_axis=1)),
    ("gn", "group_norm", (2, 32, 6, 7), dict(channel_axis=1, num_groups=8)),
    ("gn 3-d", "group_norm", (2, 16, 3, 4, 5), dict(channel_axis=1, num_groups=4)),
    ("in 3-d", "instance_norm", (2, 16, 3, 4, 5), dict(channel_axis=1)),
]


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name,op,shape,kw", CL_CASES, ids=[c[0] for c in CL_CASES])
def test_channels_last_tensors_on_torch(name, op, shape, kw, device, grad, offset):
    """Tensors in torch's channels_last / channels_last_3d memory format: at most half torch's
    error (torch's own on the same data, contiguous), the statistics to float32 rounding."""
    device = _device(device)
    x = _data(shape, offset, seed=5)
    y_ref, mean_ref, rstd_ref = _reference(op, x, kw)
    torch_err = float(np.max(np.abs(_torch_functional(op, x, kw) - y_ref)))
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    xt = torch.from_numpy(x).to(device).contiguous(memory_format=fmt).requires_grad_(grad)
    out = call(op, xt, return_stats=True, **kw)
    check_error(out[0].detach().cpu().numpy(), y_ref, torch_err, f"channels_last {name} at {offset:g}")
    if mean_ref is not None:
        assert np.max(np.abs(out[1].detach().cpu().numpy() - mean_ref)) <= 4 * F32_EPS * offset
    np.testing.assert_allclose(out[-1].detach().cpu().numpy(), rstd_ref, rtol=64 * F32_EPS)
    if grad:  # the graph runs back through whichever route served
        out[0].sum().backward()
        assert xt.grad is not None and torch.isfinite(xt.grad).all()


@pytest.mark.parametrize("offset", [100.0, 1e4])
def test_group_norm_module_and_gradients_far_from_zero(offset):
    """anynorm.nn.GroupNorm(channel_axis=-1) on a channels-last tensor: y and every gradient
    against the float64 reference."""
    import anynorm.nn

    shape, groups, channels = (2, 6, 6, 32), 4, 32
    rng = np.random.default_rng(2)
    x = _data(shape, offset, seed=3)
    w = (rng.random(channels) + 0.5).astype(np.float32)
    b = (rng.random(channels) - 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    module = anynorm.nn.GroupNorm(groups, channels, channel_axis=-1)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(w))
        module.bias.copy_(torch.from_numpy(b))
    xt = _channels_last_nhwc(x).requires_grad_(True)
    y = module(xt)
    y.backward(torch.from_numpy(dy))
    kw = dict(channel_axis=-1, num_groups=groups)
    y_ref = reference.forward("group_norm", x.astype(np.float64), w, b, eps=1e-5, **kw)[0]
    dx_ref, dw_ref, db_ref = reference.backward("group_norm", dy.astype(np.float64), x.astype(np.float64),
                                                w, eps=1e-5, **kw)
    assert np.max(np.abs(y.detach().numpy() - y_ref)) <= _ulp_bound(y_ref)
    # dx is rstd * (g - mean(g) - xhat mean(g xhat)): float32 rounding of sums over the group
    np.testing.assert_allclose(xt.grad.numpy(), dx_ref, rtol=1e-4, atol=1e-4 * np.max(np.abs(dx_ref)))
    np.testing.assert_allclose(module.weight.grad.numpy(), dw_ref, rtol=1e-4, atol=1e-4 * np.max(np.abs(dw_ref)))
    np.testing.assert_allclose(module.bias.grad.numpy(), db_ref, rtol=1e-4, atol=1e-4 * np.max(np.abs(db_ref)))


GRAD_CASES = [
    ("layer_norm", (3, 12), dict(axis=-1)),
    ("layer_norm", (2, 5, 3, 3), dict(axis=1)),
    ("instance_norm", (2, 3, 3, 3), dict(channel_axis=-1)),
    ("group_norm", (2, 6, 3, 3), dict(channel_axis=1, num_groups=3)),
    ("group_norm", (2, 3, 3, 6), dict(channel_axis=-1, num_groups=3)),
]


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("op,shape,kw", GRAD_CASES, ids=[f"{c[0]}{c[1]}" for c in GRAD_CASES])
def test_gradcheck_through_the_shift(op, shape, kw, offset):
    """float64 gradcheck, including on rows far from zero where the shifted run serves: the
    shift is detached, so it must leave every gradient as the formula gives it."""
    import anynorm
    from anynorm import _torch

    rng = np.random.default_rng(4)
    x = torch.from_numpy(offset + rng.standard_normal(shape)).requires_grad_(True)
    c = shape[kw["channel_axis"]] if "channel_axis" in kw else None
    pshape = (c,) if c else tuple(shape[a] for a in ((kw["axis"],) if isinstance(kw["axis"], int) else kw["axis"]))
    w = torch.from_numpy(rng.random(pshape) + 0.5).requires_grad_(True)
    b = torch.from_numpy(rng.random(pshape) - 0.5).requires_grad_(True)
    if op == "group_norm" and kw["channel_axis"] == -1:
        x = _channels_last_nhwc(x.detach().numpy()).requires_grad_(True)
    if offset:  # this data must take the shifted run (the first one is ill-conditioned)
        from anynorm._plan import make_plan
        plan = make_plan(op, x, w, b, **{k: v for k, v in kw.items()})
        lay = _torch._layout(plan, x)
        with torch.no_grad():
            y, mean, rstd = _torch._run(plan, lay, x, w, b)
        assert not _torch._conditioned(mean, rstd, _torch._LIMITS[torch.float64][int(lay.channels_last)])
    torch.autograd.gradcheck(lambda x, w, b: call(op, x, w, b, **kw), (x, w, b))


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("name,op,shape,kw", [c for c in CASES if c[1] != "rms_norm"],
                         ids=[c[0] for c in CASES if c[1] != "rms_norm"])
def test_torch_kernels_serve_shifted_rows(name, op, shape, kw, offset):
    """Far from zero, torch's kernels still serve (on ``x - shift``), exactly: the shifted
    run is taken, not only the exact fallbacks."""
    from anynorm import _torch
    from anynorm._plan import make_plan

    x = _data(shape, offset)
    y_ref, mean_ref, rstd_ref = _reference(op, x, kw)
    for xt in (torch.from_numpy(x), torch.from_numpy(x).requires_grad_(True)):
        if op == "group_norm" and kw["channel_axis"] == -1:
            xt = _channels_last_nhwc(x).requires_grad_(xt.requires_grad)
        plan = make_plan(op, xt, **kw)
        out = _torch.native_forward(plan, xt, None, None)
        assert out is not None, f"{name}: torch's kernel refused data at offset {offset:g}"
        y, mean, rstd = (t.detach().numpy() for t in out)
        assert np.max(np.abs(y - y_ref)) <= _ulp_bound(y_ref)
        assert np.max(np.abs(mean - mean_ref.reshape(mean.shape))) <= 4 * F32_EPS * offset
        np.testing.assert_allclose(rstd, rstd_ref.reshape(rstd.shape), rtol=64 * F32_EPS)


HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


@pytest.mark.parametrize("offset", [100.0, 1e3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,op,shape,kw", CASES, ids=[c[0] for c in CASES])
def test_half_dtypes_far_from_zero_on_torch(name, op, shape, kw, dtype, offset):
    """float16/bfloat16 torch CPU tensors: statistics in float32 from the rounded input, y
    within its dtype's rounding (torch's kernels run with float32 parameters)."""
    tdtype = getattr(torch, dtype)
    xt = torch.from_numpy(offset + 8 * np.random.default_rng(8).standard_normal(shape)).to(tdtype)
    x = xt.double().numpy()  # the rounded input the float64 reference sees
    y_ref, mean_ref, rstd_ref = reference.forward(op, x, eps=_eps(op) if op != "rms_norm" else
                                                  float(torch.finfo(tdtype).eps), **kw)
    for requires_grad in (False, True):
        out = call(op, xt.clone().requires_grad_(requires_grad), return_stats=True, **kw)
        assert out[0].dtype == tdtype and out[-1].dtype == torch.float32
        y = out[0].detach().double().numpy()
        assert np.max(np.abs(y - y_ref)) <= HALF_ULP[dtype] * np.max(np.abs(y_ref)), name
        if mean_ref is not None:
            assert np.max(np.abs(out[1].detach().numpy() - mean_ref)) <= 8 * F32_EPS * offset
        np.testing.assert_allclose(out[-1].detach().numpy(), rstd_ref, rtol=1e-5)
        # without the statistics (torch's kernels then take half parameters as given and
        # check the conditioning on half statistics): y as exact, with and without weights
        y = call(op, xt.clone().requires_grad_(requires_grad), **kw).detach().double().numpy()
        assert np.max(np.abs(y - y_ref)) <= HALF_ULP[dtype] * np.max(np.abs(y_ref)), name
    pshape = tuple(shape[a] for a in _norm_axes(kw["axis"], len(shape))) if "axis" in kw else (shape[kw["channel_axis"]],)
    rng = np.random.default_rng(9)
    w64, b64 = rng.random(pshape) + 0.5, rng.random(pshape) - 0.5
    w, b = torch.from_numpy(w64).to(tdtype), torch.from_numpy(b64).to(tdtype)
    wr, br = w.double().numpy(), b.double().numpy()
    eps = _eps(op) if op != "rms_norm" else float(torch.finfo(tdtype).eps)
    y_ref = reference.forward(op, x, wr, None if op == "rms_norm" else br, eps=eps, **kw)[0]
    for params in ((w, b), (w.float(), b.float()), (w, b.float())):
        args = (params[0],) if op == "rms_norm" else params
        y = call(op, xt, *args, **kw).double().numpy()
        assert np.max(np.abs(y - y_ref)) <= 2 * HALF_ULP[dtype] * np.max(np.abs(y_ref)), (name, params[0].dtype, params[1].dtype)


def _norm_axes(axis, ndim):
    return sorted(a % ndim for a in (axis if isinstance(axis, tuple) else (axis,)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_half_strided_group_norm_takes_torch_kernel(op, dtype, monkeypatch):
    """float16/bfloat16 tensors of neither contiguous nor channels-last memory: torch's kernel on
    a contiguous copy in x's dtype, exact far from zero, never the array-API core (which
    converts whole arrays to float32)."""
    from anynorm import _reference as core

    def refuse(*args, **kwargs):
        raise AssertionError("the array-API core served a half-precision torch tensor")

    monkeypatch.setattr(core, "forward", refuse)
    tdtype = getattr(torch, dtype)
    base = torch.from_numpy(1e3 + 8 * np.random.default_rng(10).standard_normal((2, 16, 6, 14))).to(tdtype)
    kw = dict(channel_axis=1) if op == "instance_norm" else dict(channel_axis=1, num_groups=4)
    for xt, k in ((base[:, :, :, ::2], kw), (base[:, :, :, ::2].permute(0, 2, 3, 1), dict(kw, channel_axis=-1))):
        assert not xt.is_contiguous()
        x = xt.double().numpy()
        y_ref = reference.forward(op, x, eps=1e-5, **k)[0]
        for grad in (False, True):
            y = call(op, xt.clone().requires_grad_(grad), **k).detach().double().numpy()
            assert np.max(np.abs(y - y_ref)) <= HALF_ULP[dtype] * np.max(np.abs(y_ref))


# (op, shape, keyword arguments) of half-precision calls whose memory is measured
HALF_MEMORY_CASES = [
    ("layer_norm", (256, 2048), dict(axis=-1)),
    ("layer_norm", (4, 96, 24, 24), dict(axis=1)),
    ("rms_norm", (256, 2048), dict(axis=-1)),
    ("instance_norm", (4, 64, 24, 24), dict(channel_axis=1)),
    ("group_norm", (4, 64, 24, 24), dict(channel_axis=1, num_groups=8)),
    ("group_norm", (4, 24, 24, 64), dict(channel_axis=-1, num_groups=8)),
]


@pytest.mark.parametrize("offset", [0.0, 1e3])
@pytest.mark.parametrize("op,shape,kw", HALF_MEMORY_CASES, ids=[f"{c[0]}{c[1]}" for c in HALF_MEMORY_CASES])
def test_half_torch_never_converts_whole_arrays(op, shape, kw, offset):
    """bfloat16/float16 torch CPU tensors: no allocation of a float32 copy of x (2x its bytes);
    float32 lives in torch's kernels' row/cache-sized buffers only."""
    from torch.profiler import ProfilerActivity, profile

    for tdtype in (torch.bfloat16, torch.float16):
        xt = torch.from_numpy(offset + 8 * np.random.default_rng(11).standard_normal(shape)).to(tdtype)
        if op == "group_norm" and kw["channel_axis"] == -1:
            xt = xt.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
        x = xt.double().numpy()
        eps = float(torch.finfo(tdtype).eps) if op == "rms_norm" else 1e-5
        y_ref = reference.forward(op, x, eps=eps, **kw)[0]
        for stats in (False, True):
            call(op, xt, return_stats=stats, **kw)  # first call of the signature: plan, layout
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = call(op, xt, return_stats=stats, **kw)
            biggest = max((e.cpu_memory_usage for e in prof.events()), default=0)
            assert biggest < 2 * xt.nbytes, (op, tdtype, stats, biggest, xt.nbytes)
            y = (out[0] if stats else out).double().numpy()
            assert np.max(np.abs(y - y_ref)) <= HALF_ULP[str(tdtype)[6:]] * np.max(np.abs(y_ref))


# The NumPy executor's blocks (float32 buffers of a fixed budget, a few MiB) are larger than a
# float32 copy of a small x: the batch is grown until such a copy would stand out.
HALF_MEMORY_ELEMENTS = 1 << 22


@pytest.mark.parametrize("op,shape,kw", HALF_MEMORY_CASES, ids=[f"{c[0]}{c[1]}" for c in HALF_MEMORY_CASES])
def test_float16_numpy_never_converts_whole_arrays(op, shape, kw):
    """float16 NumPy arrays: the peak traced memory beyond y stays under a float32 copy of x
    (at least 4M elements, where one would exceed every block buffer)."""
    import tracemalloc

    shape = (shape[0] * max(1, HALF_MEMORY_ELEMENTS // math.prod(shape)),) + shape[1:]
    x = (1e3 + 8 * np.random.default_rng(12).standard_normal(shape)).astype(np.float16)
    call(op, x, **kw)
    tracemalloc.start()
    try:
        y = call(op, x, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - y.nbytes < 2 * x.nbytes, (op, shape, peak / x.nbytes)


@pytest.mark.parametrize("rows", [8, 1000, 40000])
def test_nan_slice_does_not_hide_far_rows(rows):
    """A NaN slice gives NaN; the conditioning check must still see the other slices far from
    zero (a NaN-propagating max would wave them through torch's kernel unshifted)."""
    import anynorm

    x = _data((rows, 16), 0.0, seed=13)
    x[-1] += 1e4  # far from zero
    x[0, 3] = np.nan
    y = anynorm.layer_norm(torch.from_numpy(x)).numpy()
    assert np.isnan(y[0]).all() and not np.isnan(y[1:]).any()
    y_ref = _reference("layer_norm", x[1:], dict(axis=-1))[0]
    assert np.max(np.abs(y[1:] - y_ref)) <= _ulp_bound(y_ref)


@pytest.mark.parametrize("n", [1, 5, 24, 25, 1000, 40000])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_compiled_check_agrees_with_the_python_loop(dtype, n):
    """The check of torch's statistics (``|mean| * rstd`` against the limit, NaN passing) gives
    the same verdict by the compiled ``anynorm_far_*`` as by the Python loop over floats, for
    statistics of every dtype torch's CPU kernels return, one far slice anywhere or none."""
    from anynorm import _native, _torch

    tdtype = getattr(torch, dtype)
    if not _torch._far_kernels().get(tdtype):
        pytest.skip(f"no compiled check for {dtype} ({_native.status})")
    limit = _torch._LIMITS[tdtype if tdtype in _torch._LIMITS else torch.float32][0]
    gen = np.random.default_rng(n)
    cases = []
    for where in (None, 0, n // 2, n - 1):
        rstd = gen.random((n, 1)) + 0.5
        mean = 0.5 * limit * (2 * gen.random((n, 1)) - 1) / rstd  # near: half the limit at most
        if n > 2:
            mean[1] = np.nan  # a NaN slice passes, and hides no far one
        if where is not None:  # far: twice past the limit and more, below zero at n // 2
            mean[where] = (-2.5 if where == n // 2 else 2.5) * limit / rstd[where]
        cases.append((where, mean, rstd))
    for where, mean, rstd in cases:
        m, r = (torch.from_numpy(a).to(tdtype) for a in (mean, rstd))
        want = _torch._lists_within(m.tolist(), r.tolist(), limit)
        assert want == (where is None or (n > 2 and where == 1)), (where, want)
        assert _torch._conditioned(m, r, limit) == want, (dtype, n, where)
        fn = _torch._far_kernels()[tdtype]
        assert (not fn(m.data_ptr(), r.data_ptr(), n, limit)) == want
        # a strided view (not a kernel's statistics) takes the other forms
        m2, r2 = (torch.cat([t, t], dim=1)[:, :1] for t in (m, r))
        assert not m2.is_contiguous() or n == 1
        assert _torch._conditioned(m2, r2, limit) == want


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows", [4, 30, 1000])
def test_runner_check_finds_the_far_slice(rows, dtype):
    """A signature's cached runner checks with the compiled form: the one far row among
    ``rows`` (last, so a check that reads too few statistics misses it) comes out exact,
    on the first call and on the cached ones."""
    import anynorm

    x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(dtype)
    x[-1] += 1e4 if dtype == "float32" else 1e9  # torch's float64 kernel: 2e-8 at 1e9
    y_ref = reference.forward("layer_norm", x.astype(np.float64), eps=1e-5, axis=-1)[0]
    tol = _ulp_bound(y_ref) if dtype == "float32" else 64 * np.finfo(np.float64).eps * float(np.max(np.abs(y_ref)))
    for _ in range(3):
        y = anynorm.layer_norm(torch.from_numpy(x)).numpy()
        assert np.max(np.abs(y - y_ref)) <= tol


HALF_GRAD_CASES = [
    ("ln rows of 2", "layer_norm", (64, 2), {}),
    ("ln rows of 16", "layer_norm", (32, 16), {}),
    ("ln axes (0, 2)", "layer_norm", (4, 6, 8), {"axis": (0, 2)}),
    ("gn nchw", "group_norm", (4, 8, 3, 3), {"num_groups": 4}),
    ("gn channels_last", "group_norm", (4, 8, 3, 3), {"num_groups": 4, "memory": "channels_last"}),
    ("in nchw", "instance_norm", (4, 8, 2, 2), {}),
]


@pytest.mark.parametrize("mean_in_stds", [0.0, 15.0, 50.0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,op,shape,kw", HALF_GRAD_CASES, ids=[c[0] for c in HALF_GRAD_CASES])
def test_half_gradients_through_torch_kernels(name, op, shape, kw, dtype, mean_in_stds):
    """float16/bfloat16 CPU tensors under autograd on torch's kernels: the gradients keep
    their dtype's rounding at any offset.  torch's backward centres x on the mean its forward
    saved; saved in x's dtype (what its kernels return for half parameters) that mean is off
    by up to 2^-9 of itself, and with it every xhat: rows of 2 at 15 std gave 800% errors,
    rows of 16 4%.  The route feeds torch's kernels float32 parameters when autograd records."""
    import anynorm

    kw = dict(kw)
    memory = kw.pop("memory", None)
    tdtype = getattr(torch, dtype)
    gen = np.random.default_rng(len(shape))
    x = torch.tensor(0.2 * mean_in_stds + 0.2 * gen.standard_normal(shape), dtype=tdtype)
    if memory:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    c = shape[1] if op != "layer_norm" else None
    pshape = (c,) if c else tuple(shape[a] for a in sorted(a % len(shape) for a in
                                                           (kw["axis"] if "axis" in kw else (-1,))))
    w = torch.tensor(1 + 0.1 * gen.standard_normal(pshape), dtype=tdtype, requires_grad=True)
    b = torch.tensor(0.1 * gen.standard_normal(pshape), dtype=tdtype, requires_grad=True)
    dy = torch.tensor(gen.standard_normal(shape), dtype=tdtype)
    kws = {k: v for k, v in kw.items() if k != "num_groups"}
    fn = getattr(anynorm, op)
    for _ in range(2):  # the first call of a signature, then its cached runner
        for t in (x, w, b):
            t.grad = None
        y = fn(x, kw["num_groups"], w, b, **kws) if op == "group_norm" else fn(x, w, b, **kws)
        y.backward(dy)
        f64 = {k: t.detach().double().numpy() for k, t in dict(x=x, w=w, dy=dy).items()}
        ref = reference.backward(op, f64["dy"], f64["x"], f64["w"], eps=1e-5, **kw)
        step = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
        # dweight/dbias: sums of numel / C terms, which torch's float16 kernels add up in
        # float16 (F.layer_norm's own dbias: 1e-3 of it over 64 rows): their rounding grows
        # with the square root of the terms
        terms = math.prod(shape) / math.prod(pshape)
        for what, t, r in zip(("dx", "dweight", "dbias"), (x, w, b), ref):
            err = float(np.max(np.abs(t.grad.double().numpy() - r)))
            bound = 4 * step * float(np.max(np.abs(r))) * (1.0 if what == "dx" else math.sqrt(terms))
            assert err <= bound, (what, err, bound)


GIVEN_STATS_CASES = [
    ("ln rows", "layer_norm", (16, 1024), {}),
    ("ln channels-first", "layer_norm", (4, 32, 16, 16), {"axis": 1}),
    ("gn nchw", "group_norm", (4, 16, 16, 32), {"num_groups": 8}),
    ("gn nhwc", "group_norm", (4, 16, 16, 32), {"num_groups": 8, "channel_axis": -1}),
    ("in nhwc", "instance_norm", (2, 300, 40), {"channel_axis": -1}),
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("name,op,shape,kw", GIVEN_STATS_CASES, ids=[c[0] for c in GIVEN_STATS_CASES])
def test_backward_kernels_exact_with_the_forwards_statistics(name, op, shape, kw, offset, dtype, monkeypatch):
    """The CPU backward kernels given the statistics ``return_stats`` returned (the mean rounded
    to float32, or to one float64), and torch autograd's route through them (which saves
    them): dx, dweight and dbias keep their dtype's rounding far from zero.  Taking xhat
    about the rounded mean put |mean| * rstd * 2^-24 into every xhat (dx 6e-3 off at 1e6)."""
    import anynorm
    from anynorm import _numpy, _torch_cpu_grad

    monkeypatch.setattr(_numpy, "SMALL_BACKWARD_ELEMENTS", 1)
    monkeypatch.setattr(_torch_cpu_grad, "TRAINING_ROWS_MIN_ELEMENTS", 0)
    monkeypatch.setattr(_torch_cpu_grad, "TRAINING_CHANNELS_LAST_MIN_ELEMENTS", 0)
    gen = np.random.default_rng(7)
    x = (offset + gen.standard_normal(shape)).astype(dtype)
    dy = gen.standard_normal(shape).astype(dtype)
    c = shape[kw.get("channel_axis", 1)] if op != "layer_norm" else shape[kw.get("axis", -1)]
    w = (1 + 0.1 * gen.standard_normal(c)).astype(dtype)
    groups = (kw["num_groups"],) if op == "group_norm" else ()
    kws = {k: v for k, v in kw.items() if k != "num_groups"}
    forward, backward = getattr(anynorm, op), getattr(anynorm, op + "_backward")
    _, mean, rstd = forward(x, *groups, w, return_stats=True, **kws)
    ref = reference.backward(op, dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64), eps=1e-5, **kw)
    eps = F32_EPS if dtype == "float32" else float(np.finfo(np.float64).eps)

    def check(grads, what):
        for g, r, part in zip(grads, ref, ("dx", "dweight", "dbias")):
            if g is None:
                continue
            bound = 32 * eps * float(np.max(np.abs(r))) * (1 if part == "dx" else math.sqrt(x.size / c))
            err = float(np.max(np.abs(np.asarray(g, dtype=np.float64) - r)))
            assert err <= bound, f"{what} {part}: error {err:.3g}, bound {bound:.3g}"

    check(backward(dy, x, *groups, w, stats=(mean, rstd), **kws), "numpy, statistics given")
    check(backward(dy, x, *groups, w, **kws), "numpy, statistics taken again")
    xt, wt = (torch.from_numpy(a).requires_grad_(True) for a in (x, w))
    y = forward(xt, *groups, wt, **kws)
    y.backward(torch.from_numpy(dy))
    check((xt.grad.numpy(), wt.grad.numpy(), None), f"torch autograd ({y.grad_fn.name()})")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("backend_name", ["numpy", "torch", "array-api-strict", "dask", "jax", "torch-cuda", "cupy"])
@pytest.mark.parametrize("name,op,shape,kw", [GIVEN_STATS_CASES[0], GIVEN_STATS_CASES[3]],
                         ids=[GIVEN_STATS_CASES[0][0], GIVEN_STATS_CASES[3][0]])
def test_backward_with_given_statistics_on_every_backend(name, op, shape, kw, backend_name, dtype):
    """``*_backward(..., stats=...)`` with what ``return_stats`` gave, on every executor (the
    array-API core, the NumPy passes, the kernels): dx keeps its dtype's rounding at 1e6."""
    backend = get_backend(backend_name)
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend_name} has no {dtype}")
    gen = np.random.default_rng(3)
    x64 = 1e6 + gen.standard_normal(shape)
    dy64 = gen.standard_normal(shape)
    x, dy = backend.asarray(x64, dtype), backend.asarray(dy64, dtype)
    groups = (kw["num_groups"],) if op == "group_norm" else ()
    kws = {k: v for k, v in kw.items() if k != "num_groups"}
    import anynorm

    _, mean, rstd = getattr(anynorm, op)(x, *groups, return_stats=True, **kws)
    dx = getattr(anynorm, op + "_backward")(dy, x, *groups, stats=(mean, rstd), **kws)[0]
    xr, dyr = backend.to_numpy(x).astype(np.float64), backend.to_numpy(dy).astype(np.float64)
    ref = reference.backward(op, dyr, xr, None, eps=1e-5, **kw)[0]
    eps = F32_EPS if dtype == "float32" else float(np.finfo(np.float64).eps)
    err = float(np.max(np.abs(backend.to_numpy(dx).astype(np.float64) - ref)))
    assert err <= 32 * eps * float(np.max(np.abs(ref))), err
