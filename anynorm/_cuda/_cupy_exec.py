"""The CUDA executor for CuPy arrays: allocate outputs, launch on CuPy's current stream.

Outputs follow ``x``'s memory layout (``cupy.empty_like``); statistics are contiguous in the
public statistics shape, float32 for float16/bfloat16 inputs (float64 for float64).
"""

from __future__ import annotations

import math

import cupy

from . import _launch
from ._interop import dtype_key

__all__ = ["forward", "backward"]


def _param(arr, acc):
    """weight/bias/statistics as the kernels read them: contiguous, in the accumulation dtype."""
    if arr is None or (arr.dtype == acc and arr.flags.c_contiguous):
        return arr
    return cupy.ascontiguousarray(arr.astype(acc, copy=False))


def forward(plan, x, weight=None, bias=None, residual=None):
    """``(y, h, mean, rstd)``; ``h`` None without residual, ``mean`` None for RMS norm."""
    key = dtype_key(x.dtype)
    acc = _launch.acc_dtype(key)
    y = cupy.empty_like(x)
    h = cupy.empty_like(x) if residual is not None else None
    mean = cupy.empty(plan.stats_shape, dtype=acc) if plan.center else None
    rstd = cupy.empty(plan.stats_shape, dtype=acc)
    if x.size:
        with x.device:
            _launch.forward(plan, key, x, _param(weight, acc), _param(bias, acc), residual, y, h,
                            mean, rstd)
    return y, h, mean, rstd


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """``(dx, dweight, dbias)`` with dweight/dbias in weight's dtype (None without weight)."""
    key = dtype_key(x.dtype)
    acc = _launch.acc_dtype(key)
    dx = cupy.empty_like(x)
    dw = db = None
    if weight is not None:
        alloc = cupy.empty if x.size else cupy.zeros  # the kernels write every element
        dw = alloc(math.prod(plan.param_shape), dtype=acc)
        db = alloc(math.prod(plan.param_shape), dtype=acc)
    if x.size:
        rstd = _param(rstd, acc)
        mean = _param(mean, acc) if plan.center and rstd is not None else None
        with x.device:
            _launch.backward(plan, key, dy.astype(x.dtype, copy=False), x, _param(weight, acc),
                             mean, rstd, dx, dw, db)
    if weight is None:
        return dx, None, None
    return (dx, dw.reshape(plan.param_shape).astype(weight.dtype, copy=False),
            db.reshape(plan.param_shape).astype(weight.dtype, copy=False))
