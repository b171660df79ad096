"""Small torch CPU calls straight onto anynorm's row kernel (``kernels/cpu.cpp``).

For a small tensor the work is the call, not the arithmetic: torch's ``native_layer_norm``
on a (4, 8) float32 tensor takes 2.7 us, nearly all dispatch and three allocations, and the
conditioning check its one-pass statistics need (:mod:`anynorm._torch`) 0.8 more; the row
kernel called through ctypes on the tensors' memory takes 2.0 in all (one ``empty_like``,
one foreign call) and is exact on any data, so no check follows it.  Past
``DIRECT_MAX_ELEMENTS`` (half that in bfloat16) torch's kernel, on all of torch's threads, is
the faster.  Measured here (2 threads), anynorm's call direct / through torch's kernel:
float32 rows (16, 256) 0.69, (64, 256) 0.84, (64, 768) 0.99, (256, 256) 1.16, (1000, 37)
1.62, group norm (4, 64, 8, 8) 0.92, (8, 64, 16, 16) 1.25; float16 0.68-0.76 up to 16384
elements; bfloat16 (16, 768) 0.89, (4, 64, 8, 8) 1.07, (64, 768) 1.25.

It serves layer/RMS norm over trailing axes and group/instance norm of contiguous NCHW
(NCDHW) tensors (rows of a group's channels, each channel's weight on a run of its spatial
extent), no residual, in float32, float64, and bfloat16/float16 with parameters of x's
dtype or float32, on plain tensors (or parameters) with nothing for autograd to record and
no torch.func transform or trace open.  Any other call takes the caller's path.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from . import _direct, _native

__all__ = ["runner", "DIRECT_MAX_ELEMENTS"]

DIRECT_MAX_ELEMENTS = 1 << 14

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no subclass that overrides torch functions
_KERNEL_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _kernel_dtype(dtype):
    if dtype is torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError:
            return None
        return ml_dtypes.bfloat16
    return _KERNEL_DTYPES.get(dtype)


def _kernel(dtype, weight, bias):
    """The packed row kernel for x of ``dtype`` and these parameters, or None (the kernels
    not built; parameters of another dtype or layout, or of a torch subclass)."""
    params = [p for p in (weight, bias) if p is not None]
    for p in params:
        if type(p) not in _PLAIN or not p.is_contiguous() or p.dtype is not params[0].dtype:
            return None
    kernel_dtype = _kernel_dtype(dtype)
    if kernel_dtype is None:
        return None
    half = dtype in (torch.float16, torch.bfloat16)
    if params and params[0].dtype is not (torch.float32 if half else dtype):
        if not (half and params[0].dtype is dtype):
            return None
        return _native.rows_packed_kernel(kernel_dtype, half_params=True)
    return _native.rows_packed_kernel(kernel_dtype)


def runner(plan, x, weight, bias, stats, fallback):
    """``run(x, weight, bias, residual) -> (y, None, mean, rstd)`` by the row kernel for this
    call signature (x's and the parameters' types, shapes, strides, dtypes and devices, which
    the call cache keys), ``fallback`` taking the calls it does not serve (autograd records
    them, a torch.func transform or trace is open); None where the signature never fits."""
    from ._torch import _diverted

    if (x.device.type != "cpu" or type(x) not in _PLAIN or not x.is_contiguous()
            or math.prod(plan.shape) > DIRECT_MAX_ELEMENTS // (2 if plan.dtype is torch.bfloat16 else 1)):
        return None
    geometry = _direct.geometry(plan)
    kernel = _kernel(plan.dtype, weight, bias) if geometry is not None else None
    if kernel is None:
        return None
    sizes = _direct.sizes(plan, geometry)
    at_sizes = ctypes.addressof(sizes)
    center = plan.center
    acc = torch.float32 if plan.dtype in (torch.float16, torch.bfloat16) else plan.dtype
    # the statistics' shape and dtype: empty_like of this takes 0.7 us, torch.empty(shape) 1.0
    like_stats = torch.empty(plan.stats_shape, dtype=acc) if stats else None
    empty_like, grad_enabled = torch.empty_like, torch.is_grad_enabled

    def run(x, weight, bias, residual, _sizes=sizes):  # _sizes: kept alive with run
        if (grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                or (bias is not None and bias.requires_grad))) or _diverted():
            return fallback(x, weight, bias, residual)
        y = empty_like(x)
        mean = rstd = None
        if stats:
            rstd = empty_like(like_stats)
            if center:
                mean = empty_like(like_stats)
        kernel(x.data_ptr(), y.data_ptr(), None if weight is None else weight.data_ptr(),
               None if bias is None else bias.data_ptr(), None if mean is None else mean.data_ptr(),
               None if rstd is None else rstd.data_ptr(), at_sizes)
        return y, None, mean, rstd
    return run
