"""Output arrays of the NumPy executor, those of ``MIN_BYTES`` and up reused across calls.

glibc serves an allocation of ``MMAP_THRESHOLD_MAX`` (32 MiB) and up by a fresh ``mmap`` and
unmaps it when freed, so every such output faults in all its pages again, and the kernel zeroes
each one: for a float32 layer norm of 8192x4096 (128 MiB) that costs as much as copying the array
(single thread, this project's 2-core VM: touching a fresh output's pages 7.3 ms, ``np.copyto``
of x into a preallocated array 7.4 ms, the row kernel into a preallocated output 8.5 ms).  Smaller
ones glibc hands out again from its heap, but not dependably: in a torch process whose autograd
frees tensors of its own between calls, a layer norm of 1024 x 768 float32 forward + backward
(two 3 MiB outputs) faulted 1500 pages a step (3.2-3.7 ms a step, against 0.5-0.6 with its
outputs reused and 15 faults), as glibc trimmed and mapped its heap's top again.  So every
output of ``MIN_BYTES`` and up is a view of a block the cache holds, and a later call of the
same byte size takes the block again once nothing else refers to it (its reference count, read
under a lock: every view, memoryview, ctypes pointer object or torch tensor made from the output
holds the block).

The cache holds at most ``CACHE_BLOCKS`` blocks, ``CACHE_BYTES`` in all (what it keeps between
calls, a Dask worker's included, is bounded by that): ``y = f(x)`` in a loop, the last ``y``
alive while the next is made, takes two blocks in turn, ``y, h = f(x, residual=r)`` four, a
training step's ``y`` and ``dx`` two more.  Outputs past half of ``CACHE_BYTES`` come from
``np.empty``; a block still in use when room is needed is forgotten (its owner frees it).
``ANYNORM_OUTPUT_CACHE=0`` in the environment turns the cache off.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import numpy as np

MMAP_THRESHOLD_MAX = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts
MIN_BYTES = 1 << 20  # smaller outputs come from np.empty (glibc's heap keeps those)
CACHE_BLOCKS = 8
CACHE_BYTES = 256 << 20

ENABLED = os.environ.get("ANYNORM_OUTPUT_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")

_blocks: list[np.ndarray] = []  # uint8 blocks, oldest first
_lock = threading.Lock()


def _unreferenced_count():
    # sys.getrefcount of a block the list alone refers to, read as the cache reads it (the
    # interpreter's own references to an argument differ between Python versions).
    probe = [np.empty(1, np.uint8)]
    i = 0
    return sys.getrefcount(probe[i])


_UNREFERENCED = _unreferenced_count()


def empty(shape, dtype):
    """An uninitialized C-contiguous array of ``shape`` and ``dtype``, as ``np.empty`` gives,
    from a reused block where it is ``MIN_BYTES`` or more."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if not ENABLED or nbytes < MIN_BYTES or nbytes > CACHE_BYTES // 2:
        return np.empty(shape, dtype)
    return _block(nbytes).view(dtype).reshape(shape)


def _unused(i):
    """True when nothing but the cache refers to block ``i`` (called under the lock)."""
    return sys.getrefcount(_blocks[i]) == _UNREFERENCED


def _block(nbytes):
    with _lock:
        for i in range(len(_blocks)):
            if _blocks[i].nbytes == nbytes and _unused(i):
                return _blocks[i]
        # Make room before allocating: a block no one refers to goes first, oldest first; one
        # still in use is only forgotten (its owner frees it).
        while _blocks and (len(_blocks) >= CACHE_BLOCKS
                           or sum(b.nbytes for b in _blocks) + nbytes > CACHE_BYTES):
            free = [i for i in range(len(_blocks)) if _unused(i)]
            del _blocks[free[0] if free else 0]
        block = np.empty(nbytes, np.uint8)
        _blocks.append(block)
        return block


def clear():
    """Drop every held block (those still in use stay alive through their outputs)."""
    with _lock:
        _blocks.clear()
