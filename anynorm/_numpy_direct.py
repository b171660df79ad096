"""NumPy calls straight onto anynorm's packed CPU kernels, for the layouts they take.

The executor's general entry (:func:`anynorm._numpy.forward`) works out per call what the
plan already fixes: the layout, the path, the blocks, the threads, the parameter vectors.
For arrays it would run on one thread anyway (below ``PARALLEL_MIN_ELEMENTS``), in the
layouts of :func:`anynorm._direct.packed` (rows, and the column kernel's channels-first
layer norm and channels-last group/instance norm), a signature's runner instead holds the
packed kernel and its sizes, and a call costs its outputs and one foreign call (measured here,
float32, anynorm's call direct / through the executor: (4, 8) 0.18, (64, 768) 0.42, (1000,
37) 0.63, group norm (3, 30, 7, 9) 0.20, channels-first (1, 96, 14, 14) 0.46; see
asv_bench/README.md).  The results are the
kernels', as the executor's kernel paths give them (which took the plain NumPy passes below
SMALL_ELEMENTS: the same float64-reference accuracy).

Taken: exact ``numpy.ndarray`` x, C-contiguous, of float32, float64, float16 (where the kernel
is built) or ml_dtypes' bfloat16; parameters exact ndarrays, C-contiguous, of the
accumulation dtype (float32 for half x; float64 for float64) or of x's half dtype (both of
one dtype; for the column kernel, one value a channel).  Anything else, or without the
kernels, the executor's path.

:func:`backward` does the same for the ``*_backward`` functions of layer/RMS norm over
trailing axes, or leading and trailing ones (segmented rows): one call of the row backward
kernel ((4, 8) float32 9 us with the statistics given, 17 through the executor; (1000, 37)
21 against 47).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from . import _direct, _native, _outputs

__all__ = ["runner", "backward"]

from_buffer, addressof = ctypes.c_char.from_buffer, ctypes.addressof


def _half_params(plan, weight, bias):
    """False for parameters the packed kernels read as they are in the accumulation dtype
    (or none), True for parameters of x's half dtype, None for any others (a subclass,
    strided memory, mixed or other dtypes)."""
    params = [p for p in (weight, bias) if p is not None]
    for p in params:
        if type(p) is not np.ndarray or not p.flags.c_contiguous or p.dtype != params[0].dtype:
            return None
    dtype, acc = np.dtype(plan.dtype), np.dtype(plan.acc_dtype)
    if not params or params[0].dtype == acc:
        return False
    return True if params[0].dtype == dtype else None


def runner(plan, x, weight, bias, stats, max_elements):
    """``run(x, weight, bias, residual) -> (y, None, mean, rstd)`` by a packed kernel for
    this call signature (the arrays' types, shapes, strides and dtypes, which the call cache
    keys; read-only arrays are fine), or None where none takes the signature: x of
    ``max_elements`` or more, another layout or dtype, no kernel built."""
    if (type(x) is not np.ndarray or not x.flags.c_contiguous or x.size == 0
            or x.size >= max_elements):
        return None
    half_params = _half_params(plan, weight, bias)
    found = None if half_params is None else _direct.packed(plan, x, np.dtype(plan.dtype), half_params)
    if found is None:
        return None
    kernel, sizes, param_size = found
    if param_size is not None and any(p is not None and p.size != param_size for p in (weight, bias)):
        return None
    if isinstance(sizes, _native.RowsCall) and 0 < sizes.w_run < 8 and x.size >= 4096:
        return None  # runs of parameters under a vector: the executor's blocking is the faster
    at_sizes = ctypes.addressof(sizes)
    shape, dtype, center = plan.shape, np.dtype(plan.dtype), plan.center
    stats_shape, acc = plan.stats_shape, np.dtype(plan.acc_dtype)
    nbytes = x.size * dtype.itemsize
    empty = _outputs.empty if nbytes >= _outputs.MIN_BYTES else np.empty
    # addresses through ctypes' view of a buffer (0.2 us; _native.address checks first, 0.4),
    # where every array is of a NumPy float (ml_dtypes' bfloat16 exports no buffer)
    viewed = dtype.kind == "f" and all(p is None or p.dtype.kind == "f" for p in (weight, bias))

    def run(x, weight, bias, residual, _sizes=sizes):  # _sizes: kept alive with run
        y = empty(shape, dtype)
        mean = rstd = None
        if stats:
            rstd = np.empty(stats_shape, acc)
            if center:
                mean = np.empty(stats_shape, acc)
        if viewed:
            try:
                px = addressof(from_buffer(x))
                pw = None if weight is None else addressof(from_buffer(weight))
                pb = None if bias is None else addressof(from_buffer(bias))
            except TypeError:  # a read-only array: no writable buffer to view
                px, pw, pb = _at(x), _at(weight), _at(bias)
            py = addressof(from_buffer(y))
        else:
            px, pw, pb, py = _at(x), _at(weight), _at(bias), _at(y)
        kernel(px, py, pw, pb, None if mean is None else addressof(from_buffer(mean)),
               None if rstd is None else addressof(from_buffer(rstd)), at_sizes)
        return y, None, mean, rstd
    return run


def _at(a, _address=_native.address):
    return None if a is None else _address(a)


def backward(plan, dy, x, weight, mean, rstd, max_elements):
    """``(dx, dweight, dbias)`` of layer/RMS norm over trailing axes (or leading and
    trailing ones: segmented rows) by the row backward kernel in one foreign call, or None
    where this path does not take the call: x and dy not exact C-contiguous ndarrays of one
    dtype, ``max_elements`` or more, another layout, statistics or a weight not C-contiguous
    of the accumulation dtype (a weight of x's half dtype is widened), no kernel built.  The
    plan's part of that is decided once (``plan.memo``)."""
    if (type(x) is not np.ndarray or type(dy) is not np.ndarray or x.dtype != dy.dtype
            or not (x.flags.c_contiguous and dy.flags.c_contiguous) or x.size >= max_elements):
        return None
    found = plan.memo.get("numpy direct backward")
    if found is None:
        found = plan.memo["numpy direct backward"] = _backward_kernel(plan)
    if not found:
        return None
    kernel, rows, n, acc, segments = found
    if weight is not None:
        if type(weight) is not np.ndarray or not weight.flags.c_contiguous:
            return None
        w = weight if weight.dtype == acc else (weight.astype(acc) if weight.dtype == x.dtype else None)
        if w is None:
            return None
    given = [s for s in (mean, rstd) if s is not None]
    if any(type(s) is not np.ndarray or s.dtype != acc or not s.flags.c_contiguous for s in given):
        return None
    dx = (_outputs.empty if x.nbytes >= _outputs.MIN_BYTES else np.empty)(plan.shape, x.dtype)
    grads = None if weight is None else np.zeros((2, n))
    args = [_at(x), _at(dy), _at(dx), None if weight is None else _at(w),
            None if mean is None or rstd is None else _at(mean), _at(rstd),
            None if grads is None else _at(grads), None if grads is None else _at(grads) + 8 * n,
            rows, n, *segments, int(plan.center), plan.eps]
    if not segments:
        args.insert(4, 0)  # w_run: by position
    err = kernel(*args)
    if err:
        raise RuntimeError(f"anynorm's CPU backward kernel refused rows of {n}")
    if grads is None:
        return dx, None, None
    shape = plan.param_shape
    return dx, grads[0].reshape(shape).astype(weight.dtype, copy=False), grads[1].reshape(shape).astype(
        weight.dtype, copy=False)


def _backward_kernel(plan):
    """``(kernel, rows, n, accumulation dtype, (segments, seg_stride) or ())`` for the plan's
    backward over trailing axes or segmented rows, or False."""
    if plan.op not in ("layer_norm", "rms_norm"):
        return False
    ndim, k = len(plan.shape), len(plan.reduce_axes)
    dtype, acc = np.dtype(plan.dtype), np.dtype(plan.acc_dtype)
    if plan.reduce_axes == tuple(range(ndim - k, ndim)):
        kernel = _native.rows_backward_kernel(dtype)
        return False if kernel is None else (kernel, math.prod(plan.shape) // plan.count, plan.count, acc, ())
    sizes = _direct._segmented(plan)
    kernel = None if sizes is None else _native.segmented_backward_kernel(dtype)
    if kernel is None:
        return False
    return kernel, sizes.rows, sizes.n, acc, (sizes.segments, sizes.seg_stride)
