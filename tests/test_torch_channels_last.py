"""The blocked backward of channels-last group/instance norm on torch CPU tensors
(``anynorm._torch_channels_last``): torch's own gradients to float64 rounding, half dtypes
within torch's error, every block shape, the routing, double backward, NaN groups."""

from __future__ import annotations

import numpy as np
import pytest

import reference
from support import autograd_nodes

torch = pytest.importorskip("torch")

import anynorm  # noqa: E402
from anynorm import _torch_channels_last as blocked  # noqa: E402

_GNB = torch.ops.aten.native_group_norm_backward
# (shape NCHW/NCDHW, groups): 1, 2 and 4 channels a group, one spatial position, 3-d
SHAPES = [((2, 8, 3, 5), 8), ((3, 8, 4, 4), 4), ((2, 8, 5, 3), 2), ((2, 4, 1, 1), 2),
          ((2, 6, 3, 2, 4), 3), ((1, 16, 9, 7), 16)]


def _channels_last(t):
    fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return t.contiguous(memory_format=fmt)


def _torch_grads(dy, x, w, b, groups):
    """torch's native backward (its dbias is dy's sum: it refuses dbias without a weight;
    called directly it reads dy as if in x's layout, so dy is given in that layout)."""
    dy = _channels_last(dy)
    n, c = x.shape[:2]
    spatial = x.numel() // (n * c)
    _, mean, rstd = torch.native_group_norm(x, w, b, n, c, spatial, groups, 1e-5)
    dx, dw, _ = _GNB(dy, x, mean, rstd, w, n, c, spatial, groups, [True, w is not None, False])
    db = None if b is None else dy.sum([a for a in range(dy.dim()) if a != 1])
    return (dx, dw, db), mean, rstd


@pytest.mark.parametrize("block_bytes", [1 << 21, 64, 4096], ids=["samples", "runs", "mixed"])
@pytest.mark.parametrize("shape,groups", SHAPES, ids=str)
@pytest.mark.parametrize("params", ["wb", "w", "b", "none"])
def test_float64_matches_torch(monkeypatch, block_bytes, shape, groups, params):
    """float64 gradients equal torch's to rounding, whether a block holds several samples,
    one sample or a run of one sample's positions (two passes)."""
    monkeypatch.setattr(blocked, "_BLOCK_BYTES", block_bytes)
    gen = torch.Generator().manual_seed(1)
    x = _channels_last(torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 2)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64)
    c = shape[1]
    w = torch.randn(c, generator=gen, dtype=torch.float64) if "w" in params else None
    b = torch.randn(c, generator=gen, dtype=torch.float64) if "b" in params else None
    want, mean, rstd = _torch_grads(dy, x, w, b, groups)
    got = blocked.backward(dy, x, mean, rstd, w, groups, True, w is not None,
                           None if b is None else b.dtype)
    for name, g, t in zip(("dx", "dweight", "dbias"), got, want):
        assert (g is None) == (t is None), name
        if t is not None:
            assert g.dtype == t.dtype
            torch.testing.assert_close(g, t, rtol=1e-10, atol=1e-12 * float(t.abs().max()))
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    assert got[0].is_contiguous(memory_format=fmt)  # dx in x's channels-last layout


def test_dy_in_another_layout():
    """dy contiguous NCHW for a channels-last x (autograd may hand either)."""
    gen = torch.Generator().manual_seed(2)
    x = _channels_last(torch.randn(2, 8, 5, 6, generator=gen, dtype=torch.float64))
    dy = torch.randn(2, 8, 5, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(8, generator=gen, dtype=torch.float64)
    want, mean, rstd = _torch_grads(dy, x, w, None, 8)
    got = blocked.backward(dy, x, mean, rstd, w, 8, True, True, None)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)


def _nhwc_tensor(x64, dtype):
    """An NHWC view over channels-last memory, as ``_channels_last_nhwc`` in test_offset_accuracy."""
    nchw = torch.from_numpy(np.ascontiguousarray(x64.transpose(0, 3, 1, 2))).to(dtype)
    return _channels_last(nchw).permute(0, 2, 3, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op,groups", [("instance_norm", None), ("group_norm", 16), ("group_norm", 2)])
def test_public_calls_take_it_and_match_float64(op, groups, dtype):
    """anynorm's instance/group norm of an NHWC tensor (channels-last memory, channel_axis=-1)
    under autograd route through the blocked backward (1 and 2 channels a group) or torch's
    (16), and every gradient is within 2x torch's own error against float64."""
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(3)
    shape = (3, 6, 7, 32)
    x64 = rng.standard_normal(shape) * 2 + 1
    w64, b64 = rng.random(32) + 0.5, rng.random(32) - 0.5
    dy64 = rng.standard_normal(shape)
    kw = dict(channel_axis=-1) if groups is None else dict(channel_axis=-1, num_groups=groups)
    g = 32 if groups is None else groups
    ref = reference.backward(op, dy64, x64, w64, **kw)

    def run(fn):
        x = _nhwc_tensor(x64, tdtype).requires_grad_(True)
        w = torch.tensor(w64, dtype=tdtype, requires_grad=True)
        b = torch.tensor(b64, dtype=tdtype, requires_grad=True)
        y = fn(x, w, b)
        y.backward(torch.from_numpy(dy64).to(tdtype))
        return y, [t.grad.double().numpy() for t in (x, w, b)]

    if op == "instance_norm":
        y, ours = run(lambda x, w, b: anynorm.instance_norm(x, w, b, channel_axis=-1))
    else:
        y, ours = run(lambda x, w, b: anynorm.group_norm(x, g, w, b, channel_axis=-1))
    _, theirs = run(lambda x, w, b: torch.nn.functional.group_norm(
        x.permute(0, 3, 1, 2), g, w, b, 1e-5).permute(0, 2, 3, 1))
    fn_name = autograd_nodes(y)
    if shape[-1] // g <= 2:
        assert "_ChannelsLastGroupNorm" in fn_name, fn_name
    else:
        assert "_ChannelsLastGroupNorm" not in fn_name, fn_name
    floor = {"float32": 1e-6, "bfloat16": 8e-3, "float16": 1e-3}[dtype]
    for name, a, t, r in zip(("dx", "dweight", "dbias"), ours, theirs, ref):
        scale = float(np.max(np.abs(r)))
        err, torch_err = np.max(np.abs(a - r)) / scale, np.max(np.abs(t - r)) / scale
        assert err <= max(2 * torch_err, floor), (name, err, torch_err)


@pytest.mark.parametrize("channels_first", [False, True], ids=["nhwc", "nchw-channels-last"])
def test_gradgradcheck_through_the_public_call(channels_first):
    """Double backward (create_graph) differentiates the composite formula."""
    gen = torch.Generator().manual_seed(4)
    x = _channels_last(torch.randn(2, 6, 3, 3, generator=gen, dtype=torch.float64))
    if not channels_first:
        x = x.permute(0, 2, 3, 1)
    axis = 1 if channels_first else -1
    w = torch.randn(6, generator=gen, dtype=torch.float64)
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b)]
    fn = lambda x, w, b: anynorm.group_norm(x, 3, w, b, channel_axis=axis)  # noqa: E731
    assert "_ChannelsLastGroupNorm" in autograd_nodes(fn(*leaves))
    assert torch.autograd.gradcheck(fn, leaves)
    assert torch.autograd.gradgradcheck(fn, leaves)


def test_nan_stays_in_its_group():
    """A NaN in one (sample, group) makes that group's dx NaN and no other's."""
    gen = torch.Generator().manual_seed(5)
    x = _channels_last(torch.randn(2, 8, 4, 4, generator=gen))
    x[1, 2, 1, 3] = float("nan")  # sample 1, group 1 of 4 (channels 2-3)
    x.requires_grad_(True)
    y = anynorm.group_norm(x, 4)
    assert "_ChannelsLastGroupNorm" in autograd_nodes(y)
    y.backward(torch.randn(y.shape, generator=gen))
    nan = torch.isnan(x.grad)
    assert nan[1, 2:4].all()
    nan[1, 2:4] = False
    assert not nan.any()


def test_no_grad_and_statistics_keep_torch_forward():
    """Without autograd the call is torch's kernel itself; the statistics carry no gradient
    of their own (torch's kernel ignores one too)."""
    gen = torch.Generator().manual_seed(6)
    x = _channels_last(torch.randn(2, 8, 4, 4, generator=gen))
    with torch.no_grad():
        y, mean, rstd = blocked.group_norm(x, None, None, 2, 8, 16, 8, 1e-5)
    ref = torch.native_group_norm(x, None, None, 2, 8, 16, 8, 1e-5)
    for a, r in zip((y, mean, rstd), ref):
        assert torch.equal(a, r)
    xg = x.clone().requires_grad_(True)
    y, mean, rstd = blocked.group_norm(xg, None, None, 2, 8, 16, 8, 1e-5)
    (y.sum() * 0 + mean.sum() + rstd.sum()).backward()
    assert torch.equal(xg.grad, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("offset", [0.0, 1e4, 1e6])
def test_channels_last_3d_takes_torch_kernel_on_a_copy(dtype, offset):
    """(N, L, C) with channel_axis=-1 (no 3-d channels-last kernel in torch): under autograd
    the call copies to contiguous memory for torch's kernel (the array-API core's graph was
    10x F's time), exact at offsets (at most half torch's error once torch's shows), with
    gradients to float64 rounding."""
    if dtype == "bfloat16" and offset:
        pytest.skip("bfloat16 holds no data at these offsets (its ulp at 1e4 is 64)")
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(7)
    shape = (3, 40, 16)
    x64 = offset + rng.standard_normal(shape)
    x32 = x64.astype(np.float32) if dtype != "float64" else x64
    w64 = rng.random(16) + 0.5
    dy64 = rng.standard_normal(shape)
    kw = dict(channel_axis=-1, num_groups=4)
    ref_x = torch.from_numpy(x32).to(tdtype).double().numpy()  # the data as x's dtype holds it
    y_ref = reference.forward("group_norm", ref_x, w64, **kw)[0]
    grads_ref = reference.backward("group_norm", dy64, ref_x, w64, **kw)
    x = torch.from_numpy(x32).to(tdtype).requires_grad_(True)
    w = torch.tensor(w64, dtype=tdtype, requires_grad=True)
    y = anynorm.group_norm(x, 4, w, channel_axis=-1)
    assert "NativeGroupNormBackward" in autograd_nodes(y), autograd_nodes(y)
    y.backward(torch.from_numpy(dy64).to(tdtype))
    theirs = torch.nn.functional.group_norm(
        torch.from_numpy(x32).to(tdtype).transpose(1, 2), 4, w.detach()).transpose(1, 2)
    err = np.max(np.abs(y.detach().double().numpy() - y_ref))
    torch_err = np.max(np.abs(theirs.double().numpy() - y_ref))
    floor = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 2e-2}[dtype] * np.max(np.abs(y_ref))
    assert err <= max(0.5 * torch_err, floor), (err, torch_err)
    gfloor = {"float32": 2e-6, "float64": 1e-12, "bfloat16": 3e-2}[dtype]
    for name, g, r in zip(("dx", "dweight"), (x.grad, w.grad), grads_ref):
        rel = np.max(np.abs(g.double().numpy() - r)) / np.max(np.abs(r))
        assert rel <= gfloor, (name, rel)
