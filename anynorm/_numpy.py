"""The NumPy executor: the reference arithmetic, blocked so that memory is touched once.

A signature the packed CPU kernels take (rows, channels-first layer norm, channels-last
group/instance norm), below the threading size, runs them straight from the call cache
(:func:`forward_runner`, :mod:`anynorm._numpy_direct`: a (4, 8) call 2.5 us, 13.9 through
the executor).  Other forward calls on C-contiguous arrays go to one of two
specialised paths first:
:mod:`anynorm._numpy_rows` (statistics over trailing axes: layer/RMS norm rows; NCHW
instance/group norm in float16, or in every dtype with the CPU kernels) and
:mod:`anynorm._numpy_columns` (statistics over a middle axis: channels-first layer norm;
NHWC instance/group norm), in cache-sized blocks, with float16 converted per block by
:mod:`anynorm._numpy_half`; where anynorm's CPU kernels are built (:mod:`anynorm._native`)
both hand their rows and samples to them instead.  Backward calls go to the row and column
backward kernels likewise (:mod:`anynorm._numpy_rows_backward`,
:mod:`anynorm._numpy_columns_backward`) where they are built.  Everything else (float32
NCHW instance/group norm without the kernels, strided views, odd axes, the other
backwards) runs the general blocking below, whose float16 inputs are converted by the same
routine; arrays too small to block take a few whole-array NumPy calls.  Every path runs its
blocks with
NumPy's ufunc buffer no longer than its inner loops (:func:`anynorm._numpy_rows.bufsize`:
at the default 8192, broadcasting a per-row or per-channel operand over rows of 384-8191
elements copied every operand through the buffer, at 2x the time).

The view of ``x`` is cut into boxes that hold whole normalized slices (every reduced axis
full) and fit in a core's cache (``BLOCK_BYTES`` of accumulation-dtype elements).  Per box,
with the box read from memory once and ``y`` written once::

    shift = sum(x) / n;  d = x - shift;  c = sum(d) / n      (corrected two-pass, as the
    mean  = shift + c;   var = sum(d * d) / n - c * c         reference; sums by BLAS dot
    rstd  = 1 / sqrt(var + eps);  xc = d - c                  products where rows allow)
    y     = xc * (rstd * weight) + bias                       (in place; the last step writes y)

Backward per box, with ``xhat = (x - mean) * rstd`` and ``g = dy * weight``::

    dx = rstd * (g - xhat * mean(g * xhat) - mean(g))          (no mean(g) for RMS norm)
    dweight += sum(dy * xhat),  dbias += sum(dy)               (over the non-parameter axes)

float32 sums over more than a few thousand terms (long reduced axes, outer axes summed slice
after slice) are cut into runs (:data:`anynorm._numpy_rows.SUM_RUN` and friends) whose partial
sums are added in float64, and the centring is redone where the first mean missed by more
than a quarter of the standard deviation: errors stay at float32 rounding for any extent and
offset.  float16/bfloat16-like inputs are cast per box into a float32 temporary.  Adjacent view axes of
the same kind (reduced or kept, parameter or not) are merged first when strides allow, so
layer norm rows, NCHW and NHWC instance/group norm and channels-first layer norm all become
2- to 4-axis boxes.  Peak extra memory: the outputs plus a few box-sized temporaries.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import math
import os

import numpy as np

from . import _numpy_direct, _outputs
from ._numpy_columns import ColumnsForward, NativeColumns
from ._numpy_half import half_to_float
from ._numpy_rows import RowsForward, bufsize, col_sums, reduce_sums, row_dots, row_sums
from ._numpy_columns_backward import ColumnsBackward
from ._numpy_rows_backward import RowsBackward
from ._plan import plan_for

__all__ = ["forward", "forward_runner", "backward", "BLOCK_BYTES", "NUM_THREADS"]

BLOCK_BYTES = 2 << 20  # accumulation-dtype bytes per box (measured best: 2 threads, L2 + L3)
LARGE_BOX_BYTES = 8 << 20  # a whole sample rather than strided slivers, up to this size
# cores that work on separate boxes of one call (NumPy and BLAS release the GIL)
NUM_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                  else os.cpu_count() or 1)
PARALLEL_MIN_ELEMENTS = 1 << 20  # below this, handing boxes to threads costs more than it saves
# below this (one thread), a signature a packed kernel takes runs it straight (_numpy_direct)
DIRECT_MAX_ELEMENTS = PARALLEL_MIN_ELEMENTS
# below this, the blocking's bookkeeping costs more than the array-API core's extra passes
SMALL_ELEMENTS = 4096
# below this, a backward the kernels do not take costs more in the blocking's bookkeeping than
# in whole-array NumPy passes (:func:`_small_backward`)
SMALL_BACKWARD_ELEMENTS = 1 << 16
SHORT_TAIL = 1024  # elements after the reduced run below which boxes take several samples
# largest |first-pass mean| * rstd of a box at which the correction pass is skipped
SKIP_CORRECTION = 0.25


class _Layout:
    """The view of ``x`` with merged axes, and how to cut it into boxes (made once per plan
    and memory layout of the arrays: :func:`_layout`).

    ``shape``: merged view shape; ``reduce``: merged axes the statistics run over;
    ``param``: merged axes weight/bias vary along; ``boxes()`` yields index tuples (slices,
    every axis kept) whose boxes hold whole normalized slices; ``views(arrays)`` the arrays
    with their axes merged so.
    """

    def __init__(self, plan, arrays):
        view = self.view_shape = plan.view_shape
        reduce_set, param_set = set(plan.reduce_axes), set(plan.param_axes)
        views = [a.reshape(view) for a in arrays]
        groups = [[0]]
        for a in range(1, len(view)):
            last = groups[-1][-1]
            same_kind = ((a in reduce_set) == (last in reduce_set)
                         and (a in param_set) == (last in param_set))
            if same_kind and all(_extends(v, groups[-1], a) for v in views):
                groups[-1].append(a)
            else:
                groups.append([a])
        self.shape = tuple(math.prod(view[a] for a in g) for g in groups)
        self.reduce = tuple(i for i, g in enumerate(groups) if g[0] in reduce_set)
        self.param = tuple(i for i, g in enumerate(groups) if g[0] in param_set)
        self.kept = tuple(i for i in range(len(groups)) if i not in self.reduce)
        self.nonparam = tuple(i for i in range(len(groups)) if i not in self.param)
        self.groups = groups
        self.stats_shape = tuple(1 if i in self.reduce else s for i, s in enumerate(self.shape))
        self.param_shape = tuple(s if i in self.param else 1 for i, s in enumerate(self.shape))

    def views(self, arrays):
        """``arrays`` (those the layout was made for, or laid out as they were) with the
        merged axes."""
        return [_merge(a.reshape(self.view_shape), self.groups) for a in arrays]

    def _unit(self, j):
        """Elements in a box that takes one index of kept axis ``j``."""
        before = math.prod(self.shape[a] for a in self.reduce if a < j)
        return before * math.prod(self.shape[j + 1:])

    def boxes(self, budget, large):
        """Index tuples of boxes: kept axes before ``j`` one index, ``j`` chunked, rest full.

        ``j`` is the outermost kept axis whose one-index box fits ``budget`` elements (else
        the innermost kept axis, or an outer one up to ``large`` elements).  Returns ``(list of index tuples, largest box size)``.
        """
        if not self.kept:
            return [tuple(slice(None) for _ in self.shape)], math.prod(self.shape)
        j = next((k for k in self.kept if self._unit(k) <= budget), self.kept[-1])
        chunk = max(1, min(self.shape[j], budget // self._unit(j)))
        # with a reduced axis before j, a box is strided runs of chunk * (axes after j); when
        # those runs are short, a whole index of an outer kept axis (in L3) is faster
        leading = [k for k in self.kept if k < self.reduce[0]]
        if (self.reduce[0] < j and chunk * math.prod(self.shape[j + 1:]) < 1024 and leading
                and self._unit(leading[-1]) <= large):
            j = leading[-1]
            chunk = max(1, min(self.shape[j], budget // self._unit(j)))
        # kept axes after the reduced ones (channels-last, channels-first): one sample per box
        # keeps it a (rows, columns) matrix for BLAS column sums, unless a single reduced
        # run is followed by a short tail (ConvNeXt's late stages, NHWC instance norm): then
        # several samples per box and NumPy's own reductions cost fewer calls (2-3x faster)
        short_tail = len(self.reduce) == 1 and math.prod(self.shape[self.reduce[0] + 1:]) < SHORT_TAIL
        if j < self.reduce[0] and self.kept[-1] > self.reduce[0] and not short_tail:
            chunk = 1
        unit = self._unit(j)
        outer = [range(self.shape[a]) for a in self.kept if a < j]
        boxes = []
        for prefix in itertools.product(*outer):
            lead = iter(prefix)
            head = tuple(slice(None) if a in self.reduce else slice(i := next(lead), i + 1)
                         for a in range(j))
            tail = tuple(slice(None) for _ in self.shape[j + 1:])
            for start in range(0, self.shape[j], chunk):
                boxes.append(head + (slice(start, start + chunk),) + tail)
        return boxes, unit * chunk

    def small(self, full, index):
        """Slice of a statistics/parameter array (size 1 where it broadcasts) for a box."""
        return tuple(slice(None) if full[a] == 1 else s for a, s in enumerate(index))


def _layout(plan, arrays):
    """The plan's :class:`_Layout` for arrays of these strides (memoized: the merging
    depends on shapes and strides alone)."""
    key = ("numpy layout",) + tuple((a.strides, a.itemsize) for a in arrays)
    layout = plan.memo.get(key)
    if layout is None:
        layout = plan.memo[key] = _Layout(plan, arrays)
    return layout


def _extends(arr, group, a):
    """True when axis ``a`` continues the merged axes ``group`` of ``arr`` as one strided axis."""
    inner = [g for g in group if arr.shape[g] != 1]
    if arr.shape[a] == 1 or not inner:
        return True
    return arr.strides[inner[-1]] == arr.strides[a] * arr.shape[a]


def _merge(arr, groups):
    """``arr`` viewed with each group of adjacent axes as one axis (no copy)."""
    shape, strides = [], []
    for g in groups:
        shape.append(math.prod(arr.shape[a] for a in g))
        # a size-1 axis may carry any stride; the group's step is its last non-trivial axis
        steps = [arr.strides[a] for a in g if arr.shape[a] != 1]
        strides.append(steps[-1] if steps else arr.itemsize)
    return np.lib.stride_tricks.as_strided(arr, shape, strides, writeable=arr.flags.writeable)


def _param_view(plan, layout, arr):
    if arr is None:
        return None
    return np.asarray(arr, dtype=plan.acc_dtype).reshape(layout.param_shape)


class _Scratch:
    """Box-sized temporaries in the accumulation dtype, made on first use, reused per box."""

    def __init__(self, dtype, size):
        self.dtype, self.size, self.buffers = dtype, size, {}

    def get(self, slot, shape):
        buffer = self.buffers.get(slot)
        if buffer is None:
            buffer = self.buffers[slot] = np.empty(self.size, self.dtype)
        return buffer[:math.prod(shape)].reshape(shape)


def _merged(arr, axes):
    """``(extent, stride)`` of ``arr``'s adjacent ``axes`` as one axis, or None if impossible."""
    extent, stride, expected = 1, arr.itemsize, None
    for a in reversed(axes):
        if arr.shape[a] == 1:
            continue
        if expected is None:
            stride = arr.strides[a]
        elif arr.strides[a] != expected:
            return None
        extent *= arr.shape[a]
        expected = arr.strides[a] * arr.shape[a]
    return extent, stride


def _as_2d(arr, s):
    """``arr`` as a (prod(shape[:s]), prod(shape[s:])) view with unit inner stride, or None."""
    rows, cols = _merged(arr, range(s)), _merged(arr, range(s, arr.ndim))
    if rows is None or cols is None or (cols[0] > 1 and cols[1] != arr.itemsize):
        return None
    return np.lib.stride_tricks.as_strided(arr, (rows[0], cols[0]), (rows[1], arr.itemsize),
                                           writeable=arr.flags.writeable)


def _column_sums(arr, s, reduce, out):
    """``out[...] = sum of arr over the axes reduce`` (keepdims) where those are the axes
    before ``s`` and possibly some after it: column sums ``ones @ arr`` (BLAS) of ``arr`` as
    a ``(rows, columns)`` matrix, then NumPy's sums over the rest.  False (nothing written)
    where ``arr`` is no such matrix."""
    a2 = _as_2d(arr, s)
    if a2 is None:
        return False
    col = col_sums(a2, np.empty(a2.shape[1], arr.dtype)).reshape(arr.shape[s:])
    inner = tuple(a - s for a in reduce if a >= s)
    if inner:
        col = reduce_sums(col, inner, np.empty(
            tuple(1 if a in inner else e for a, e in enumerate(col.shape)), col.dtype))
    np.copyto(out, col.reshape(out.shape))
    return True


class _Kernel:
    """Sums over the reduced axes and broadcast arithmetic for one box layout.

    ``"rows"``: reduced axes trailing and contiguous: each slice is a row, summed by BLAS
    (``vecdot``).  ``"columns"``: the box is ``(P, Q)`` with reduced axes in front of axis
    ``s`` (channels-last, channels-first): column sums are ``ones @ box`` (BLAS); per-column
    operands are tiled so NumPy's inner loops stay long.  ``"batched"``: leading kept axes
    (several samples per box) in front of a ``"columns"`` box, summed per leading index.
    ``"generic"``: ``add.reduce``.
    """

    def __init__(self, layout, box_shape, arrays):
        self.layout = layout
        d = len(box_shape)
        k = d - len(layout.reduce)
        self.mode, self.split = "generic", None
        if layout.reduce == tuple(range(k, d)) and all(a.flags.c_contiguous for a in arrays):
            self.mode, self.split = "rows", k
            return
        s = next((a for a in range(d) if a not in layout.reduce and box_shape[a] > 1), None)
        if s is not None and math.prod(box_shape[:s]) > 1:
            self.mode, self.split = "columns", s
            return
        # kept axes in front of the reduced ones (several samples per box, channels-last):
        # each leading index is a "columns" box of its own
        r0 = layout.reduce[0]
        s = next((a for a in range(r0, d) if a not in layout.reduce and box_shape[a] > 1), None)
        if r0 > 0 and s is not None and math.prod(box_shape[r0:s]) > 1:
            self.mode, self.split, self.lead = "batched", s, r0

    def sums(self, arr, out):
        """``out[...] = add.reduce(arr, reduced axes, keepdims)`` by the fastest route."""
        layout, s = self.layout, self.split
        if self.mode == "rows":
            n = math.prod(arr.shape[s:])
            a2 = arr.reshape(-1, n)
            np.copyto(out, row_sums(a2, np.empty(a2.shape[0], arr.dtype)).reshape(out.shape))
            return
        if self.mode == "columns" and _column_sums(arr, s, layout.reduce, out):
            return
        if self.mode == "batched":
            lead = self.lead
            reduce = tuple(a - lead for a in layout.reduce)
            if all(_column_sums(arr[i], s - lead, reduce, out[i]) for i in np.ndindex(arr.shape[:lead])):
                return
        reduce_sums(arr, layout.reduce, out)

    def sum_squares(self, arr, out, scratch):
        """``out[...] = sum(arr * arr)`` over the reduced axes (keepdims)."""
        if self.mode == "rows":
            n = math.prod(arr.shape[self.split:])
            a2 = arr.reshape(-1, n)
            np.copyto(out, row_dots(a2, np.empty(a2.shape[0], arr.dtype)).reshape(out.shape))
            return
        squares = scratch.get("squares", arr.shape)
        np.multiply(arr, arr, out=squares)
        self.sums(squares, out)

    def apply(self, ufunc, a, operand, out):
        """``ufunc(a, operand, out=out)``; returns ``out``.

        In ``"columns"`` mode an operand that varies along the box's contiguous tail only
        (per channel, per group) is first spread over the whole tail, so that NumPy's inner
        loop runs over the tail rather than over a few channels of one group.
        """
        s = self.split
        if (self.mode == "columns" and operand.shape[:s] == (1,) * s
                and operand.shape[s:] != a.shape[s:] and operand.size > 1):
            operand = np.broadcast_to(operand, operand.shape[:s] + a.shape[s:]).copy()
        ufunc(a, operand, out=out)
        return out


def _rstd_from_var(plan, var):
    """``var`` becomes ``1 / sqrt(var + eps)`` in place."""
    np.add(var, plan.eps, out=var)
    np.sqrt(var, out=var)
    np.divide(1.0, var, out=var)


def _statistics(plan, kernel, xa, xc, mean_out, rstd_out, scratch):
    """Corrected two-pass statistics of the box ``xa`` into ``mean_out``/``rstd_out`` (keepdims).

    ``shift = sum(x) / n``, ``d = x - shift`` (exact near the shift), ``c = sum(d) / n``::

        mean = shift + c,   var = sum(d * d) / n - c * c,   xc = d - c

    as in the reference.  ``c`` is the summation error of the first pass; ``d - c`` costs a
    full pass, so it is taken only where ``|c| * rstd`` exceeds the accumulation dtype's
    epsilon (rows far from zero), i.e. where skipping it would show in ``y``.
    Returns ``xc`` (written into ``xc``; ``xa`` itself for RMS norm).
    """
    n = plan.count
    if not plan.center:
        kernel.sum_squares(xa, rstd_out, scratch)
        np.divide(rstd_out, n, out=rstd_out)
        _rstd_from_var(plan, rstd_out)
        return xa
    kernel.sums(xa, mean_out)
    np.divide(mean_out, n, out=mean_out)
    kernel.apply(np.subtract, xa, mean_out, xc)
    kernel.sum_squares(xc, rstd_out, scratch)
    np.divide(rstd_out, n, out=rstd_out)
    # c is the first sum's rounding, |c| <~ k * eps * |shift| (BLAS sums: k small): where
    # |shift| * rstd <= SKIP_CORRECTION it moves y by a fraction of an ulp, and its pass
    # (a third of the statistics' work) is skipped
    ratio = np.sqrt(rstd_out + plan.eps)
    np.divide(np.abs(mean_out), ratio, out=ratio)
    if not np.max(ratio) > SKIP_CORRECTION:
        _rstd_from_var(plan, rstd_out)
        return xc
    correction = np.empty_like(mean_out)
    kernel.sums(xc, correction)
    np.divide(correction, n, out=correction)
    if _far_off(correction, rstd_out, plan.eps):
        # the first mean missed by more than std / 4 (long float32 sums of data far from
        # zero): sum(d*d) / n - c*c would cancel, so centre again and redo both sums
        kernel.apply(np.subtract, xc, correction, xc)
        np.add(mean_out, correction, out=mean_out)
        kernel.sum_squares(xc, rstd_out, scratch)
        np.divide(rstd_out, n, out=rstd_out)
        kernel.sums(xc, correction)
        np.divide(correction, n, out=correction)
    np.subtract(rstd_out, correction * correction, out=rstd_out)
    np.maximum(rstd_out, 0, out=rstd_out)
    _rstd_from_var(plan, rstd_out)
    if np.max(np.abs(correction) * rstd_out) > np.finfo(correction.dtype).eps:
        kernel.apply(np.subtract, xc, correction, xc)
    np.add(mean_out, correction, out=mean_out)
    return xc


def _far_off(c, q, eps):
    """True where some slice's correction ``c`` (mean of ``d = x - first mean``) exceeds a
    quarter of its standard deviation, ``q = mean(d*d)`` being ``var + c*c``."""
    c2 = c * c
    return bool(np.any(np.greater(c2, SKIP_CORRECTION ** 2 * (q - c2 + eps))))


def _as_acc(plan, src, scratch, slot="cast"):
    """``src`` in the accumulation dtype: itself, or a cast copy in scratch."""
    if src.dtype == plan.acc_dtype:
        return src
    out = scratch.get(slot, src.shape)
    if src.dtype == np.float16:
        half_to_float(src, out)
    else:
        np.copyto(out, src, casting="unsafe")
    return out


def _box_shape(index, shape):
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape))


class _ForwardCall:
    """One forward call: outputs, parameters and the per-box arithmetic."""

    def __init__(self, plan, layout, views, weight, bias, residual):
        self.plan = plan
        self.acc = np.dtype(plan.acc_dtype)
        self.layout, self.views = layout, views
        self.y = _outputs.empty(plan.view_shape, plan.dtype)
        self.h = None if residual is None else _outputs.empty(plan.shape, plan.dtype)
        self.mean = np.empty(layout.stats_shape, self.acc) if plan.center else None
        self.rstd = np.empty(layout.stats_shape, self.acc)
        self.ym = self.y.reshape(layout.shape)
        self.hm = None if self.h is None else self.h.reshape(layout.shape)
        self.w = _param_view(plan, layout, weight)
        self.b = _param_view(plan, layout, bias)
        self.direct = np.dtype(plan.dtype) == self.acc  # y's own block can hold x - mean
        budget = BLOCK_BYTES // self.acc.itemsize
        self.boxes, self.box_size = layout.boxes(budget, LARGE_BOX_BYTES // self.acc.itemsize)
        largest = _box_shape(self.boxes[0], layout.shape)
        self.kernel = _Kernel(layout, largest, views)
        # a bias that varies only along the reduced axes is the same in every box: tile it
        # once, so adding it is a same-shape sum rather than a (slow) broadcast
        self.b_tile = None
        if self.b is not None and all(a in layout.reduce for a in layout.param):
            self.b_tile = np.empty(largest, self.acc)
            self.b_tile[...] = self.b[layout.small(layout.param_shape, self.boxes[0])]

    def run(self, boxes, scratch):
        plan, layout = self.plan, self.layout
        no_mean = None if plan.center else np.empty(layout.stats_shape, self.acc)
        for index in boxes:
            yb = self.ym[index]
            if self.hm is None:
                src = self.views[0][index]
            else:
                src = self.hm[index]
                np.add(self.views[0][index], self.views[1][index], out=src)
            xa = _as_acc(plan, src, scratch)
            work = yb if self.direct else scratch.get("work", yb.shape)
            stats_index = layout.small(layout.stats_shape, index)
            rb = self.rstd[stats_index]
            mb = self.mean[stats_index] if plan.center else no_mean[stats_index]
            xc = _statistics(plan, self.kernel, xa, work, mb, rb, scratch)
            self._scale(index, xc, rb, work, yb, scratch)

    def _scale(self, index, xc, rb, work, yb, scratch):
        """``yb = xc * (rstd * weight) + bias``: one product, one sum, the last one into y."""
        layout, kernel = self.layout, self.kernel
        param_index = layout.small(layout.param_shape, index)
        factor = rb
        if self.w is not None:
            wb = self.w[param_index]
            shape = np.broadcast_shapes(rb.shape, wb.shape)
            if math.prod(shape) == yb.size:  # weight along the slice: a box-sized outer product
                factor = scratch.get("factor", shape)
                np.multiply(rb, wb, out=factor)
            else:
                factor = rb * wb
        if self.b is None:
            kernel.apply(np.multiply, xc, factor, yb)
            return
        kernel.apply(np.multiply, xc, factor, work)
        if self.b_tile is not None:
            np.add(work, self.b_tile[tuple(slice(0, e) for e in yb.shape)], out=yb)
        else:
            kernel.apply(np.add, work, self.b[param_index], yb)


def _run(boxes, work, scratch_for, parallel, inner=None, team=None):
    """Run ``work(boxes_part, scratch)`` over the boxes, split across up to ``parallel``
    threads (:func:`_parallel`) where there are enough of them: ``team``'s
    (:class:`anynorm._torch_openmp.Team`) where given, else anynorm's pool.

    NumPy, BLAS and the kernels release the GIL inside their loops, so boxes on separate cores
    overlap.  ``inner``: the length of the inner loops the work runs
    (:func:`anynorm._numpy_rows.bufsize`).  Returns the list of ``work``'s results.
    """
    size = bufsize(inner)
    if size is not None:
        work = _with_bufsize(work, size)
    threads = min(parallel, len(boxes) // 4)
    if threads <= 1:
        return [work(boxes, scratch_for())]
    step = -(-len(boxes) // threads)
    parts = [boxes[i:i + step] for i in range(0, len(boxes), step)]
    if team is not None:
        return team.run([functools.partial(work, part, scratch_for()) for part in parts])
    futures = [_pool().submit(work, part, scratch_for()) for part in parts[1:]]
    results = [work(parts[0], scratch_for())]
    return results + [f.result() for f in futures]


def _with_bufsize(work, size):
    """``work`` run with NumPy's ufunc buffer at ``size`` elements (in the calling thread's
    context: every pool thread sets its own), restored afterwards."""
    def run(*args):
        with np.errstate():
            np.setbufsize(size)
            return work(*args)
    return run


_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max(1, NUM_THREADS - 1),
                                                      thread_name_prefix="anynorm")
    return _POOL


def _parallel(x, threads=None):
    """Threads a call on ``x`` may take: NUM_THREADS (at most ``threads`` where given) from
    PARALLEL_MIN_ELEMENTS elements, else 1."""
    if x.size < PARALLEL_MIN_ELEMENTS:
        return 1
    return NUM_THREADS if threads is None else max(1, min(NUM_THREADS, threads))


def _first_index(plan):
    """Index of each normalized slice's first element (keepdims), memoized per plan."""
    index = plan.memo.get("numpy first")
    if index is None:
        index = plan.memo["numpy first"] = tuple(
            slice(0, 1) if a in plan.reduce_axes else slice(None) for a in range(len(plan.view_shape)))
    return index


def _small_statistics(plan, xv):
    """``(d, mean, rstd)`` of a small view ``xv`` (accumulation dtype) in plain NumPy calls:
    ``d`` x centred (a new array; x itself for RMS norm), mean (None for RMS norm) and rstd
    with keepdims.  Corrected two-pass, as the reference: shift by ``x0 + mean(x - x0)``
    (``x0`` each slice's first element)."""
    axes, inv_n = plan.reduce_axes, 1.0 / plan.count
    if plan.center:
        first = xv[_first_index(plan)]
        d = np.subtract(xv, first)
        shift = np.add.reduce(d, axis=axes, keepdims=True)
        shift *= inv_n
        shift += first
        d = np.subtract(xv, shift, out=d)
        mean = np.add.reduce(d, axis=axes, keepdims=True)
        mean *= inv_n
        d -= mean
        mean += shift
        sq = np.multiply(d, d)
    else:
        d, mean = xv, None
        sq = np.multiply(xv, xv)
    rstd = np.add.reduce(sq, axis=axes, keepdims=True)
    rstd *= inv_n
    _rstd_from_var(plan, rstd)
    return d, mean, rstd


def _small_forward(plan, x, weight, bias, residual):
    """The reference's arithmetic in plain NumPy calls, for arrays too small to block: on
    a few dozen elements the cost is per call, and ``add.reduce`` on NumPy arrays costs a
    fraction of the array-API wrappers' ``mean``."""
    acc = plan.acc_dtype
    h = None if residual is None else np.add(x, residual)
    xv = (x if h is None else h).reshape(plan.view_shape)
    if xv.dtype != acc:
        xv = xv.astype(acc)
    d, mean, rstd = _small_statistics(plan, xv)
    y = np.multiply(d, rstd)
    if weight is not None:
        y *= np.asarray(weight, dtype=acc).reshape(plan.param_view_shape)
    if bias is not None:
        y += np.asarray(bias, dtype=acc).reshape(plan.param_view_shape)
    y = y.astype(plan.dtype, copy=False).reshape(plan.shape)
    if mean is not None:
        mean = mean.reshape(plan.stats_shape)
    return y, h, mean, rstd.reshape(plan.stats_shape)


def _small_backward(plan, dy, x, weight, mean, rstd):
    """:func:`anynorm._reference.backward` in plain NumPy calls, for arrays too small to
    block (a (4, 8) layer norm: 23-35 us a call, the array-API wrappers' arithmetic alone 38;
    (7, 130, 33) over axes (0, 2): 226-259 us, 425 through the general blocking)."""
    acc = plan.acc_dtype
    xv, dyv = x.reshape(plan.view_shape), dy.reshape(plan.view_shape)
    if xv.dtype != acc:
        xv = xv.astype(acc)
    if dyv.dtype != acc:
        dyv = dyv.astype(acc)
    if rstd is None:
        xhat, _, r = _small_statistics(plan, xv)
        if not plan.center:
            xhat = np.multiply(xv, r)
        else:
            xhat *= r
    else:
        r = np.asarray(rstd, dtype=acc).reshape(plan.stats_view_shape)
        if plan.center:  # about the given (rounded) mean, then what its rounding left out
            xhat = np.subtract(xv, np.asarray(mean, dtype=acc).reshape(plan.stats_view_shape))
            xhat -= np.add.reduce(xhat, axis=plan.reduce_axes, keepdims=True) * (1.0 / plan.count)
        else:
            xhat = np.array(xv)
        xhat *= r
    g = dyv if weight is None else np.multiply(dyv, np.asarray(weight, dtype=acc).reshape(plan.param_view_shape))
    axes, inv_n = plan.reduce_axes, 1.0 / plan.count
    proj = np.add.reduce(g * xhat, axis=axes, keepdims=True)
    proj *= inv_n
    dx = np.multiply(xhat, proj)
    np.subtract(g, dx, out=dx)
    if plan.center:
        centre = np.add.reduce(g, axis=axes, keepdims=True)
        centre *= inv_n
        dx -= centre
    dx *= r
    dx = dx.astype(plan.dtype, copy=False).reshape(plan.shape)
    if weight is None:
        return dx, None, None
    others = plan.nonparam_axes

    def param_sum(arr):
        summed = np.add.reduce(arr, axis=others) if others else arr
        return summed.astype(weight.dtype, copy=False).reshape(plan.param_shape)

    return dx, param_sum(dyv * xhat), param_sum(dyv)


def _memory_order(plan, x, *others):
    """The axis order in which ``x`` (and each of ``others`` not None) is C-contiguous with
    the normalized axes last: a Fortran-ordered or transposed array (``df.to_numpy()``,
    ``a.T``) normalized along its memory's rows, which the row path then serves; None when
    ``x`` is C-contiguous already or no such order exists.  (Memory columns stay on the
    general path: as the columns path they measured slower, 4096 x 1024 float32 F-order
    over axis -1 33 ms against 24.)"""
    if x.flags.c_contiguous or x.ndim < 2:
        return None
    order = sorted(range(x.ndim), key=lambda a: -x.strides[a])
    k = len(plan.reduce_axes)
    if sorted(order[-k:]) != list(plan.reduce_axes):
        return None
    if not all(a is None or a.transpose(order).flags.c_contiguous for a in (x,) + others):
        return None
    return tuple(order)


def _in_memory_order(plan, order):
    """``(plan_t, weight_axes, inverse, weight_inverse)``: the layer/RMS norm plan of
    ``x.transpose(order)``, the permutation that takes weight/bias into its axis order and
    the inverses of both (made once per plan and order)."""
    key = ("memory order", order)
    found = plan.memo.get(key)
    if found is None:
        positions = [order.index(a) for a in plan.reduce_axes]
        weight_axes = tuple(sorted(range(len(positions)), key=positions.__getitem__))
        shape = tuple(plan.shape[a] for a in order)
        param = tuple(plan.param_shape[k] for k in weight_axes)
        found = plan.memo[key] = (plan_for(
            plan.op, plan.xp, shape, plan.dtype, tuple(sorted(positions)), 1, None, plan.eps,
            param if plan.has_weight else None, param if plan.has_bias else None,
            plan.has_residual), weight_axes, tuple(np.argsort(order)),
            tuple(np.argsort(weight_axes)))
    return found


def _transposed(arr, axes):
    return None if arr is None else arr.transpose(axes)


def _forward_in_memory_order(plan, order, x, weight, bias, residual, threads, team):
    """Layer/RMS norm of an array C-contiguous in ``order``: the same call on that view (the
    executor's blocks then follow memory), the results seen back through x's axes (y in
    x's memory layout, as NumPy's ufuncs give)."""
    plan_t, weight_axes, inverse, _ = _in_memory_order(plan, order)
    outs = forward(plan_t, x.transpose(order), _transposed(weight, weight_axes),
                   _transposed(bias, weight_axes), _transposed(residual, order), threads=threads, team=team)
    return tuple(_transposed(a, inverse) for a in outs)


def forward_runner(plan, x, weight, bias, stats):
    """``run(x, weight, bias, residual) -> (y, h, mean, rstd)`` for one call signature (kept by
    ``anynorm._calls``): a packed kernel straight (:mod:`anynorm._numpy_direct`) where one
    takes the signature and the call runs on one thread, else :func:`forward`."""
    direct = _numpy_direct.runner(plan, x, weight, bias, stats, DIRECT_MAX_ELEMENTS)
    if direct is not None:
        return direct

    def run(x, weight, bias, residual):
        return forward(plan, x, weight, bias, residual)
    return run


def forward(plan, x, weight=None, bias=None, residual=None, *, threads=None, team=None):
    """Return ``(y, h, mean, rstd)`` as :func:`anynorm._reference.forward` does; ``threads``:
    at most this many threads (the torch executor passes ``torch.get_num_threads()``), those of
    ``team`` where given (:class:`anynorm._torch_openmp.Team`), else anynorm's pool."""
    if x.size < SMALL_ELEMENTS:
        return _small_forward(plan, x, weight, bias, residual)
    if plan.op in ("layer_norm", "rms_norm"):
        order = _memory_order(plan, x, residual)
        if order is not None:
            return _forward_in_memory_order(plan, order, x, weight, bias, residual, threads, team)
    arrays = [x] if residual is None else [x, residual]
    layout = _layout(plan, arrays)
    for path in (RowsForward, NativeColumns, ColumnsForward):
        call = path.make(plan, layout, x, weight, bias, residual)
        if call is not None:
            _run(call.blocks(), call.run, call.buffers, _parallel(x, threads), call.inner, team=team)
            return call.results()
    call = _ForwardCall(plan, layout, layout.views(arrays), weight, bias, residual)
    scratch_for = lambda: _Scratch(call.acc, call.box_size)  # noqa: E731
    _run(call.boxes, call.run, scratch_for, _parallel(x, threads),
         _box_shape(call.boxes[0], layout.shape)[-1], team=team)
    mean = call.mean.reshape(plan.stats_shape) if plan.center else None
    return call.y.reshape(plan.shape), call.h, mean, call.rstd.reshape(plan.stats_shape)


class _BackwardCall:
    """One backward call: statistics, parameter-gradient sums and the per-box arithmetic."""

    def __init__(self, plan, dy, x, weight, mean, rstd):
        self.plan = plan
        self.acc = acc = np.dtype(plan.acc_dtype)
        self.layout = layout = _layout(plan, [x, dy])
        self.views = layout.views([x, dy])
        self.dx = _outputs.empty(plan.view_shape, plan.dtype)
        self.dxm = self.dx.reshape(layout.shape)
        self.given = rstd is not None
        if self.given:
            self.rstd = np.asarray(rstd, dtype=acc).reshape(layout.stats_shape)
            self.mean = np.asarray(mean, dtype=acc).reshape(layout.stats_shape) if plan.center else None
        else:
            self.rstd = np.empty(layout.stats_shape, acc)
            self.mean = np.empty(layout.stats_shape, acc)
        self.w = _param_view(plan, layout, weight)
        budget = BLOCK_BYTES // acc.itemsize
        self.boxes, self.box_size = layout.boxes(budget, LARGE_BOX_BYTES // acc.itemsize)
        self.kernel = _Kernel(layout, _box_shape(self.boxes[0], layout.shape), self.views)

    def run(self, boxes, scratch):
        """Write dx for ``boxes``; return this part's ``(dweight, dbias)`` sums (or Nones)."""
        plan, layout, kernel = self.plan, self.layout, self.kernel
        n, sums = plan.count, layout.nonparam
        xm, dym = self.views
        w = self.w
        dw = np.zeros(layout.param_shape, self.acc) if w is not None else None
        db = np.zeros(layout.param_shape, self.acc) if w is not None else None
        for index in boxes:
            xa = _as_acc(plan, xm[index], scratch)
            dya = _as_acc(plan, dym[index], scratch, "dy")
            shape = xa.shape
            stats_index = layout.small(layout.stats_shape, index)
            rb = self.rstd[stats_index]
            xhat = scratch.get("xhat", shape)
            if self.given:
                if plan.center:
                    # about the given mean, then its slice's mean: the given one is rounded to
                    # the statistics' dtype, which would put |mean| * rstd ulps into every xhat
                    kernel.apply(np.subtract, xa, self.mean[stats_index], xhat)
                    lo = np.empty(rb.shape, self.acc)
                    kernel.sums(xhat, lo)
                    lo /= n
                    kernel.apply(np.subtract, xhat, lo, xhat)
                    kernel.apply(np.multiply, xhat, rb, xhat)
                else:
                    kernel.apply(np.multiply, xa, rb, xhat)
            else:
                xc = _statistics(plan, kernel, xa, xhat, self.mean[stats_index], rb, scratch)
                kernel.apply(np.multiply, xc, rb, xhat)
            prod = scratch.get("prod", shape)
            np.multiply(dya, xhat, out=prod)  # dy * xhat
            if w is not None:
                param_index = layout.small(layout.param_shape, index)
                wb = w[param_index]
                dw[param_index] += np.add.reduce(prod, axis=sums, keepdims=True) if sums else prod
                db[param_index] += np.add.reduce(dya, axis=sums, keepdims=True) if sums else dya
                kernel.apply(np.multiply, prod, wb, prod)  # g * xhat
                g = kernel.apply(np.multiply, dya, wb, scratch.get("g", shape))
            else:
                g = dya
            small = np.empty(rb.shape, self.acc)
            kernel.sums(prod, small)
            small /= n  # mean(g * xhat)
            kernel.apply(np.multiply, xhat, small, xhat)
            np.subtract(g, xhat, out=xhat)
            if plan.center:
                kernel.sums(g, small)
                small /= n  # mean(g)
                kernel.apply(np.subtract, xhat, small, xhat)
            kernel.apply(np.multiply, xhat, rb, self.dxm[index])
        return dw, db


def backward(plan, dy, x, weight=None, mean=None, rstd=None, *, threads=None, team=None):
    """Return ``(dx, dweight, dbias)``; stats in public shape, recomputed when None;
    ``threads``, ``team``: as :func:`forward`'s."""
    if x.size and x.size < DIRECT_MAX_ELEMENTS:  # rows the backward kernel takes, straight
        direct = _numpy_direct.backward(plan, dy, x, weight, mean, rstd, DIRECT_MAX_ELEMENTS)
        if direct is not None:
            return direct
    if x.size < SMALL_ELEMENTS:
        return _small_backward(plan, dy, x, weight, mean, rstd)
    if plan.op in ("layer_norm", "rms_norm"):
        order = _memory_order(plan, x, dy)
        if order is not None:
            plan_t, weight_axes, inverse, back = _in_memory_order(plan, order)
            dx, dw, db = backward(plan_t, dy.transpose(order), x.transpose(order),
                                  _transposed(weight, weight_axes), _transposed(mean, order),
                                  _transposed(rstd, order), threads=threads, team=team)
            return dx.transpose(inverse), _transposed(dw, back), _transposed(db, back)
    layout = _layout(plan, [x, dy])
    for path in (RowsBackward, ColumnsBackward):
        call = path.make(plan, layout, dy, x, weight, mean, rstd)
        if call is not None:
            return call.results(_run(call.blocks(), call.run, lambda: None, _parallel(x, threads),
                                            team=team))
    if x.size < SMALL_BACKWARD_ELEMENTS:
        return _small_backward(plan, dy, x, weight, mean, rstd)
    call = _BackwardCall(plan, dy, x, weight, mean, rstd)
    scratch_for = lambda: _Scratch(call.acc, call.box_size)  # noqa: E731
    parts = _run(call.boxes, call.run, scratch_for, _parallel(x, threads),
                 _box_shape(call.boxes[0], call.layout.shape)[-1], team=team)
    dx = call.dx.reshape(plan.shape)
    if weight is None:
        return dx, None, None
    dw = sum(p[0] for p in parts)
    db = sum(p[1] for p in parts)
    return (dx, dw.reshape(plan.param_shape).astype(weight.dtype, copy=False),
            db.reshape(plan.param_shape).astype(weight.dtype, copy=False))
