"""NumPy forward for statistics over x's trailing axes, in L2-sized blocks of whole rows.

Layer/RMS norm over the last axes, NCHW instance norm and NCHW group norm view a C-contiguous
``x`` as ``(rows, n)``: one normalized slice per row.  Blocks of ``rb`` rows
(``ROW_BLOCK_BYTES`` of float32/float64, so that x's block, y's block and one temporary stay
in a core's L2) are read from memory once; per block::

    m = (x @ 1) / n;  d = x - m;  v = (d . d) / n            (BLAS sums; shifted two-pass)
    [c = (d @ 1) / n;  v -= c * c;  d -= c;  m += c]         (only where |m| * rstd > 1/4)
    r = 1 / sqrt(v + eps)
    y = d * r;  y *= w;  y += b      "outer": weight along the row (layer/RMS norm)
    y = d * (r * w_k) + b_k          "run": weight constant on runs of S elements (the
                                     spatial run of a channel: float16 instance/group norm)

(no one-pass ``E[x^2] - E[x]^2`` anywhere; sums over more than ``SUM_RUN`` terms are added
in float64 over runs, and the centring is redone where the first mean missed by > std/4).

Where the host could build anynorm's CPU kernels (:mod:`anynorm._native`, ``kernels/cpu.cpp``:
the same corrected two-pass statistics from short float32 sums added in float64, each row
read from memory once and its three passes run from L1), a thread's rows go to the row
kernel in one call instead of the passes above (float16, float32 and float64; NCHW
instance/group norm too, runs of >= ``MIN_RUN_NATIVE``).

Broadcast passes (a column ``r``, a row ``w``) run as fast as same-shape ones once NumPy's
ufunc buffer is no longer than the rows (:func:`bufsize`, set by the executor around the
blocked loops; at NumPy's default 8192 they were 2x slower).  float16 blocks are converted
by :mod:`anynorm._numpy_half`, the arithmetic runs in float32 in place in the converted block.
"""

from __future__ import annotations

import math

import numpy as np

from . import _native, _outputs
from ._numpy_half import float_to_half, half_to_float

__all__ = ["COL_RUN", "REDUCE_RUN", "ROW_BLOCK_BYTES", "SUM_RUN", "RowsForward", "bufsize", "col_sums", "far_off",
           "param_vector", "reduce_sums", "row_dots", "row_sums"]

ROW_BLOCK_BYTES = 512 << 10  # accumulation-dtype bytes of x per block (256K: 1.1x the time)
MIN_RUN = 64  # shortest run of constant parameters for the "per run" affine step
MIN_RUN_NATIVE = 8  # the same for the compiled kernel (a run's loop: one vector or more)
SKIP_CORRECTION = 0.25  # largest |mean| * rstd of a block at which the correction is skipped


# longest runs of float32 terms that one BLAS/NumPy reduction call sums per output: longer
# sums are cut into runs whose float32 partial sums are added in float64.  A float32 sum
# of L terms added one after another errs by up to ~L * eps relative (262144 rows: 2.3e-4
# at offset 1e4).  Row sums and dot products (BLAS: 32 accumulators) stay within a few eps
# up to 4096 terms, sgemv's column sums (row after row) up to 1024, NumPy's add.reduce
# along an outer axis (slice after slice) up to 256 (measured on sums of squares)
SUM_RUN = 4096
COL_RUN = 1024
REDUCE_RUN = 256

_ONES = {}
# NumPy >= 2.0 keeps the ufunc buffer size in the errstate context (per thread), so a call
# can set it and restore it; before 2.0 it is process-wide and left alone
_CONTEXT_BUFSIZE = int(np.__version__.split(".")[0]) >= 2
_DEFAULT_BUFSIZE = 8192
MIN_BUFSIZE_INNER = 384  # measured per element, subtract a column: 384 0.18 vs 0.21 ns, 256 equal


def bufsize(inner):
    """NumPy ufunc buffer size (elements) for loops whose inner axis has ``inner`` elements,
    or None to leave it (8192).

    A broadcast operand that cannot be merged into one strided axis with the others (a
    per-row mean subtracted from a block of rows, a per-channel weight) makes NumPy 2.x's
    buffered iterator copy the operands through its buffer whenever the inner axis is
    shorter than the buffer: (16, 4096) - (16, 1) measured 0.20 ns per element against
    0.10 with the buffer at 4096 (and 0.08 for a scalar).  A buffer no longer than the inner
    axis lets the loop run row by row straight from memory.  Below ``MIN_BUFSIZE_INNER``
    elements the per-row loop overhead outweighs the copies (inner 64: 0.62 against 0.24 ns).
    """
    if not _CONTEXT_BUFSIZE or inner is None or not MIN_BUFSIZE_INNER <= inner < _DEFAULT_BUFSIZE:
        return None
    return max(16, inner // 16 * 16)


def _ones(n, dtype):
    """A read-only vector of n ones: ``x @ ones``, ``ones @ a`` and ``vecdot(a, ones)`` are
    BLAS sums (cached up to 4M elements)."""
    key = (n, np.dtype(dtype))
    ones = _ONES.get(key)
    if ones is None:
        ones = np.ones(n, dtype)
        ones.flags.writeable = False
        if n <= 1 << 22:
            _ONES[key] = ones
    return ones


def _in_runs(a, axis, run, fn):
    """``fn`` of ``a`` cut along ``axis`` (0 or 1 of a 2-d ``a``) into runs of ``run``: one
    call on the whole runs stacked along a new axis, one on the remainder; the float32
    partial results added in float64 and returned."""
    n = a.shape[axis]
    k = n // run
    if axis == 0:
        whole, rest = a[:k * run].reshape(k, run, a.shape[1]), a[k * run:]
    else:
        whole, rest = a[:, :k * run].reshape(a.shape[0], k, run), a[:, k * run:]
    acc = np.add.reduce(fn(whole), axis=0 if axis == 0 else 1, dtype=np.float64)
    if rest.shape[axis]:
        acc += fn(rest)
    return acc


def row_sums(a, out):
    """``out[i] = sum(a[i, :])`` for a 2-d ``a`` (rows of unit stride) by BLAS, in float64 over
    runs of ``SUM_RUN`` where the rows are longer and ``a`` is float32."""
    n = a.shape[1]
    if n <= SUM_RUN or a.dtype != np.float32:
        return np.matmul(a, _ones(n, a.dtype), out=out)
    acc = _in_runs(a, 1, SUM_RUN, lambda p: np.matmul(p, _ones(p.shape[-1], a.dtype)))
    np.copyto(out, acc, casting="same_kind")
    return out


def _matmul_vecdot(a, b, out=None):
    """``np.vecdot`` (over the last axis) where NumPy (< 2.0) has none: a stack of
    (1, n) @ (n, 1) matmuls, BLAS each (1.2x vecdot's time, 0.4x einsum's)."""
    dots = np.matmul(a[..., None, :], b[..., :, None])[..., 0, 0]
    if out is None:
        return dots
    np.copyto(out, dots)
    return out


_vecdot = getattr(np, "vecdot", None) or _matmul_vecdot


def row_dots(a, out):
    """``out[i] = a[i, :] . a[i, :]`` (BLAS dot products), float64 over runs as :func:`row_sums`."""
    n = a.shape[1]
    if n <= SUM_RUN or a.dtype != np.float32:
        return _vecdot(a, a, out=out)
    acc = _in_runs(a, 1, SUM_RUN, lambda p: _vecdot(p, p))
    np.copyto(out, acc, casting="same_kind")
    return out


def col_sums(a, out):
    """``out[j] = sum(a[:, j])`` (``ones @ a``, BLAS) for a 2-d ``a``, float64 over runs of
    ``COL_RUN`` rows where ``a`` is longer and float32 (sgemv adds row after row)."""
    n = a.shape[0]
    if n <= COL_RUN or a.dtype != np.float32:
        return np.matmul(_ones(n, a.dtype), a, out=out)
    acc = _in_runs(a, 0, COL_RUN, lambda p: np.matmul(_ones(p.shape[-2], a.dtype), p))
    np.copyto(out, acc, casting="same_kind")
    return out


def reduce_sums(a, axes, out):
    """``np.add.reduce(a, axes, keepdims=True, out=out)``; for float32 with more than
    ``REDUCE_RUN`` terms per output, the outermost reduced axis of length > 1 is cut so that
    each call sums at most ``REDUCE_RUN`` terms (NumPy adds along non-inner axes one slice
    after another), the partial sums added in float64."""
    count = math.prod(a.shape[k] for k in axes)
    if count <= REDUCE_RUN or a.dtype != np.float32:
        return np.add.reduce(a, axis=axes, keepdims=True, out=out)
    k = next(k for k in axes if a.shape[k] > 1)
    length = a.shape[k]
    step = max(1, REDUCE_RUN // (count // length))
    acc = np.zeros(out.shape, np.float64)
    part = np.empty(out.shape, a.dtype)
    lead = (slice(None),) * k
    for s in range(0, length, step):
        reduce_sums(a[lead + (slice(s, s + step),)], axes, part)
        acc += part
    np.copyto(out, acc, casting="same_kind")
    return out


def far_off(c, q, eps):
    """True where some slice's correction ``c`` (the mean of ``d = x - first mean``) exceeds
    ``SKIP_CORRECTION`` of its standard deviation, ``q = mean(d*d)`` being ``var + c*c``:
    then ``q - c*c`` would cancel and the centring is redone."""
    c2 = c * c
    return bool(np.any(np.greater(c2, SKIP_CORRECTION ** 2 * (q - c2 + eps))))


def _affine_mode(layout, has_params, min_run=MIN_RUN):
    """``("none" | "outer" | "run", tail)``: how parameters vary along a row, or None.

    "outer": only along the reduced axes (one vector of n per row); "run": constant over
    the merged axes from ``tail`` on (reduced, not parameter axes: >= ``min_run`` elements),
    so one value per run of those elements.
    """
    d = len(layout.shape)
    if not has_params:
        return "none", d - len(layout.reduce)  # one run per row
    if set(layout.param) <= set(layout.reduce):
        return "outer", d
    tail = d
    while tail > 0 and tail - 1 in layout.reduce and tail - 1 not in layout.param:
        tail -= 1
    return ("run", tail) if tail < d and math.prod(layout.shape[tail:]) >= min_run else None


def param_vector(arr, layout, k, tail, acc):
    """weight/bias (or None) as the vector the row kernels read, for rows of the layout's axes
    from ``k`` on: one value a position in the row (``tail`` None: n values), or one a run of
    the axes from ``tail`` on, over all of x (NCHW instance/group norm)."""
    if arr is None:
        return None
    p = np.asarray(arr, dtype=acc)
    if tail is None and p.size == math.prod(layout.shape[k:]):  # the row's own: no broadcast
        return np.ascontiguousarray(p).reshape(-1)
    p = p.reshape(layout.param_shape)
    if tail is None:
        return np.ascontiguousarray(np.broadcast_to(p.reshape(p.shape[k:]), layout.shape[k:])).reshape(-1)
    lead = layout.shape[:tail]
    return np.ascontiguousarray(np.broadcast_to(p.reshape(p.shape[:tail]), lead)).reshape(-1)


class RowsForward:
    """One forward call whose reduced axes are x's trailing ones.

    ``RowsForward.make(...)`` returns None where this path does not apply (strided views,
    reduced axes not trailing, parameters varying on short runs, a float16/bfloat16 residual,
    bfloat16 without the compiled kernel, the "run" kind outside float16).
    ``run(blocks, buffers)`` writes y, mean and rstd for a list of ``(start, stop)`` row
    ranges; ``blocks`` and ``buffers()`` give those ranges and per-thread scratch.
    """

    @classmethod
    def make(cls, plan, layout, x, weight, bias, residual):
        k = len(layout.shape) - len(layout.reduce)
        if layout.reduce != tuple(range(k, len(layout.shape))) or not x.flags.c_contiguous or (
                residual is not None and not residual.flags.c_contiguous):
            return None
        half = np.dtype(plan.dtype) != np.dtype(plan.acc_dtype)
        kernel = _native.rows_kernel(plan.dtype)
        # NumPy passes convert float16 blocks only; the kernel takes bfloat16 (ml_dtypes) too
        if half and (residual is not None or np.dtype(plan.dtype) != np.float16 and kernel is None):
            return None
        mode = _affine_mode(layout, weight is not None or bias is not None,
                            MIN_RUN if kernel is None else MIN_RUN_NATIVE)
        # without the kernel, float32/float64 NCHW instance/group norm: the general blocking
        # measured as fast or 10-15% faster than "run" (whose gain is the per-block float16
        # conversion)
        if mode is None or mode[0] == "run" and not half and kernel is None:
            return None
        return cls(plan, layout, k, mode, x, weight, bias, residual, half, kernel)

    def __init__(self, plan, layout, k, mode, x, weight, bias, residual, half, kernel=None):
        self.plan, self.half, self.kernel = plan, half, kernel
        self.acc = acc = np.dtype(plan.acc_dtype)
        self.rows = math.prod(layout.shape[:k])
        self.n = math.prod(layout.shape[k:])
        self.mode, tail = mode
        self.run_length = math.prod(layout.shape[tail:])
        self.tail = tail
        self.inner = self.n if self.mode == "outer" else self.run_length  # inner loop length
        self.x2 = x.reshape(self.rows, self.n)
        self.r2 = None if residual is None else residual.reshape(self.rows, self.n)
        self.y = _outputs.empty(plan.shape, plan.dtype)
        self.h = None if residual is None else _outputs.empty(plan.shape, plan.dtype)
        self.y2 = self.y.reshape(self.rows, self.n)
        self.h2 = None if self.h is None else self.h.reshape(self.rows, self.n)
        self.mean = np.empty(self.rows, acc)
        self.rstd = np.empty(self.rows, acc)
        self.block_rows = max(1, min(self.rows, ROW_BLOCK_BYTES // (self.n * acc.itemsize)))
        self.w, self.b = (param_vector(p, layout, k, tail if self.mode == "run" else None, acc)
                          for p in (weight, bias))

    def blocks(self):
        rb = self.block_rows
        return [(s, min(s + rb, self.rows)) for s in range(0, self.rows, rb)]

    def buffers(self):
        """Per-thread scratch: block-sized float temporaries (and uint32 ones for float16);
        none for the compiled kernel."""
        if self.kernel is not None:
            return {}
        shape = (self.block_rows, self.n)
        bufs = {"t": np.empty(shape, self.acc)}
        if self.half:
            bufs["x"] = np.empty(shape, self.acc)
            bufs["u"] = np.empty(shape, np.uint32)
        return bufs

    def run(self, blocks, bufs):
        if self.kernel is not None:
            self._native(blocks[0][0], blocks[-1][1])  # a thread's blocks are consecutive
            return
        for s0, s1 in blocks:
            self._block(s0, s1, bufs)

    def _native(self, s0, s1):
        """Rows ``s0:s1`` by ``kernels/cpu.cpp``: one read of each row, three passes
        over it in L1."""
        n, size = self.n, self.y2.itemsize

        def at(a, itemsize=size, per_row=n):
            return 0 if a is None else _native.address(a) + s0 * per_row * itemsize

        acc = self.acc.itemsize
        w_run = 0 if self.mode == "outer" else self.run_length
        per_run = n // self.run_length
        params = [0 if p is None else _native.address(p) + (0 if w_run == 0 else s0 * per_run * acc)
                  for p in (self.w, self.b)]
        mean = at(self.mean, acc, 1) if self.plan.center else 0
        err = self.kernel(at(self.x2), at(self.r2), at(self.h2), at(self.y2), *params, w_run,
                          mean, at(self.rstd, acc, 1), s1 - s0, n, int(self.plan.center), self.plan.eps)
        if err:
            raise RuntimeError(f"anynorm's CPU kernel refused rows of {n} (runs of {w_run})")

    def _block(self, s0, s1, bufs):
        rb, plan = s1 - s0, self.plan
        if self.half:
            xa = bufs["x"][:rb]
            half_to_float(self.x2[s0:s1], xa)
            yw = xa  # the arithmetic runs in place in the converted block
        else:
            xa = self.x2[s0:s1]
            if self.r2 is not None:
                xa = np.add(xa, self.r2[s0:s1], out=self.h2[s0:s1])
            yw = self.y2[s0:s1]
        m, r = self.mean[s0:s1], self.rstd[s0:s1]
        d = xa
        if not plan.center:
            row_dots(xa, r)
            np.multiply(r, 1.0 / self.n, out=r)
        else:
            self._two_pass(xa, yw, m, r)
            d = yw
        np.add(r, plan.eps, out=r)
        np.sqrt(r, out=r)
        np.divide(1.0, r, out=r)
        self._affine(d, yw, yw, r, s0, s1, bufs["t"][:rb])
        if self.half:
            float_to_half(yw, self.y2[s0:s1], bufs["t"][:rb].view(np.uint32), bufs["u"][:rb])

    def _two_pass(self, x, d, m, v):
        """``m = sum(x) / n``, ``d = x - m``, ``v = (d . d) / n``; then the correction
        ``c = mean(d)``: ``v -= c*c``, ``d -= c``, ``m += c``, taken only where ``c`` (the first
        sum's rounding, ~eps * |m|) could show in y, i.e. where some row has
        ``|m| > SKIP_CORRECTION * std``."""
        inv_n = 1.0 / self.n
        row_sums(x, m)
        np.multiply(m, inv_n, out=m)
        np.subtract(x, m[:, None], out=d)
        row_dots(d, v)
        np.multiply(v, inv_n, out=v)
        if not np.greater(m * m, SKIP_CORRECTION ** 2 * (v + self.plan.eps)).any():
            return
        c = row_sums(d, np.empty_like(m))
        c *= inv_n
        if far_off(c, v, self.plan.eps):
            # the first mean missed by more than std / 4 (long float32 sums far from zero):
            # v - c*c would cancel, so centre again and redo both sums
            np.subtract(d, c[:, None], out=d)
            m += c
            row_dots(d, v)
            v *= inv_n
            row_sums(d, c)
            c *= inv_n
        v -= c * c
        np.maximum(v, 0, out=v)
        if np.any(np.greater(c * c, np.finfo(self.acc).eps ** 2 * (v + self.plan.eps))):
            np.subtract(d, c[:, None], out=d)
        m += c

    def _affine(self, d, work, y, r, s0, s1, t):
        """``y = d * (r * w) + b`` for rows ``s0:s1`` (``d``: centred, or x for RMS norm);
        ``work``: where a first pass may go (``d``'s block or scratch), ``t``: a block-sized
        temporary; the last pass writes ``y``."""
        if self.mode == "outer":
            last = y if self.w is None and self.b is None else work
            np.multiply(d, r[:, None], out=last)
            if self.w is not None:
                np.multiply(last, self.w, out=y if self.b is None else last)
            if self.b is not None:
                np.add(last, self.b, out=y)
            return
        per_row = self.n // self.run_length  # runs per row
        rows = slice(s0 * per_row, s1 * per_row)
        scale = np.repeat(r, per_row) if per_row > 1 else r.copy()
        if self.w is not None:
            scale *= self.w[rows]
        shift = None if self.b is None else self.b[rows]
        d3, y3 = d.reshape(-1, self.run_length), y.reshape(-1, self.run_length)
        if shift is None:
            np.multiply(d3, scale[:, None], out=y3)
        else:
            w3 = work.reshape(-1, self.run_length)
            np.multiply(d3, scale[:, None], out=w3)
            np.add(w3, shift[:, None], out=y3)

    def results(self):
        """``(y, h, mean, rstd)`` in the plan's public shapes."""
        plan = self.plan
        mean = self.mean.reshape(plan.stats_shape) if plan.center else None
        return self.y, self.h, mean, self.rstd.reshape(plan.stats_shape)

