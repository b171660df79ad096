"""Gradients: the reference's backward vs finite differences, anynorm's *_backward on every backend
vs the reference, torch autograd vs *_backward vs torch.nn.functional, and torch's gradcheck."""

from __future__ import annotations

import numpy as np
import pytest

import reference
from support import (CASES, assert_close, call, call_backward, case, default_eps, get_backend, has_bias,
                     make_inputs, stats_dtype, torch_functional)

SMALL_CASES = [c for c in CASES if np.prod(c.shape) <= 60]
FIRST_OF_EACH_OP = [next(c for c in SMALL_CASES if c.op == op) for op in reference.OPS]


def directional_derivatives(forward, dy, arrays, seed=5, h=1e-6):
    """Central differences of ``sum(dy * forward(*arrays))`` along a random direction per argument."""
    rng = np.random.default_rng(seed)
    derivs, directions = [], []
    for i, a in enumerate(arrays):
        v = rng.standard_normal(a.shape)
        plus = [b + h * v if j == i else b for j, b in enumerate(arrays)]
        minus = [b - h * v if j == i else b for j, b in enumerate(arrays)]
        derivs.append(np.sum(dy * (forward(*plus) - forward(*minus))) / (2 * h))
        directions.append(v)
    return derivs, directions


def grad_inputs(c, seed=0):
    x, w, b = make_inputs(c, seed)
    dy = np.random.default_rng(seed + 1).standard_normal(c.shape)
    return x, w, b, dy


@pytest.mark.parametrize("c", CASES, ids=str)
def test_reference_backward_matches_finite_differences(c):
    """The oracle itself: its analytic backward agrees with central differences of its forward."""
    x, w, b, dy = grad_inputs(c)
    params = [w] + ([b] if b is not None else [])

    def forward(x_, w_, b_=None):
        return reference.forward(c.op, x_, w_, b_, **c.kw)[0]

    derivs, dirs = directional_derivatives(forward, dy, [x, *params])
    grads = [g for g in reference.backward(c.op, dy, x, w, **c.kw) if g is not None]
    for name, deriv, grad, v in zip(("dx", "dweight", "dbias"), derivs, grads, dirs):
        np.testing.assert_allclose(np.sum(grad * v), deriv, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("c", CASES, ids=str)
def test_backward_matches_reference(backend, c, dtype):
    """*_backward on every backend, with stats recomputed and with stats from the forward."""
    x64, w64, _, dy64 = grad_inputs(c)
    x, w, dy = backend.asarray(x64, dtype), backend.asarray(w64, dtype), backend.asarray(dy64, dtype)
    want = reference.backward(c.op, backend.to_numpy(dy), backend.to_numpy(x), backend.to_numpy(w),
                              eps=default_eps(c.op, dtype), **c.kw)
    stats = call(c.op, x, w, return_stats=True, **c.kw)[1:]
    scale = 4 * np.prod(c.shape) ** 0.5  # dweight/dbias are sums over the batch
    for given in (None, stats):
        got = call_backward(c.op, dy, x, w, stats=given, **c.kw)
        for name, g, ref in zip(("dx", "dweight", "dbias"), got, want):
            if ref is None or not has_bias(c.op) and name == "dbias":
                assert g is None
                continue
            backend.check(g, ref.shape, dtype)
            assert_close(backend.to_numpy(g), ref, dtype, scale=scale, what=name)


@pytest.mark.parametrize("c", CASES[::2], ids=str)
def test_backward_without_weight(backend, c):
    """No weight: dweight and dbias are None, dx is the gradient of the unscaled norm."""
    x64, _, _, dy64 = grad_inputs(c)
    got = call_backward(c.op, backend.asarray(dy64), backend.asarray(x64), None, **c.kw)
    want = reference.backward(c.op, dy64, x64, None, **c.kw)
    assert got[1] is None and got[2] is None
    assert_close(backend.to_numpy(got[0]), want[0], "float64", scale=10)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("c", CASES, ids=str)
def test_torch_autograd_vs_backward_vs_functional(c, dtype):
    """torch autograd through anynorm == anynorm.*_backward on NumPy == autograd through torch.nn.functional."""
    torch = pytest.importorskip("torch")
    tb = get_backend("torch")
    x64, w64, b64, dy64 = grad_inputs(c)
    grads = []
    for fn in (call, torch_functional):
        leaves = [tb.asarray(a, dtype).requires_grad_() for a in (x64, w64, b64) if a is not None]
        y = fn(c.op, *leaves, **c.kw)
        y.backward(tb.asarray(dy64, dtype))
        grads.append([leaf.grad for leaf in leaves])
    ours, torchs = grads
    numpy_grads = [g for g in call_backward(c.op, dy64.astype(dtype), x64.astype(dtype), w64.astype(dtype),
                                            **c.kw) if g is not None]
    scale = 4 * np.prod(c.shape) ** 0.5
    for name, a, t, n in zip(("dx", "dweight", "dbias"), ours, torchs, numpy_grads):
        assert a.dtype == getattr(torch, dtype)
        assert_close(tb.to_numpy(a), tb.to_numpy(t), dtype, scale=scale, what=f"{name} vs torch.nn.functional")
        assert_close(tb.to_numpy(a), n.astype(np.float64), dtype, scale=scale, what=f"{name} vs *_backward")


@pytest.mark.parametrize("c", SMALL_CASES, ids=str)
def test_gradcheck(c):
    """torch.autograd.gradcheck (and gradgradcheck) in float64 for x, weight and bias."""
    torch = pytest.importorskip("torch")
    x64, w64, b64, _ = grad_inputs(c)
    leaves = [torch.asarray(a).requires_grad_() for a in (x64, w64, b64) if a is not None]
    fn = lambda *args: call(c.op, *args, **c.kw)  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves)
    if c in FIRST_OF_EACH_OP:  # second order: once per operation (it is slow)
        assert torch.autograd.gradgradcheck(fn, leaves)


def test_stats_dtype_for_half_inputs(backend):
    """float16 inputs give float32 statistics; *_backward accepts them back."""
    c = case("layer_norm", (4, 8))
    x64, w64, _, dy64 = grad_inputs(c)
    x, dy = backend.asarray(x64, "float16"), backend.asarray(dy64, "float16")
    _, mean, rstd = call("layer_norm", x, return_stats=True)
    backend.check(rstd, (4, 1), stats_dtype("float16"))
    dx = call_backward("layer_norm", dy, x, stats=(mean, rstd))[0]
    backend.check(dx, c.shape, "float16")
