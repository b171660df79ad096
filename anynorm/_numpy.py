"""The NumPy executor.  For now the array-API core; a blocked, in-place version comes next."""

from __future__ import annotations

from ._reference import backward, forward

__all__ = ["forward", "backward"]
