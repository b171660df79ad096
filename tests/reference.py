"""The float64 NumPy reference every test compares against, written without anynorm.

Each call is brought to a 2-D layout: one row per normalized slice, one column per element
of the slice (``np.moveaxis``/``reshape``), so mean, variance and the backward are textbook
row operations.  The parameters are broadcast to ``x``'s full shape first and moved the same
way, which keeps the layout logic in one place for all four operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OPS = ("layer_norm", "rms_norm", "instance_norm", "group_norm")


@dataclass(frozen=True)
class Layout:
    """How ``x`` (shape ``shape``) maps onto rows of normalized slices."""

    shape: tuple
    order: tuple  # permutation of x's axes: kept axes first, normalized axes last
    rows_shape: tuple  # shape after the permutation, grouped as (rows, n)
    stats_shape: tuple  # public statistics shape
    param_full: callable  # (C,) or normalized-shape parameter -> array of x's shape

    def to_rows(self, arr):
        return np.transpose(arr, self.order).reshape(self.rows_shape)

    def from_rows(self, rows):
        moved = rows.reshape(tuple(self.shape[a] for a in self.order))
        return np.transpose(moved, np.argsort(self.order))


def _sorted_axes(axis, ndim):
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    return sorted(a % ndim for a in items)


def layout(op, shape, *, axis=-1, channel_axis=1, num_groups=None):
    """The row layout of ``op`` on an input of ``shape``."""
    shape = tuple(shape)
    ndim = len(shape)
    if op in ("layer_norm", "rms_norm"):
        reduced = _sorted_axes(axis, ndim)
        kept = [a for a in range(ndim) if a not in reduced]
        n = int(np.prod([shape[a] for a in reduced]))
        stats_shape = tuple(1 if a in reduced else s for a, s in enumerate(shape))

        def param_full(p):
            keep_dims = tuple(s if a in reduced else 1 for a, s in enumerate(shape))
            return np.broadcast_to(np.reshape(p, keep_dims), shape)

        return Layout(shape, tuple(kept + reduced), (-1, n), stats_shape, param_full)

    c = channel_axis % ndim
    others = [a for a in range(1, ndim) if a != c]
    spatial = int(np.prod([shape[a] for a in others]))
    channels = shape[c]

    def param_full(p):
        dims = [1] * ndim
        dims[c] = channels
        return np.broadcast_to(np.reshape(p, dims), shape)

    order = (0, c, *others)
    if op == "instance_norm":
        stats_shape = tuple(s if a in (0, c) else 1 for a, s in enumerate(shape))
        return Layout(shape, order, (-1, spatial), stats_shape, param_full)
    # group norm: channels (moved next to the batch axis) split into consecutive groups
    return Layout(shape, order, (-1, channels // num_groups * spatial), (shape[0], num_groups), param_full)


def _as64(arr):
    return None if arr is None else np.asarray(arr, dtype=np.float64)


def forward(op, x, weight=None, bias=None, *, eps=None, axis=-1, channel_axis=1, num_groups=None):
    """``(y, mean, rstd)`` in float64; ``mean`` is None for RMS norm.  Statistics in public shape."""
    x = _as64(x)
    if eps is None:
        eps = 1e-5 if op != "rms_norm" else np.finfo(x.dtype).eps
    lay = layout(op, x.shape, axis=axis, channel_axis=channel_axis, num_groups=num_groups)
    rows = lay.to_rows(x)
    if op == "rms_norm":
        mean = None
        centred = rows
    else:
        # corrected two-pass, so that the oracle stays exact-ish for rows far from zero
        first = rows.sum(axis=1, keepdims=True) / rows.shape[1]
        correction = (rows - first).sum(axis=1, keepdims=True) / rows.shape[1]
        mean = first + correction
        centred = (rows - first) - correction
    rstd = 1.0 / np.sqrt((centred * centred).sum(axis=1, keepdims=True) / rows.shape[1] + eps)
    y = lay.from_rows(centred * rstd)
    if weight is not None:
        y = y * lay.param_full(_as64(weight))
    if bias is not None:
        y = y + lay.param_full(_as64(bias))
    reshape = lambda s: None if s is None else s.reshape(lay.stats_shape)  # noqa: E731
    return y, reshape(mean), reshape(rstd)


def backward(op, dy, x, weight=None, *, eps=None, axis=-1, channel_axis=1, num_groups=None):
    """``(dx, dweight, dbias)`` in float64 (``dweight``/``dbias`` None without weight)."""
    x, dy = _as64(x), _as64(dy)
    where = dict(axis=axis, channel_axis=channel_axis, num_groups=num_groups)
    lay = layout(op, x.shape, **where)
    xhat, _, rstd = forward(op, x, eps=eps, **where)  # without weight/bias: the normalized x
    g = dy if weight is None else dy * lay.param_full(_as64(weight))
    g_rows, xhat_rows = lay.to_rows(g), lay.to_rows(xhat)
    n = g_rows.shape[1]
    inner = g_rows - xhat_rows * (g_rows * xhat_rows).sum(axis=1, keepdims=True) / n
    if op != "rms_norm":
        inner = inner - g_rows.sum(axis=1, keepdims=True) / n
    dx = lay.from_rows(inner * rstd.reshape(-1, 1))
    if weight is None:
        return dx, None, None
    dweight = _reduce_to_param(op, dy * xhat, lay, np.shape(weight), **where)
    dbias = _reduce_to_param(op, dy, lay, np.shape(weight), **where)
    return dx, dweight, dbias


def _reduce_to_param(op, arr, lay, param_shape, *, axis, channel_axis, num_groups):
    ndim = arr.ndim
    if op in ("layer_norm", "rms_norm"):
        kept = tuple(a for a in range(ndim) if a not in _sorted_axes(axis, ndim))
    else:
        c = channel_axis % ndim
        kept = tuple(a for a in range(ndim) if a != c)
    return arr.sum(axis=kept).reshape(param_shape)
