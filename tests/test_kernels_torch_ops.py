"""The torch custom ops' plumbing, checked on the CPU without a GPU.

CPU stand-ins (the reference executor) are registered for ``anynorm::forward`` and
``anynorm::backward``, so schemas, fake kernels, the autograd formula (weight, bias,
residual), ``torch.library.opcheck`` and ``torch.compile`` are exercised here; the CUDA
kernels behind the same ops are checked by ``tests/gpu``. Also: ``anynorm._cuda._executor`` imports
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


def _data(*tensors):
    """The tensors as a kernel reads them: memory, nothing autograd or forward mode tracks."""
    return [None if t is None else t.detach() for t in tensors]


def _cpu_forward_run(plan, x, weight, bias, residual, stats=True, site=None):
    """The forward runner's contract, computed by the reference executor on the data."""
    x, weight, bias, residual = _data(x, weight, bias, residual)
    outs = ops._forward_outputs(x, residual, plan.stats_shape, plan.center)
    for out, value in zip(outs, _reference.forward(plan, x, weight, bias, residual)):
        if out is not None:
            out.copy_(value)
    return outs


def _cpu_backward_run(plan, dy, x, weight, mean, rstd, param_grads, site=None):
    dy, x, weight, mean, rstd = _data(dy, x, weight, mean, rstd)
    acc = ops._acc(x.dtype)
    dx, dw, db = _reference.backward(plan, dy.to(x.dtype), x, weight, mean, rstd)
    if not param_grads:
        return dx, x.new_zeros((0,), dtype=acc), x.new_zeros((0,), dtype=acc)
    if dw is None:
        ones = x.new_ones(plan.param_shape, dtype=acc)
        _, dw, db = _reference.backward(plan, dy.to(x.dtype), x, ones, mean, rstd)
    return dx, dw.to(acc), db.to(acc)


def _cpu_forward(x, weight, bias, residual, *args):
    plan = ops._plan(x, weight, bias, residual, *args)
    return ops._placeholders(x, _cpu_forward_run(plan, x, weight, bias, residual))


def _cpu_backward(dy, x, weight, mean, rstd, *args):
    *args, param_grads = args
    plan = ops._plan(x, weight, None, None, *args)
    return _cpu_backward_run(plan, dy, x, weight, mean, rstd, param_grads)


# CPU stand-ins for the CUDA runners, both behind the ops and for eager calls
ops._forward_op.register_kernel("cpu")(_cpu_forward)
ops._backward_op.register_kernel("cpu")(_cpu_backward)
ops.RUNNERS["cpu"] = (_cpu_forward_run, _cpu_backward_run)

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


def _op_forward(plan, x, w, b, res):
    """ops.forward's outputs, through the registered op whatever the route would be."""
    y, h, mean, rstd = ops._forward_op(x, w, b, res, *ops._op_args(plan))
    return y, (h if res is not None else None), (mean if plan.center else None), rstd


@pytest.mark.parametrize("via", ["eager", "eager-no-stats", "op"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_autograd_matches_reference(case, via):
    """Both autograd routes, eager (_EagerNorm, no dispatcher; with and without the statistics
    among its outputs) and the op's registered autograd, give the reference executor's
    gradients for every input."""
    plan, x, w, b, res = _inputs(case)
    stats = via != "eager-no-stats"
    leaves = [t for t in (x, w, b, res) if t is not None]

    def loss(y, h):
        gen = torch.Generator().manual_seed(3)
        total = (y * torch.randn(y.shape, generator=gen, dtype=y.dtype)).sum()
        if h is not None:
            total = total + (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
        return total

    assert ops._route(x, w, b, res) == ops.AUTOGRAD
    if via == "op":
        y, h, mean, rstd = _op_forward(plan, x, w, b, res)
    else:
        y, h, mean, rstd = ops.forward(plan, x, w, b, res, stats)
    assert ("EagerNorm" in type(y.grad_fn).__name__) == (via != "op")
    got = torch.autograd.grad(loss(y, h), leaves)
    ry, rh, rmean, rrstd = _reference.forward(plan, x, w, b, res)
    want = torch.autograd.grad(loss(ry, rh), leaves)
    torch.testing.assert_close(y, ry)
    if stats:
        assert (mean is None) == (rmean is None) and rstd.shape == rrstd.shape
    else:
        assert mean is None and rstd is None
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=["layer_norm-residual", "rms_norm"])
def test_eager_statistics_carry_no_gradient(case):
    """The statistics a training call returns are marked non-differentiable (a gradient
    through them would be dropped, so autograd must not pretend to carry one)."""
    plan, x, w, b, res = _inputs(case)
    _, _, mean, rstd = ops.forward(plan, x, w, b, res)
    assert not rstd.requires_grad and (mean is None or not mean.requires_grad)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]], ids=["layer_norm", "rms_norm", "group_norm"])
def test_returned_statistics_changed_in_place_refuse_backward(case):
    """The backward reads the statistics it returned: changed in place by the caller, they
    make it raise autograd's in-place error (as torch's own layer norm does), where it
    computed a wrong gradient from them."""
    plan, x, w, b, res = _inputs(case)
    y, _, mean, rstd = ops.forward(plan, x, w, b, res)
    loss = (y * y).sum()
    torch.autograd.grad(loss, x, retain_graph=True)
    rstd.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, x)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=["layer_norm-residual", "rms_norm"])
def test_eager_route_without_autograd(case):
    """Nothing to record: the runner's outputs, no graph, the same values."""
    plan, x, w, b, res = _inputs(case)
    with torch.no_grad():
        assert ops._route(x, w, b, res) == ops.RUN
        y, h, mean, rstd = ops.forward(plan, x, w, b, res)
    ry, rh, rmean, rrstd = _reference.forward(plan, x.detach(), w, b, res)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(rstd, rrstd)
    assert (h is None) == (rh is None) and (mean is None) == (rmean is None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_eager_double_backward(case):
    """Gradients of gradients (a gradient penalty: ``create_graph=True``, then a loss of the
    gradient) equal autograd's of the array-API core, for x, weight, bias and residual; the
    eager route raised."""
    plan, x, w, b, res = _inputs(case)
    leaves = [t for t in (x, w, b, res) if t is not None]

    def second(forward):
        y, h = forward(plan, x, w, b, res)[:2]
        loss = (y ** 3).sum() + (0 if res is None else (h * h).sum())
        grads = torch.autograd.grad(loss, leaves, create_graph=True)
        penalty = sum((g * g).sum() for g in grads)
        return grads, torch.autograd.grad(penalty, leaves)

    (got_1, got_2), (want_1, want_2) = second(ops.forward), second(_reference.forward)
    for got, want in zip(got_1 + got_2, want_1 + want_2):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_torch_func_grad_of_grad(case):
    """torch.func.grad of a loss of torch.func.grad (the transform route's backward with a
    graph) equals the same of the array-API core."""
    plan, *tensors = _inputs(case)
    x, w, b, res = _data(*tensors)

    def penalty(forward):
        def loss(x):
            return (forward(plan, x, w, b, res)[0] ** 3).sum()
        return torch.func.grad(lambda x: (torch.func.grad(loss)(x) ** 2).sum())(x)

    torch.testing.assert_close(penalty(ops.forward), penalty(_reference.forward))


def test_torch_func_grad():
    """torch.func.grad reaches the runners through _EagerNorm (the transform unwraps its
    tensors for an autograd.Function; the registered op's autograd cannot serve it)."""
    plan, x, w, b, _ = _inputs(CASES[1])
    res = torch.randn(plan.shape, dtype=x.dtype)
    w, b = w.detach(), b.detach()

    def loss(x):
        y, h, _, _ = ops.forward(plan, x, w, b, res)
        return (y * y).sum() + (h * h).sum()

    got = torch.func.grad(loss)(x.detach())
    (want,) = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_torch_func_vmap_and_per_sample_grads(case):
    """Under vmap (batched tensors have no memory for a kernel; _TransformNorm has no vmap
    rule) the calls take the array-API core: outputs and per-sample gradients equal a loop."""
    plan, x, w, b, res = _inputs(case)
    xs = torch.stack([x.detach(), x.detach() * 0.5 + 1, x.detach() - 2])
    w = None if w is None else w.detach()
    b = None if b is None else b.detach()
    res = None if res is None else res.detach()

    def first(x):
        return ops.forward(plan, x, w, b, res)[0]

    torch.testing.assert_close(torch.func.vmap(first)(xs), torch.stack([first(s) for s in xs]))
    if w is None:
        return

    def loss(w, x):
        return (ops.forward(plan, x, w, b, res)[0] ** 3).sum()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, xs)
    want = torch.stack([torch.func.grad(loss)(w, s) for s in xs])
    torch.testing.assert_close(got, want)
    dys = torch.randn(xs.shape, dtype=xs.dtype, generator=torch.Generator().manual_seed(1))
    dx = torch.func.vmap(lambda dy, x: ops.backward(plan, dy, x, w)[0])(dys, xs)
    torch.testing.assert_close(dx, torch.stack([ops.backward(plan, d, s, w)[0] for d, s in zip(dys, xs)]))


def test_tensor_left_over_from_a_transform():
    """A tensor kept from inside a finished torch.func transform (a dead functorch wrapper)
    takes the op, whose autograd.Function unwraps it: the eager route calls the C apply,
    which would hand the wrapper itself to the runner."""
    plan, x, w, b, _ = _inputs(CASES[0])
    kept = []

    def keep(t):
        kept.append(t * 1)
        return t.sum()

    torch.func.grad(keep)(x.detach())
    (dead,) = kept
    assert dead.requires_grad and torch._C._functorch.is_functorch_wrapped_tensor(dead)
    assert ops._route(dead, w, b, None) == ops.OP
    assert ops._route(dead.detach().requires_grad_(), w, b, None) == ops.AUTOGRAD
    y = ops.forward(plan, dead, w, b)[0]
    want = _reference.forward(plan, x.detach(), w.detach(), b.detach(), None)[0]
    torch.testing.assert_close(y.detach(), want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_forward_mode_takes_the_array_api_core(case):
    """A kernel reads memory: dual tensors (torch.autograd.forward_ad) and torch.func's jvp
    transform (jvp, jacfwd, hessian) take the array-API core, whose torch operations carry
    the tangents (the runner returned y without one). With a weight that requires grad too
    (forward over reverse through autograd)."""
    import torch.autograd.forward_ad as fwAD

    plan, x, w, b, res = _inputs(case)
    x = x.detach()
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(x.shape, dtype=x.dtype, generator=gen)

    def reference(x):
        return _reference.forward(plan, x, w, b, res)[0]

    def call(x):
        return ops.forward(plan, x, w, b, res)[0]

    want = torch.func.jvp(reference, (x,), (v,))[1]
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, v)
        assert ops._route(dual, w, b, res) == ops.CORE
        assert ops._route(x, None) == ops.RUN  # no tangent: the kernels as before
        tangent = fwAD.unpack_dual(call(dual)).tangent
        dy = fwAD.make_dual(torch.ones_like(x), v)  # the *_backward entry point too
        dx_tangent = fwAD.unpack_dual(ops.backward(plan, dy, x, w)[0]).tangent
    assert tangent is not None and dx_tangent is not None
    torch.testing.assert_close(tangent, want)
    torch.testing.assert_close(dx_tangent, torch.func.jvp(
        lambda dy: _reference.backward(plan, dy, x, w)[0], (torch.ones_like(x),), (v,))[1])
    torch.testing.assert_close(torch.func.jvp(call, (x,), (v,))[1], want)
    torch.testing.assert_close(torch.func.jacfwd(call)(x), torch.func.jacfwd(reference)(x))


@pytest.mark.parametrize("case", CASES[:2] + CASES[5:], ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_functionalize(case):
    """torch.func.functionalize, alone and around or inside vmap and grad, takes the
    array-API core (a Python autograd.Function has no functionalize rule: it raised NYI)."""
    plan, *tensors = _inputs(case)
    x, w, b, res = _data(*tensors)
    xs = torch.stack([x, x * 0.5 - 1])

    def call(forward):
        return lambda x: forward(plan, x, w, b, res)[0]

    def loss(forward):
        return lambda x: (call(forward)(x) ** 3).sum()

    func = torch.func
    for transform, arg in ((func.functionalize, x), (lambda f: func.functionalize(func.vmap(f)), xs),
                           (lambda f: func.vmap(func.functionalize(f)), xs)):
        torch.testing.assert_close(transform(call(ops.forward))(arg), transform(call(_reference.forward))(arg))
    for transform in (lambda f: func.functionalize(func.grad(f)), lambda f: func.grad(func.functionalize(f))):
        torch.testing.assert_close(transform(loss(ops.forward))(x), transform(loss(_reference.forward))(x))


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


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3:]}")
def test_compiles_the_call_path_with_dynamic_shapes(case):
    """What torch.compile traces on a CUDA tensor, from the plan to the op, with
    ``dynamic=True``: the plan keeps symbolic sizes (no ``int()``, nothing hashed), the op's
    fake kernel shapes its outputs from them; one graph serves three batch sizes, outputs and
    gradients as eager's."""
    op, shape, kw, *_ = case
    _, x0, w, b, res0 = _inputs(case, torch.float32)

    def fn(x, w, b, res):
        plan = make_plan(op, x, w, b, res, cache=False, **kw)
        y, h, _, rstd = ops.forward(plan, x, w, b, res)
        return y.square().sum() + rstd.sum() + (0 if h is None else h.sum())

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    leaves = [t for t in (w, b) if t is not None]
    for batch in (shape[0], shape[0] + 3, shape[0] + 7):
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn((batch, *shape[1:]), generator=gen).requires_grad_()
        res = None if res0 is None else torch.randn(x.shape, generator=gen).requires_grad_()
        inputs = [x, *leaves] + ([] if res is None else [res])
        got = torch.autograd.grad(compiled(x, w, b, res), inputs)
        want = torch.autograd.grad(fn(x, w, b, res), inputs)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_unsupported_answers_without_raising():
    from anynorm._cuda import _executor as cuda

    x = np.zeros((2, 3), np.float32)
    reason = cuda.unsupported(make_plan("layer_norm", x), x)
    assert reason is None or isinstance(reason, str)


def test_import_without_cupy_raises_import_error():
    code = ("import sys; sys.modules['cupy'] = None\n"
            "try:\n    import anynorm._cuda._executor\nexcept ImportError as e:\n    print('ImportError', e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(anynorm.__file__).parents[1]))
    assert run.stdout.startswith("ImportError"), run.stdout + run.stderr


def test_route_leaves_the_dispatcher_out_only_where_it_adds_nothing():
    """Eager calls skip the dispatcher (the runner, or _EagerNorm when autograd records);
    a mode, a tensor subclass, torch.compile or a device without a runner gets the
    registered op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Subclass(torch.Tensor):
        pass

    x = torch.ones(2, 3)
    weight = torch.nn.Parameter(torch.ones(3))
    assert ops._route(x, None) == ops.RUN
    assert ops._route(x, weight) == ops.AUTOGRAD  # a parameter that requires grad, grad mode on
    assert ops._route(x.requires_grad_(), None) == ops.AUTOGRAD
    with torch.no_grad():
        assert ops._route(x, weight) == ops.RUN  # inference with a module's parameters
    with torch.inference_mode():
        assert ops._route(torch.ones(2, 3), weight) == ops.RUN
    with Passthrough():
        assert ops._route(x) == ops.OP
    assert ops._route(x.as_subclass(Subclass)) == ops.OP
    assert ops._route(torch.ones(2, 3, device="meta")) == ops.OP
    seen = []  # torch.jit.trace records ops, not the runner's CuPy launches: the op it is

    def traced(t):
        seen.append(ops._route(t, None))
        return t + 1

    torch.jit.trace(traced, torch.ones(2, 3), check_trace=False)
    assert seen == [ops.OP]
