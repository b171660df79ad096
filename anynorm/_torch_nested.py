"""Nested (jagged) torch tensors: layer and RMS norm over the regular axes after the ragged one.

A ``torch.nested`` tensor of layout ``torch.jagged`` (variable-length sequences, shape
``(B, j, ...)``) keeps its elements as one dense ``values()`` tensor ``(sum of lengths, ...)``
and the sequence boundaries as ``offsets()``.  Normalizing over axes after the ragged one
normalizes each row of ``values()`` on its own, so the call runs as the ordinary call on
``values()`` (the axes moved down by the ragged one; torch's own LayerNorm on a jagged
tensor does the same), and ``y`` (with ``h`` and the statistics) comes back as a jagged
tensor on the same offsets.  Autograd flows through ``values()``.  The batch or ragged axis
cannot be normalized over (a slice would cross sequences), nor can instance and group norm,
whose statistics span the ragged axis.
"""

from __future__ import annotations

import torch

from ._plan import _canonical_axes

__all__ = ["forward_call"]


def _axes(axis, ndim, ragged) -> tuple:
    """``axis`` of the nested tensor as axes of its values, checked."""
    axes = _canonical_axes(axis, ndim)  # in range, not repeated
    if axes[0] <= ragged:
        raise ValueError(f"axis={axis!r} names the batch or ragged axis ({ragged}) of a jagged "
                         "nested tensor: a normalized slice may only span the axes after it")
    return tuple(a - ragged for a in axes)


def _jagged(values, like):
    """``values`` as a jagged tensor with ``like``'s offsets, lengths and ragged axis."""
    if values is None:
        return None
    return torch.nested.nested_tensor_from_jagged(values, like.offsets(), lengths=like.lengths(),
                                                  jagged_dim=like._ragged_idx)


def forward_call(op, x, weight, bias, residual, stats, axis, channel_axis, num_groups, eps):
    """``(plan, run)`` as :func:`anynorm._calls.forward_call` gives them, for a nested ``x``
    (the plan is that of ``x.values()``)."""
    from ._calls import forward_call as dense_call

    if x.layout is not torch.jagged:
        raise TypeError("x must be a dense tensor or a nested tensor of layout torch.jagged, got a "
                        f"nested tensor of layout {x.layout}")
    if op not in ("layer_norm", "rms_norm"):
        raise TypeError(f"{op} of a nested tensor: its statistics would span the ragged axis; "
                        "layer_norm and rms_norm over the axes after it take nested tensors")
    if residual is not None and (not residual.is_nested or residual.dim() != x.dim()):
        raise ValueError("residual must be a nested tensor with x's sequences")
    values_axis = _axes(axis, x.dim(), x._ragged_idx)
    plan, run = dense_call(op, x.values(), weight, bias,
                           None if residual is None else residual.values(), stats,
                           values_axis, channel_axis, num_groups, eps)

    def nested_run(x, weight, bias, residual):
        out = run(x.values(), weight, bias, None if residual is None else residual.values())
        return tuple(_jagged(t, x) for t in out)

    return plan, nested_run
