"""anynorm: layer, RMS, instance and group normalization over arbitrary axes, for any
array-API library (NumPy, PyTorch, CuPy, Dask, JAX, ...), with CUDA kernels on GPU."""

import sys as _sys

from ._backend import get_backend, set_backend, use_backend
from ._functional import (
    group_norm,
    group_norm_backward,
    instance_norm,
    instance_norm_backward,
    layer_norm,
    layer_norm_backward,
    rms_norm,
    rms_norm_backward,
)
from ._modules import GroupNorm, InstanceNorm, LayerNorm, RMSNorm

__version__ = "0.1.0"

__all__ = [
    "layer_norm", "rms_norm", "instance_norm", "group_norm",
    "layer_norm_backward", "rms_norm_backward", "instance_norm_backward", "group_norm_backward",
    "LayerNorm", "RMSNorm", "InstanceNorm", "GroupNorm",
    "set_backend", "get_backend", "use_backend",
]


def _register_torch_ops():
    """Register ``torch.ops.anynorm.forward``/``backward`` (CUDA kernels behind them) when
    torch is loaded and CuPy importable, so that they exist before anynorm's first call
    (torch.library.opcheck, torch.compile in a fresh process)."""
    try:
        from ._cuda._executor import _torch_ops
    except ImportError:  # no usable CuPy: the ops would have no kernels to run
        return
    try:
        _torch_ops()
    except Exception:  # torch without torch.library.custom_op: the kernels take no torch ops
        pass


if "torch" in _sys.modules:  # importing torch here would slow NumPy-only users by seconds
    from ._calls import bind_torch as _bind_torch

    _bind_torch()


def __getattr__(name):
    # anynorm.nn needs torch: import it on first use only.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
