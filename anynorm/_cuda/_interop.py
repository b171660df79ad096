"""Launch bound schedules on torch's or CuPy's current stream; the kernels' dtype keys.

A torch tensor reaches the kernels as its data pointer (``Tensor.data_ptr``), no conversion
per call; work runs on torch's current stream of the tensor's device, as a CuPy stream
object made once per raw stream pointer (:func:`cupy_stream`). Where a layout needs a copy,
torch makes it (``_torch_ops``).
"""

from __future__ import annotations

import cupy
import numpy as np

__all__ = ["dtype_key", "cupy_stream", "torch_stream", "current_device", "run_on_torch_stream",
           "run_on_cupy_stream"]

_KEYS = ("float16", "bfloat16", "float32", "float64")
# dtype object -> key, filled as dtypes are seen (str() costs per call). NumPy's dtypes apart
# from torch's: torch.compile (2.11) cannot hash NumPy dtypes, so a dict holding both makes
# a lookup of a torch dtype a graph break under fullgraph=True.
_KEY_OF_NUMPY: dict = {}
_KEY_OF_OTHER: dict = {}


def dtype_key(dtype) -> str | None:
    """"float16" / "bfloat16" / "float32" / "float64" for a NumPy/CuPy or torch dtype, else None."""
    known = _KEY_OF_NUMPY if isinstance(dtype, np.dtype) else _KEY_OF_OTHER
    try:
        return known[dtype]
    except (KeyError, TypeError):
        pass
    name = str(dtype)
    name = name[len("torch."):] if name.startswith("torch.") else name
    key = name if name in _KEYS else None
    try:
        known[dtype] = key
    except TypeError:  # an unhashable dtype
        pass
    return key


# ---- the hot path: a recorded schedule launched with no context switches ---------------------

def current_device() -> int:
    """The CUDA runtime's current device of this thread (torch and CuPy share it)."""
    return cupy.cuda.runtime.getDevice()


def torch_stream(device: int) -> int:
    """torch's current stream of ``device`` as a raw pointer (no Stream object is built)."""
    import torch

    return torch._C._cuda_getCurrentRawStream(device)


_STREAMS: dict = {}  # (pointer, device) -> a CuPy stream over it


def cupy_stream(pointer: int, device: int):
    """A CuPy stream object for a raw stream pointer, made once per pointer (wrapping one
    costs microseconds): the legacy NULL stream is ``Stream.null``."""
    key = (pointer, device)
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) > 64:  # streams made and dropped in a loop: forget the old ones
            _STREAMS.clear()
        stream = cupy.cuda.Stream.null if pointer == 0 else cupy.cuda.ExternalStream(pointer, device)
        _STREAMS[key] = stream
    return stream


def run_on_torch_stream(bound, ptrs, device: int) -> None:
    """Launch a ``_launcher.BoundLaunch`` on torch's current stream of ``device``; the current
    device is switched only when it is another one."""
    stream = torch_stream(device)
    if bound.direct is None:  # CuPy's launch: a CuPy stream object (made once per pointer)
        stream = cupy_stream(stream, device)
    if current_device() == device:
        bound.run(ptrs, stream)
    else:
        with cupy.cuda.Device(device):
            bound.run(ptrs, stream)


def run_on_cupy_stream(bound, ptrs, device: int) -> None:
    """Launch a ``_launcher.BoundLaunch`` on CuPy's current stream (of ``device``)."""
    if current_device() == device:
        bound.run(ptrs, cupy.cuda.get_current_stream())
    else:
        with cupy.cuda.Device(device):
            bound.run(ptrs, cupy.cuda.get_current_stream())
