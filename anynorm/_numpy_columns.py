"""NumPy forward for statistics over a middle axis: channels-first layer norm, NHWC instance
and group norm.

A C-contiguous ``x`` is viewed as ``(B, P, Q)`` with the statistics over ``P`` (column sums
``1 @ x[b]`` by BLAS):

``"cf"`` (layer norm over the channels of NCHW: ``P`` = C, ``Q`` = H*W, one slice per column,
weight along ``P``), in whole samples up to ``CF_BLOCK_BYTES`` (else column blocks
``x[b, :, q0:q1]``)::

    m = (1 @ x) / P;  d = x - m;  v = sum_p(d*d) / P;  [correction as in _numpy_rows]
    d *= r;  y = d * w + b                                 (d in y's block for whole samples)

``"cl"`` (NHWC instance/group norm: ``P`` = H*W, ``Q`` = C = G * Cg, one slice per group of
``Cg`` columns, weight along ``Q``), several samples at a time (``SAMPLE_ELEMENTS``), in
sweeps over chunks of rows (column sums added in float64)::

    m = (1 @ x) / n  summed per group                              (sweep 1)
    d = x - m;  q = sum_p(d*d) / n  per group                      (sweep 2, d in the output)
    [c = (1 @ d) / n, only where |m| > std / 4;  sweep 2 again on d - c where |c| > std / 4]
    y = d * a + s,  a = r * w,  s = b - c * a                      (sweep 3, in place)

Per-column operands are tiled ``k`` times and ``x[b]`` viewed as ``(P / k, k * Q)``, so NumPy's
inner loops run over ``k * Q`` elements rather than ``Q`` (64 channels: 3-8x slower loops),
and the column sums of that view (``P / k`` terms) are folded back to ``Q`` in float64.
"""

from __future__ import annotations

import math

import numpy as np

from . import _native, _numpy_rows, _outputs
from ._numpy_half import float_to_half, half_to_float

__all__ = ["ColumnsForward", "NativeColumns"]

# float32/float64 NHWC take "cl" too (IN/GN 32x56x56x64: 10.3/10.8 ms in the general
# blocking, 6.1-6.8 here, at 4 samples per block)
CL_FLOAT = True
# "cl": several samples per block below this size (1 sample of 64 x 56 x 56: 7.3 ms, 4: 6.1,
# 8: 7.4; the per-block Python costs ~0.1 ms)
SAMPLE_ELEMENTS = 1 << 20
# float16 blocks are converted into float32 buffers (block, chunk, uint32 chunk per thread):
# fewer samples per block keep them at a fraction of the output
SAMPLE_ELEMENTS_HALF = 1 << 18
# "cl": bytes of a chunk of rows per sweep (whole blocks measured fastest: fewer, longer
# NumPy calls; the samples stay in L3 between sweeps)
CL_CHUNK_BYTES = 4 << 20
LOOP_ELEMENTS = 4096  # target inner-loop length for per-column operands
SHORT_ROW = 256  # without parameters, "cl" (whole samples) below this many columns
# "cf": accumulation-dtype bytes of x per block: x's block, the centred temporary and y's
# block in a core's L2
CF_BLOCK_BYTES = 2 << 20
# "cf" rows shorter than this go through the folded "cl" sweeps instead (32x384x14x14:
# inner loops of 196 elements ran each pass at 2x the time per element)
CF_FOLD_BELOW = 384
CF_IN_Y = True  # "cf" blocks of whole samples centre x into y's block (no temporary)
# NativeColumns: a strip of a sample's columns (all P rows) stays in L2 for its y pass (256 KiB:
# NHWC 32x56x56x64 float32 in strips of 16 of its 64 channels, 5.5x a copy; 1 MiB: whole, 2.9x)
NATIVE_STRIP_BYTES = 1 << 20
# Channels-first layer norm, whose y pass prefetches the next strip: strips of 256 KiB, a
# whole sample up to 320 KiB.  A strip in its y pass and the next one both in a 1 MiB L2 (the
# kernel alone, float32, / a copy: 32x96x56x56 3.35 in 1 MiB strips, 2.82 in 256 KiB;
# 32x192x28x28 3.57 whole, 3.08 in 256 KiB; 32x384x14x14, 294 KiB a sample, 3.36 whole and
# 3.86 in 256 KiB)
NATIVE_CF_STRIP_BYTES = 256 << 10
NATIVE_CF_WHOLE_BYTES = 320 << 10


def _pattern(layout):
    """``(kind, lead)`` for a merged layout this path takes, else None; ``lead``: 1 when axis 0
    is a batch axis (kept, no parameters) in front of the pattern."""
    shape, reduce, param = layout.shape, set(layout.reduce), set(layout.param)
    lead = 1 if len(shape) > 1 and 0 not in reduce and 0 not in param else 0
    rest = tuple(range(lead, len(shape)))
    if len(rest) == 2 and reduce == {rest[0]}:
        if param and param <= {rest[0]} or not param and shape[rest[1]] >= SHORT_ROW:
            return "cf", lead
        if param <= {rest[1]}:
            return "cl", lead
    if len(rest) == 3 and reduce == {rest[0], rest[2]} and param <= {rest[1], rest[2]}:
        return "cl", lead
    return None


def _fold(p, q, limit=LOOP_ELEMENTS):
    """Largest ``k`` dividing ``p`` with ``k * q <= limit`` (at least 1)."""
    best = 1
    for k in range(1, max(1, limit // q) + 1):
        if p % k == 0:
            best = k
    return best


class ColumnsForward:
    """One forward call of the ``"cf"`` or ``"cl"`` kind; ``make`` returns None elsewhere."""

    @classmethod
    def make(cls, plan, layout, x, weight, bias, residual):
        if residual is not None or not plan.center or not x.flags.c_contiguous:
            return None
        half = np.dtype(plan.dtype) != np.dtype(plan.acc_dtype)
        if half and np.dtype(plan.dtype) != np.float16:
            return None
        found = _pattern(layout)
        if found is None or found[0] == "cl" and not (half or CL_FLOAT):
            return None
        return cls(plan, layout, found, x, weight, bias, half)

    def __init__(self, plan, layout, found, x, weight, bias, half):
        self.plan, self.half, (self.kind, lead) = plan, half, found
        self.acc = acc = np.dtype(plan.acc_dtype)
        shape = layout.shape
        # channels-first layer norm over short rows (ConvNeXt's late stages, 14 x 14): the
        # folded "cl" sweeps, one group per column, weight and bias as (P, Q) tiles
        self.row_params = self.kind == "cf" and math.prod(shape[lead + 1:]) < CF_FOLD_BELOW
        if self.row_params:
            self.kind = "cl"
        self.B = shape[0] if lead else 1
        self.P = shape[lead]
        self.Q = math.prod(shape[lead + 1:])
        self.groups = shape[lead + 1] if len(shape) - lead == 3 else self.Q
        self.x3 = x.reshape(self.B, self.P, self.Q)
        self.y = _outputs.empty(plan.shape, plan.dtype)
        self.y3 = self.y.reshape(self.B, self.P, self.Q)
        stats = (self.B, self.Q) if self.kind == "cf" else (self.B, self.groups)
        self.mean = np.empty(stats, acc)
        self.rstd = np.empty(stats, acc)
        self.ones = _numpy_rows._ones(self.P, acc)
        self.w = self._params(layout, lead, weight)
        self.b = self._params(layout, lead, bias)
        if self.kind == "cf":
            budget = CF_BLOCK_BYTES // (self.P * acc.itemsize)
            parts = -(-self.Q // max(1, budget))
            self.chunk = self.inner = -(-self.Q // parts)
        else:
            limit = SAMPLE_ELEMENTS_HALF if half else SAMPLE_ELEMENTS
            self.per_block = max(1, min(self.B, limit // (self.P * self.Q)))
            self.k = _fold(self.P, self.Q)
            self.inner = self.k * self.Q

    def _params(self, layout, lead, arr):
        """weight/bias as ``(P, 1)`` ("cf": one per row), ``(Q,)`` ("cl": one per column) or
        a ``(P / k, k * Q)`` tile (``row_params``: the folded view of a sample)."""
        if arr is None:
            return None
        p = np.asarray(arr, dtype=self.acc).reshape(layout.param_shape[lead:])
        if self.row_params:
            k = _fold(self.P, self.Q)
            tile = np.broadcast_to(p.reshape(self.P, 1), (self.P, self.Q))
            return np.ascontiguousarray(tile).reshape(self.P // k, k * self.Q)
        if self.kind == "cf":
            return np.ascontiguousarray(np.broadcast_to(p.reshape(p.shape[0], -1), (self.P, 1)))
        return np.ascontiguousarray(np.broadcast_to(p, (1,) + layout.shape[lead + 1:])).reshape(self.Q)

    def blocks(self):
        if self.kind == "cf":
            return [(b, q, min(q + self.chunk, self.Q)) for b in range(self.B)
                    for q in range(0, self.Q, self.chunk)]
        return [(b, min(b + self.per_block, self.B)) for b in range(0, self.B, self.per_block)]

    def buffers(self):
        """Per-thread scratch: a chunk-sized temporary (and, for float16, the block converted
        to float32 and a uint32 chunk)."""
        if self.kind == "cf":
            size = block = self.P * self.chunk
        else:
            block = self.per_block * self.P * self.Q
            p0, p1 = self._chunks(self.per_block)[0]  # the largest chunk of rows
            size = self.per_block * (p1 - p0) * self.Q
            if not self.half:
                return {}
        bufs = {"t": np.empty(size, self.acc)}
        if self.half:
            bufs["x"] = np.empty(block, self.acc)
            bufs["u"] = np.empty(size, np.uint32)
        return bufs

    def run(self, blocks, bufs):
        step = self._cf_block if self.kind == "cf" else self._cl_block
        for block in blocks:
            step(block, bufs)

    def _source(self, xb, bufs):
        """The block in the accumulation dtype and where y's arithmetic runs."""
        if not self.half:
            return xb, None
        xa = bufs["x"][:xb.size].reshape(xb.shape)
        half_to_float(xb, xa)
        return xa, xa

    def _finish(self, work, yb, bufs):
        if self.half:
            n = work.size
            float_to_half(work, yb, bufs["t"][:n].view(np.uint32).reshape(work.shape),
                          bufs["u"][:n].reshape(work.shape))

    def _cf_block(self, block, bufs):
        """Columns ``q0:q1`` of sample ``b``: ``d = x - m`` (in y's block for whole samples,
        else in a contiguous temporary), ``sum(d*d)`` over the rows, then ``d *= r`` in place
        and ``* w``, ``+ b`` (per-row operands), the last pass into y."""
        b, q0, q1 = block
        xa, work = self._source(self.x3[b, :, q0:q1], bufs)
        yb = self.y3[b, :, q0:q1]
        if work is not None:
            d = work
        elif CF_IN_Y and q1 - q0 == self.Q:
            d = yb  # whole samples: y's block is contiguous, the arithmetic runs in it
        else:
            d = bufs["t"][:xa.size].reshape(xa.shape)
        m, v = self.mean[b, q0:q1], self.rstd[b, q0:q1]
        inv = 1.0 / self.P
        _numpy_rows.col_sums(xa, m)
        m *= inv
        np.subtract(xa, m, out=d)
        if self.P <= _numpy_rows.REDUCE_RUN:
            np.einsum("pq,pq->q", d, d, out=v)  # one pass (rows added one after another)
        else:  # BLAS column sums of the squares (in float64 over runs past COL_RUN rows)
            sq = yb if d is not yb and work is None else bufs["t"][:xa.size].reshape(xa.shape)
            np.multiply(d, d, out=sq)
            _numpy_rows.col_sums(sq, v)
        v *= inv
        _correct_columns(d, m, v, self.plan.eps)
        _rstd(v, self.plan.eps)
        last = d if work is not None or d is yb else yb
        if self.w is None and self.b is None:
            np.multiply(d, v, out=last)
        else:
            np.multiply(d, v, out=d)
            if self.w is not None:
                np.multiply(d, self.w, out=last)
            if self.b is not None:
                np.add(last if self.w is not None else d, self.b, out=last)
        self._finish(work, yb, bufs)

    def _cl_block(self, block, bufs):
        """Samples ``b0:b1`` in sweeps of chunks of rows, each sample viewed as
        ``(P / k, k * Q)`` with per-column operands tiled ``k`` times: column sums of x; then
        ``d = x - m`` into the output with the column sums of ``d*d`` (and of ``d``, where the
        mean may have missed: ``|m| > std / 4``); then ``y = d * a + c`` in place, with
        ``a = r * w`` and ``c = b - mean(d) * a`` (the two-pass correction folded in).
        Column sums run over at most ``REDUCE_RUN`` folded rows per call, the partial sums
        (and the ``k`` folds) added in float64."""
        b0, b1 = block
        xa, work = self._source(self.x3[b0:b1], bufs)
        yb = self.y3[b0:b1]
        out = yb if work is None else work
        nb = b1 - b0
        m, v = self.mean[b0:b1], self.rstd[b0:b1]
        n = self.P * (self.Q // self.groups)
        per_col, k = self.Q // self.groups, self.k
        chunks = self._chunks(nb)
        s1 = np.zeros((nb, self.Q), np.float64)
        for p0, p1 in chunks:
            s1 += self._add_folds(np.matmul(self.ones[:(p1 - p0) // k], self._view(xa, p0, p1)))
        self._group_sums(s1, m)
        m *= 1.0 / n
        q = self._centre(xa, out, m, chunks)
        c = np.zeros_like(q)
        if np.greater(m * m, _numpy_rows.SKIP_CORRECTION ** 2 * (q + self.plan.eps)).any():
            c = self._mean_of(out, chunks)
            if _numpy_rows.far_off(c, q, self.plan.eps):
                # the first mean missed by more than std / 4: centre on m + c and sum again
                m += c
                q = self._centre(out, out, c, chunks)
                c = self._mean_of(out, chunks)
        np.subtract(q, c * c, out=v)
        np.maximum(v, 0, out=v)
        m += c
        _rstd(v, self.plan.eps)
        scale = np.repeat(v, per_col, axis=1)  # (nb, Q)
        if self.w is not None and not self.row_params:
            scale *= self.w
        shift = np.repeat(c, per_col, axis=1) * scale
        shift = -shift if self.b is None or self.row_params else np.subtract(self.b, shift, out=shift)
        scale = np.tile(scale, k)[:, None, :]
        shift = np.tile(shift, k)[:, None, :]
        for p0, p1 in chunks:
            oc = self._view(out, p0, p1)
            np.multiply(oc, scale, out=oc)
            np.add(oc, shift, out=oc)
            if self.row_params:  # y = ((x - mean) * r) * w + b, w and b along P
                rows = slice(p0 // k, p1 // k)
                if self.w is not None:
                    np.multiply(oc, self.w[rows], out=oc)
                if self.b is not None:
                    np.add(oc, self.b[rows], out=oc)
            if self.half:
                size = nb * (p1 - p0) * self.Q
                shape = out[:, p0:p1].shape
                float_to_half(out[:, p0:p1], yb[:, p0:p1], bufs["t"][:size].view(np.uint32).reshape(shape),
                              bufs["u"][:size].reshape(shape))

    def _view(self, arr, p0, p1):
        """Rows ``p0:p1`` (a multiple of ``k``) of the samples ``arr`` as ``(nb, rows / k, k * Q)``."""
        return arr[:, p0:p1].reshape(arr.shape[0], (p1 - p0) // self.k, self.k * self.Q)

    def _add_folds(self, sums):
        """``(nb, k * Q)`` column sums of a folded view as ``(nb, Q)``, added in float64."""
        return np.add.reduce(sums.reshape(sums.shape[0], self.k, self.Q), axis=1, dtype=np.float64)

    def _centre(self, xa, d, m, chunks):
        """``d = x - m`` (per group) chunk by chunk; returns ``mean(d*d)`` per group (nb, G),
        from column sums added in float64."""
        nb, k = xa.shape[0], self.k
        n = self.P * (self.Q // self.groups)
        mt = np.tile(np.repeat(m, self.Q // self.groups, axis=1), k)[:, None, :]
        sq = np.zeros((nb, self.Q), np.float64)
        for p0, p1 in chunks:
            dc = self._view(d, p0, p1)
            np.subtract(self._view(xa, p0, p1), mt, out=dc)
            sq += self._add_folds(np.einsum("bpq,bpq->bq", dc, dc))  # one pass, rows one by one
        q = np.empty(m.shape, self.acc)
        self._group_sums(sq, q)
        q *= 1.0 / n
        return q

    def _mean_of(self, d, chunks):
        """``mean(d)`` per group (nb, G) by column sums (the two-pass correction)."""
        sd = np.zeros((d.shape[0], self.Q), np.float64)
        for p0, p1 in chunks:
            sd += self._add_folds(np.matmul(self.ones[:(p1 - p0) // self.k], self._view(d, p0, p1)))
        c = np.empty((d.shape[0], self.groups), self.acc)
        self._group_sums(sd, c)
        c *= 1.0 / (self.P * (self.Q // self.groups))
        return c

    def _chunks(self, nb):
        """Row ranges of up to ``CL_CHUNK_BYTES`` over ``nb`` samples and ``REDUCE_RUN``
        folded rows, multiples of ``k`` rows."""
        k = self.k
        rows = CL_CHUNK_BYTES // (nb * self.Q * self.acc.itemsize)
        rows = max(k, min(rows, _numpy_rows.REDUCE_RUN * k) // k * k)
        return [(p, min(p + rows, self.P)) for p in range(0, self.P, rows)]

    def _group_sums(self, cols, out):
        """``out[b, g]``: the sum of column sums ``cols[b, q]`` over group g's columns."""
        if self.groups == self.Q:
            np.copyto(out, cols)
        else:
            np.add.reduce(cols.reshape(out.shape[0], self.groups, -1), axis=2, out=out)

    def results(self):
        plan = self.plan
        mean = self.mean.reshape(plan.stats_shape) if plan.center else None
        return self.y, None, mean, self.rstd.reshape(plan.stats_shape)


def native_params(arr, layout, lead, P, Q, param_rows, acc):
    """weight/bias (or None) as the column kernels read it: one value a row (P, ``param_rows``:
    channels first) or a column (Q)."""
    if arr is None:
        return None
    p = np.asarray(arr, dtype=acc)
    if p.size == (P if param_rows else Q):  # one value a row or column
        return np.ascontiguousarray(p).reshape(-1)
    p = p.reshape(layout.param_shape[lead:])
    if param_rows:
        return np.ascontiguousarray(p.reshape(P))
    return np.ascontiguousarray(np.broadcast_to(p, (1,) + layout.shape[lead + 1:])).reshape(Q)


def native_geometry(layout, found):
    """``(samples, P, Q, group, param_rows)`` of the column kernel for a layout of the
    ``found = (kind, lead)`` :func:`_pattern` gives: samples of (P, Q), a statistic per
    ``group`` adjacent columns, parameters by row (channels first) or by column."""
    kind, lead = found
    shape = layout.shape
    P, Q = shape[lead], math.prod(shape[lead + 1:])
    groups = shape[lead + 1] if len(shape) - lead == 3 else Q
    return (shape[0] if lead else 1), P, Q, (1 if kind == "cf" else Q // groups), kind == "cf"


def native_strip(P, Q, group, size, param_rows, arrays=1):
    """Columns a strip of a (P, Q) sample of ``size``-byte elements, for the column kernels:
    ``arrays`` (x; x and dy for the backward) of P x strip within the L2 budget, or a whole
    channels-first sample of up to NATIVE_CF_WHOLE_BYTES; multiples of the group (and of 8
    columns where that fits)."""
    whole, budget = (NATIVE_CF_WHOLE_BYTES, NATIVE_CF_STRIP_BYTES) if param_rows \
        else (NATIVE_STRIP_BYTES // arrays, NATIVE_STRIP_BYTES)
    budget //= arrays
    unit = math.lcm(group, 8) if P * math.lcm(group, 8) * size <= budget else group
    fit = budget // (P * size) // unit * unit
    return Q if P * Q * size <= whole else min(Q, max(unit, fit))


class NativeColumns:
    """A ``"cf"``/``"cl"`` call through ``kernels/cpu.cpp``'s column kernel (:mod:`anynorm._native`):
    each strip of a sample's columns read from memory once, its statistics from chunks of
    rows summed in L1 and merged in float64, y written in one more pass from L2.
    ``make`` returns None where the kernel is not built or the layout is not one of these."""

    @classmethod
    def make(cls, plan, layout, x, weight, bias, residual):
        if residual is not None or not plan.center or not x.flags.c_contiguous:
            return None
        found = _pattern(layout)
        kernel = None if found is None else _native.cols_kernel(plan.dtype)
        return None if kernel is None else cls(plan, layout, found, x, weight, bias, kernel)

    def __init__(self, plan, layout, found, x, weight, bias, kernel):
        self.plan, self.kernel, lead = plan, kernel, found[1]
        self.acc = acc = np.dtype(plan.acc_dtype)
        self.B, self.P, self.Q, self.group, self.param_rows = native_geometry(layout, found)
        self.x3 = x.reshape(self.B, self.P, self.Q)
        self.y = _outputs.empty(plan.shape, plan.dtype)
        stats = self.B * (self.Q // self.group)
        self.mean, self.rstd = np.empty(stats, acc), np.empty(stats, acc)
        self.w, self.b = (native_params(p, layout, lead, self.P, self.Q, self.param_rows, acc)
                          for p in (weight, bias))
        self.strip = native_strip(self.P, self.Q, self.group, np.dtype(plan.dtype).itemsize, self.param_rows)

    inner = None  # no NumPy loops: the ufunc buffer stays as it is

    def blocks(self):
        return [(b, b + 1) for b in range(self.B)]

    def buffers(self):
        return {}

    def run(self, blocks, bufs):
        b0, b1 = blocks[0][0], blocks[-1][1]  # a thread's samples are consecutive
        sample, acc = self.P * self.Q * self.x3.itemsize, self.acc.itemsize
        stats = self.Q // self.group
        at = _native.address
        err = self.kernel(at(self.x3) + b0 * sample, at(self.y) + b0 * sample,
                          0 if self.w is None else at(self.w), 0 if self.b is None else at(self.b),
                          at(self.mean) + b0 * stats * acc, at(self.rstd) + b0 * stats * acc,
                          b1 - b0, self.P, self.Q, self.group, self.strip, int(self.param_rows), self.plan.eps)
        if err:
            raise RuntimeError(f"anynorm's CPU kernel refused columns ({self.P}, {self.Q}, group {self.group})")

    def results(self):
        plan = self.plan
        return self.y, None, self.mean.reshape(plan.stats_shape), self.rstd.reshape(plan.stats_shape)


def _correct_columns(d, m, v, eps):
    """The two-pass correction ``c = mean(d)``: ``v -= c*c``, ``d -= c``, ``m += c`` for the
    columns of ``d`` (P, chunk) with ``|m| > SKIP_CORRECTION * std``, where ``c`` (the first
    sum's rounding, ~eps * |m|) could show in y; gathered when they are few."""
    far = np.flatnonzero(np.greater(m * m, _numpy_rows.SKIP_CORRECTION ** 2 * (v + eps)))
    if far.size == 0:
        return
    few = far.size * 4 < m.size
    part = d[:, far] if few else d
    inv = 1.0 / d.shape[0]
    c = _numpy_rows.col_sums(part, np.empty(part.shape[1], d.dtype)) * inv
    np.subtract(part, c, out=part)
    vp = v[far] if few else v
    if _numpy_rows.far_off(c, vp, eps):
        # the first mean missed by more than std / 4 (long float32 sums far from zero):
        # vp - c*c would cancel; part is centred again now, so redo both sums
        vp = _numpy_rows.col_sums(part * part, np.empty_like(c)) * inv
        c2 = _numpy_rows.col_sums(part, np.empty_like(c)) * inv
        np.subtract(part, c2, out=part)
        vp = vp - c2 * c2
        c = c + c2
    else:
        vp = vp - c * c
    if few:
        d[:, far] = part
        v[far] = np.maximum(vp, 0)
        m[far] += c
    else:
        np.maximum(vp, 0, out=v)
        m += c


def _rstd(v, eps):
    """``v`` becomes ``1 / sqrt(v + eps)`` in place."""
    np.add(v, eps, out=v)
    np.sqrt(v, out=v)
    np.divide(1.0, v, out=v)
