"""Tensors without memory to read: the meta device (``torch.device("meta")`` model
initialisation, shape inference) and FakeTensorMode (torch's shape propagation outside
torch.compile).  Every op and layout gives the shapes and dtypes a real call gives, forward
and backward, where the conditioning check would have read the statistics
(``Tensor.item() cannot be called on meta tensors``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import anynorm  # noqa: E402
import anynorm.nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

# (op, shape, keywords, parameter shape, channels_last memory)
CASES = [
    ("layer_norm", (4, 6, 8), dict(axis=-1), (8,), False),
    ("layer_norm", (4, 6, 5, 5), dict(axis=1), (6,), False),
    ("layer_norm", (4, 6, 5, 5), dict(axis=1), (6,), True),
    ("layer_norm", (4, 6, 8), dict(axis=(0, 2)), (4, 8), False),
    ("rms_norm", (4, 6, 8), dict(axis=-1), (8,), False),
    ("rms_norm", (4, 6, 8), dict(axis=(0, 2)), (4, 8), False),
    ("group_norm", (4, 6, 5, 5), dict(channel_axis=1), (6,), False),
    ("group_norm", (4, 6, 5, 5), dict(channel_axis=1), (6,), True),
    ("group_norm", (4, 5, 5, 6), dict(channel_axis=-1), (6,), False),
    ("group_norm", (4, 5, 6), dict(channel_axis=-1), (6,), False),
    ("instance_norm", (4, 6, 5, 5), dict(channel_axis=1), (6,), False),
    ("instance_norm", (4, 6, 5, 5), dict(channel_axis=1), (6,), True),
]
IDS = [f"{op}{shape}{sorted(kw.items())}{'-cl' if cl else ''}" for op, shape, kw, _, cl in CASES]
DTYPES = ["float32", "bfloat16", "float16", "float64"]


def _inputs(shape, pshape, dtype, channels_last, grad, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) + 100).to(getattr(torch, dtype))
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.rand(pshape, generator=g).to(x.dtype)
    b = torch.rand(pshape, generator=g).to(x.dtype)
    x, w, b = x.to(device), w.to(device), b.to(device)
    return x.requires_grad_(grad), w.requires_grad_(grad), b


def _call(op, kw, x, w, b, stats):
    if op == "rms_norm":
        return anynorm.rms_norm(x, w, return_stats=stats, **kw)
    if op == "group_norm":
        return anynorm.group_norm(x, 3, w, b, return_stats=stats, **kw)
    return getattr(anynorm, op)(x, w, b, return_stats=stats, **kw)


def _run(op, kw, inputs, stats, grad):
    out = _call(op, kw, *inputs, stats)
    outs = out if stats else (out,)
    grads = ()
    if grad:
        grads = torch.autograd.grad(outs[0].sum(), inputs[:2])
    return [(tuple(t.shape), t.dtype) for t in (*outs, *grads)]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op,shape,kw,pshape,cl", CASES, ids=IDS)
def test_meta_and_fake_tensors_give_real_shapes_and_dtypes(op, shape, kw, pshape, cl, dtype, grad):
    stats = not grad  # both forms, without doubling the cases
    want = _run(op, kw, _inputs(shape, pshape, dtype, cl, grad), stats, grad)
    assert _run(op, kw, _inputs(shape, pshape, dtype, cl, grad, "meta"), stats, grad) == want
    with FakeTensorMode():
        got = _run(op, kw, _inputs(shape, pshape, dtype, cl, grad), stats, grad)
    assert got == want


def test_modules_initialised_on_meta():
    """The pattern of large-model loading: build on the meta device, infer shapes there,
    then ``to_empty`` and load real weights."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), anynorm.nn.LayerNorm(8),
                                    anynorm.nn.RMSNorm(8))
        assert model(torch.empty(2, 3, 8)).shape == (2, 3, 8)
    model = model.to_empty(device="cpu")
    model.load_state_dict({"0.weight": torch.eye(8), "0.bias": torch.zeros(8),
                           "1.weight": torch.ones(8), "1.bias": torch.zeros(8),
                           "2.weight": torch.ones(8)})
    x = torch.randn(2, 3, 8) + 1e4
    want = torch.nn.functional.rms_norm(torch.nn.functional.layer_norm(x.double(), (8,)), (8,))
    torch.testing.assert_close(model(x).double(), want, rtol=0, atol=2e-6)
