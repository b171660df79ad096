"""RMS norm of torch CPU rows in blocks (``anynorm._torch_rms``): the autograd function's
gradients against the composite formula's in float64 (every block shape, weight or none,
gradients reaching y, rstd or both), half dtypes against float64, the routing, NaN rows."""

from __future__ import annotations

import numpy as np
import pytest

import reference
from support import autograd_nodes

torch = pytest.importorskip("torch")

import anynorm  # noqa: E402
from anynorm import _torch_rms as blocked  # noqa: E402

EPS = 1e-6


def _composite(x, w, axes):
    rstd = torch.rsqrt(x.square().mean(axes, keepdim=True) + EPS)
    y = x * rstd
    return (y if w is None else y * w), rstd


@pytest.mark.parametrize("block_bytes", [1 << 20, 64, 1024], ids=["one", "rows", "some"])
@pytest.mark.parametrize("shape,k", [((4, 8), 1), ((3, 5, 6), 2), ((70, 37), 1), ((1, 300), 1)], ids=str)
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("reach", ["y", "rstd", "both"])
def test_float64_matches_the_composite(monkeypatch, block_bytes, shape, k, weight, reach):
    monkeypatch.setattr(blocked, "_BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(blocked, "_AUTOGRAD_MIN_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) + 0.5).requires_grad_(True)
    w = torch.randn(shape[-k:], generator=gen, dtype=torch.float64).requires_grad_(True) if weight else None
    axes = tuple(range(len(shape) - k, len(shape)))
    y, rstd = anynorm.rms_norm(x, w, axis=axes, eps=EPS, return_stats=True)
    assert "_RMSRows" in type(y.grad_fn).__name__
    dy, dr = torch.randn(y.shape, generator=gen, dtype=torch.float64), torch.randn(rstd.shape, generator=gen, dtype=torch.float64)
    leaves = [x] + ([w] if weight else [])

    def loss(y, rstd):
        return ((y * dy).sum() if reach != "rstd" else 0) + ((rstd * dr).sum() if reach != "y" else 0)

    got = torch.autograd.grad(loss(y, rstd), leaves, allow_unused=True)
    want = torch.autograd.grad(loss(*_composite(x, w, axes)), leaves, allow_unused=True)
    for g, t, leaf in zip(got, want, leaves):  # None: no gradient reaches it (rstd, weight)
        g = torch.zeros_like(leaf) if g is None else g
        t = torch.zeros_like(leaf) if t is None else t
        torch.testing.assert_close(g, t, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("axis", [-1, 1], ids=["rows", "channels-first"])
def test_half_and_float32_within_torch_error(monkeypatch, dtype, axis):
    """Every gradient within 2x F.rms_norm's own error against float64 (or a rounding floor)."""
    monkeypatch.setattr(blocked, "_AUTOGRAD_MIN_ELEMENTS", 1)
    tdtype = getattr(torch, dtype)
    rng = np.random.default_rng(2)
    shape = (6, 64, 5, 3) if axis == 1 else (40, 96)
    c = shape[axis]
    x64, w64, dy64 = rng.standard_normal(shape) + 1, rng.random(c) + 0.5, rng.standard_normal(shape)
    xq = torch.from_numpy(x64).to(tdtype).double().numpy()  # the data as x's dtype holds it
    ref = reference.backward("rms_norm", dy64, xq, w64, axis=axis, eps=EPS)

    def grads(fn):
        x = torch.from_numpy(x64).to(tdtype).requires_grad_(True)
        w = torch.tensor(w64, dtype=tdtype, requires_grad=True)
        y = fn(x, w)
        y.backward(torch.from_numpy(dy64).to(tdtype))
        return y, [t.grad.double().numpy() for t in (x, w)]

    y, ours = grads(lambda x, w: anynorm.rms_norm(x, w, axis=axis, eps=EPS))
    assert "_RMSRows" in autograd_nodes(y, depth=2)
    if axis == 1:
        _, theirs = grads(lambda x, w: torch.nn.functional.rms_norm(
            x.movedim(1, -1), (c,), w, EPS).movedim(-1, 1))
    else:
        _, theirs = grads(lambda x, w: torch.nn.functional.rms_norm(x, (c,), w, EPS))
    floor = {"float32": 1e-6, "bfloat16": 8e-3, "float16": 1e-3}[dtype]
    for name, a, t, r in zip(("dx", "dweight"), ours, theirs, ref):
        scale = float(np.max(np.abs(r)))
        err, torch_err = np.max(np.abs(a - r)) / scale, np.max(np.abs(t - r)) / scale
        assert err <= max(2 * torch_err, floor), (name, err, torch_err)


def test_nan_stays_in_its_row(monkeypatch):
    monkeypatch.setattr(blocked, "_AUTOGRAD_MIN_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=gen)
    x[2, 7] = float("nan")
    x.requires_grad_(True)
    w = torch.rand(16, generator=gen).requires_grad_(True)
    y = anynorm.rms_norm(x, w)
    y.backward(torch.randn(5, 16, generator=gen))
    nan = torch.isnan(x.grad)
    assert nan[2].all() and not nan[[0, 1, 3, 4]].any()
    assert torch.isnan(w.grad).all()  # every column sums the NaN row


def test_no_grad_half_forward_in_blocks_matches_torch():
    """Without autograd, half rows larger than a block take the blocked forward: y within a
    rounding of torch's composite, rstd float32."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(600, 512, generator=gen).to(torch.bfloat16)
    w = torch.rand(512, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        y, rstd = anynorm.rms_norm(x, w, eps=EPS, return_stats=True)
        ty, trstd = torch._fused_rms_norm(x.float(), [512], w.float(), EPS)
    assert rstd.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(rstd, trstd, rtol=1e-6, atol=0)
    torch.testing.assert_close(y.float(), ty, rtol=8e-3, atol=8e-3)


def test_small_calls_under_autograd_keep_torch_composite():
    """Below ``_AUTOGRAD_MIN_ELEMENTS`` autograd records torch's composite (a Python
    autograd.Function costs more there); from it, the blocked function."""
    x = torch.randn(4, 8, requires_grad=True)
    assert "_RMSRows" not in type(anynorm.rms_norm(x).grad_fn).__name__
    big = torch.randn(blocked._AUTOGRAD_MIN_ELEMENTS // 256, 256, requires_grad=True)
    assert "_RMSRows" in type(anynorm.rms_norm(big).grad_fn).__name__


def test_gradgradcheck_through_the_blocked_function(monkeypatch):
    """Double backward (create_graph) differentiates the composite formula; rstd included."""
    monkeypatch.setattr(blocked, "_AUTOGRAD_MIN_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(6, generator=gen, dtype=torch.float64).requires_grad_(True)

    def fn(x, w):
        y, rstd = anynorm.rms_norm(x, w, return_stats=True)
        return y, rstd

    assert "_RMSRows" in type(fn(x, w)[0].grad_fn).__name__
    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))
