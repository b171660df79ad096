"""What a call straight onto anynorm's packed CPU kernels needs from its plan (shared by
:mod:`anynorm._torch_direct` and :mod:`anynorm._numpy_direct`).

For a C-contiguous x, :func:`packed` finds the kernel's view of the call (``kernels/cpu.cpp``,
``anynorm_rows_packed_*`` / ``anynorm_cols_packed_*``):

- rows: layer/RMS norm over x's trailing axes (``rows`` rows of ``n = count`` elements, the
  parameters by position in the row); group/instance norm with channels on axis 1 (NCHW,
  NCDHW, (N, C): a row per (sample, group), the parameters constant on runs of the spatial
  extent S, ``w[(row * n + i) / S mod C]``); layer/RMS norm over leading and trailing axes,
  keeping those between (x as (A, R, B) over A and B: R rows of A runs of B elements, the
  row kernel's segmented rows, runs of 8 and more);
- columns: layer norm over adjacent axes before the last (ConvNeXt's channels-first layer
  norm: samples of (C, HW), a statistic per column, the parameters by row) and group/instance
  norm with channels last (NHWC, NDHWC: samples of (HW, C), a statistic per group of
  adjacent columns, the parameters by column), as the NumPy executor's column path
  (:class:`anynorm._numpy_columns.NativeColumns`) lays them out.

For small arrays a call's cost is its Python steps, not its arithmetic: these paths take the
fewest (a cached runner, one allocation per result, one foreign call of seven arguments),
and the kernels are exact on any data.
"""

from __future__ import annotations

import math

from . import _native

__all__ = ["packed"]


def _rows(plan):
    """``RowsCall`` of the row kernel for the plan, or None where it does not take it."""
    size = math.prod(plan.shape)
    ndim = len(plan.shape)
    if plan.op in ("layer_norm", "rms_norm"):
        k = len(plan.reduce_axes)
        if plan.reduce_axes != tuple(range(ndim - k, ndim)):
            return _segmented(plan)
        rows, n, w_run, w_count = size // plan.count, plan.count, 0, 0
    elif plan.channel_axis == 1:
        n_samples, c = plan.shape[0], plan.shape[1]
        groups = c if plan.op == "instance_norm" else plan.num_groups
        rows, n, w_run, w_count = n_samples * groups, plan.count, size // (n_samples * c), c
    else:
        return None
    return _native.RowsCall(rows, n, w_run, w_count, int(plan.center), plan.eps)


def _segmented(plan):
    """``RowsCall`` of the row kernel's segmented rows for layer/RMS norm over leading and
    trailing axes, keeping those between (x as (A, R, B): R rows of A runs of B), or None."""
    axes, ndim = plan.reduce_axes, len(plan.shape)
    lead = next(i for i in range(ndim + 1) if i == ndim or i not in axes)
    kept = ndim - (len(axes) - lead)  # the trailing reduce axes start here
    if lead == 0 or kept == ndim or axes != (*range(lead), *range(kept, ndim)):
        return None
    a, r, b = (math.prod(plan.shape[i:j]) for i, j in ((0, lead), (lead, kept), (kept, ndim)))
    if b < 8:  # runs too short for the kernel's vectors: the executor's passes
        return None
    return _native.RowsCall(r, a * b, 0, 0, int(plan.center), plan.eps, a, r * b)


def _cols(plan, x):
    """``(ColsCall, parameter size)`` of the column kernel, or None (the plan NumPy's, x a
    C-contiguous NumPy array or view of the call's memory)."""
    from . import _numpy, _numpy_columns  # (they import this module's users)

    if not plan.center:
        return None
    layout = _numpy._layout(plan, [x])
    found = _numpy_columns._pattern(layout)
    if found is None:
        return None
    samples, p, q, group, param_rows = _numpy_columns.native_geometry(layout, found)
    strip = _numpy_columns.native_strip(p, q, group, x.itemsize, param_rows)
    return _native.ColsCall(samples, p, q, group, strip, int(param_rows), plan.eps), (p if param_rows else q)


def packed(plan, x, kernel_dtype, half_params):
    """``(kernel, sizes, parameter size)`` for a call of the plan (NumPy's) on C-contiguous
    NumPy ``x`` (a view of the call's memory), parameters of x's half dtype where
    ``half_params``; None where neither packed kernel takes it (a residual, another layout,
    no kernel built).  ``parameter size``: the elements a weight or bias must hold to be
    read as it is (None: any the plan accepted)."""
    if plan.has_residual:
        return None
    sizes = _rows(plan)
    if sizes is not None:
        kernel = _native.rows_packed_kernel(kernel_dtype, half_params)
        return None if kernel is None else (kernel, sizes, None)
    found = _cols(plan, x)
    if found is None:
        return None
    kernel = _native.cols_packed_kernel(kernel_dtype, half_params)
    return None if kernel is None else (kernel, found[0], found[1])
