"""torch custom ops for the CUDA kernels, with fake kernels and autograd.

``anynorm::forward(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps)
-> (y, h, mean, rstd)`` and ``anynorm::backward(dy, x, weight, mean, rstd, op, axes,
channel_axis, num_groups, eps) -> (dx, dweight, dbias)``. Outputs that do not apply (``h``
without a residual, ``mean`` for RMS norm, ``dweight``/``dbias`` without weight) are empty
tensors of shape ``(0,)``, since custom ops cannot return None. ``axes`` are the plan's
canonical reduce axes (layer/RMS norm), ``num_groups`` 0 outside group norm. Gradients
flow to x, weight, bias and residual; gradients of the returned statistics are ignored.

The dispatcher costs tens of microseconds per call (more than the kernels take on a
transformer's rows), so eager calls leave it out (:func:`_route`): with nothing for
autograd to record they call the runner, which launches the kernels, directly; with
autograd recording, :class:`_EagerNorm` (an ``autograd.Function``, same formula) calls it.
torch.compile tracing, torch function/dispatch modes and tensor subclasses see the ops.
"""

# No `from __future__ import annotations`: torch.library reads the annotations at runtime.
from typing import List, Optional, Tuple

import torch
from torch.autograd import forward_ad as _forward_ad

from . import _interop, _launcher
from .. import _reference
from .._plan import namespace_of, plan_for

__all__ = ["forward", "backward", "RUNNERS"]

_HALF = (torch.float16, torch.bfloat16)


def _acc(dtype):
    return torch.float32 if dtype in _HALF else dtype


def _stats_shape(x, op, axes, channel_axis, num_groups):
    """Public statistics shape, built from x.shape without forcing symbolic sizes."""
    if op == "group_norm":
        return (x.shape[0], num_groups)
    if op == "instance_norm":
        keep = (0, channel_axis)
        return tuple(s if a in keep else 1 for a, s in enumerate(x.shape))
    return tuple(1 if a in axes else s for a, s in enumerate(x.shape))


def _forward_outputs(x, residual, stats_shape, center):
    """``(y, h, mean, rstd)`` allocated; ``h``/``mean`` None where they do not apply."""
    acc = _acc(x.dtype)
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else None
    mean = x.new_empty(stats_shape, dtype=acc) if center else None
    return y, h, mean, x.new_empty(stats_shape, dtype=acc)


def _run_outputs(plan, x, residual, stats):
    """:func:`_forward_outputs` of a runner call: without ``stats``, y and h alone."""
    if stats:
        return _forward_outputs(x, residual, plan.stats_shape, plan.center)
    return torch.empty_like(x), None if residual is None else torch.empty_like(x), None, None


def _placeholders(x, outputs):
    """The op's outputs: an empty ``(0,)`` tensor for each None (custom ops return tensors)."""
    y, h, mean, rstd = outputs
    return (y, x.new_empty((0,)) if h is None else h,
            x.new_empty((0,), dtype=rstd.dtype) if mean is None else mean, rstd)


def _plan(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps):
    """The caller's plan again (its arrays were checked by make_plan), from the plan cache."""
    return plan_for(op, namespace_of(x), tuple(x.shape), x.dtype, tuple(axes) or -1, channel_axis,
                    num_groups or None, eps, None if weight is None else tuple(weight.shape),
                    None if bias is None else tuple(bias.shape), residual is not None)


def _op_args(plan):
    axes = list(plan.reduce_axes) if plan.op in ("layer_norm", "rms_norm") else []
    return plan.op, axes, plan.channel_axis or 1, plan.num_groups or 0, float(plan.eps)


def _param(t, dtype):
    """weight, bias or statistics as the kernels read them: contiguous, in ``dtype`` (the
    accumulation dtype, or x's for parameters that hold it)."""
    if t is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    return t.to(dtype).contiguous()


# ---- runners: outputs allocated, kernels launched on torch's current stream ------------------

def _forward_run(plan, x, weight, bias, residual, stats=True, site=None):
    """``(y, h, mean, rstd)`` of ``plan``; ``h`` None without residual, ``mean`` None for RMS
    norm, both statistics None when ``stats`` is False (inference: only y is written).
    ``site``: a dict kept per call signature (``_executor.forward_runner``), where the bound
    launch found by the first call is kept (per ``stats``) when the parameters need no
    conversion. Where x or the residual is not laid out as the kernels' buffer (a transposed
    view, a residual in another memory order, a non-dense view), torch adds them into the
    buffer of the other (:func:`_summed`: h) and the kernels normalize h; x alone is copied
    once (:func:`_copied`). y and h then come out in that buffer's layout with a ``site``
    (eager calls), and in x's without one (the custom op, whose fake kernel promises x's
    strides)."""
    if not x.numel():
        return _run_outputs(plan, x, residual, stats)
    kept = None if site is None else site.get(stats)
    if kept is not None:
        bound, device, copies = kept
    else:
        given_weight, given_bias = weight, bias
        weight, bias, param_in_t = _launcher.kernel_params(x.dtype, _acc(x.dtype), _param, weight,
                                                           bias)
        device = x.get_device()
        bound, copies = _bound_forward(plan, x, residual, weight, bias, stats, device, param_in_t)
        if site is not None and weight is given_weight and bias is given_bias:
            site[stats] = bound, device, copies
    given_x, summed = x, None
    if copies is not None:
        if residual is None:
            x = _copied(plan, copies, x)
        else:  # the kernels then normalize h, with no residual of their own
            x = summed = _summed(copies, x, residual)
            residual = None
    y, h, mean, rstd = _run_outputs(plan, x, residual, stats)
    scratch = _scratch(bound, x)
    _interop.run_on_torch_stream(bound, (
        x.data_ptr(), _data_ptr(residual), _data_ptr(h), y.data_ptr(), _data_ptr(weight),
        _data_ptr(bias), _data_ptr(mean), _data_ptr(rstd), _data_ptr(scratch)), device)
    if summed is not None:
        h = summed
    if site is None and copies is not None:
        y, h = _like(given_x, y), _like(given_x, h)
    return y, h, mean, rstd


def _summed(copies, x, residual):
    """h = x + residual (rounded to x's dtype, as the kernels round it) by one torch add into
    the buffer ``copies`` names: where x and the residual are not both laid out as the
    buffer, one pass of 3 transfers of x's size, where a copy of one of them and the fused
    kernel's residual (read, and h written) took 6."""
    _, strides = copies
    h = torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)
    return torch.add(x, residual, out=h)


def _copied(plan, copies, t):
    """``t`` where its memory is laid out as the buffer ``copies = (layout, strides)``
    names, else a copy of it that is (one torch copy kernel)."""
    layout, strides = copies
    if t is None or _launcher.strides_are_buffer(plan, layout, t.stride()):
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _like(ref, t):
    """``t`` with ``ref``'s strides (``torch.empty_like``'s for a dense ``ref``)."""
    return t if t is None or t.stride() == ref.stride() else torch.empty_like(ref).copy_(t)


def _grad_in_t(x_dtype, acc, param_grads) -> int:
    """Bits 0 / 1 when dweight / dbias are to be written in x's (half) dtype: ``param_grads``
    a (weight dtype, bias dtype) pair naming it."""
    if param_grads is True or not param_grads or x_dtype is acc:
        return 0
    weight_dtype, bias_dtype = param_grads
    return (weight_dtype == x_dtype) | (bias_dtype == x_dtype) << 1


def _backward_run(plan, dy, x, weight, mean, rstd, param_grads, site=None):
    """dx, and with ``param_grads`` dweight/dbias (else empty), in the accumulation dtype or,
    where ``param_grads`` is a (weight dtype, bias dtype) pair naming x's half dtype, in that
    dtype (written so by the kernel: no conversion after it). ``site``: the forward's
    (:func:`_forward_run`), where the bound backward is kept per strides of x and dy, which
    gradients are written in which dtype and whether statistics came. x or dy not laid out
    as the kernels' buffer is copied into the other's, as in :func:`_forward_run` (dx then
    comes out in that layout with a ``site``, in x's without)."""
    acc = _acc(x.dtype)
    shape = plan.param_shape if param_grads else (0,)
    alloc = x.new_empty if x.numel() else x.new_zeros  # the kernels write every element
    grad_in_t = _grad_in_t(x.dtype, acc, param_grads)
    dw = alloc(shape, dtype=x.dtype if grad_in_t & 1 else acc)
    db = alloc(shape, dtype=x.dtype if grad_in_t & 2 else acc)
    if not x.numel():
        return torch.empty_like(x), dw, db
    if rstd is None:
        mean = None
    else:
        rstd = _param(rstd, acc)
        mean = _param(mean, acc) if plan.center else None
    dy = _as(dy, x.dtype)
    key = kept = None
    if site is not None:
        key = x.stride(), dy.stride(), bool(param_grads), grad_in_t, rstd is None
        kept = site.get(key)
    if kept is not None:
        bound, device, copies = kept
    else:
        given_weight = weight
        weight, _, param_in_t = _launcher.kernel_params(x.dtype, acc, _param, weight)
        device = x.get_device()
        bound, copies = _bound_backward(plan, x, dy, weight, rstd is not None, bool(param_grads),
                                        device, param_in_t, grad_in_t)
        if key is not None and weight is given_weight:
            site[key] = bound, device, copies
    given_x = x
    if copies is not None:
        x, dy = _copied(plan, copies, x), _copied(plan, copies, dy)
    dx = torch.empty_like(x)
    scratch = _scratch(bound, x)
    _interop.run_on_torch_stream(bound, (
        dy.data_ptr(), x.data_ptr(), _data_ptr(weight), _data_ptr(mean), _data_ptr(rstd),
        dx.data_ptr(), dw.data_ptr() if param_grads else 0, db.data_ptr() if param_grads else 0,
        _data_ptr(scratch)), device)
    if site is None and copies is not None:
        dx = _like(given_x, dx)
    return dx, dw, db


def _data_ptr(t):
    return 0 if t is None else t.data_ptr()


def _scratch(bound, x):
    """The schedule's workspaces, from torch's caching allocator on x's device (so that CUDA
    graph captures own it), or None."""
    n = bound.scratch_bytes
    return x.new_empty((n,), dtype=torch.uint8) if n else None


def _bound_forward(plan, x, residual, weight, bias, stats, device, param_in_t):
    """``(bound, copies)``: the bound forward schedule for this signature and None, or, where
    x or the residual is not laid out as the kernels' buffer, the bound forward (without a
    residual where there is one: :func:`_summed`) of the buffer they go to and ``copies =
    (layout, strides)`` naming it (worked out once per plan and strides;
    ``_launcher.dense_forward``, ``_launcher.copied_forward``)."""
    args = (plan, _interop.dtype_key(x.dtype), x.stride(),
            None if residual is None else residual.stride(),
            _launcher.forward_present(plan, residual, weight, bias, stats), param_in_t, device)
    bound = _launcher.dense_forward(*args)
    if bound is not None:
        return bound, None
    if residual is not None:  # h = x + residual by torch (_summed), the kernels normalize h
        args = args[:4] + (_launcher.forward_present(plan, None, weight, bias, stats),) + args[5:]
    bound, layout, strides = _launcher.copied_forward(*args)
    return bound, (layout, strides)


def _bound_backward(plan, x, dy, weight, has_stats, param_grads, device, param_in_t,
                    grad_in_t=0):
    """``(bound, copies)`` of the backward, as :func:`_bound_forward` (dy for the residual)."""
    args = (plan, _interop.dtype_key(x.dtype), x.stride(), dy.stride(),
            _launcher.backward_present(plan, weight, has_stats, param_grads), param_in_t, grad_in_t,
            device)
    bound = _launcher.dense_backward(*args)
    if bound is not None:
        return bound, None
    bound, layout, strides = _launcher.copied_backward(*args)
    return bound, (layout, strides)


# Per device type, the (forward, backward) runners that eager calls use without the
# dispatcher; the ops' registered kernels run the same functions.
RUNNERS = {"cuda": (_forward_run, _backward_run)}


# ---- the custom ops --------------------------------------------------------------------------

def _forward_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  residual: Optional[torch.Tensor], op: str, axes: List[int], channel_axis: int,
                  num_groups: int, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _plan(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps)
    return _placeholders(x, _forward_run(plan, x, weight, bias, residual))


_forward_op = torch.library.custom_op("anynorm::forward", mutates_args=(),
                                      device_types="cuda")(_forward_impl)


@_forward_op.register_fake
def _(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps):
    shape = _stats_shape(x, op, axes, channel_axis, num_groups)
    return _placeholders(x, _forward_outputs(x, residual, shape, op != "rms_norm"))


def _param_shape(x, op, axes, channel_axis):
    if op in ("layer_norm", "rms_norm"):
        return tuple(x.shape[a] for a in axes)
    return (x.shape[channel_axis],)


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                   mean: Optional[torch.Tensor], rstd: Optional[torch.Tensor], op: str,
                   axes: List[int], channel_axis: int, num_groups: int, eps: float,
                   param_grads: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _plan(x, weight, None, None, op, axes, channel_axis, num_groups, eps)
    return _backward_run(plan, dy, x, weight, mean, rstd, param_grads)


_backward_op = torch.library.custom_op("anynorm::backward", mutates_args=(),
                                       device_types="cuda")(_backward_impl)


@_backward_op.register_fake
def _(dy, x, weight, mean, rstd, op, axes, channel_axis, num_groups, eps, param_grads):
    shape = _param_shape(x, op, axes, channel_axis) if param_grads else (0,)
    acc = _acc(x.dtype)
    return torch.empty_like(x), x.new_empty(shape, dtype=acc), x.new_empty(shape, dtype=acc)


# ---- autograd: one formula for the op and for eager calls ------------------------------------

def _save(ctx, x, weight, bias, residual, output, center):
    _, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean if center else None, rstd)
    _save_flags(ctx, weight, bias, residual)


def _save_flags(ctx, weight, bias, residual):
    ctx.has_residual = residual is not None
    ctx.weight_dtype = None if weight is None else weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _input_grads(ctx, needs, dy, dh, saved, run_backward):
    """Gradients of (x, weight, bias, residual) from ``run_backward(dy, src, weight, mean,
    rstd, param_grads) -> (dx, dweight, dbias)``; ``saved``: (src, weight, mean, rstd);
    ``needs``: which inputs want one."""
    src, weight, mean, rstd = saved
    want_w = ctx.weight_dtype is not None and needs[1]
    want_b = ctx.bias_dtype is not None and needs[2]
    dx, dw, db = run_backward(dy, src, weight, mean, rstd, want_w or want_b)
    if ctx.has_residual and dh is not None:
        dx = dx + dh
    return (dx if needs[0] else None,
            _as(dw, ctx.weight_dtype) if want_w else None,
            _as(db, ctx.bias_dtype) if want_b else None,
            dx if ctx.has_residual and needs[3] else None)


def _as(t, dtype):
    """``t`` in ``dtype`` (``Tensor.to`` costs a microsecond even where it has nothing to do)."""
    return t if t.dtype == dtype else t.to(dtype)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, op, axes, channel_axis, num_groups, eps = inputs
    _save(ctx, x, weight, bias, residual, output, op != "rms_norm")
    ctx.args = (op, axes, channel_axis, num_groups, eps)


def _op_backward(ctx, dy, dh, dmean, drstd):
    def run(*args):
        return _backward_op(*args[:5], *ctx.args, args[5])

    return _input_grads(ctx, ctx.needs_input_grad, dy, dh, ctx.saved_tensors, run) + (None,) * 5


_forward_op.register_autograd(_op_backward, setup_context=_setup_context)


def _eager_setup(ctx, inputs, output):
    plan, x, weight, bias, residual = inputs[:5]
    _save(ctx, x, weight, bias, residual, output, plan.center)
    ctx.plan = plan


class _EagerNorm(torch.autograd.Function):
    """``anynorm::forward``'s autograd for eager calls: the runners, no dispatcher.

    Returns ``y`` (``(y, h)`` with a residual), or with ``stats`` all of ``(y, h, mean, rstd)``
    with the statistics marked non-differentiable: each differentiable output costs autograd
    a few microseconds. x (or h) and the weight go through ``save_for_backward`` (its
    version check catches an in-place change of them before backward), and so do the
    statistics where they are returned (the caller may change them in place, as torch's
    own layer norm then refuses its backward); kept nowhere else, they stay on ``ctx``.
    (The ``forward(ctx, ...)`` form: for a separate ``setup_context``, ``apply`` binds the
    signature of ``forward`` on every call.)"""

    @staticmethod
    def forward(ctx, plan, x, weight, bias, residual, stats, site):
        y, h, mean, rstd = output = RUNNERS[_device_type(x)][0](plan, x, weight, bias, residual,
                                                                True, site)
        src = x if residual is None else h
        _save_flags(ctx, weight, bias, residual)
        ctx.plan, ctx.site = plan, site
        if stats:  # mean None for RMS norm
            ctx.save_for_backward(src, weight, mean, rstd)
            ctx.stats = None
            ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
            return output
        ctx.save_for_backward(src, weight)
        ctx.stats = mean, rstd
        return y if residual is None else (y, h)

    @staticmethod
    def backward(ctx, dy, *other_grads):
        saved = ctx.saved_tensors if ctx.stats is None else ctx.saved_tensors + ctx.stats
        return (None,) + _norm_backward(ctx, dy, other_grads, saved) + (None, None)


def _norm_backward(ctx, dy, other_grads, saved):
    """The eager autograd functions' input gradients; ``other_grads``: the gradients of the
    outputs after ``y`` (``h``'s first where there is a residual)."""
    dh = other_grads[0] if ctx.has_residual and other_grads else None
    run = RUNNERS[_device_type(dy)][1]
    site = getattr(ctx, "site", None)  # _TransformNorm's ctx has none

    grad_dtypes = ctx.weight_dtype, ctx.bias_dtype

    def run_backward(dy, src, weight, mean, rstd, param_grads):
        # param_grads as the dtypes wanted: the kernel writes half gradients as they are
        return run(ctx.plan, dy, src, weight, mean, rstd, param_grads and grad_dtypes, site)

    if not torch.is_grad_enabled():  # the engine's default (no create_graph)
        return _input_grads(ctx, ctx.needs_input_grad[1:], dy, dh, saved, run_backward)
    return _input_grads(ctx, ctx.needs_input_grad[1:], dy, dh, saved, _composite_backward(ctx))


def _composite_backward(ctx):
    """``run_backward`` for a backward that builds a graph (``create_graph=True``: a
    gradient penalty, a Hessian-vector product): the array-API core's backward in torch
    operations, its statistics recomputed from x (or h), so that autograd can differentiate
    the gradients again (the kernels' backward has no derivative). The bias alone (no
    weight) has its sum of dy from the same formula with a weight of ones."""
    plan, bias_dtype = ctx.plan, ctx.bias_dtype

    def run(dy, src, weight, mean, rstd, param_grads):
        w = weight
        if w is None and param_grads:
            w = src.new_ones(plan.param_shape, dtype=bias_dtype)
        dx, dw, db = _reference.backward(plan, dy, src, w)
        return dx, dw if weight is not None else None, db

    return run


class _TransformNorm(torch.autograd.Function):
    """:class:`_EagerNorm` in the form torch.func transforms require (``setup_context``,
    every tensor through ``save_for_backward``); returns all of ``(y, h, mean, rstd)``."""

    @staticmethod
    def forward(plan, x, weight, bias, residual, stats, site):
        return RUNNERS[_device_type(x)][0](plan, x, weight, bias, residual)

    setup_context = staticmethod(_eager_setup)

    @staticmethod
    def backward(ctx, dy, *other_grads):
        return (None,) + _norm_backward(ctx, dy, other_grads, ctx.saved_tensors) + (None, None)


# ``Function.apply`` without its Python wrapper, whose work (unwrapping tensors left over from
# finished torch.func transforms) :func:`_route` has done: the wrapper costs more than the
# C apply itself (~7 of ~15 us for a 4-argument Function on this project's CPU host)
_eager_apply = super(torch.autograd.Function, _EagerNorm).apply
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

# ---- entry points ----------------------------------------------------------------------------

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # Parameter disables __torch_function__
OP, AUTOGRAD, TRANSFORM, RUN, CORE = "op", "autograd", "transform", "run", "core"


try:  # torch's private view of the transform stack (2.1 on)
    from torch._C._functorch import TransformType as _TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters as _interpreters
except ImportError:  # without it every transform is taken for a vmap: slower, still right
    _TransformType = _interpreters = None


def _transform_route() -> str:
    """The route under the active torch.func transforms: ``TRANSFORM`` (the kernels through
    :class:`_TransformNorm`) where they are all reverse mode (grad, vjp, jacrev), else
    ``CORE``: vmap's batched tensors have no memory a kernel could read, and a Python
    autograd.Function has no vmap rule, no jvp formula and no functionalize rule, where the
    array-API core's torch operations go through every transform."""
    if _interpreters is None:
        return CORE
    grad = _TransformType.Grad
    return TRANSFORM if all(i.key() == grad for i in _interpreters()) else CORE


def _dual(tensors, level) -> bool:
    """A tensor among ``tensors`` carries a forward-mode tangent of dual level ``level``
    (``torch.autograd.forward_ad``, an open level): the kernels would read its primal and
    drop the tangent, so the call takes the array-API core, which propagates it."""
    for t in tensors:
        if t is not None and torch._VF._unpack_dual(t, level)[1] is not None:
            return True
    return False


def _device_type(t) -> str:
    return "cuda" if t.is_cuda else t.device.type  # t.device builds an object per call


def _route(*tensors) -> str:
    """How a call on these tensors (the first one is x) runs: ``RUN`` (the runner itself:
    nothing for autograd to record), ``AUTOGRAD`` (:class:`_EagerNorm`: autograd records,
    nothing else looks), ``TRANSFORM`` (:class:`_TransformNorm`, under torch.func
    transforms of reverse mode), ``CORE`` (the array-API core: under any other transform,
    :func:`_transform_route`, and where a tensor carries a forward-mode tangent) or ``OP``
    (the registered op: torch.compile or torch.jit.trace tracing, torch function or dispatch
    modes, tensor subclasses, tensors left over from a finished transform, a device without
    a runner)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_tracing()  # torch.jit.trace records ops, not CuPy launches
            or torch._C._is_torch_function_mode_enabled()
            or _device_type(tensors[0]) not in RUNNERS):
        return OP
    grad = torch.is_grad_enabled()
    # torch.func transforms hand an autograd.Function (_TransformNorm) its tensors unwrapped;
    # the runner alone would see wrappers
    if torch._C._are_functorch_transforms_active():
        for t in tensors:
            if t is not None and type(t) not in _PLAIN:
                return OP
        return _transform_route()
    records = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN:
                return OP
            if grad and t.requires_grad:
                records = True
    level = _forward_ad._current_level
    if level >= 0 and _dual(tensors, level):
        return CORE
    if not records:
        return RUN
    for t in tensors:
        if t is not None and _is_wrapped(t):
            return OP  # a wrapper left over from a finished transform: the op unwraps it
    return AUTOGRAD


def forward(plan, x, weight=None, bias=None, residual=None, stats=True, site=None):
    """``(y, h, mean, rstd)`` like the reference executor, differentiable through autograd;
    ``stats=False``: mean/rstd may be None where nothing needs them; ``site``: see
    :func:`_forward_run`."""
    route = _route(x, weight, bias, residual)
    if route == RUN:
        y, h, mean, rstd = RUNNERS[_device_type(x)][0](plan, x, weight, bias, residual, stats,
                                                       site)
    elif route == CORE:
        return _reference.forward(plan, x, weight, bias, residual)
    elif route == TRANSFORM:
        y, h, mean, rstd = _TransformNorm.apply(plan, x, weight, bias, residual, stats, site)
    elif route == AUTOGRAD:
        out = _eager_apply(plan, x, weight, bias, residual, stats, site)
        if stats:
            y, h, mean, rstd = out
        elif residual is None:
            y, h, mean, rstd = out, None, None, None
        else:
            (y, h), mean, rstd = out, None, None
    else:
        y, h, mean, rstd = _forward_op(x, weight, bias, residual, *_op_args(plan))
        h, mean = (h if residual is not None else None), (mean if plan.center else None)
    return y, h, mean, rstd


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """``(dx, dweight, dbias)``; dweight/dbias None without weight."""
    route = _route(x, dy, weight, mean, rstd)
    if route == RUN:
        wanted = weight is not None and (weight.dtype, weight.dtype)
        dx, dw, db = RUNNERS[_device_type(x)][1](plan, dy, x, weight, mean, rstd, wanted)
    elif route == CORE:
        return _reference.backward(plan, dy, x, weight, mean, rstd)
    else:
        dx, dw, db = _backward_op(dy, x, weight, mean, rstd, *_op_args(plan), weight is not None)
    if weight is None:
        return dx, None, None
    return dx, _as(dw, weight.dtype), _as(db, weight.dtype)
