"""The Dask executor (for now the array-API core; see issue 17 for the bounded-memory design)."""

from __future__ import annotations

from ._reference import backward, forward

__all__ = ["forward", "backward"]
