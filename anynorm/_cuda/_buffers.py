"""Move CuPy arrays in and out of a Layout's dense kernel buffer.

An array whose memory already is the buffer (same element strides on every non-trivial
view axis) is used in place; anything else is copied once, in the layout's order, on the
current stream. Arrays here are CuPy arrays or torch tensors as ``_interop.TensorRef``
(strides and a data pointer; they become CuPy arrays through DLPack only to be copied;
bfloat16 then arrives as int16 bits, which copies treat the same).
"""

from __future__ import annotations

import cupy
from cupy.lib.stride_tricks import as_strided

from ._interop import TensorRef, as_cupy
from ._layout import buffer_strides, view_strides

__all__ = ["element_strides", "is_buffer", "input_buffer", "output_buffer", "store"]


def element_strides(arr) -> tuple:
    if type(arr) is TensorRef:
        return arr.element_strides
    return tuple(s // arr.itemsize for s in arr.strides)


def _view(plan, arr):
    """``arr`` (shape ``plan.shape``) as ``plan.view_shape``, always a view."""
    strides = view_strides(plan, element_strides(arr))
    return as_strided(arr, shape=plan.view_shape, strides=tuple(s * arr.itemsize for s in strides))


def is_buffer(plan, layout, arr) -> bool:
    """True when ``arr``'s memory is laid out exactly as the kernel buffer (worked out once
    per plan, layout and strides)."""
    strides = element_strides(arr)
    key = ("is_buffer", layout, strides)
    answer = plan.memo.get(key)
    if answer is None:
        want = buffer_strides(plan, layout)
        have = view_strides(plan, strides)
        answer = plan.memo[key] = all(n == 1 or w == h for n, w, h in zip(plan.view_shape, want, have))
    return answer


def _ordered(plan, layout, arr):
    return cupy.transpose(_view(plan, arr), layout.order)


def input_buffer(plan, layout, arr):
    """``arr`` itself when it is laid out as the buffer, else a dense copy in layout order."""
    if is_buffer(plan, layout, arr):
        return arr
    return cupy.ascontiguousarray(_ordered(plan, layout, as_cupy(arr)))


def output_buffer(plan, layout, out):
    """Where the kernels should write ``out``: ``out`` itself, or a scratch buffer."""
    if is_buffer(plan, layout, out):
        return out
    return cupy.empty(layout.total, dtype=out.dtype)


def store(plan, layout, buf, out) -> None:
    """Copy a scratch buffer back into ``out`` (no-op when the kernels wrote ``out``)."""
    if buf is out:
        return
    ordered = _ordered(plan, layout, as_cupy(out))
    ordered[...] = buf.reshape(ordered.shape)
