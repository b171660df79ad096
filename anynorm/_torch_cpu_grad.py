"""torch CPU calls that autograd records, through anynorm's CPU kernels both ways.

Where :func:`anynorm._torch._native_first` sends a call to anynorm's kernels (outputs of
32 MiB and up, which the NumPy executor reuses where torch's fault in their pages again;
channels-first layer norm, which torch permutes and copies; float16 channels-first group
norm) and autograd must record it, torch's own routine would run both ways instead, as slow
backward as forward there (layer norm 8192 x 4096 float32: forward + backward 78 ms, most
of it page faults).  Layer norm and instance/group norm in the CPU kernels' layouts then run
as one ``autograd.Function``: the forward is the NumPy executor's (y, mean, rstd on the
tensors' memory), the backward the row or column backward kernel
(:mod:`anynorm._numpy_rows_backward`, :mod:`anynorm._numpy_columns_backward`) on the saved x
and statistics::

    dx = (g - xhat * mean(g * xhat) - mean(g)) * rstd,   g = dy * w
    dweight = sum(dy * xhat),  dbias = sum(dy)

The statistics it returns are not differentiable, as torch's ``native_layer_norm`` and
``native_group_norm`` return theirs.  A backward that builds a graph (``create_graph=True``)
runs the array-API core's backward on torch operations (the statistics taken again from x),
which autograd differentiates again.
"""

from __future__ import annotations

import math

import torch

from . import _native, _reference
from . import _torch as _executor

__all__ = ["takes", "forward", "prefers_kernels"]

# Where _native_first keeps torch's kernels (they win without autograd) but a call autograd
# records runs faster on anynorm's both ways: forward + backward, kernels / torch's route, both
# / F (float32, bfloat16), this VM's 2 cores.  Layer norm rows of 768: 256 rows 2.55/1.14,
# 1.90/1.07; 1024 rows 0.46/0.79, 1.36/1.03; 4096 rows 0.55/1.01, 0.81/1.14.  NHWC group norm
# (32 groups, 64 channels, 28x28): 1 sample 1.25/2.64, 0.26/0.97; 4 samples 0.67/1.50,
# 0.11/0.73; 16 samples 0.42/1.35, 0.07/0.72.  NCHW group norm lost at every size under 32 MiB
# (16x64x28x28: 1.77/1.00, 2.12/1.03): torch's kernel serves it.  Rows shorter than that
# whose forward takes the kernels (_torch.SHORT_ROW_MAX) keep torch's graph below it too: rows
# of 37, 1000 of them, 1.91/1.06 and 1.22/1.03; of 8, 4096, 1.60/1.03 and 0.41/1.12.
TRAINING_ROWS_MIN_ELEMENTS = 1 << 21
TRAINING_CHANNELS_LAST_MIN_ELEMENTS = 1 << 15


def takes(plan, x, weight, bias, residual):
    """True for a call this path serves: a gradient to record (else the NumPy executor runs
    it directly), plain CPU tensors of a kernel dtype, no residual, layer norm or
    instance/group norm in a layout the CPU kernels take (rows, short ones from
    TRAINING_ROWS_MIN_ELEMENTS; channels first or last, channels last from
    TRAINING_CHANNELS_LAST_MIN_ELEMENTS), C-contiguous x, the kernels built."""
    if residual is not None or (weight is None and bias is not None) or _executor._tracing():
        return False
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return False
    if plan.op == "rms_norm" or not _executor._kernel_layout(plan):  # RMS: _torch_rms records its own
        return False
    if (_channels_last(plan) or _executor._short_rows(plan)) and not prefers_kernels(plan):
        # small channels-last calls (torch's graph costs less than a Python Function's) and
        # short rows under TRAINING_ROWS_MIN_ELEMENTS (the kernels win their forward alone)
        return False
    for t in (x, weight, bias):
        if t is not None and (type(t) not in _executor._PLAIN or t.device.type != "cpu"
                              or t.dtype not in _executor._KERNEL_DTYPES):
            return False
    dtype = _executor._numpy_dtype(plan.dtype)
    return dtype is not None and x.is_contiguous() and _native.rows_backward_kernel(dtype) is not None


def prefers_kernels(plan):
    """True for a signature whose calls autograd records run faster here than on torch's
    kernels, though without autograd torch's win (:func:`anynorm._torch._native_first`):
    layer norm rows of ``TRAINING_ROWS_MIN_ELEMENTS`` and up, instance/group norm with
    channels last from ``TRAINING_CHANNELS_LAST_MIN_ELEMENTS`` (torch's channels-last
    backward is slow)."""
    size = math.prod(plan.shape)
    if plan.op == "layer_norm":
        return _executor._trailing(plan) and size >= TRAINING_ROWS_MIN_ELEMENTS
    return _channels_last(plan) and size >= TRAINING_CHANNELS_LAST_MIN_ELEMENTS


def _channels_last(plan):
    """Instance/group norm with the channels on x's last axis."""
    return plan.op in ("group_norm", "instance_norm") and plan.channel_axis == len(plan.shape) - 1


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
