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
