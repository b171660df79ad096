"""anynorm: layer, RMS, instance and group normalization over arbitrary axes, for any
array-API library (NumPy, PyTorch, CuPy, Dask, JAX, ...), with CUDA kernels on GPU."""

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


def __getattr__(name):
    # anynorm.nn needs torch: import it on first use only.
    if name == "nn":
        import importlib

        return importlib.import_module(".nn", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
