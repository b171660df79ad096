"""What a call straight onto anynorm's packed row kernel needs from its plan (shared by
:mod:`anynorm._torch_direct` and :mod:`anynorm._numpy_direct`).

For a C-contiguous x the row kernel takes (``kernels/cpu.cpp``, ``anynorm_rows_packed_*``):

- layer/RMS norm over x's trailing axes: ``rows = size / n`` rows of ``n = count`` elements,
  the parameters by position in the row;
- group/instance norm with channels on axis 1 (NCHW, NCDHW, (N, C)): a row per (sample,
  group) of ``n = C / G * S`` elements (S: the spatial extent), the parameters constant on
  runs of S elements, ``w[(row * n + i) / S mod C]``.

For small arrays a call's cost is its Python steps, not its arithmetic: this path takes the
fewest (a cached runner, one output allocation per result, one foreign call of seven
arguments), and the kernel is exact on any data.
"""

from __future__ import annotations

import math

from . import _native

__all__ = ["geometry", "sizes"]


def geometry(plan):
    """``(rows, n, w_run, w_count)`` of the row kernel for the plan on C-contiguous memory,
    or None where the kernel does not take its layout (or a residual)."""
    if plan.has_residual:
        return None
    size = math.prod(plan.shape)
    ndim = len(plan.shape)
    if plan.op in ("layer_norm", "rms_norm"):
        k = len(plan.reduce_axes)
        if plan.reduce_axes != tuple(range(ndim - k, ndim)):
            return None
        return size // plan.count, plan.count, 0, 0
    if plan.channel_axis != 1:
        return None
    n, c = plan.shape[0], plan.shape[1]
    groups = c if plan.op == "instance_norm" else plan.num_groups
    return n * groups, plan.count, size // (n * c), c


def sizes(plan, found):
    """The :class:`anynorm._native.RowsCall` of a plan's ``geometry``."""
    rows, n, w_run, w_count = found
    return _native.RowsCall(rows, n, w_run, w_count, int(plan.center), plan.eps)
