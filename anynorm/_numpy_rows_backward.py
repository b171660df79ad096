"""NumPy backward for statistics over x's trailing axes, by anynorm's CPU row kernel.

Layer/RMS norm over the last axes and NCHW instance/group norm view C-contiguous ``x`` and
``dy`` as ``(rows, n)``, one normalized slice per row, as :mod:`anynorm._numpy_rows` does for
the forward.  Each thread hands its range of rows to ``anynorm_rows_bwd`` (``kernels/cpu.cpp``),
which reads a row of x and dy from memory once and writes dx::

    xhat = (x - mean) * rstd;  g = dy * w
    dx   = (g - xhat * mean(g * xhat) - mean(g)) * rstd          (RMS norm: no mean(g))
    dweight = sum(dy * xhat),  dbias = sum(dy)                  (over the rows: float32 in
                                                                  blocks of rows, then float64)

with the statistics as the forward returned them, or taken again from x as the forward
takes them.  The general blocking in :mod:`anynorm._numpy` runs NumPy passes over each box
instead (six to eight of them: 7-8x the time of ``np.copyto`` on float32 rows).
"""

from __future__ import annotations

import math

import numpy as np

from . import _native, _outputs
from ._numpy_rows import MIN_RUN_NATIVE, ROW_BLOCK_BYTES, _affine_mode, param_vector

__all__ = ["RowsBackward"]


class RowsBackward:
    """One backward call whose reduced axes are x's trailing ones, on the compiled kernel.

    ``RowsBackward.make(...)`` returns None where it does not apply (no kernel for the dtype,
    dy of another dtype than x, x or dy not C-contiguous, reduced axes not trailing, a weight varying on short runs).
    ``run(blocks, _)`` writes dx for consecutive ``(start, stop)`` row ranges and returns
    that part's weight and bias gradients; ``results(parts)`` the call's ``(dx, dw, db)``.
    """

    @classmethod
    def make(cls, plan, layout, dy, x, weight, mean, rstd):
        kernel = _native.rows_backward_kernel(plan.dtype)
        k = len(layout.shape) - len(layout.reduce)
        if (kernel is None or layout.reduce != tuple(range(k, len(layout.shape))) or dy.dtype != x.dtype
                or not (x.flags.c_contiguous and dy.flags.c_contiguous)):
            return None
        mode = _affine_mode(layout, weight is not None, MIN_RUN_NATIVE)
        if mode is None:
            return None
        return cls(plan, layout, k, mode, dy, x, weight, mean, rstd, kernel)

    def __init__(self, plan, layout, k, mode, dy, x, weight, mean, rstd, kernel):
        self.plan, self.layout, self.kernel = plan, layout, kernel
        self.acc = acc = np.dtype(plan.acc_dtype)
        self.rows = math.prod(layout.shape[:k])
        self.n = n = math.prod(layout.shape[k:])
        self.k = k
        kind, self.tail = mode
        self.by_run = kind == "run"
        self.run_length = math.prod(layout.shape[self.tail:]) if self.by_run else 0
        self.x2, self.dy2 = x.reshape(self.rows, n), dy.reshape(self.rows, n)
        self.dx = _outputs.empty(plan.shape, plan.dtype)
        self.dx2 = self.dx.reshape(self.rows, n)
        self.rstd = None if rstd is None else np.ascontiguousarray(rstd, dtype=acc).reshape(-1)
        self.mean = (np.ascontiguousarray(mean, dtype=acc).reshape(-1)
                     if rstd is not None and plan.center else None)
        self.w = param_vector(weight, layout, k, self.tail if self.by_run else None, acc)
        self.w_dtype = None if weight is None else weight.dtype
        # by run: one gradient a run of all x (each run in one row: threads write apart)
        if self.w is not None and self.by_run:
            runs = self.rows * (n // self.run_length)
            self.dw_runs, self.db_runs = np.zeros(runs), np.zeros(runs)
        self.block_rows = max(1, min(self.rows, ROW_BLOCK_BYTES // (n * acc.itemsize)))

    def blocks(self):
        rb = self.block_rows
        return [(s, min(s + rb, self.rows)) for s in range(0, self.rows, rb)]

    def run(self, blocks, _scratch=None):
        """dx for the rows of ``blocks`` (consecutive), in one kernel call; returns this
        part's ``(dw, db)`` by position in the row (float64), or None."""
        s0, s1 = blocks[0][0], blocks[-1][1]
        n, size, acc = self.n, self.dx2.itemsize, self.acc.itemsize
        w, part = self.w, None
        if w is None:
            w_at = dw_at = db_at = 0
        elif self.by_run:
            per_run = n // self.run_length
            w_at = _native.address(w) + s0 * per_run * acc
            dw_at = _native.address(self.dw_runs) + s0 * per_run * 8
            db_at = _native.address(self.db_runs) + s0 * per_run * 8
        else:
            part = np.zeros((2, n))
            w_at, dw_at, db_at = _native.address(w), _native.address(part), _native.address(part) + n * 8
        stats = [0 if s is None else _native.address(s) + s0 * acc for s in (self.mean, self.rstd)]
        err = self.kernel(_native.address(self.x2) + s0 * n * size, _native.address(self.dy2) + s0 * n * size,
                          _native.address(self.dx2) + s0 * n * size, w_at, self.run_length, *stats,
                          dw_at, db_at, s1 - s0, n, int(self.plan.center), self.plan.eps)
        if err:
            raise RuntimeError(f"anynorm's CPU backward kernel refused rows of {n} (runs of {self.run_length})")
        return part

    def results(self, parts):
        """``(dx, dweight, dbias)`` in the plan's shapes (the gradients in the weight's
        dtype; None without a weight)."""
        plan = self.plan
        dx = self.dx.reshape(plan.shape)
        if self.w is None:
            return dx, None, None
        if self.by_run:
            shape = self.layout.shape[:self.tail]
            dw, db = self.dw_runs.reshape(shape), self.db_runs.reshape(shape)
        else:
            shape = self.layout.shape[self.k:]
            total = sum(parts)
            dw, db = total[0].reshape(shape), total[1].reshape(shape)
        return dx, self._param(dw, shape), self._param(db, shape)

    def _param(self, grad, shape):
        """A gradient over ``shape`` (a run of the layout's axes: by run the leading, by
        position the trailing ones) summed over the axes the weight does not vary along."""
        layout, offset = self.layout, 0 if self.by_run else self.k
        axes = tuple(j for j in range(len(shape)) if layout.param_shape[offset + j] == 1 and shape[j] > 1)
        if axes:
            grad = np.add.reduce(grad, axis=axes)
        return grad.reshape(self.plan.param_shape).astype(self.w_dtype, copy=False)
