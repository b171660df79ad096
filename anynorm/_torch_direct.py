"""Small torch CPU calls straight onto anynorm's packed CPU kernels (``kernels/cpu.cpp``).

For a small tensor the work is the call, not the arithmetic: torch's ``native_layer_norm``
on a (4, 8) float32 tensor takes 2.7 us, nearly all dispatch and three allocations, and the
conditioning check its one-pass statistics need (:mod:`anynorm._torch`) 0.8 more; the row
kernel called through ctypes on the tensors' memory takes 2.0 in all (one ``empty_like``,
one foreign call) and is exact on any data, so no check follows it.  Past
``DIRECT_MAX_ELEMENTS`` (half that in bfloat16) torch's kernel, on all of torch's threads, is
the faster.  Measured here (2 threads), anynorm's call direct / through torch's kernel:
float32 rows (16, 256) 0.69, (64, 256) 0.84, (64, 768) 0.99, (256, 256) 1.16, (1000, 37)
1.62, group norm (4, 64, 8, 8) 0.92, (8, 64, 16, 16) 1.25; float16 0.68-0.76 up to 16384
elements; bfloat16 (16, 768) 0.89, (4, 64, 8, 8) 1.07, (64, 768) 1.25.  The column kernel's
calls, up to ``DIRECT_MAX_COLUMN_ELEMENTS``, against torch's permuted or channels-last
kernels (from 65536 elements channels-first layer norm took the same kernel through the
NumPy executor): float32 / bfloat16 channels-first (1, 96, 14, 14) 0.40 / 0.43, (2, 96, 28,
28) 0.99 / 0.99; NHWC group norm (1, 14, 14, 96) 0.61 / 0.22, (2, 28, 28, 96) 0.82 / 0.16;
NHWC instance norm (2, 14, 14, 64) 0.18 / 0.03; past it torch's can be the faster (NHWC
instance norm (4, 56, 56, 64) 1.23 / 1.81).  Segmented rows (layer norm over leading and
trailing axes, which torch's route permutes into a copy first), up to
``DIRECT_MAX_SEGMENTED_ELEMENTS`` (half that in bfloat16), against that route, float32 /
bfloat16: (7, 130, 33) over (0, 2) 0.68 / 0.85, (4, 64, 16) 0.54 / 0.61, (8, 96, 8, 8) over
(0, 2, 3) 0.76 / 0.95; past it the route's two threads win ((7, 520, 33) 0.93 / 1.23, (16,
256, 64) 1.31 / 1.38).

Past those sizes, up to ``DIRECT_MAX_THREADED_ELEMENTS``, the same kernels run on torch's own
OpenMP threads (:func:`anynorm._torch_openmp.kernels_on_team`: one region opened in C, each
thread its rows or samples; on ``torch.get_num_threads()`` of them) where torch's checked
kernel was the route: ours / ``F`` against the route / ``F`` (2 threads, float32 / bfloat16):
rows (64, 768) 0.96 / 0.95 against 1.28 / 1.20, (1024, 768) 0.77 / 0.82 against 1.02 /
1.01, (8192, 768) 0.76 / 0.80 against 1.09 / 1.03, (16, 65536) 0.65 / 0.84; NCHW group norm
(32, 64, 56, 56) 0.68 / 0.78 against 1.00 / 1.03; segmented (16, 256, 64) 0.75 / 0.82
against 1.12 / 1.07; NHWC group norm float32 (32, 56, 56, 64) 0.80-0.85 against 1.02-1.10.
Channels-last group norm in half dtypes keeps torch's kernel where it was the route (its
half channels-last kernel is the faster: (8, 64, 64, 320) bfloat16 1.68x ``F`` on the
column kernel, 1.06x on torch's).

It serves the layouts of :func:`anynorm._direct.packed` on contiguous tensors: layer/RMS
norm over trailing axes (or leading and trailing ones) and group/instance norm of NCHW
(NCDHW) tensors by the row kernel,
channels-first layer norm and group/instance norm with ``channel_axis=-1`` of a contiguous
(N, ..., C) tensor by the column kernel; no residual, in float32, float64, and
bfloat16/float16 with parameters of x's dtype or float32, on plain tensors (or parameters)
with nothing for autograd to record and no torch.func transform or trace open.  Any other
call takes the caller's path.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import _direct, _native, _outputs, _torch_openmp

__all__ = ["runner", "DIRECT_MAX_ELEMENTS", "DIRECT_MAX_COLUMN_ELEMENTS", "DIRECT_MAX_SEGMENTED_ELEMENTS",
           "DIRECT_MAX_THREADED_ELEMENTS"]

DIRECT_MAX_ELEMENTS = 1 << 14  # the row kernel's calls (half that in bfloat16)
DIRECT_MAX_COLUMN_ELEMENTS = 1 << 17  # the column kernel's
# the row kernel's segmented rows (layer norm over outer and inner axes), half that in
# bfloat16: torch's route permutes x into a copy first
DIRECT_MAX_SEGMENTED_ELEMENTS = 1 << 16
# past those, up to this, the packed kernels' calls on torch's OpenMP team; past it (float32
# outputs of 64 MiB) the executor's threads, whose blocks the same kernels run
DIRECT_MAX_THREADED_ELEMENTS = 1 << 24

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no subclass that overrides torch functions


def _half_params(dtype, weight, bias):
    """False for parameters the packed kernels read as they are in the accumulation dtype
    (or none), True for parameters of x's half dtype, None for any others (a subclass,
    strided memory, mixed or other dtypes)."""
    params = [p for p in (weight, bias) if p is not None]
    for p in params:
        if type(p) not in _PLAIN or not p.is_contiguous() or p.dtype is not params[0].dtype:
            return None
    half = dtype in (torch.float16, torch.bfloat16)
    if not params or params[0].dtype is (torch.float32 if half else dtype):
        return False
    return True if half and params[0].dtype is dtype else None


def _team_takes(plan, sizes, kernels_first):
    """Whether a packed call past one thread's share runs on torch's team (torch's threads):
    the row kernel's by rows; the column kernel's by samples (two or more), but for
    channels-last group norm in half dtypes where torch's kernel serves the signature (its
    half channels-last kernel is the faster)."""
    from ._torch import _HALF

    if isinstance(sizes, _native.RowsCall):
        return True
    return sizes.samples > 1 and (kernels_first or plan.op != "group_norm" or plan.dtype not in _HALF)


def runner(plan, x, weight, bias, stats, fallback, kernels_first=False):
    """``run(x, weight, bias, residual) -> (y, None, mean, rstd)`` by a packed kernel for this
    call signature (x's and the parameters' types, shapes, strides, dtypes and devices, which
    the call cache keys), ``fallback`` taking the calls it does not serve (autograd records
    them, a torch.func transform or trace is open); None where the signature never fits.
    ``kernels_first``: the executor would run anynorm's kernels on this call anyway (not
    torch's), on one thread below ``_numpy.DIRECT_MAX_ELEMENTS``: up to there, the same
    kernel straight."""
    from . import _numpy
    from ._torch import _as_numpy, _as_torch, _diverted, _numpy_dtype, _numpy_plan

    size = math.prod(plan.shape)
    limit = _numpy.DIRECT_MAX_ELEMENTS if kernels_first else None
    if (x.device.type != "cpu" or type(x) not in _PLAIN or not x.is_contiguous()
            or size > max(limit or 0, DIRECT_MAX_THREADED_ELEMENTS, DIRECT_MAX_COLUMN_ELEMENTS)):
        return None
    kernel_dtype = _numpy_dtype(plan.dtype)
    half_params = _half_params(plan.dtype, weight, bias)
    if kernel_dtype is None or half_params is None:
        return None
    found = _direct.packed(_numpy_plan(plan), _as_numpy(x), kernel_dtype, half_params)
    if found is None:
        return None
    kernel, sizes, param_size = found
    if param_size is not None and any(p is not None and p.numel() != param_size for p in (weight, bias)):
        return None
    rows = isinstance(sizes, _native.RowsCall)
    most = (DIRECT_MAX_COLUMN_ELEMENTS if not rows
            else DIRECT_MAX_SEGMENTED_ELEMENTS if sizes.segments > 1 else DIRECT_MAX_ELEMENTS)
    one_thread = most // 2 if rows and plan.dtype is torch.bfloat16 else most
    threaded = (one_thread < size <= DIRECT_MAX_THREADED_ELEMENTS and _team_takes(plan, sizes, kernels_first)
                and _torch_openmp.kernels_on_team())
    if not threaded and size > (limit or one_thread):
        return None
    at_sizes = ctypes.addressof(sizes)
    center = plan.center
    acc = torch.float32 if plan.dtype in (torch.float16, torch.bfloat16) else plan.dtype
    # the statistics' shape and dtype: empty_like of this takes 0.7 us, torch.empty(shape) 1.0
    like_stats = torch.empty(plan.stats_shape, dtype=acc) if stats else None
    empty_like, grad_enabled = torch.empty_like, torch.is_grad_enabled
    new_y = empty_like
    if size * x.element_size() >= _outputs.MIN_BYTES:  # reused blocks, as the executor's outputs
        shape, dtype, as_torch = plan.shape, _as_numpy(x).dtype, _as_torch

        def new_y(x):
            return as_torch(_outputs.empty(shape, dtype))

    def run(x, weight, bias, residual, _sizes=sizes):  # _sizes: kept alive with run
        if (grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                or (bias is not None and bias.requires_grad))) or _diverted():
            return fallback(x, weight, bias, residual)
        y = new_y(x)
        mean = rstd = None
        if stats:
            rstd = empty_like(like_stats)
            if center:
                mean = empty_like(like_stats)
        kernel(x.data_ptr(), y.data_ptr(), None if weight is None else weight.data_ptr(),
               None if bias is None else bias.data_ptr(), None if mean is None else mean.data_ptr(),
               None if rstd is None else rstd.data_ptr(), at_sizes)
        return y, None, mean, rstd
    if threaded:
        one_call = run

        def run(x, weight, bias, residual, _sizes=sizes, _threads=torch.get_num_threads):
            _sizes.threads = _threads()  # a caller who limits torch's threads limits ours
            return one_call(x, weight, bias, residual)
    return run
