"""The torch CPU executor: PyTorch's fused routines where they are exact, else the NumPy
executor on the same memory, else the array-API core.

torch's CPU kernels (``native_layer_norm``, ``native_group_norm``, ``_fused_rms_norm``)
compute the contract's formula, return the statistics and carry autograd; they serve
layer/RMS norm over any axes (the normalized axes moved last, as ``F.layer_norm`` needs),
group norm with channels on axis 1 of a contiguous or channels-last (NHWC) tensor, and
instance norm as group norm with one channel per group.  float16/bfloat16 inputs: the
kernels accumulate in float32 and convert only cache-sized rows; they take float32
parameters where the statistics are asked for (then returned in float32), else the
parameters as given.  torch's CPU RMS norm is composite (a float32 copy of the whole
array, a slow autograd graph): :mod:`anynorm._torch_rms` runs half rows and every call
autograd records in blocks of rows instead, and group/instance norm on memory neither
contiguous nor channels-last (an (N, L, C) tensor) a contiguous copy in x's dtype.  torch's
channels-last group-norm backward is slow with few channels a group (10-40x its contiguous
one): there autograd records :mod:`anynorm._torch_channels_last`'s blocked backward.

:func:`forward_runner` works out, once per call signature, what a call needs (layout,
routine, arguments, limit): a plain call costs torch's kernel, the check and a few Python
steps (the call layer in ``_calls``/``_functional`` adds about as much again).  Small calls
with nothing for autograd to record (up to ``_torch_direct.DIRECT_MAX_ELEMENTS``, in the
packed kernels' layouts) skip torch's kernel: :mod:`anynorm._torch_direct` runs anynorm's
kernels on their memory, which are exact, so no check follows (a (4, 8) call 0.5x the time);
so do calls the executor would hand to those kernels anyway, below its threading size.

Accuracy: these kernels are exact only on well-conditioned slices.  The row kernels scale
as ``x * rstd - mean * rstd``, which loses ``|mean| * rstd`` ulps, and the channels-last
group-norm kernel takes ``E[x^2] - E[x]^2``, which loses ``(|mean| * rstd)^2`` of them (all
digits at an offset of 1e4).  So every centred call checks the conditioning its own
statistics show (``max |mean| * rstd`` against ``_LIMITS``: Python floats for a few
statistics, three torch ops below 32768, NumPy beyond; NaN slices never hide the others); a call over the limit runs
again on ``x - shift``, the shift being the first run's mean rounded to x's dtype on the
slices over the limit (zero on the others) and detached from autograd (layer and group
norm are shift-invariant: ``x - shift`` is exact for rows far from zero, its statistics well
conditioned, and ``shift`` is added back to the returned mean), and is checked again; what
still fails takes the exact executors.  Checking after the kernel beats shifting before it
at every size measured on torch CPU (a (4, 8) call: the check on Python floats 1.1 us,
``x - x[..., :1]`` 3.4 us; at 1000 rows three torch ops 3.8 us against a pass over x).  Under
``torch.compile``, ``torch.jit.trace`` and torch.func's transforms (:func:`_tracing`: no
data-dependent branch, no memory to read under vmap), and on tensors without memory (meta,
fake: :func:`_dataless`), the shift is always taken, the mean of a few leading elements of
each slice, half dtypes run in float32 (:func:`_traced_forward`), and the channels-last
kernel is not used.

When no gradient is recorded, the blocked NumPy executor runs on the tensors' own memory
(``Tensor.numpy()``, zero-copy) wherever it is the faster (:func:`_native_first`):
layer/RMS rows longer than ``NATIVE_MAX_ROW`` (through the row kernel: in arrays of
``LONG_ROWS_KERNEL_MIN_BYTES``, not bfloat16), RMS rows of ``RMS_KERNEL_MIN_ELEMENTS``,
channels-first layer norm through anynorm's column kernel (runs of ``CF_KERNEL_MIN_RUN``,
arrays of ``CF_KERNEL_MIN_ELEMENTS``), float16 channels-first group norm, and every layout
the CPU kernels take once an output reaches ``FAULTING_BYTES`` (torch's allocations fault
their pages in again on every call, the executor reuses its own).  bfloat16 tensors reach the
kernels as ml_dtypes' bfloat16 arrays on the same memory (where ml_dtypes is installed).
With autograd on, the calls the kernels serve (and layer norm rows of 2M elements and up,
channels-last group/instance norm, where only the backward makes the kernels the faster) run
the NumPy executor's forward and anynorm's backward kernels as one ``autograd.Function``
(:mod:`anynorm._torch_cpu_grad`); layouts without a torch routine take the array-API core,
whose torch operations autograd differentiates.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import chain as _chain

import numpy as np
import torch
from torch.autograd import forward_ad as _forward_ad

from . import (_native, _numpy, _outputs, _reference, _torch_channels_last, _torch_cpu_grad, _torch_direct,
               _torch_openmp, _torch_rms)

__all__ = ["forward", "forward_runner", "backward"]

_NUMPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
                 torch.float64: np.dtype(np.float64)}
_HALF = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (*_NUMPY_DTYPES, torch.bfloat16)  # those the CPU kernels take (bfloat16: ml_dtypes)
NATIVE_MAX_ROW = 2048
# Layer/RMS rows longer than NATIVE_MAX_ROW take anynorm's row kernel from arrays of this many
# bytes (float32, float16), where x and y no longer share the L3 cache and torch's long-row
# kernel falls behind.  Measured, 2 threads, ours / F (torch's kernel route in brackets):
# float32 2048x3072 0.68 (1.13), 1536x4096 0.91 (1.14); below, torch's kernel is the faster:
# 1024x4096 1.10 (1.02), 256x4096 1.78 (1.03), 256x8192 1.40 (0.94); float16 2048x4096 1.35
# (1.02), 4096x3072 1.02 (1.01).  bfloat16 rows keep torch's kernel up to FAULTING_BYTES
# (2048x4096 1.27 against 0.94, 4096x3072 1.06 against 1.02).
LONG_ROWS_KERNEL_MIN_BYTES = 24 << 20
SHORT_RUN = 1024
# Layer/RMS norm rows of SHORT_ROW_MIN to SHORT_ROW_MAX elements take anynorm's row kernel,
# which holds them in registers four at a time: one thread does about three times torch's
# per thread there (float32 rows of 37: 11.5 ns a row against 35; bfloat16 19 against 58).
# So below the executor's threading size where torch has at most SHORT_ROWS_THREADS threads,
# and from there on any number (the executor threads them too).  Measured, 2 threads, the
# kernel straight / F: float32 rows of 8 0.57-0.69, of 37 0.65-0.72, of 64 0.94-0.96;
# bfloat16 0.27-0.34, 0.56-0.61, 0.78-0.82 (1000 to 65536 rows).
SHORT_ROW_MIN, SHORT_ROW_MAX, SHORT_ROWS_THREADS = 8, 64, 3
# Channels-first layer norm of C-contiguous x through anynorm's column kernel (NumPy
# executor): from runs of this many elements and arrays of this many.  Measured, float32,
# 2 threads, ours / F on the permuted view: ConvNeXt 32x192x28x28 0.07 (torch's kernel: 0.99),
# 32x384x14x14 0.30-0.51 (1.03), 32x768x7x7 0.84 (1.02), 64x256x5x5 0.75 (1.24), 64x256x4x4
# 0.88 (1.09), 4x96x14x14 0.69 (1.17), 1x96x28x28 0.90 (1.14); float16 0.52-0.92; below,
# the executor's per-call cost (2x96x14x14 float16 1.33 against 1.15, 1x768x7x7 1.32 against
# 1.27) and short runs' scalar loops (32x256x3x3 1.73 against 1.20, x1x1 19) lose.
CF_KERNEL_MIN_RUN = 16
CF_KERNEL_MIN_ELEMENTS = 1 << 16
# Outputs from which torch's CPU allocations fault their pages in again every call (past
# glibc's largest mmap threshold) while the executor reuses its own (:mod:`anynorm._outputs`;
# before that cache, where NumPy's got huge pages and torch's 4 KiB ones): the kernels take
# C-contiguous x from there. Measured before the cache, 2 threads, ours / F, the NumPy
# executor (torch's kernel route in brackets):
# layer norm 16384x1024 float32 0.44 (1.01), 16384x2048 float16 0.26 (1.00), group norm (32)
# 32x64x64x64 float32 0.39 (1.01), 32x128x64x64 float16 0.26 (1.02), NHWC 32x64x64x128
# float32 0.33 (0.96), instance norm 32x128x64x64 float32 0.17 (0.64), NHWC 32x64x64x128
# float16 0.19 (0.40).
FAULTING_BYTES = _outputs.MMAP_THRESHOLD_MAX
# RMS norm rows through the row kernel from here (F.rms_norm and anynorm's blocked torch
# route: 1024x768 float32 0.10 against 1.01, 512x768 1.23 against 1.03; float16 1024x768
# 0.07 against 0.08, 512x768 0.79 against 1.11)
RMS_KERNEL_MIN_ELEMENTS = 1 << 19
# float16 group norm with channels first through the kernels from here (4x64x32x32 0.76
# against 1.01, 32x64x56x56 0.51 against 0.93; 8x64x16x16 1.06 against 1.10)
HALF_GROUPS_MIN_ELEMENTS = 1 << 18
# torch's channels-last group norm splits a call over (sample, group) pairs, each read strided
# across the image, below this spatial extent (its ``feature_map_threshold``; over pixels
# above): there anynorm's column kernel runs channels-last group/instance norm instead.
# Measured, 2 threads, anynorm's kernel / torch's, float32 / bfloat16: group norm (8
# channels a group) (4, 28, 28, 64) 0.81 / 0.17, (4, 28, 28, 128) 0.88 / 0.17, instance norm
# (4, 28, 28, 64) 0.11 / 0.02; at 56 x 56, past it: (2, 56, 56, 64) 0.73 / 1.72 and 1.40 / 1.70.
TORCH_CHANNELS_LAST_SPLIT_MIN = 1024
# Largest max |mean| * rstd (the ratio r) at which a kernel's output stays at float32 rounding
# (~1e-6 of max|y|): (row kernels, channels-last group-norm kernel).  Row kernels
# (native_layer_norm; native_group_norm on contiguous NCHW gives the same figures), measured
# on torch 2.13 CPU, float32 slices of 64 ... 65536 elements, std 0.1-3, both signs, 3 seeds,
# against float64 (max |y - y64| / max |y64|; rstd relative):
#     r       1       2       4       6       8      12      16
#     y     1.6e-7  2.1e-7  2.6e-7  3.2e-7  3.7e-7  5.6e-7  9.9e-7   (worst at 64 elements)
#     rstd  1.6e-7  1.3e-7  1.9e-7  2.7e-7  3.1e-7  3.8e-7  5.8e-7
# and the backward (F.layer_norm with a weight, dx and dweight relative to their max) flat to
# r = 8 (dx <= 4.3e-7, dweight <= 7.2e-7; 6.2e-7 / 9.9e-7 at 16).  So 8 for float32 rows:
# within 3.1 float32 eps of max|y| (r <= 2 gave 1.8 eps, 16 gives 8.3), and data with r in
# (2, 8] (sigmoid outputs: ~2.5) no longer pays a second kernel run.  float64 keeps 2 (its
# ulps are not the concern; its reruns are rare).  The channels-last kernel takes
# E[x^2] - E[x]^2, which loses r^2 ulps (5e-7 at 0.25, 1.3e-6 at 1 for 64 elements); it
# also sums in float32 without pairwise blocking, so large groups lose digits at any r
# (8e-7 of max|y| at 4096 elements, 3.6e-6 at 65536: its own error, not the limit's).
# Half dtypes round their output to 8 or 11 bits, so float32 arithmetic may lose more there.
_LIMITS = {torch.float32: (8.0, 0.5), torch.float64: (2.0, 0.5),
           torch.bfloat16: (256.0, 16.0), torch.float16: (64.0, 8.0)}
# Channels a group up to which channels-last group norm under autograd takes the blocked
# backward of ``_torch_channels_last`` (float32/float64, half): torch's own loops over a
# group's channels.  Measured, torch 2.13, 2 threads, 16 x 128 x 32 x 32, backward ms
# torch / blocked: float32 9.6/2.5 (1 channel a group), 4.8/2.3 (2), 4.3/2.8 (4),
# 0.9/2.2 (8); bfloat16 26.5/3.2, 13.7/2.8, 7.7/2.2, 5.1/3.4 (8), 1.1/4.0 (16).
_BLOCKED_BACKWARD_CHANNELS = (4, 8)


_transforms = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._is_tracing


def _diverted():
    """:func:`_tracing` but for torch.compile (whose tracing never reaches a cached runner)."""
    return _transforms() or _jit_tracing() or _forward_ad._current_level >= 0


def _tracing():
    """torch.compile traces the call, ``torch.jit.trace`` records it (also the legacy
    ``torch.onnx.export``), a torch.func transform (vmap, grad, jacrev, jvp, ...) runs it, or
    a forward-mode AD level is open (``torch.autograd.forward_ad``: dual tensors' tangents
    go through torch operations only): then no data-dependent branch (a recorded trace
    replays the branch taken while tracing, vmap's batched tensors have no memory to read),
    no NumPy view, no Python autograd.Function without transform rules."""
    return torch.compiler.is_compiling() or _diverted()


_is_fake = torch._subclasses.fake_tensor.is_fake


def _dataless(t):
    """True for a tensor without memory to read (meta device, a FakeTensor of shape
    propagation): it takes the traced path, whose result does not depend on a check."""
    return t.is_meta or (type(t) is not torch.Tensor and _is_fake(t))


def _params_ok(plan, *params):
    """torch's kernels take parameters of x's dtype, or float32 ones for half inputs."""
    if plan.dtype not in _LIMITS:
        return False
    allowed = (plan.dtype, torch.float32) if plan.dtype in _HALF else (plan.dtype,)
    return all(p is None or p.dtype in allowed for p in params)


def _trailing(plan):
    ndim, k = len(plan.shape), len(plan.reduce_axes)
    return plan.reduce_axes == tuple(range(ndim - k, ndim))


_ONES: dict = {}


def _float_params(plan, weight, bias, shape):
    """For half inputs: weight/bias as float32 (ones when absent), so that torch's kernels
    accumulate and return the statistics in float32 (its mixed-dtype path)."""
    if plan.dtype not in _HALF:
        return weight, bias
    if weight is None:
        weight = _ONES.get(shape)
        if weight is None:
            weight = _ONES[shape] = torch.ones(shape, dtype=torch.float32)
    elif weight.dtype is not torch.float32:
        weight = _to_float(weight)
    if bias is not None and bias.dtype is not torch.float32:
        bias = _to_float(bias)
    return weight, bias


def _to_float(t, _float=torch.Tensor.float):
    """``t`` as float32: ``Tensor.float`` (differentiable; measured, one thread, an (8,)
    bfloat16 tensor: 1.6 us against 2.4 us for ``t.to(torch.float32)``, whose overload
    parsing costs the difference)."""
    return _float(t)


class _Layout:
    """How a plan maps onto torch's kernels (made once per plan and memory layout).

    ``kind``: "rows" (layer/RMS norm, the normalized axes moved last when they are not),
    "groups" (group/instance norm on the NCHW view, channels on axis 1), "batch" (float16
    instance norm of contiguous NCHW: batch norm's kernel on (1, N*C, HW)); ``channels_last``:
    the NCHW view is channels-last memory (torch's E[x^2] - E[x]^2 kernel); ``copy``: the
    NCHW view is neither (an (N, L, C) tensor with ``channel_axis=-1``: torch has no 3-d
    channels-last kernel), and it is copied to contiguous memory (x's dtype) for torch's
    kernel rather than take the array-API core, which converts half arrays to float32 whole
    and under autograd records a slow graph ((32, 3136, 64) float32 group norm forward +
    backward: 235 ms there, 35 ms copied; F.group_norm of the transposed view 23-28 ms); y
    is then the copy's layout seen through x's axes, as with F on the transposed view;
    ``group_norm``: the routine of "groups", ``native_group_norm`` or, on channels-last
    memory with few channels a group, :func:`anynorm._torch_channels_last.group_norm` (the
    same forward, a faster backward)."""

    __slots__ = ("kind", "order", "inverse", "normalized", "n", "c", "spatial", "groups",
                 "channels_last", "copy", "group_norm")

    def __init__(self, plan, src):
        ndim = len(plan.shape)
        self.channels_last = self.copy = False
        self.group_norm = torch.native_group_norm
        if plan.op in ("layer_norm", "rms_norm"):
            self.kind = "rows"
            order = [a for a in range(ndim) if a not in plan.reduce_axes] + list(plan.reduce_axes)
            moved = not _trailing(plan)
            self.order = order if moved else None
            self.inverse = sorted(range(ndim), key=order.__getitem__) if moved else None
            self.normalized = list(plan.param_shape)
            return
        self.kind = "groups"
        self.n, self.c = plan.shape[0], plan.shape[plan.channel_axis]
        self.spatial = math.prod(plan.shape) // (self.n * self.c)
        self.groups = self.c if plan.op == "instance_norm" else plan.num_groups
        self.order = _channels_first(plan)
        self.inverse = None if self.order is None else sorted(range(ndim), key=self.order.__getitem__)
        view = src if self.order is None else src.permute(self.order)
        if view.is_contiguous():
            if plan.op == "instance_norm" and plan.dtype == torch.float16:
                self.kind = "batch"  # torch's float16 group-norm kernel is 1.5x slower
        elif _channels_last_memory(view):
            self.channels_last = True
            if self.c // self.groups <= _BLOCKED_BACKWARD_CHANNELS[plan.dtype in _HALF]:
                self.group_norm = _torch_channels_last.group_norm
        else:
            self.copy = True


def _layout(plan, src):
    """The plan's :class:`_Layout` for ``src``'s memory (memoized per plan and strides)."""
    key = ("torch",) if plan.op in ("layer_norm", "rms_norm") else ("torch", src.stride())
    lay = plan.memo.get(key)
    if lay is None:
        lay = plan.memo[key] = _Layout(plan, src)
    return lay


def _run(plan, lay, t, w, b):
    """``(y, mean, rstd)`` (statistics in the public shape) of torch's kernel on ``t``
    (laid out as the plan's input); ``w``/``b`` as :func:`_float_params` gives them."""
    if lay.kind == "rows":
        if lay.order is not None:
            t = t.permute(lay.order)
        normalized = lay.normalized
        if w is not None and w.dim() != len(normalized):
            w = w.reshape(normalized)
        if b is not None and b.dim() != len(normalized):
            b = b.reshape(normalized)
        if plan.op == "rms_norm" and _tracing():
            # the aten op: torch.compile cannot trace the Python binding, and a transform
            # takes no Python autograd.Function without its rules (_torch_rms's)
            y, rstd = torch.ops.aten._fused_rms_norm(t, normalized, w, plan.eps)
            mean = None
        elif plan.op == "rms_norm":
            y, mean, rstd = _torch_rms.rms_norm(t, normalized, plan.count, w, plan.eps)
        else:
            y, mean, rstd = torch.native_layer_norm(t, normalized, w, b, plan.eps)
        if lay.inverse is not None:
            y, rstd = y.permute(lay.inverse), rstd.permute(lay.inverse)
            mean = None if mean is None else mean.permute(lay.inverse)
        return y, _stats(plan, mean), _stats(plan, rstd)
    if lay.order is not None:
        t = t.permute(lay.order)
    if lay.copy:
        t = t.contiguous()
    if lay.kind == "batch":  # instance norm as F.instance_norm runs it: batch norm of (1, N*C, HW)
        y, mean, rstd = torch.native_batch_norm(
            t.reshape(1, lay.n * lay.c, lay.spatial), None if w is None else w.repeat(lay.n),
            None if b is None else b.repeat(lay.n), None, None, True, 0.0, plan.eps)
        y = y.reshape(t.shape)
    else:
        y, mean, rstd = lay.group_norm(t, w, b, lay.n, lay.c, lay.spatial, lay.groups, plan.eps)
    if lay.inverse is not None:
        y = y.permute(lay.inverse)
    return y, _stats(plan, mean), _stats(plan, rstd)


def _conditioned(mean, rstd, limit):
    """True unless some slice's ``|mean| * rstd`` exceeds ``limit`` (NaN slices pass: their
    result is NaN on every path; the other slices are still checked).  CPU statistics of any
    shape and float dtype, each tensor one kernel gave (same dtype)."""
    far = _far_kernels().get(mean.dtype)
    if far is not None and rstd.dtype is mean.dtype and mean.is_contiguous() and rstd.is_contiguous():
        return not far(mean.data_ptr(), rstd.data_ptr(), mean.numel(), limit)
    if mean.requires_grad:  # detach() costs a microsecond where there is no graph to leave
        mean, rstd = mean.detach(), rstd.detach()
    n = mean.numel()
    if n <= _LIST_CHECK:
        # a few statistics: two tolist() calls and a Python loop, no torch or NumPy op
        return _lists_within(mean.tolist(), rstd.tolist(), limit)
    if n < _NUMPY_CHECK:
        # three torch ops and an item() (measured the cheapest between 32 and 8192 slices)
        worst = float((mean * rstd).abs_().max())
        if worst == worst:
            return not worst > limit
        # a NaN slice: NumPy's fmax below skips it and finds the worst of the others
    if mean.dtype == torch.bfloat16:  # NumPy has no bfloat16
        mean, rstd = mean.float(), rstd.float()
    # many statistics: NumPy's single-threaded loops on the tensors' memory, no OpenMP region
    # per torch op (on a busy machine each of those waits for its threads)
    ratio = np.multiply(mean.numpy(), rstd.numpy())
    worst = _FMAX(np.abs(ratio, out=ratio), axis=None)
    return not worst > limit


# statistics up to which the check runs on Python floats (measured: a loop over tolist()
# costs 1.1 us at 4 statistics, 2.6 at 16, 4.6 at 32; NumPy's or torch's three ops 3.4)
_LIST_CHECK = 24
_SHIFT_FIRST_AFTER = 2  # reruns after which a float32/float64 signature shifts first
# |mean| * rstd up to which torch's backward may take half statistics (each xhat then off by
# at most that many half-ulps of its dtype); past it the call runs on float32 parameters
_GRAD_LIMIT = 2.0
_NUMPY_CHECK = 32768  # statistics from which it runs in NumPy (torch's ops go parallel there)
_FMAX = np.fmax.reduce


_FAR = None  # {torch dtype: anynorm_far_*} once looked up ({} without the kernels)


def _far_kernels():
    """The compiled conditioning checks by statistics dtype (:func:`anynorm._native.far_kernel`:
    one ctypes call of 0.5 us, where the loop over ``tolist()`` took 1.1-1.4 us and torch's
    ops 3-4 us); empty where the CPU kernels are not built."""
    global _FAR
    if _FAR is None:
        found = {t: _numpy_dtype(t) for t in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
        found = {t: _native.far_kernel(d) for t, d in found.items() if d is not None}
        _FAR = {t: fn for t, fn in found.items() if fn is not None}
    return _FAR


def _lists_within(means, rstds, limit):
    """:func:`_conditioned` on the nested lists ``tolist()`` gives."""
    while means and type(means[0]) is list:  # one nesting level at a time, at C speed
        means, rstds = list(_chain(*means)), list(_chain(*rstds))
    for m, r in zip(means, rstds):
        if abs(m * r) > limit:
            return False
    return True


def _shifted(plan, lay, src, shift, w, b):
    """Torch's kernel on ``src - shift`` (``shift``: detached, x's dtype, statistics' view
    shape): ``(y, mean, rstd)``, the mean that of ``src - shift`` (the caller adds the shift)."""
    moved = (src.reshape(plan.view_shape) - shift).reshape(plan.shape)
    return _run(plan, lay, moved, w, b)


def _leading_index(plan):
    """The view's index of up to 8 leading elements of each normalized slice (Python sizes)."""
    view_shape, last = plan.view_shape, plan.reduce_axes[-1]
    return tuple(slice(0, min(8, view_shape[a])) if a == last else
                 slice(0, 1) if a in plan.reduce_axes else slice(None)
                 for a in range(len(view_shape)))


def _leading_mean(plan, t):
    """The mean of up to 8 leading elements of each normalized slice of ``t`` (detached), in
    the statistics' view shape: a shift within a few standard deviations of the slice's mean
    (one element may sit sqrt(n) of them away), taken without a data-dependent branch.  A
    symbolic extent (torch.compile's dynamic shapes, torch.export's ``Dim``) is indexed, not
    sliced: a slice's bounds would add a guard on it."""
    view_shape, last = plan.view_shape, plan.reduce_axes[-1]
    v = t.detach().reshape(view_shape)
    size = view_shape[last]
    if type(size) is int:
        lead = v[_leading_index(plan)]
    else:
        index = tuple(slice(0, 1) if a in plan.reduce_axes and a != last else slice(None)
                      for a in range(len(view_shape)))
        lead = v[index].index_select(last, torch.arange(8, device=t.device).clamp(max=size - 1))
    return lead.mean(plan.reduce_axes, keepdim=True)


def _traced_forward(plan, lay, src, weight, bias):
    """``(y, mean, rstd)`` under ``torch.compile`` or a torch.func transform (no
    data-dependent branch, :func:`_tracing`): torch's kernel
    on ``x - shift`` (:func:`_leading_mean`) for layer/group norm, on ``x`` for RMS norm.

    float16/bfloat16 run in float32 (``x.float()``; inductor fuses the conversion into its
    reduction): ``x - shift`` rounded to x's dtype would lose the digits of slices near zero
    (rstd off by the dtype's rounding, 4e-3 in bfloat16, gradients 3x torch's error), and
    inductor's decompositions of the mixed-dtype kernels (half x, float32 parameters) return
    the statistics in x's dtype (torch 2.13), where the contract asks for float32."""
    half = plan.dtype in _HALF
    t = src.float() if half else src
    w = weight.float() if half and weight is not None else weight
    b = bias.float() if half and bias is not None else bias
    if not plan.center:
        y, mean, rstd = _run(plan, lay, t, w, b)
    else:
        shift = _leading_mean(plan, t)
        y, mean, rstd = _shifted(plan, lay, t, shift, w, b)
        mean = mean + shift.reshape(plan.stats_shape)
    return (y.to(plan.dtype) if half else y), mean, rstd


def native_forward(plan, src, weight, bias):
    """``(y, mean, rstd)`` from torch's kernels, exact as the contract asks, or None where
    they cannot give that (the caller then takes an exact executor)."""
    if not _params_ok(plan, weight, bias) or src.numel() == 0:
        return None
    if _tracing() or _dataless(src):  # traced: a fresh plan, strides possibly symbolic
        lay = _Layout(plan, src)
        if lay.channels_last and plan.center:
            return None
        return _traced_forward(plan, lay, src, weight, bias)
    lay = _layout(plan, src)
    w, b = _float_params(plan, weight, bias, plan.param_shape)
    if not plan.center:  # RMS norm: x * rstd, no cancellation
        return _run(plan, lay, src, w, b)
    limit = _LIMITS[plan.dtype][1 if lay.channels_last else 0]
    out = _run(plan, lay, src, w, b)
    if _conditioned(out[1], out[2], limit):
        return out
    # far from zero: again on x - mean (exact there), which is centred to a few ulps
    return _shift_and_rerun(plan, lay, src, out[1], out[2], w, b, limit)


def _stats(plan, t):
    """A statistic in the public shape (torch's row kernels already give it: no reshape)."""
    if t is None or t.shape == plan.stats_shape:
        return t
    return t.reshape(plan.stats_shape)


def _channels_first(plan):
    """None when channels are on axis 1, else the permutation that puts them there."""
    c = plan.channel_axis
    if c == 1:
        return None
    return [0, c] + [a for a in range(1, len(plan.shape)) if a != c]


def _channels_last_memory(view):
    """True for an NCHW (NCDHW) view whose memory is channels-last exactly as torch lays it out
    (its strides, size-1 axes included, equal a fresh channels-last tensor's): where size-1 axes
    make the layout ambiguous, torch's kernels may take the tensor as contiguous and refuse it."""
    if view.dim() not in (4, 5):
        return False
    n, c, *spatial = view.shape
    strides = [0] * view.dim()
    step = c
    for axis in range(view.dim() - 1, 1, -1):  # W, H (, D): innermost after the channels
        strides[axis] = step
        step *= spatial[axis - 2]
    strides[1], strides[0] = 1, step
    return tuple(view.stride()) == tuple(strides)


def _numpy_plan(plan):
    """The same plan, described in NumPy's terms (made once per plan)."""
    numpy_plan = plan.memo.get("numpy")
    if numpy_plan is None:
        import array_api_compat.numpy as xp

        numpy_plan = plan.memo["numpy"] = dataclasses.replace(
            plan, xp=xp, dtype=_numpy_dtype(plan.dtype), acc_dtype=_NUMPY_DTYPES[plan.acc_dtype])
    return numpy_plan


_BF16 = []  # [ml_dtypes.bfloat16's NumPy dtype, or None without ml_dtypes], once looked up


def _numpy_dtype(dtype):
    """NumPy's dtype for a torch dtype: bfloat16 as ml_dtypes' (None where it is not
    installed), through which the executor hands bfloat16 to anynorm's CPU kernels."""
    if dtype is not torch.bfloat16:
        return _NUMPY_DTYPES.get(dtype)
    if not _BF16:
        try:
            import ml_dtypes
        except ImportError:
            _BF16.append(None)
        else:
            _BF16.append(np.dtype(ml_dtypes.bfloat16))
    return _BF16[0]


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # no subclass that overrides torch functions


def _numpy_eligible(plan, *tensors, kernels=False):
    """True when the NumPy executor may run on these tensors' memory: CPU, plain tensors (or
    a module's parameters) of a NumPy dtype (with ``kernels``, for a call
    :func:`_native_first` gave anynorm's CPU kernels, bfloat16 too), no gradient to record,
    not traced (:func:`_tracing`)."""
    dtypes = _KERNEL_DTYPES if kernels else _NUMPY_DTYPES
    if plan.dtype not in dtypes or _tracing():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or t.device.type != "cpu" or t.dtype not in dtypes:
            return False
        if grad and t.requires_grad:
            return False
    return True


def _as_numpy(t):
    if t is None:
        return None
    if t.dtype is torch.bfloat16:  # the same bits, as ml_dtypes' bfloat16 (NumPy has none)
        return t.detach().view(torch.int16).numpy().view(_numpy_dtype(torch.bfloat16))
    return t.detach().numpy()


def _as_torch(a):
    if a is None:
        return None
    if a.dtype.kind == "V":  # ml_dtypes' bfloat16: torch.from_numpy takes no such dtype
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _prefers_native(plan, x):
    """Memoized :func:`_native_first` for ``x``'s memory (C-contiguous or not)."""
    key = ("torch native first", x.is_contiguous(), torch.get_num_threads())
    first = plan.memo.get(key)
    if first is None:
        first = plan.memo[key] = _native_first(plan, key[1], key[2])
    return first


def _native_first(plan, contiguous=True, threads=1):
    """Where torch's own routine beats the NumPy executor on the CPU (measured, see
    asv_bench/README.md): bfloat16 without ml_dtypes (NumPy has no bfloat16 of its own) or
    in a layout anynorm's CPU kernels do not take (NumPy passes on ml_dtypes' are slow),
    float16 where the kernels are not built (NumPy's float16 conversions are slow); else,
    for a C-contiguous ``x`` (``contiguous``) and no residual, the kernels take outputs of
    FAULTING_BYTES and up, which the executor reuses where torch's fault in their pages
    again each call (:func:`_large_outputs_cheaper`), RMS norm rows of
    RMS_KERNEL_MIN_ELEMENTS and up (torch's CPU RMS norm is composite), layer/RMS norm rows
    of SHORT_ROW_MIN to SHORT_ROW_MAX elements where torch has at most SHORT_ROWS_THREADS
    ``threads`` or the call is the executor's to thread (the row kernel holds them in
    registers, four at a time), float16
    channels-first group norm of HALF_GROUPS_MIN_ELEMENTS and up (torch's float16 group-norm
    kernel is slow), group/instance norm with channels last on images of fewer than
    TORCH_CHANNELS_LAST_SPLIT_MIN pixels (torch's kernel reads them strided there),
    channels-first layer norm the column kernel takes (CF_KERNEL_MIN_RUN,
    CF_KERNEL_MIN_ELEMENTS); otherwise group and instance
    norm take torch's, layer/RMS norm rows up to NATIVE_MAX_ROW long (beyond that torch's row
    kernel falls to a fraction of memory bandwidth) and, where the row kernel would take
    them, longer ones under LONG_ROWS_KERNEL_MIN_BYTES (in cache torch's kernel is the
    faster) or in bfloat16, other layer/RMS axes where the contiguous run after them is short
    (ConvNeXt's late stages in channels-last memory: 14 x 14)."""
    dtype = _numpy_dtype(plan.dtype)
    if dtype is None or plan.dtype == torch.float16 and _native.rows_kernel(np.float16) is None:
        return True
    size = math.prod(plan.shape)
    nbytes = size * dtype.itemsize
    kernels = (contiguous and not plan.has_residual and _kernel_layout(plan)
               and _native.rows_kernel(dtype) is not None)
    if plan.dtype == torch.bfloat16 and not kernels:  # NumPy passes on ml_dtypes: slow
        return True
    if kernels and nbytes >= FAULTING_BYTES and _large_outputs_cheaper():
        return False
    if plan.op in ("layer_norm", "rms_norm"):
        if _trailing(plan):
            if kernels and plan.op == "rms_norm" and size >= RMS_KERNEL_MIN_ELEMENTS:
                return False
            if (kernels and _short_rows(plan) and plan.dtype != torch.float64
                    and (size >= _numpy.PARALLEL_MIN_ELEMENTS or threads <= SHORT_ROWS_THREADS)):
                return False
            if kernels and (plan.dtype == torch.bfloat16 or nbytes < LONG_ROWS_KERNEL_MIN_BYTES):
                return True
            return plan.count <= NATIVE_MAX_ROW
        run = math.prod(plan.shape[plan.reduce_axes[-1] + 1:])
        if kernels and plan.op == "layer_norm":
            return run < CF_KERNEL_MIN_RUN or size < CF_KERNEL_MIN_ELEMENTS
        return run < SHORT_RUN
    if (kernels and plan.op == "group_norm" and plan.dtype == torch.float16 and plan.channel_axis == 1
            and size >= HALF_GROUPS_MIN_ELEMENTS):
        return False
    if (kernels and plan.channel_axis == len(plan.shape) - 1 and len(plan.shape) in (4, 5)
            and math.prod(plan.shape[1:-1]) < TORCH_CHANNELS_LAST_SPLIT_MIN):
        return False  # channels last, a small image: torch reads each (sample, group) strided
    return True


def _kernel_layout(plan):
    """True for the layouts whose C-contiguous arrays the NumPy executor hands to anynorm's
    CPU kernels (with no residual, where they are built): layer/RMS norm rows, layer norm over
    adjacent axes before the last (the column kernel), group/instance norm with channels on
    axis 1 or last."""
    if plan.op in ("layer_norm", "rms_norm"):
        axes = plan.reduce_axes
        return _trailing(plan) or (plan.op == "layer_norm" and axes == tuple(range(axes[0], axes[-1] + 1)))
    return plan.channel_axis in (1, len(plan.shape) - 1)


_THP = None


def _large_outputs_cheaper():
    """True where anynorm's outputs of FAULTING_BYTES and up cost less to make than torch's:
    the executor reuses them (:mod:`anynorm._outputs`), or NumPy's get huge pages where
    torch's fault 4 KiB at a time (:func:`_torch_outputs_fault`).  Layer norm 8192x4096
    float32, ours / F with the reuse: THP ``always`` 0.62 (torch's pages huge too, yet each
    call's zeroed again), ``never`` 0.18, ``madvise`` 0.15-0.17."""
    return _outputs.ENABLED or _torch_outputs_fault()


def _torch_outputs_fault():
    """True where a large NumPy allocation gets transparent huge pages (the kernel's mode
    ``madvise`` and NumPy's madvise on) and torch's CPU allocations do not (torch advises no
    huge pages; under mode ``always`` both would get them): torch's outputs of
    FAULTING_BYTES and up, past glibc's largest mmap threshold, fault in every call a page of
    4 KiB at a time (measured: ``torch.empty_like(x).fill_(1)`` of 32 MiB 8.2 ms, of 32 MiB
    less 8 KiB 0.74; ``np.empty`` + ``fill`` 2.5 ms)."""
    global _THP
    if _THP is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
                madvise = "[madvise]" in f.read()
        except OSError:
            madvise = False
        _THP = madvise and _numpy_madvises_huge_pages()
    return _THP


def _numpy_madvises_huge_pages():
    try:
        from numpy._core.multiarray import _get_madvise_hugepage
    except ImportError:  # NumPy 1.x
        try:
            from numpy.core.multiarray import _get_madvise_hugepage
        except ImportError:
            return False
    return bool(_get_madvise_hugepage())


def _numpy_forward(plan, x, weight, bias, residual):
    """The NumPy executor on the tensors' memory, on at most ``torch.get_num_threads()``
    threads (a caller who limits torch's threads limits anynorm's), those of torch's OpenMP
    team where it is found (:mod:`anynorm._torch_openmp`)."""
    outs = _numpy.forward(_numpy_plan(plan), _as_numpy(x), _as_numpy(weight), _as_numpy(bias),
                          _as_numpy(residual), threads=torch.get_num_threads(), team=_torch_openmp.team())
    return tuple(_as_torch(a) for a in outs)


def forward(plan, x, weight=None, bias=None, residual=None):
    """Return ``(y, h, mean, rstd)`` as :func:`anynorm._reference.forward` does."""
    # not while traced: sizes may be symbolic there, and a size test would guard them
    if not _tracing():
        if not _prefers_native(plan, x):
            if _numpy_eligible(plan, x, weight, bias, residual, kernels=True):
                return _numpy_forward(plan, x, weight, bias, residual)
            if _torch_cpu_grad.takes(plan, x, weight, bias, residual):  # autograd records it
                return _torch_cpu_grad.forward(plan, x, weight, bias)
        elif _torch_cpu_grad.prefers_kernels(plan) and _torch_cpu_grad.takes(plan, x, weight, bias, residual):
            return _torch_cpu_grad.forward(plan, x, weight, bias)
    h = _reference.add_residual(plan, x, residual) if residual is not None else None
    native = native_forward(plan, h if h is not None else x, weight, bias)
    if native is not None:
        y, mean, rstd = native
        return y, h, mean, rstd
    return _exact_forward(plan, x, weight, bias, residual)


def forward_runner(plan, x, weight, bias, stats):
    """``run(x, weight, bias, residual) -> (y, h, mean, rstd)``: :func:`forward` for one call
    signature (the types, shapes, strides, dtypes and devices of ``x`` and of the parameters
    this first call passes), with what
    the signature decides worked out here once: the layout, torch's routine and its
    arguments, the conditioning limit and the form of the check.  A plain call (CPU, no
    residual, torch's kernel first) then costs the kernel, the check and one Python frame;
    the statistics are None unless ``stats`` (or autograd) asks for them, which lets
    float16/bfloat16 take their parameters as given (torch's kernels accumulate in float32
    either way: only the returned statistics would be rounded to x's dtype)."""
    def general(x, weight, bias, residual):
        return forward(plan, x, weight, bias, residual)

    # a runner is only built, and only served from the call cache, outside torch.compile's
    # tracing (the cache takes no traced call), so run() need not ask again; torch.func's
    # transforms and torch.jit.trace do reach a cached runner, which then hands the call to
    # the traced path
    if (_tracing() or x.device.type != "cpu" or _dataless(x) or plan.dtype not in _LIMITS
            or x.numel() == 0 or plan.has_residual):
        return general
    if not _prefers_native(plan, x):  # the executor's kernels: straight where a packed one takes it
        fallback = general
        if _short_rows(plan) and not _torch_cpu_grad.prefers_kernels(plan):
            # what autograd records keeps torch's graph (_torch_cpu_grad.takes): its runner
            fallback = _kernel_runner(plan, _layout(plan, x), stats, general)
        return _torch_direct.runner(plan, x, weight, bias, stats, fallback, kernels_first=True) or general
    lay = _layout(plan, x)
    if lay.kind not in ("rows", "groups"):
        return _torch_direct.runner(plan, x, weight, bias, stats, general) or general
    run = _kernel_runner(plan, lay, stats, general)
    if _torch_cpu_grad.prefers_kernels(plan):  # what autograd records runs on anynorm's kernels
        untracked = run

        def run(x, weight, bias, residual):
            if _torch_cpu_grad.takes(plan, x, weight, bias, residual):
                return _torch_cpu_grad.forward(plan, x, weight, bias)
            return untracked(x, weight, bias, residual)
    # small calls, nothing recorded: anynorm's row kernel, exact, in less time than torch's
    return _torch_direct.runner(plan, x, weight, bias, stats, run) or run


def _short_rows(plan):
    """Layer/RMS norm over trailing axes in rows of SHORT_ROW_MIN to SHORT_ROW_MAX."""
    return plan.op in ("layer_norm", "rms_norm") and _trailing(plan) and SHORT_ROW_MIN <= plan.count <= SHORT_ROW_MAX


def _kernel_runner(plan, lay, stats, general):
    """:func:`forward_runner`'s run on torch's kernel for a rows or groups layout ``lay``,
    checked after; ``general`` takes the calls it does not serve."""
    dtype = plan.dtype
    half = dtype in _HALF
    center = plan.center
    # half inputs with their statistics asked for: float32 parameters make torch's kernels
    # return float32 statistics (RMS norm's always are)
    float_params = half and stats and center
    plain = center and not stats  # y alone from a centred kernel: check, nothing to publish
    limit = _LIMITS[dtype][1 if lay.channels_last else 0]
    public = _publisher(plan, lay)
    within = _checker(plan, lay, limit)
    kernel = _kernel(plan, lay)
    f32 = torch.float32

    # Data far from zero costs a check-after call a second kernel run and a dozen small torch
    # ops (a (4, 8) call at offset 1e4: 54 us against F's 4 us).  A float32/float64 signature
    # that met such data twice shifts first from then on: torch's kernel on x minus a shift
    # per slice taken from its data (exact for a far slice, a float32 rounding of the
    # spread for a near one), checked after as ever.  Half dtypes never do: x - x0 rounded
    # to 8 or 11 bits would lose the float32 statistics' digits on slices near zero.
    reruns = [0] if center and not half and not lay.channels_last else None
    view_shape, shape, stats_shape = plan.view_shape, plan.shape, plan.stats_shape
    # the shift: the mean of up to 8 leading elements of each slice (one element would sit
    # up to sqrt(n) std from the slice's mean: over the limit for 1 group in 2 of (3, 30,
    # 7, 9) randn data, each failure a full plain call and rerun more)
    first = _leading_index(plan)
    reduce_axes = plan.reduce_axes

    def shift_first(x, weight, bias):
        """``finish``'s result from torch's kernel on ``x - shift`` (None where even that run
        shows an ill-conditioned slice: the caller then takes the plain path)."""
        v = x.reshape(view_shape)
        shift = v.detach()[first].mean(reduce_axes, keepdim=True)
        y, mean, rstd = kernel((v - shift).reshape(shape), weight, bias)
        if not within(mean, rstd):
            return None
        if not stats:
            return y, None, None, None
        return y, None, public(mean) + shift.reshape(stats_shape), public(rstd)

    def finish(x, weight, bias, w, b, y, mean, rstd, checked=False):
        """The statistics of a kernel run: published, or the shifted rerun where they show
        an ill-conditioned slice (then the exact executors where even that fails);
        ``checked``: the caller found them ill-conditioned already."""
        if not center:
            return y, None, None, (public(rstd) if stats else None)
        if not checked and within(mean, rstd):
            return (y, None, public(mean), public(rstd)) if stats else (y, None, None, None)
        if reruns is not None:
            reruns[0] += 1
        # far from zero: torch's kernel again on x - shift (the shift: this run's mean in
        # x's dtype), checked again; else the exact executors, as forward falls back
        out = _shift_and_rerun(plan, lay, x, public(mean), public(rstd), w, b, limit)
        if out is not None:
            return (out[0], None, out[1], out[2]) if stats else (out[0], None, None, None)
        return _exact_forward(plan, x, weight, bias, None)

    def converted(x, weight, bias):
        """Parameters not of x's dtype, or float32 ones wanted (half inputs)."""
        if (weight is not None and weight.dtype is not dtype
                and not (half and weight.dtype is f32)) or (
                bias is not None and bias.dtype is not dtype and not (half and bias.dtype is f32)):
            return general(x, weight, bias, None)
        w, b = weight, bias
        if half and (float_params or (w is not None and w.dtype is not dtype)
                     or (b is not None and b.dtype is not dtype)):
            w, b = _float_params(plan, w, b, plan.param_shape)
        return finish(x, weight, bias, w, b, *kernel(x, w, b))

    def run_plain(x, weight, bias, residual):
        if _diverted():
            return general(x, weight, bias, residual)
        if ((weight is not None and weight.dtype is not dtype)
                or (bias is not None and bias.dtype is not dtype)):
            return converted(x, weight, bias)
        if reruns is not None and reruns[0] >= _SHIFT_FIRST_AFTER:
            out = shift_first(x, weight, bias)
            if out is not None:
                return out
        y, mean, rstd = kernel(x, weight, bias)
        if plain:  # the common call, finish's first branch inline
            if within(mean, rstd):
                return y, None, None, None
            return finish(x, weight, bias, weight, bias, y, mean, rstd, True)
        return finish(x, weight, bias, weight, bias, y, mean, rstd)

    run = run_plain
    if half and center:
        # Parameters of x's dtype are converted on every call (``_to_float``, 1.6 us each):
        # a converted copy kept between calls would go stale where a parameter changes
        # in place without a version bump (``p.data.copy_(...)``, a NumPy view of its memory),
        # and torch's kernels take no half parameters with float32 statistics (torch 2.13:
        # both parameters float32, or the statistics come back in x's dtype).
        ones = _float_params(plan, None, None, plan.param_shape)[0]

        def run_float(x, weight, bias, residual):
            if _diverted():
                return general(x, weight, bias, residual)
            if weight is None:
                if bias is not None and bias.dtype is not dtype:
                    return converted(x, weight, bias)
                w = ones
            elif weight.dtype is dtype and (bias is None or bias.dtype is dtype):
                w = _to_float(weight)
            else:
                return converted(x, weight, bias)
            b = None if bias is None else _to_float(bias)
            return finish(x, weight, bias, w, b, *kernel(x, w, b))

        if float_params:
            run = run_float
        else:
            # A call autograd records: torch's backward centres x on the mean its forward
            # saved, in x's dtype for half parameters, off by up to half an ulp of the mean
            # (2^-8 of it in bfloat16), so every xhat is off by |mean| * rstd half-ulps (rows
            # of 16 at |mean| = 15 std: 4% of the gradient, rows of 2 at any offset 100%
            # and more).  Where the statistics show more than _GRAD_LIMIT, the call runs
            # again on float32 parameters, whose float32 statistics keep xhat exact.
            within_grad = _checker(plan, lay, min(limit, _GRAD_LIMIT))

            def run(x, weight, bias, residual, _grad=torch.is_grad_enabled):
                # unrecorded, diverted, or parameters not of x's dtype (which `converted`
                # makes float32): run_plain's own branches
                if (not (_grad() and (x.requires_grad or (weight is not None and weight.requires_grad)
                                      or (bias is not None and bias.requires_grad)))
                        or (weight is not None and weight.dtype is not dtype)
                        or (bias is not None and bias.dtype is not dtype) or _diverted()):
                    return run_plain(x, weight, bias, residual)
                y, mean, rstd = kernel(x, weight, bias)
                if within_grad(mean, rstd):
                    return y, None, None, None
                return run_float(x, weight, bias, residual)
    return run


def _checker(plan, lay, limit):
    """``within(mean, rstd) -> bool``: :func:`_conditioned` in the cheapest form for this
    signature's statistics as :func:`_kernel` gives them (decided once): the compiled check
    (:func:`_far_kernels`) where the CPU kernels are built; else, up to ``_LIST_CHECK``
    statistics, a Python loop over ``tolist()`` without flattening where the kernel's
    statistics are (rows, 1), (B, T, 1) or (N, groups)."""
    if lay.kind == "rows":
        k = len(plan.reduce_axes)
        count = math.prod(plan.shape) // plan.count
        rows_by_one = len(plan.shape) - k == 1 and k == 1
        rows_3d = len(plan.shape) == 3 and k == 1  # (B, T, D): statistics (B, T, 1)
    else:
        count = lay.n * lay.groups
        rows_by_one = rows_3d = False
    far = _far_kernels()
    if far:
        # the kernel's statistics: of one float dtype (float32 for half inputs with float32
        # parameters, else x's, which torch returns for half x too), contiguous as torch's
        # kernels return them
        def within(mean, rstd, _far=far.get, _count=count):
            check = _far(mean.dtype)
            if check is None or not (mean.is_contiguous() and rstd.is_contiguous()):
                return _conditioned(mean, rstd, limit)
            return not check(mean.data_ptr(), rstd.data_ptr(), _count, limit)
        return within
    if count > _LIST_CHECK:
        return lambda mean, rstd: _conditioned(mean, rstd, limit)
    # the common forms loop here, one Python frame per check (NaN slices pass)
    if rows_by_one:
        def within(mean, rstd):
            for (m,), (r,) in zip(mean.tolist(), rstd.tolist()):
                if abs(m * r) > limit:
                    return False
            return True
        return within
    if rows_3d:
        def within(mean, rstd):
            for ms, rs in zip(mean.tolist(), rstd.tolist()):
                for (m,), (r,) in zip(ms, rs):
                    if abs(m * r) > limit:
                        return False
            return True
        return within
    if lay.kind == "groups":  # native_group_norm's statistics: (N, groups)
        def within(mean, rstd):
            for ms, rs in zip(mean.tolist(), rstd.tolist()):
                for m, r in zip(ms, rs):
                    if abs(m * r) > limit:
                        return False
            return True
        return within
    return lambda mean, rstd: _lists_within(mean.tolist(), rstd.tolist(), limit)


def _kernel(plan, lay):
    """``kernel(t, w, b) -> (y, mean, rstd)``: torch's routine for this layout, y in x's
    layout, the statistics as the routine returns them (see :func:`_publisher`)."""
    eps = plan.eps
    if lay.kind == "rows":
        normalized = lay.normalized
        if plan.op == "rms_norm":
            count = plan.count

            def routine(t, w, b, _rms=_torch_rms.rms_norm):
                return _rms(t, normalized, count, w, eps)
        else:
            def routine(t, w, b, _ln=torch.native_layer_norm):
                return _ln(t, normalized, w, b, eps)
        if lay.order is None:
            return routine
        order, inverse = lay.order, lay.inverse

        def moved(t, w, b):
            y, mean, rstd = routine(t.permute(order), w, b)
            return y.permute(inverse), mean, rstd
        return moved
    n, c, spatial, groups, order, inverse = lay.n, lay.c, lay.spatial, lay.groups, lay.order, lay.inverse
    copy = lay.copy

    def grouped(t, w, b, _gn=lay.group_norm):
        if order is not None:
            t = t.permute(order)
        if copy:
            t = t.contiguous()
        y, mean, rstd = _gn(t, w, b, n, c, spatial, groups, eps)
        return (y if inverse is None else y.permute(inverse)), mean, rstd
    return grouped


def _publisher(plan, lay):
    """``public(stat)``: a statistic as :func:`_kernel` gives it, in the public shape."""
    if lay.kind == "rows" and lay.inverse is not None:
        inverse = lay.inverse
        return lambda t: _stats(plan, t.permute(inverse))
    return lambda t: _stats(plan, t)


def _shift_and_rerun(plan, lay, src, mean, rstd, w, b, limit):
    """``(y, mean, rstd)`` of torch's kernel on ``src - shift``, if the statistics it shows are
    well conditioned; else None.  ``mean``/``rstd``: the public-shape statistics of a first
    run; ``shift``: that mean rounded to x's dtype on the slices whose ``|mean| * rstd``
    exceeds ``limit``, zero on the others.  So ``x - shift`` is exact where it is taken (a
    slice that far from zero lies within a factor 2 of its mean, half dtypes' limits included),
    and the slices torch's kernel served well keep their data: rounding ``x - mean`` to
    float16/bfloat16 on a slice near zero would lose the float32 statistics' digits."""
    mean = mean.detach()
    far = (mean * rstd.detach()).abs_() > limit
    shift = torch.where(far, mean, 0.0).reshape(plan.stats_view_shape).to(src.dtype)
    y, centred, rstd = _shifted(plan, lay, src, shift, w, b)
    if not _conditioned(centred, rstd, limit):
        return None
    return y, centred + shift.reshape(plan.stats_shape).to(centred.dtype), rstd


def _exact_forward(plan, x, weight, bias, residual):
    """The exact executors, as :func:`forward` falls back to them."""
    # NumPy's float16 arithmetic is slow: the array-API core (torch ops) serves it
    if plan.dtype != torch.float16 and _numpy_eligible(plan, x, weight, bias, residual):
        return _numpy_forward(plan, x, weight, bias, residual)
    return _reference.forward(plan, x, weight, bias, residual)


def _backward_kernel_takes(plan, x, dy):
    """True where the NumPy executor's backward runs anynorm's backward kernels on these
    tensors (the layouts of :func:`_kernel_layout`, C-contiguous x and dy of x's dtype): then
    bfloat16 goes there too, as ml_dtypes' arrays."""
    dtype = _numpy_dtype(plan.dtype)
    return (dtype is not None and _kernel_layout(plan) and dy.dtype is x.dtype and x.is_contiguous()
            and dy.is_contiguous() and _native.rows_backward_kernel(dtype) is not None)


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """Return ``(dx, dweight, dbias)`` as :func:`anynorm._reference.backward` does."""
    if _numpy_eligible(plan, dy, x, weight, mean, rstd, kernels=_backward_kernel_takes(plan, x, dy)):
        outs = _numpy.backward(_numpy_plan(plan), _as_numpy(dy), _as_numpy(x), _as_numpy(weight),
                               _as_numpy(mean), _as_numpy(rstd), threads=torch.get_num_threads(),
                               team=_torch_openmp.team())
        return tuple(_as_torch(a) for a in outs)
    return _reference.backward(plan, dy, x, weight, mean, rstd)
