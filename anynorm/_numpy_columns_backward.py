"""NumPy backward for statistics over a middle axis, by anynorm's CPU column kernel.

Channels-first layer norm (``(B, C, H*W)``, the statistics per position over the channels,
the weight per channel) and NHWC instance/group norm (``(B, H*W, C)``, the statistics per
channel group over the positions, the weight per channel) view C-contiguous ``x`` and ``dy``
as ``(B, P, Q)``, as :class:`anynorm._numpy_columns.NativeColumns` does for the forward.
Each thread hands its samples to ``anynorm_cols_bwd`` (``kernels/cpu.cpp``), which takes a
strip of a sample's columns (x's and dy's rows of it in L2) through two passes: the column
sums of ``g = dy * w`` and ``g * (x - mean)`` down the rows, then dx::

    dx = (g - xhat * mean(g * xhat) - mean(g)) * rstd       (means over each slice)
    dweight = sum(dy * xhat),  dbias = sum(dy)

with the statistics as the forward returned them, or taken again from x as the forward's
kernel takes them (the mean in two floats).  The general blocking in :mod:`anynorm._numpy`
runs NumPy passes instead (7-13x the time of ``np.copyto`` at ConvNeXt's and ResNet's shapes).
"""

from __future__ import annotations

import math

import numpy as np

from . import _native, _outputs
from ._numpy_columns import _pattern, native_params, native_strip

__all__ = ["ColumnsBackward"]


class ColumnsBackward:
    """One ``"cf"``/``"cl"`` backward call on the compiled kernel; ``make`` returns None where
    the kernel is not built, dy is not of x's dtype, either is not C-contiguous or the layout
    is not one of these.  ``run(blocks, _)`` writes dx for consecutive samples and returns
    that part's weight and bias gradients; ``results(parts)`` the call's ``(dx, dw, db)``."""

    @classmethod
    def make(cls, plan, layout, dy, x, weight, mean, rstd):
        if (not plan.center or dy.dtype != x.dtype
                or not (x.flags.c_contiguous and dy.flags.c_contiguous)):
            return None
        found = _pattern(layout)
        kernel = None if found is None else _native.cols_backward_kernel(plan.dtype)
        return None if kernel is None else cls(plan, layout, found, dy, x, weight, mean, rstd, kernel)

    def __init__(self, plan, layout, found, dy, x, weight, mean, rstd, kernel):
        self.plan, self.layout, self.kernel, (kind, self.lead) = plan, layout, kernel, found
        self.acc = acc = np.dtype(plan.acc_dtype)
        shape, lead = layout.shape, self.lead
        self.B = shape[0] if lead else 1
        self.P, self.Q = shape[lead], math.prod(shape[lead + 1:])
        groups = shape[lead + 1] if len(shape) - lead == 3 else self.Q
        self.param_rows = kind == "cf"
        self.group = 1 if self.param_rows else self.Q // groups
        self.x3, self.dy3 = x.reshape(self.B, self.P, self.Q), dy.reshape(self.B, self.P, self.Q)
        self.dx = _outputs.empty(plan.shape, plan.dtype)
        self.mean = self.rstd = None
        if rstd is not None:
            self.mean = np.ascontiguousarray(mean, dtype=acc).reshape(-1)
            self.rstd = np.ascontiguousarray(rstd, dtype=acc).reshape(-1)
        self.w = native_params(weight, layout, lead, self.P, self.Q, self.param_rows, acc)
        self.w_dtype = None if weight is None else weight.dtype
        # x's and dy's rows of a strip both in L2; a whole channels-first sample as the
        # forward takes one (x and dy then one run of memory each)
        self.strip = native_strip(self.P, self.Q, self.group, np.dtype(plan.dtype).itemsize, self.param_rows,
                                  arrays=2)

    def blocks(self):
        return [(b, b + 1) for b in range(self.B)]

    def run(self, blocks, _scratch=None):
        """dx for the samples of ``blocks`` (consecutive), in one kernel call; returns this
        part's ``(dw, db)`` (float64, P or Q values), or None without a weight."""
        b0, b1 = blocks[0][0], blocks[-1][1]
        sample, acc = self.P * self.Q * self.x3.itemsize, self.acc.itemsize
        stats = self.Q // self.group
        part = None if self.w is None else np.zeros((2, self.w.size))
        at = (lambda a, step: 0 if a is None else _native.address(a) + b0 * step)  # noqa: E731
        err = self.kernel(at(self.x3, sample), at(self.dy3, sample), at(self.dx, sample), at(self.w, 0),
                          at(self.mean, stats * acc), at(self.rstd, stats * acc),
                          at(part, 0), 0 if part is None else _native.address(part) + self.w.size * 8,
                          b1 - b0, self.P, self.Q, self.group, self.strip, int(self.param_rows), self.plan.eps)
        if err:
            raise RuntimeError(f"anynorm's CPU backward kernel refused columns ({self.P}, {self.Q}, "
                               f"group {self.group})")
        return part

    def results(self, parts):
        """``(dx, dweight, dbias)`` in the plan's shapes (the gradients in the weight's dtype;
        None without a weight)."""
        plan = self.plan
        dx = self.dx.reshape(plan.shape)
        if self.w is None:
            return dx, None, None
        total = sum(parts)
        return dx, self._param(total[0]), self._param(total[1])

    def _param(self, grad):
        """A gradient by row or column, summed over the axes the weight does not vary along."""
        layout, lead = self.layout, self.lead
        if not self.param_rows:
            shape = layout.shape[lead + 1:]
            axes = tuple(j for j, s in enumerate(shape) if layout.param_shape[lead + 1 + j] == 1 and s > 1)
            grad = grad.reshape(shape)
            if axes:
                grad = np.add.reduce(grad, axis=axes)
        return grad.reshape(self.plan.param_shape).astype(self.w_dtype, copy=False)
