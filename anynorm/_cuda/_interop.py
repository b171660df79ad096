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
