"""The torch CPU executor: PyTorch's own fused routines where they give the same answer.

``torch.native_layer_norm``, ``torch._fused_rms_norm`` and ``torch.native_group_norm``
compute exactly the contract's formula (biased variance, eps inside the square root) and
return the statistics, with autograd.  They serve float32/float64 inputs whose normalized
axes are the trailing ones (layer/RMS norm) or whose channels sit on axis 1 of a contiguous
tensor (instance/group norm).  Everything else, and float16/bfloat16 (whose statistics
PyTorch's CPU routines round to the input dtype), runs the array-API core.
"""

from __future__ import annotations

import math

import torch

from . import _reference

__all__ = ["forward", "backward"]


def _same_dtype(plan, *params):
    return plan.dtype in (torch.float32, torch.float64) and all(
        p is None or p.dtype == plan.dtype for p in params)


def _trailing(plan):
    ndim, k = len(plan.shape), len(plan.reduce_axes)
    return plan.reduce_axes == tuple(range(ndim - k, ndim))


def native_forward(plan, src, weight, bias):
    """``(y, mean, rstd)`` from a torch routine, or None where none gives the same answer."""
    if not _same_dtype(plan, weight, bias) or src.numel() == 0:
        return None
    if plan.op in ("layer_norm", "rms_norm"):
        if not _trailing(plan):
            return None
        normalized = list(plan.param_shape)
        if plan.op == "rms_norm":
            y, rstd = torch._fused_rms_norm(src, normalized, weight, plan.eps)
            return y, None, rstd.reshape(plan.stats_shape)
        y, mean, rstd = torch.native_layer_norm(src, normalized, weight, bias, plan.eps)
        return y, mean.reshape(plan.stats_shape), rstd.reshape(plan.stats_shape)
    if plan.channel_axis != 1 or not src.is_contiguous():
        return None
    n, c = plan.shape[0], plan.shape[1]
    groups = plan.num_groups if plan.op == "group_norm" else c
    spatial = math.prod(plan.shape[2:])
    y, mean, rstd = torch.native_group_norm(src, weight, bias, n, c, spatial, groups, plan.eps)
    return y, mean.reshape(plan.stats_shape), rstd.reshape(plan.stats_shape)


def forward(plan, x, weight=None, bias=None, residual=None):
    """Return ``(y, h, mean, rstd)`` as :func:`anynorm._reference.forward` does."""
    h = _reference.add_residual(plan, x, residual) if residual is not None else None
    native = native_forward(plan, h if h is not None else x, weight, bias)
    if native is None:
        return _reference.forward(plan, x, weight, bias, residual)
    y, mean, rstd = native
    return y, h, mean, rstd


backward = _reference.backward
