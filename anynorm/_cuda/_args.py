"""Kernel arguments in the form CuPy launches them, made once.

RawKernel turns each argument into a C value on every launch: a NumPy scalar costs about a
microsecond to create and as much again to convert, a dozen of them per launch. Sizes,
flags and eps repeat from call to call, so each distinct value is made once, as CuPy's own
holder (``CScalar``, which it passes through); a torch tensor's data pointer becomes CuPy's
pointer-sized holder (``CIntptr``). Widths stay explicit: int64 for sizes, int32 for flags,
float64 for eps, 8 bytes for addresses. A CuPy without those classes gets NumPy scalars.
"""

from __future__ import annotations

import functools

import numpy as np

try:  # CuPy's own argument holders (cupy >= 13): passed to the driver as they are
    from cupy._core._scalar import CScalar as _hold
    from cupy.cuda.function import CIntptr as _address
except ImportError:  # pragma: no cover - other CuPy versions convert NumPy scalars per launch
    def _hold(value):
        return value

    _address = np.uint64

__all__ = ["i64", "i32", "f64", "address", "NULL", "kernel_arg"]


@functools.lru_cache(maxsize=4096)
def i64(value) -> object:
    """A ``long long`` argument."""
    return _hold(np.int64(value))


@functools.lru_cache(maxsize=64)
def i32(value) -> object:
    """An ``int`` argument."""
    return _hold(np.int32(value))


@functools.lru_cache(maxsize=256)
def f64(value) -> object:
    """A ``double`` argument."""
    return _hold(np.float64(value))


def address(pointer: int) -> object:
    """A device pointer given as an integer (a torch tensor's ``data_ptr()``)."""
    return _address(pointer)


NULL = address(0)


_HOLDERS = {np.int64: i64, np.int32: i32, np.float64: f64}


def kernel_arg(value) -> object:
    """A schedule's constant (``_schedule``: a NumPy scalar of the parameter's width, None for
    a null pointer) as the launch takes it."""
    if value is None:
        return NULL
    hold = _HOLDERS.get(type(value))
    return value if hold is None else hold(value.item())
