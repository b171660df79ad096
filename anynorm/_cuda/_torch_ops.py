"""torch custom ops for the CUDA kernels, with fake kernels and autograd.

``anynorm::forward(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps)
-> (y, h, mean, rstd)`` and ``anynorm::backward(dy, x, weight, mean, rstd, op, axes,
channel_axis, num_groups, eps) -> (dx, dweight, dbias)``. Outputs that do not apply (``h``
without a residual, ``mean`` for RMS norm, ``dweight``/``dbias`` without weight) are empty
tensors of shape ``(0,)``, since custom ops cannot return None. ``axes`` are the plan's
canonical reduce axes (layer/RMS norm), ``num_groups`` 0 outside group norm. Gradients
flow to x, weight, bias and residual; gradients of the returned statistics are ignored.
Calls with nothing to record or trace run the implementations without the dispatcher.
"""

# No `from __future__ import annotations`: torch.library reads the annotations at runtime.
from typing import List, Optional, Tuple

import torch

from . import _interop, _launch
from .._plan import namespace_of, plan_for

__all__ = ["forward", "backward"]

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


def _forward_outputs(x, residual, op, axes, channel_axis, num_groups):
    acc = _acc(x.dtype)
    shape = _stats_shape(x, op, axes, channel_axis, num_groups)
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else x.new_empty((0,))
    mean = x.new_empty(shape, dtype=acc) if op != "rms_norm" else x.new_empty((0,), dtype=acc)
    return y, h, mean, x.new_empty(shape, dtype=acc)


def _plan(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps):
    """The caller's plan again (its arrays were checked by make_plan), from the plan cache."""
    return plan_for(op, namespace_of(x), tuple(x.shape), x.dtype, tuple(axes) or -1, channel_axis,
                    num_groups or None, eps, None if weight is None else tuple(weight.shape),
                    None if bias is None else tuple(bias.shape), residual is not None)


def _param(t, acc):
    return None if t is None else t.detach().to(acc).contiguous().reshape(-1)


def _forward_impl(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  residual: Optional[torch.Tensor], op: str, axes: List[int], channel_axis: int,
                  num_groups: int, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = _plan(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps)
    y, h, mean, rstd = _forward_outputs(x, residual, op, axes, channel_axis, num_groups)
    if x.numel():
        acc = _acc(x.dtype)
        ref = _interop.ref
        with _interop.on_torch_stream(x.device):
            _launch.forward(plan, _interop.dtype_key(x.dtype), ref(x), ref(_param(weight, acc)),
                            ref(_param(bias, acc)), ref(residual), ref(y),
                            ref(h) if residual is not None else None,
                            ref(mean) if plan.center else None, ref(rstd))
    return y, h, mean, rstd


_forward_op = torch.library.custom_op("anynorm::forward", mutates_args=(),
                                      device_types="cuda")(_forward_impl)


@_forward_op.register_fake
def _(x, weight, bias, residual, op, axes, channel_axis, num_groups, eps):
    return _forward_outputs(x, residual, op, axes, channel_axis, num_groups)


def _param_shape(x, op, axes, channel_axis):
    if op in ("layer_norm", "rms_norm"):
        return tuple(x.shape[a] for a in axes)
    return (x.shape[channel_axis],)


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                   mean: Optional[torch.Tensor], rstd: Optional[torch.Tensor], op: str,
                   axes: List[int], channel_axis: int, num_groups: int, eps: float,
                   param_grads: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx, and with ``param_grads`` dweight/dbias in the accumulation dtype (else empty)."""
    plan = _plan(x, weight, None, None, op, axes, channel_axis, num_groups, eps)
    acc = _acc(x.dtype)
    dx = torch.empty_like(x)
    shape = plan.param_shape if param_grads else (0,)
    alloc = x.new_empty if x.numel() else x.new_zeros  # the kernels write every element
    dw = alloc(shape, dtype=acc)
    db = alloc(shape, dtype=acc)
    if x.numel():
        if rstd is None:
            mean = None
        else:
            rstd = rstd.detach().to(acc).contiguous()
            mean = mean.detach().to(acc).contiguous() if plan.center else None
        ref = _interop.ref
        with _interop.on_torch_stream(x.device):
            _launch.backward(plan, _interop.dtype_key(x.dtype), ref(dy.detach().to(x.dtype)), ref(x),
                             ref(_param(weight, acc)), ref(mean), ref(rstd), ref(dx),
                             ref(dw) if param_grads else None, ref(db) if param_grads else None)
    return dx, dw, db


_backward_op = torch.library.custom_op("anynorm::backward", mutates_args=(),
                                       device_types="cuda")(_backward_impl)


@_backward_op.register_fake
def _(dy, x, weight, mean, rstd, op, axes, channel_axis, num_groups, eps, param_grads):
    shape = _param_shape(x, op, axes, channel_axis) if param_grads else (0,)
    acc = _acc(x.dtype)
    return torch.empty_like(x), x.new_empty(shape, dtype=acc), x.new_empty(shape, dtype=acc)


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, op, axes, channel_axis, num_groups, eps = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.args = (op, axes, channel_axis, num_groups, eps)
    ctx.has_residual = residual is not None
    ctx.weight_dtype = None if weight is None else weight.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _autograd_backward(ctx, dy, dh, dmean, drstd):
    src, weight, mean, rstd = ctx.saved_tensors
    op = ctx.args[0]
    needs = ctx.needs_input_grad
    want_w = ctx.weight_dtype is not None and needs[1]
    want_b = ctx.bias_dtype is not None and needs[2]
    dx, dw, db = _backward_op(dy, src, weight, mean if op != "rms_norm" else None, rstd, *ctx.args,
                              want_w or want_b)
    if ctx.has_residual and dh is not None:
        dx = dx + dh
    return (dx if needs[0] else None,
            dw.to(ctx.weight_dtype) if want_w else None,
            db.to(ctx.bias_dtype) if want_b else None,
            dx if ctx.has_residual and needs[3] else None,
            None, None, None, None, None)


_forward_op.register_autograd(_autograd_backward, setup_context=_setup_context)


def _op_args(plan):
    axes = list(plan.reduce_axes) if plan.op in ("layer_norm", "rms_norm") else []
    return plan.op, axes, plan.channel_axis or 1, plan.num_groups or 0, float(plan.eps)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # Parameter disables __torch_function__


def _direct(*tensors) -> bool:
    """True when calling an op's implementation directly on these (CUDA) tensors gives what
    the dispatcher would: plain tensors or parameters, nothing for autograd to record, no
    torch.compile tracing, no torch function or dispatch modes. Inference calls then skip the dispatcher's per-call cost
    (about 15 us, longer than the kernels on a transformer's rows)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or (grad and t.requires_grad)):
            return False
    return True


def forward(plan, x, weight=None, bias=None, residual=None):
    """``(y, h, mean, rstd)`` like the reference executor, differentiable through autograd."""
    op = _forward_impl if x.is_cuda and _direct(x, weight, bias, residual) else _forward_op
    y, h, mean, rstd = op(x, weight, bias, residual, *_op_args(plan))
    return y, (h if residual is not None else None), (mean if plan.center else None), rstd


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """``(dx, dweight, dbias)``; dweight/dbias None without weight."""
    op = _backward_impl if x.is_cuda and _direct(dy, x, weight, mean, rstd) else _backward_op
    dx, dw, db = op(dy, x, weight, mean, rstd, *_op_args(plan), weight is not None)
    if weight is None:
        return dx, None, None
    return dx, dw.to(weight.dtype), db.to(weight.dtype)
