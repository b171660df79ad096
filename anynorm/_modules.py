"""Array-API module classes (no autograd): parameters held in any library, PyTorch's keys.

``LayerNorm(normalized_shape, ...)``, ``RMSNorm``, ``GroupNorm``, ``InstanceNorm`` take the
constructor arguments of their ``torch.nn`` namesakes plus ``xp=`` (an array library module
or namespace, default NumPy), ``device=`` and ``dtype=`` (default float32).  ``weight`` starts
as ones and ``bias`` as zeros; ``state_dict()``/``load_state_dict()`` use PyTorch's keys and
accept arrays from any library.
"""

from __future__ import annotations

import numbers

import array_api_compat
import numpy as np

from ._functional import group_norm, instance_norm, layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm"]


def _host_copy(arr):
    """A NumPy copy of an array from any library (torch tensors detached, GPU arrays fetched)."""
    if array_api_compat.is_torch_array(arr):
        arr = arr.detach().cpu()
        if str(arr.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            arr = arr.float()
        return arr.numpy().copy()
    if array_api_compat.is_cupy_array(arr):
        return arr.get()
    return np.array(arr, copy=True)


class _Module:
    """Holds named parameters in one library and device; subclasses define ``__call__``."""

    _param_names: tuple = ()

    def _init_params(self, shape, names, xp, device, dtype):
        namespace = array_api_compat.array_namespace(xp.empty(0)) if xp is not None else \
            array_api_compat.array_namespace(np.empty(0))
        self.xp = namespace
        self.dtype = namespace.float32 if dtype is None else dtype
        self.device = device
        self._param_names = names
        fill = {"weight": namespace.ones, "bias": namespace.zeros}
        for name in ("weight", "bias"):
            value = fill[name](shape, dtype=self.dtype, device=device) if name in names else None
            setattr(self, name, value)

    def state_dict(self) -> dict:
        """The parameters under PyTorch's keys (``weight``, ``bias``), as held."""
        return {name: getattr(self, name) for name in self._param_names}

    def load_state_dict(self, state_dict) -> None:
        """Copy parameters from a mapping with PyTorch's keys; arrays of any library."""
        keys, wanted = set(state_dict), set(self._param_names)
        if keys != wanted:
            raise ValueError(f"state_dict must have exactly the keys {sorted(wanted)}, got {sorted(keys)} "
                             f"(missing {sorted(wanted - keys)}, unexpected {sorted(keys - wanted)})")
        for name in self._param_names:
            current = getattr(self, name)
            host = _host_copy(state_dict[name])
            if tuple(host.shape) != tuple(current.shape):
                raise ValueError(f"state_dict[{name!r}] must have shape {tuple(current.shape)}, "
                                 f"got {tuple(host.shape)}")
            setattr(self, name, self.xp.asarray(host, dtype=self.dtype, device=self.device))

    def __repr__(self):
        return f"{type(self).__name__}({self._extra_repr()})"


def _as_shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


class LayerNorm(_Module):
    """``y = layer_norm(x, weight, bias, axis=axis, eps=eps)``; axis defaults to the trailing ones."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *,
                 axis=None, xp=None, device=None, dtype=None):
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.axis = tuple(range(-len(self.normalized_shape), 0)) if axis is None else axis
        names = ("weight", "bias") if bias else ("weight",)
        self._init_params(self.normalized_shape, names if elementwise_affine else (), xp, device, dtype)

    def __call__(self, x, residual=None):
        return layer_norm(x, self.weight, self.bias, axis=self.axis, eps=self.eps, residual=residual)

    def _extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, axis={self.axis}"


class RMSNorm(_Module):
    """``y = rms_norm(x, weight, axis=axis, eps=eps)``; ``eps=None`` is ``finfo(x.dtype).eps``."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, *,
                 axis=None, xp=None, device=None, dtype=None):
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.axis = tuple(range(-len(self.normalized_shape), 0)) if axis is None else axis
        self._init_params(self.normalized_shape, ("weight",) if elementwise_affine else (), xp, device, dtype)

    def __call__(self, x, residual=None):
        return rms_norm(x, self.weight, axis=self.axis, eps=self.eps, residual=residual)

    def _extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, axis={self.axis}"


class GroupNorm(_Module):
    """``y = group_norm(x, num_groups, weight, bias, channel_axis=channel_axis, eps=eps)``."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, *, bias=True,
                 channel_axis=1, xp=None, device=None, dtype=None):
        if num_channels % num_groups:
            raise ValueError(f"num_groups must divide num_channels: got num_groups={num_groups}, "
                             f"num_channels={num_channels}")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.channel_axis = channel_axis
        names = ("weight", "bias") if bias else ("weight",)
        self._init_params((num_channels,), names if affine else (), xp, device, dtype)

    def __call__(self, x):
        return group_norm(x, self.num_groups, self.weight, self.bias, channel_axis=self.channel_axis,
                          eps=self.eps)

    def _extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, channel_axis={self.channel_axis}"


class InstanceNorm(_Module):
    """``y = instance_norm(x, weight, bias, channel_axis=channel_axis, eps=eps)``, any spatial rank."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False, *,
                 bias=True, channel_axis=1, xp=None, device=None, dtype=None):
        if track_running_stats:
            raise NotImplementedError("anynorm.InstanceNorm does not track running statistics: "
                                      "track_running_stats must be False")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.channel_axis = channel_axis
        names = ("weight", "bias") if bias else ("weight",)
        self._init_params((num_features,), names if affine else (), xp, device, dtype)

    def __call__(self, x):
        return instance_norm(x, self.weight, self.bias, channel_axis=self.channel_axis, eps=self.eps)

    def _extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, channel_axis={self.channel_axis}"
