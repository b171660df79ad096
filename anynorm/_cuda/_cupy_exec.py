"""The CUDA executor for CuPy arrays: allocate outputs, launch on CuPy's current stream.

Outputs follow ``x``'s memory layout (``cupy.empty_like``); statistics are contiguous in the
public statistics shape, float32 for float16/bfloat16 inputs (float64 for float64). Where
the buffers need no copies, a call launches the schedule bound for its signature
(``_launcher.dense_forward``); otherwise ``_launcher.forward`` copies around it.
"""

from __future__ import annotations

import math

import cupy

from . import _launcher
from ._schedule import acc_dtype
from ._interop import dtype_key, run_on_cupy_stream

__all__ = ["forward", "backward"]


def _param(arr, dtype):
    """weight/bias/statistics as the kernels read them: contiguous, in ``dtype`` (the
    accumulation dtype, or x's for parameters that hold it)."""
    if arr is None or (arr.dtype == dtype and arr.flags.c_contiguous):
        return arr
    return cupy.ascontiguousarray(arr.astype(dtype, copy=False))


def _ptr(arr):
    return 0 if arr is None else arr.data.ptr


def _scratch(bound):
    return cupy.empty(bound.scratch_bytes, dtype=cupy.uint8) if bound.scratch_bytes else None


def _bound_forward(plan, x, residual, weight, bias, stats, param_in_t):
    return _launcher.dense_forward(
        plan, dtype_key(x.dtype), _launcher.element_strides(x),
        None if residual is None else _launcher.element_strides(residual),
        _launcher.forward_present(plan, residual, weight, bias, stats), param_in_t, x.data.device_id)


def _bound_backward(plan, x, dy, weight, has_stats, param_grads, param_in_t, grad_in_t):
    return _launcher.dense_backward(
        plan, dtype_key(x.dtype), _launcher.element_strides(x), _launcher.element_strides(dy),
        _launcher.backward_present(plan, weight, has_stats, param_grads), param_in_t, grad_in_t,
        x.data.device_id)


def forward(plan, x, weight=None, bias=None, residual=None, stats=True, site=None):
    """``(y, h, mean, rstd)``; ``h`` None without residual, ``mean`` None for RMS norm, both
    statistics None with ``stats=False`` where the kernels need not write them. ``site``: a
    dict kept per call signature (``_executor.forward_runner``), where the bound launch the
    first call finds is kept when the parameters need no conversion."""
    key = dtype_key(x.dtype)
    acc = acc_dtype(key)
    y = cupy.empty_like(x)
    h = cupy.empty_like(x) if residual is not None else None
    mean = rstd = None
    if stats:
        mean = cupy.empty(plan.stats_shape, dtype=acc) if plan.center else None
        rstd = cupy.empty(plan.stats_shape, dtype=acc)
    if not x.size:
        return y, h, mean, rstd
    bound = None if site is None else site.get(stats)
    if bound is None:
        given_weight, given_bias = weight, bias
        weight, bias, param_in_t = _launcher.kernel_params(x.dtype, acc, _param, weight, bias)
        bound = _bound_forward(plan, x, residual, weight, bias, stats, param_in_t)
        if (site is not None and bound is not None and weight is given_weight
                and bias is given_bias):
            site[stats] = bound
    if bound is None:
        if rstd is None:
            mean = cupy.empty(plan.stats_shape, dtype=acc) if plan.center else None
            rstd = cupy.empty(plan.stats_shape, dtype=acc)
        with x.device:
            _launcher.forward(plan, key, x, weight, bias, residual, y, h, mean, rstd, param_in_t)
        return y, h, mean, rstd
    scratch = _scratch(bound)
    run_on_cupy_stream(bound, (x.data.ptr, _ptr(residual), _ptr(h), y.data.ptr, _ptr(weight),
                               _ptr(bias), _ptr(mean), _ptr(rstd), _ptr(scratch)), x.data.device_id)
    return y, h, mean, rstd


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """``(dx, dweight, dbias)`` with dweight/dbias in weight's dtype (None without weight)."""
    key = dtype_key(x.dtype)
    acc = acc_dtype(key)
    dx = cupy.empty_like(x)
    dw = db = None
    # a half weight of x's dtype takes its gradients in that dtype, written by the kernel
    grad_in_t = 3 if weight is not None and weight.dtype == x.dtype != acc else 0
    if weight is not None:
        alloc = cupy.empty if x.size else cupy.zeros  # the kernels write every element
        grad_dtype = x.dtype if grad_in_t else acc
        dw = alloc(math.prod(plan.param_shape), dtype=grad_dtype)
        db = alloc(math.prod(plan.param_shape), dtype=grad_dtype)
    if x.size:
        rstd = _param(rstd, acc)
        mean = _param(mean, acc) if plan.center and rstd is not None else None
        dy = dy.astype(x.dtype, copy=False)
        w, _, param_in_t = _launcher.kernel_params(x.dtype, acc, _param, weight)
        bound = _bound_backward(plan, x, dy, w, rstd is not None, dw is not None, param_in_t,
                                grad_in_t)
        if bound is None:
            with x.device:
                _launcher.backward(plan, key, dy, x, w, mean, rstd, dx, dw, db, param_in_t,
                                   grad_in_t)
        else:
            scratch = _scratch(bound)
            run_on_cupy_stream(bound, (dy.data.ptr, x.data.ptr, _ptr(w), _ptr(mean), _ptr(rstd),
                                       dx.data.ptr, _ptr(dw), _ptr(db), _ptr(scratch)),
                               x.data.device_id)
    if weight is None:
        return dx, None, None
    return (dx, dw.reshape(plan.param_shape).astype(weight.dtype, copy=False),
            db.reshape(plan.param_shape).astype(weight.dtype, copy=False))
