"""Hand torch CUDA tensors to the launcher without copies, on torch's current stream.

A tensor reaches the kernels as a :class:`TensorRef`: its strides for the layout and its
data pointer as the kernel argument, no conversion per call. Where a layout needs a copy,
the tensor crosses to CuPy through DLPack (``cupy.from_dlpack``); bfloat16 crosses as int16
bits so that no CuPy bfloat16 support is needed (the kernels get the dtype separately).
Work runs on torch's current stream of the tensor's device, wrapped by
``cupy.cuda.Stream.from_external``.
"""

from __future__ import annotations

import contextlib

import cupy
import numpy as np

from ._args import address

__all__ = ["TensorRef", "ref", "as_cupy", "to_cupy", "on_torch_stream", "dtype_key",
           "cupy_stream", "torch_stream", "current_device", "run_on_torch_stream", "run_on_cupy_stream"]

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


def to_cupy(tensor):
    """A CuPy view of a CUDA tensor (int16 bits for bfloat16); None stays None."""
    if tensor is None:
        return None
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return cupy.from_dlpack(tensor)


class TensorRef:
    """A CUDA torch tensor as the launcher reads it (what a CuPy array would give).

    ``element_strides`` decide the layout (``strides`` in bytes, as CuPy gives them);
    ``dtype`` is the NumPy dtype of a CuPy view (int16 for bfloat16); ``kernel_arg`` is the
    data pointer as a launch argument (a DLPack round trip per tensor would cost
    microseconds per call).
    """

    __slots__ = ("tensor", "element_strides", "kernel_arg")

    def __init__(self, tensor):
        self.tensor = tensor  # keeps the memory alive for the launch
        self.element_strides = tensor.stride()
        self.kernel_arg = address(tensor.data_ptr())

    @property
    def dtype(self):
        return _NUMPY_DTYPE[self.tensor.dtype]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple:
        return tuple(s * self.itemsize for s in self.element_strides)


class _TorchDtypes(dict):
    """torch dtype -> NumPy dtype of its CuPy view, filled on first use (no torch import here)."""

    def __missing__(self, dtype):
        name = str(dtype)
        value = {"torch.float16": np.dtype(np.float16), "torch.bfloat16": np.dtype(np.int16),
                 "torch.float32": np.dtype(np.float32), "torch.float64": np.dtype(np.float64)}[name]
        self[dtype] = value
        return value


_NUMPY_DTYPE = _TorchDtypes()


def ref(tensor):
    """A :class:`TensorRef` of a CUDA tensor; None stays None."""
    return None if tensor is None else TensorRef(tensor)


def as_cupy(arr):
    """A CuPy array of the same memory (a TensorRef crosses by DLPack); CuPy arrays as they are."""
    return to_cupy(arr.tensor) if type(arr) is TensorRef else arr


class _StreamHandle:
    """The CUDA stream protocol for a torch stream (works whether or not torch has it)."""

    def __init__(self, stream):
        self.stream = stream  # keeps the torch stream alive

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


@contextlib.contextmanager
def on_torch_stream(device):
    """Make torch's current stream of ``device`` CuPy's current stream (and ``device`` the
    current device of both: torch exports tensors by DLPack only from its current device).

    torch's default stream is the legacy NULL stream (handle 0), which is CuPy's
    ``Stream.null``; any other stream is wrapped by ``Stream.from_external``.
    """
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index), cupy.cuda.Device(index):
        current = torch.cuda.current_stream(index)
        if current.cuda_stream == 0:
            stream = cupy.cuda.Stream.null
        else:
            stream = cupy.cuda.Stream.from_external(_StreamHandle(current))
        with stream:
            yield


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
    stream = cupy_stream(torch_stream(device), device)
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
