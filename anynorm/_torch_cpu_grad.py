"""torch CPU calls that autograd records, through anynorm's CPU kernels both ways.

Where :func:`anynorm._torch._native_first` sends a call to anynorm's kernels (outputs of
32 MiB and up, which the NumPy executor reuses where torch's fault in their pages again;
float16 channels-first group norm) and autograd must record it, torch's own routine would
run both ways instead: its backward is as slow as its forward there (layer norm 8192 x 4096
float32: forward + backward 78 ms, most of it page faults).  Layer norm over trailing axes
and NCHW instance/group norm then run as one ``autograd.Function``: the forward is the NumPy
executor's (y, mean, rstd on the tensors' memory), the backward the row backward kernel
(:mod:`anynorm._numpy_rows_backward`) on the saved x and statistics::

    dx = (g - xhat * mean(g * xhat) - mean(g)) * rstd,   g = dy * w
    dweight = sum(dy * xhat),  dbias = sum(dy)

The statistics it returns are not differentiable, as torch's ``native_layer_norm`` and
``native_group_norm`` return theirs.  A backward that builds a graph (``create_graph=True``)
runs the array-API core's backward on torch operations (the statistics taken again from x),
which autograd differentiates again.
"""

from __future__ import annotations

import torch

from . import _native, _reference
from . import _torch as _executor

__all__ = ["takes", "forward"]


def takes(plan, x, weight, bias, residual):
    """True for a call this path serves: a gradient to record (else the NumPy executor runs
    it directly), plain CPU tensors of a kernel dtype, no residual, layer norm over trailing
    axes or instance/group norm with channels on axis 1, C-contiguous x, the kernel built."""
    if residual is not None or (weight is None and bias is not None) or _executor._tracing():
        return False
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return False
    if plan.op == "layer_norm":
        if not _executor._trailing(plan):
            return False
    elif plan.op not in ("group_norm", "instance_norm") or plan.channel_axis != 1:
        return False
    for t in (x, weight, bias):
        if t is not None and (type(t) not in _executor._PLAIN or t.device.type != "cpu"
                              or t.dtype not in _executor._KERNEL_DTYPES):
            return False
    dtype = _executor._numpy_dtype(plan.dtype)
    return dtype is not None and x.is_contiguous() and _native.rows_backward_kernel(dtype) is not None


def forward(plan, x, weight, bias):
    """``(y, None, mean, rstd)`` with autograd's record of them (y differentiable)."""
    y, mean, rstd = _KernelNorm.apply(plan, x, weight, bias)
    return y, None, mean, rstd


class _KernelNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, x, weight, bias):
        y, _, mean, rstd = _executor._numpy_forward(plan, x, weight, bias, None)
        ctx.plan = plan
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        ctx.set_materialize_grads(False)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        if dy is None:  # no gradient reached y: the statistics take none
            return None, None, None, None
        x, weight, mean, rstd = ctx.saved_tensors
        plan = ctx.plan
        if torch.is_grad_enabled():
            # create_graph: torch operations autograd can differentiate, the statistics taken
            # again from x so that the second derivatives through them are there too
            dx, dw, db = _reference.backward(plan, dy, x, weight, None, None)
        else:
            dx, dw, db = _executor.backward(plan, dy.contiguous(), x, weight, mean, rstd)
        need_x, need_w, need_b = ctx.needs_input_grad[1:]
        return None, dx if need_x else None, dw if need_w else None, db if need_b else None
