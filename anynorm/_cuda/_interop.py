"""Hand torch CUDA tensors to CuPy without copies, on torch's current stream.

Tensors cross through DLPack (``cupy.from_dlpack``); bfloat16 crosses as int16 bits so that
no CuPy bfloat16 support is needed (the kernels get the dtype separately). Work runs on
torch's current stream of the tensor's device, wrapped by ``cupy.cuda.Stream.from_external``.
"""

from __future__ import annotations

import contextlib

import cupy

__all__ = ["to_cupy", "on_torch_stream", "dtype_key"]

_KEYS = ("float16", "bfloat16", "float32", "float64")


def dtype_key(dtype) -> str | None:
    """"float16" / "bfloat16" / "float32" / "float64" for a NumPy/CuPy or torch dtype, else None."""
    name = str(dtype)
    name = name[len("torch."):] if name.startswith("torch.") else name
    return name if name in _KEYS else None


def to_cupy(tensor):
    """A CuPy view of a CUDA tensor (int16 bits for bfloat16); None stays None."""
    if tensor is None:
        return None
    import torch

    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return cupy.from_dlpack(tensor)


class _StreamHandle:
    """The CUDA stream protocol for a torch stream (works whether or not torch has it)."""

    def __init__(self, stream):
        self.stream = stream  # keeps the torch stream alive

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


@contextlib.contextmanager
def on_torch_stream(device):
    """Make CuPy's current device and stream torch's current ones for ``device``."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        stream = cupy.cuda.Stream.from_external(_StreamHandle(torch.cuda.current_stream(index)))
        with stream:
            yield
