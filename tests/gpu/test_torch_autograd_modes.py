"""Autograd beyond first-order reverse mode on CUDA tensors, against torch.nn.functional on
the same tensors: forward mode (dual tensors, torch.func.jvp, jacfwd), gradients of
gradients (a gradient penalty), and the refusal of a backward whose returned statistics
were changed in place. The CPU suite checks the same routes on CPU stand-ins
(``tests/test_kernels_torch_ops.py``); these run the kernels themselves."""

from __future__ import annotations

import pytest

import anynorm

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device", allow_module_level=True)
F = torch.nn.functional
CUDA = "cuda"

# (name, anynorm call, torch.nn.functional's, x shape, parameter shape)
CASES = [
    ("layer_norm", lambda x, w, b: anynorm.layer_norm(x, w, b),
     lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), (64, 768), (768,)),
    ("layer_norm axis=1", lambda x, w, b: anynorm.layer_norm(x, w, b, axis=1),
     lambda x, w, b: F.layer_norm(x.movedim(1, -1), (x.shape[1],), w, b).movedim(-1, 1), (4, 96, 7, 7), (96,)),
    ("rms_norm", lambda x, w, b: anynorm.rms_norm(x, w),
     lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w), (64, 1024), (1024,)),
    ("group_norm", lambda x, w, b: anynorm.group_norm(x, 8, w, b),
     lambda x, w, b: F.group_norm(x, 8, w, b), (4, 64, 9, 9), (64,)),
    ("instance_norm nhwc", lambda x, w, b: anynorm.instance_norm(x, w, b, channel_axis=-1),
     lambda x, w, b: F.instance_norm(x.movedim(-1, 1).contiguous(), weight=w, bias=b).movedim(1, -1),
     (4, 9, 9, 32), (32,)),
]
IDS = [c[0] for c in CASES]


def _inputs(shape, pshape, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)

    def rand(s, scale=1.0, loc=0.0):
        return torch.randn(s, generator=g, device=CUDA, dtype=torch.float64) * scale + loc

    return rand(shape, 2.0, 3.0), rand(pshape, 0.3, 1.0), rand(pshape), rand(shape)


@pytest.mark.parametrize("name, ours, theirs, shape, pshape", CASES, ids=IDS)
def test_forward_mode(name, ours, theirs, shape, pshape):
    import torch.autograd.forward_ad as fwAD

    x, w, b, v = _inputs(shape, pshape)
    want = torch.func.jvp(lambda x: theirs(x, w, b), (x,), (v,))[1]
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(ours(fwAD.make_dual(x, v), w, b)).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, want)
    torch.testing.assert_close(torch.func.jvp(lambda x: ours(x, w, b), (x,), (v,))[1], want)


@pytest.mark.parametrize("name, ours, theirs, shape, pshape", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_penalty(name, ours, theirs, shape, pshape, dtype):
    """grad with create_graph, then the gradient of a loss of that gradient (WGAN-GP)."""
    base = [t.to(dtype) for t in _inputs(shape, pshape)[:3]]

    def penalty(fn):
        x, w, b = (t.clone().requires_grad_() for t in base)
        gx, = torch.autograd.grad((fn(x, w, b) ** 2).sum(), x, create_graph=True)
        return torch.autograd.grad(((gx.norm() - 1) ** 2), (x, w, b), allow_unused=True)

    tol = {} if dtype == torch.float64 else dict(rtol=1e-3, atol=1e-4)
    for got, want in zip(penalty(ours), penalty(theirs)):  # rms_norm has no bias: None
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, **tol)


def test_returned_statistics_changed_in_place_refuse_backward():
    x, w, b, _ = _inputs((64, 768), (768,))
    x.requires_grad_()
    y, mean, rstd = anynorm.layer_norm(x, w, b, return_stats=True)
    rstd.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("name, ours, theirs, shape, pshape", CASES, ids=IDS)
def test_functionalize(name, ours, theirs, shape, pshape):
    x, w, b, _ = _inputs(shape, pshape)
    torch.testing.assert_close(torch.func.functionalize(lambda x: ours(x, w, b))(x), theirs(x, w, b))
