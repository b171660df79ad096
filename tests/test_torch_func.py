"""torch.func transforms over anynorm on CPU tensors: vmap (batched tensors have no memory to
read: no data-dependent check, no NumPy view) and per-sample gradients (vmap of grad), equal
to a loop over the samples, exact on data far from zero."""

from __future__ import annotations

import numpy as np
import pytest

import reference

torch = pytest.importorskip("torch")

import anynorm  # noqa: E402

vmap, grad = torch.func.vmap, torch.func.grad

# (op, per-sample shape, keyword arguments, parameter shape)
CASES = [
    ("layer_norm", (4, 8), {}, (8,)),
    ("layer_norm", (6, 5, 3), {"axis": 0}, (6,)),
    ("rms_norm", (4, 8), {}, (8,)),
    ("group_norm", (8, 3, 3), {"num_groups": 4}, (8,)),
    ("group_norm", (3, 3, 8), {"num_groups": 4, "channel_axis": -1}, (8,)),
    ("instance_norm", (6, 5), {}, (6,)),
]


def _call(op, x, w, kw):
    kw = dict(kw)
    if op == "group_norm":
        return anynorm.group_norm(x, kw.pop("num_groups"), w, **kw)
    return getattr(anynorm, op)(x, w, **kw)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op,shape,kw,pshape", CASES, ids=lambda v: str(v))
def test_vmap_and_per_sample_grads(op, shape, kw, pshape, dtype):
    tdtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    # the per-sample call adds a leading batch axis that vmap hides: ops whose statistics
    # need one (instance/group norm) see the sample itself as the batch
    xs = (torch.randn((5,) + shape, generator=gen, dtype=torch.float64) * 2 + 3).to(tdtype)
    w = (torch.rand(pshape, generator=gen, dtype=torch.float64) + 0.5).to(tdtype)
    per = (lambda x: _call(op, x[None], w, kw)[0]) if op in ("group_norm", "instance_norm") \
        else (lambda x: _call(op, x, w, kw))
    y = vmap(per)(xs)
    loop = torch.stack([per(x) for x in xs])
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == "float64" else dict(rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(y, loop, **tol)

    def loss(w, x):
        out = _call(op, x[None], w, kw)[0] if op in ("group_norm", "instance_norm") else _call(op, x, w, kw)
        return (out ** 3).sum()

    g = vmap(grad(loss), in_dims=(None, 0))(w, xs)
    ref = torch.stack([grad(loss)(w, x) for x in xs])
    torch.testing.assert_close(g, ref, **tol)


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_vmap_exact_far_from_zero(offset):
    """Under vmap the shift is always taken: float32 rows near 1e4/1e6 at fp32 rounding."""
    x64 = offset + np.random.default_rng(1).standard_normal((3, 16, 64))
    x = torch.from_numpy(x64.astype(np.float32))
    y = vmap(lambda s: anynorm.layer_norm(s))(x)
    y_ref = reference.forward("layer_norm", x.double().numpy())[0]
    assert np.max(np.abs(y.numpy() - y_ref)) <= 2e-6


def _torch_nn(op, x, w, kw):
    """torch.nn.functional's own routine for the same call (its forward-mode formulas)."""
    F = torch.nn.functional
    if op == "layer_norm":
        axis = kw.get("axis", -1) % x.ndim
        return F.layer_norm(x.movedim(axis, -1), (x.shape[axis],), w).movedim(-1, axis)
    if op == "rms_norm":
        return F.rms_norm(x, (x.shape[-1],), w)
    channel = kw.get("channel_axis", 1) % x.ndim
    xc = x.movedim(channel, 1).contiguous()  # torch's group_norm jvp views its input
    y = F.group_norm(xc, kw["num_groups"], w) if op == "group_norm" else F.instance_norm(xc, weight=w)
    return y.movedim(1, channel)


@pytest.mark.parametrize("op,shape,kw,pshape", CASES, ids=lambda v: str(v))
def test_forward_mode(op, shape, kw, pshape):
    """Forward-mode AD (dual tensors, torch.func.jvp, jacfwd) and forward-over-reverse
    (torch.func.hessian) give torch.nn.functional's tangents, in x and in the weight."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(2)
    full = shape if op in ("layer_norm", "rms_norm") else (2,) + shape
    x = torch.randn(full, generator=gen, dtype=torch.float64) * 2 + 3
    w = torch.rand(pshape, generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn(full, generator=gen, dtype=torch.float64)
    vw = torch.randn(pshape, generator=gen, dtype=torch.float64)
    tol = dict(rtol=1e-10, atol=1e-10)

    want = torch.func.jvp(lambda x, w: _torch_nn(op, x, w, kw), (x, w), (v, vw))[1]
    with fwAD.dual_level():
        y = _call(op, fwAD.make_dual(x, v), fwAD.make_dual(w, vw), kw)
        tangent = fwAD.unpack_dual(y).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, want, **tol)
    torch.testing.assert_close(torch.func.jvp(lambda x, w: _call(op, x, w, kw), (x, w), (v, vw))[1],
                               want, **tol)
    torch.testing.assert_close(torch.func.jacfwd(lambda x: _call(op, x, w, kw))(x),
                               torch.func.jacrev(lambda x: _torch_nn(op, x, w, kw))(x), **tol)

    def loss(fn):
        return lambda x: (fn(op, x, w, kw) ** 3).sum()

    torch.testing.assert_close(torch.func.hessian(loss(lambda op, x, w, kw: _call(op, x, w, kw)))(x),
                               torch.func.hessian(loss(_torch_nn))(x), **tol)


# (op, shape, keyword arguments, parameter shape): the torch CPU routes a forward-mode call
# must not leave (NumPy executor rows and channels-first layer norm, torch's kernels,
# channels-last group norm, the shift first far from zero)
ROUTES = [
    ("layer_norm", (4, 8192), {}, (8192,)),
    ("rms_norm", (4, 8192), {}, (8192,)),
    ("layer_norm", (2, 64, 9, 9), {"axis": 1}, (64,)),
    ("group_norm", (2, 5, 5, 8), {"num_groups": 4, "channel_axis": -1}, (8,)),
    ("instance_norm", (2, 16, 6, 6), {}, (16,)),
]


@pytest.mark.parametrize("offset", [0.0, 3e3])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op,shape,kw,pshape", ROUTES, ids=lambda v: str(v))
def test_forward_mode_on_every_route(op, shape, kw, pshape, dtype, offset):
    """Dual tensors keep their tangents on every CPU route (the NumPy executor, which reads
    memory, dropped them: y came back without a tangent), against torch.nn.functional's
    tangent in float64."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) + offset
    w = torch.rand(pshape, generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    want = torch.func.jvp(lambda x: _torch_nn(op, x, w, kw), (x,), (v,))[1]
    tdtype = getattr(torch, dtype)
    with fwAD.dual_level():
        y = _call(op, fwAD.make_dual(x.to(tdtype), v.to(tdtype)), w.to(tdtype), kw)
        tangent = fwAD.unpack_dual(y).tangent
    assert tangent is not None
    scale = float(want.abs().max())
    # float32 x at 3e3 carries its own rounding into the tangent (eps * 3e3 = 3.6e-4 of std)
    tol = 1e-12 if dtype == "float64" else 2e-5 * max(1.0, offset / 100)
    assert float((tangent.double() - want).abs().max()) <= tol * scale


@pytest.mark.parametrize("shape", [(4, 8), (4, 8192)])
def test_forward_mode_through_the_backward_functions(shape):
    """``layer_norm_backward`` of a dual dy carries its tangent (dx is linear in dy), also
    where the NumPy executor takes the call."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(5)
    x, dy, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    w = torch.rand(shape[-1], generator=gen, dtype=torch.float64) + 0.5
    with fwAD.dual_level():
        dx = anynorm.layer_norm_backward(fwAD.make_dual(dy, v), x, w)[0]
        tangent = fwAD.unpack_dual(dx).tangent
    assert tangent is not None
    torch.testing.assert_close(tangent, anynorm.layer_norm_backward(v, x, w)[0], rtol=1e-12, atol=1e-12)
