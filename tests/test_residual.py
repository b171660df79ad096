"""The fused residual: ``h = x + residual`` normalized, returned as ``(y, h)``, and its gradients."""

from __future__ import annotations

import numpy as np
import pytest

import anynorm
import reference
from support import assert_close, call, call_backward, case, default_eps, get_backend, make_inputs

RESIDUAL_CASES = [case("layer_norm", (3, 8)), case("layer_norm", (2, 3, 4), axis=(0, 2)),
                  case("rms_norm", (3, 8)), case("rms_norm", (2, 6, 2, 2), axis=1)]


def residual_inputs(c, seed=0):
    x, w, b = make_inputs(c, seed)
    rng = np.random.default_rng(seed + 2)
    return x, rng.standard_normal(c.shape), w, b


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("c", RESIDUAL_CASES, ids=str)
def test_returns_y_and_h(backend, c, dtype):
    x64, r64, w64, b64 = residual_inputs(c)
    x, r = backend.asarray(x64, dtype), backend.asarray(r64, dtype)
    w, b = backend.asarray(w64, dtype), None if b64 is None else backend.asarray(b64, dtype)
    y, h = call(c.op, x, w, b, residual=r, **c.kw)
    backend.check(h, c.shape, dtype)
    backend.check(y, c.shape, dtype)
    # h is the sum in x's dtype, rounded once, as a pre-norm block carries it forward
    h_want = backend.to_numpy(x + r)
    np.testing.assert_array_equal(backend.to_numpy(h), h_want)
    y_want = reference.forward(c.op, h_want, backend.to_numpy(w), backend.to_numpy(b),
                               eps=default_eps(c.op, dtype), **c.kw)[0]
    assert_close(backend.to_numpy(y), y_want, dtype, scale=4)


@pytest.mark.parametrize("c", RESIDUAL_CASES, ids=str)
def test_return_stats_with_residual(backend, c):
    x64, r64, w64, b64 = residual_inputs(c)
    out = call(c.op, backend.asarray(x64), backend.asarray(w64), None if b64 is None else backend.asarray(b64),
               residual=backend.asarray(r64), return_stats=True, **c.kw)
    _, ref_mean, ref_rstd = reference.forward(c.op, x64 + r64, eps=default_eps(c.op, "float64"), **c.kw)
    want_stats = (ref_rstd,) if c.op == "rms_norm" else (ref_mean, ref_rstd)
    assert len(out) == 2 + len(want_stats)
    for got, want in zip(out[2:], want_stats):
        assert_close(backend.to_numpy(got), want, "float64")


@pytest.mark.parametrize("c", RESIDUAL_CASES, ids=str)
def test_torch_gradients_reach_x_and_residual(c):
    """Through autograd both x and residual get the gradient through the norm plus the one of h."""
    torch = pytest.importorskip("torch")
    x64, r64, w64, b64 = residual_inputs(c)
    dy64, dh64 = (np.random.default_rng(s).standard_normal(c.shape) for s in (8, 9))
    x, r, w = (torch.asarray(a).requires_grad_() for a in (x64, r64, w64))
    y, h = call(c.op, x, w, None, residual=r, **c.kw)
    (torch.sum(y * torch.asarray(dy64)) + torch.sum(h * torch.asarray(dh64))).backward()
    dx_norm, dw, _ = reference.backward(c.op, dy64, x64 + r64, w64, eps=default_eps(c.op, "float64"), **c.kw)
    for leaf in (x, r):
        assert_close(leaf.grad.numpy(), dx_norm + dh64, "float64", scale=10)
    assert_close(w.grad.numpy(), dw, "float64", scale=10)
    assert torch.autograd.gradcheck(lambda a, b_: call(c.op, a, residual=b_, **c.kw)[0],
                                    (x.detach().requires_grad_(), r.detach().requires_grad_()))


@pytest.mark.parametrize("c", RESIDUAL_CASES, ids=str)
def test_numpy_composition_with_backward(backend, c):
    """Without autograd: ``*_backward(dy, h, ...)`` plus dh is the gradient of both x and residual,
    the same numbers torch autograd gives through the fused call."""
    torch = pytest.importorskip("torch")
    x64, r64, w64, _ = residual_inputs(c)
    dy64, dh64 = (np.random.default_rng(s).standard_normal(c.shape) for s in (8, 9))
    y, h, *stats = call(c.op, backend.asarray(x64), backend.asarray(w64), residual=backend.asarray(r64),
                        return_stats=True, **c.kw)
    dx_norm, dw, _ = call_backward(c.op, backend.asarray(dy64), h, backend.asarray(w64), stats=tuple(stats), **c.kw)
    grad_x = backend.to_numpy(dx_norm) + dh64

    xt, rt, wt = (torch.asarray(a).requires_grad_() for a in (x64, r64, w64))
    yt, ht = call(c.op, xt, wt, residual=rt, **c.kw)
    (torch.sum(yt * torch.asarray(dy64)) + torch.sum(ht * torch.asarray(dh64))).backward()
    assert_close(grad_x, xt.grad.numpy(), "float64", scale=10)
    assert_close(grad_x, rt.grad.numpy(), "float64", scale=10)
    assert_close(backend.to_numpy(dw), wt.grad.numpy(), "float64", scale=10)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_modules_take_a_residual(lib, module):
    """``module(x, residual)`` returns ``(y, h)``: anynorm.LayerNorm on NumPy, anynorm.nn on torch."""
    b = get_backend(lib)
    mod = getattr(anynorm.nn if lib == "torch" else anynorm, module)(5, dtype=b.dtype("float64"))
    x64, r64 = np.random.default_rng(3).standard_normal((2, 2, 5))
    y, h = mod(b.asarray(x64), b.asarray(r64))
    op = "layer_norm" if module == "LayerNorm" else "rms_norm"
    want = reference.forward(op, x64 + r64, eps=default_eps(op, "float64"))[0]
    assert_close(b.to_numpy(h), x64 + r64, "float64")
    assert_close(b.to_numpy(y), want, "float64")


def test_residual_is_not_modified_by_torch_in_place():
    """h is a new tensor: x and residual keep their values and version counters."""
    torch = pytest.importorskip("torch")
    x, r = torch.randn(3, 4), torch.randn(3, 4)
    before = (x.clone(), r.clone(), x._version, r._version)
    anynorm.layer_norm(x, residual=r)
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])
    assert (x._version, r._version) == before[2:]
