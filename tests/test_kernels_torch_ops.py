"""The torch custom ops' plumbing, checked on the CPU without a GPU.

CPU stand-ins (the reference executor) are registered for ``anynorm::forward`` and
``anynorm::backward``, so schemas, fake kernels, the autograd formula (weight, bias,
residual), ``torch.library.opcheck`` and ``torch.compile`` are exercised here; the CUDA
kernels behind the same ops are checked by ``tests/gpu``. Also: ``anynorm._cuda`` imports
without a GPU, raises ImportError without CuPy, and ``unsupported`` answers instead of raising.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy", exc_type=ImportError)
ops = pytest.importorskip("anynorm._cuda._torch_ops", exc_type=ImportError)

import anynorm  # noqa: E402
from anynorm import _reference  # noqa: E402
from anynorm._plan import make_plan  # noqa: E402


def _cpu_forward(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps):
    plan = ops._plan(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps)
    got = _reference.forward(plan, x, weight, bias, residual)
    outs = ops._forward_outputs(x, residual, op, axes, channel_axis, num_groups)
    for out, value in zip(outs, got):
        if value is not None:
            out.copy_(value)
    return outs


def _cpu_backward(dy, x, weight, mean, rstd, op, axes, channel_axis, num_groups, eps, param_grads):
    plan = ops._plan(x, weight, None, None, op, axes, channel_axis, num_groups, eps)
    acc = ops._acc(x.dtype)
    dx, dw, db = _reference.backward(plan, dy.to(x.dtype), x, weight, mean, rstd)
    if not param_grads:
        return dx, x.new_zeros((0,), dtype=acc), x.new_zeros((0,), dtype=acc)
    if dw is None:
        ones = x.new_ones(plan.param_shape, dtype=acc)
        plan1 = ops._plan(x, ones, None, None, op, axes, channel_axis, num_groups, eps)
        _, dw, db = _reference.backward(plan1, dy.to(x.dtype), x, ones, mean, rstd)
    return dx, dw.to(acc), db.to(acc)


ops._forward_op.register_kernel("cpu")(_cpu_forward)
ops._backward_op.register_kernel("cpu")(_cpu_backward)

CASES = [
    # op, shape, kwargs for make_plan, weight, bias, residual
    ("layer_norm", (6, 10), {"axis": -1}, True, True, False),
    ("layer_norm", (6, 10), {"axis": -1}, True, True, True),
    ("layer_norm", (6, 10), {"axis": -1}, False, True, False),
    ("layer_norm", (2, 4, 3, 5), {"axis": 1}, True, False, False),
    ("rms_norm", (6, 10), {"axis": -1, "eps": 1e-6}, True, False, True),
    ("instance_norm", (2, 4, 3, 5), {"channel_axis": -1}, True, True, False),
    ("group_norm", (2, 6, 3, 5), {"channel_axis": 1, "num_groups": 3}, True, True, False),
]


def _inputs(case, dtype=torch.float64):
    op, shape, kw, has_w, has_b, has_res = case
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen, dtype=dtype) * 2 + 1).requires_grad_()
    pshape = make_plan(op, x.detach(), **kw).param_shape
    w = (torch.randn(pshape, generator=gen, dtype=dtype) * 0.3 + 1).requires_grad_() if has_w else None
    b = torch.randn(pshape, generator=gen, dtype=dtype).requires_grad_() if has_b else None
    res = torch.randn(shape, generator=gen, dtype=dtype).requires_grad_() if has_res else None
    plan = make_plan(op, x.detach(), w, b, res, **kw)
    return plan, x, w, b, res


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_opcheck(case):
    plan, x, w, b, res = _inputs(case)
    torch.library.opcheck(ops._forward_op, (x, w, b, res) + ops._op_args(plan))
    dy = torch.randn(plan.shape, dtype=x.dtype)
    torch.library.opcheck(ops._backward_op,
                          (dy, x.detach(), None if w is None else w.detach(), None, None)
                          + ops._op_args(plan) + (True,))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_autograd_matches_reference(case):
    plan, x, w, b, res = _inputs(case)
    leaves = [t for t in (x, w, b, res) if t is not None]

    def loss(y, h):
        gen = torch.Generator().manual_seed(3)
        total = (y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum()
        if h is not None:
            total = total + (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
        return total

    y, h, mean, rstd = ops.forward(plan, x, w, b, res)
    got = torch.autograd.grad(loss(y, h), leaves)
    ry, rh, rmean, rrstd = _reference.forward(plan, x, w, b, res)
    want = torch.autograd.grad(loss(ry, rh), leaves)
    torch.testing.assert_close(y, ry)
    assert (mean is None) == (rmean is None) and rstd.shape == rrstd.shape
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


def test_backward_entry_point_shapes():
    plan, x, w, _, _ = _inputs(CASES[5])
    dy = torch.randn(plan.shape, dtype=x.dtype)
    dx, dw, db = ops.backward(plan, dy, x.detach(), w.detach())
    assert dx.shape == plan.shape and dw.shape == w.shape == db.shape and dw.dtype == w.dtype
    assert ops.backward(plan, dy, x.detach(), None)[1:] == (None, None)


def test_compiles_fullgraph_with_backward():
    plan, x, w, b, _ = _inputs(CASES[0], torch.float32)
    args = ops._op_args(plan)

    def fn(x, w, b):
        y, _, mean, rstd = torch.ops.anynorm.forward(x, w, b, None, *args)
        return (y * y).sum() + rstd.sum()

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    got = torch.autograd.grad(compiled(x, w, b), (x, w, b))
    want = torch.autograd.grad(fn(x, w, b), (x, w, b))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


def test_unsupported_answers_without_raising():
    import anynorm._cuda as cuda

    x = np.zeros((2, 3), np.float32)
    reason = cuda.unsupported(make_plan("layer_norm", x), x)
    assert reason is None or isinstance(reason, str)


def test_import_without_cupy_raises_import_error():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "try:\n    import anynorm._cuda\nexcept ImportError as e:\n    print('ImportError', e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(anynorm.__file__).parents[1]))
    assert run.stdout.startswith("ImportError"), run.stdout + run.stderr


def test_direct_calls_only_where_the_dispatcher_adds_nothing():
    """Inference calls skip the dispatcher; anything autograd, a mode or torch.compile must
    see goes through the registered op (and CPU tensors always do: the entry points check
    ``x.is_cuda`` first, which test_backward_entry_point_shapes relies on)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Subclass(torch.Tensor):
        pass

    x = torch.ones(2, 3)
    weight = torch.nn.Parameter(torch.ones(3))
    assert ops._direct(x, None)
    assert not ops._direct(x, weight)  # a parameter that requires grad, grad mode on
    with torch.no_grad():
        assert ops._direct(x, weight)  # inference with a module's parameters
    with torch.inference_mode():
        assert ops._direct(x, weight)
    with Passthrough():
        assert not ops._direct(x)
    assert not ops._direct(x.as_subclass(Subclass))
