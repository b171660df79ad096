"""PyTorch modules: drop-ins for their ``torch.nn`` namesakes, run by anynorm.

Each subclasses the torch module it replaces, so constructor arguments, defaults, parameter
names, ``state_dict`` keys and ``reset_parameters`` are PyTorch's own; only ``forward``
changes, plus one keyword: ``axis=`` (LayerNorm, RMSNorm; default the trailing
``len(normalized_shape)`` axes) or ``channel_axis=`` (GroupNorm, InstanceNorm; default 1).
"""

from __future__ import annotations

import torch
from torch.nn.modules.instancenorm import _InstanceNorm

from ._functional import group_norm, instance_norm, layer_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm"]


def _default_axis(normalized_shape, axis):
    return tuple(range(-len(normalized_shape), 0)) if axis is None else axis


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over any axes; ``forward(x, residual=None)`` (see ``anynorm.layer_norm``)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, axis=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.axis = _default_axis(self.normalized_shape, axis)

    def forward(self, x, residual=None):
        return layer_norm(x, self.weight, self.bias, axis=self.axis, eps=self.eps, residual=residual)

    def extra_repr(self):
        return f"{super().extra_repr()}, axis={self.axis}"


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over any axes; ``forward(x, residual=None)`` (see ``anynorm.rms_norm``)."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None,
                 *, axis=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.axis = _default_axis(self.normalized_shape, axis)

    def forward(self, x, residual=None):
        return rms_norm(x, self.weight, axis=self.axis, eps=self.eps, residual=residual)

    def extra_repr(self):
        return f"{super().extra_repr()}, axis={self.axis}"


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` with the channels on any axis (``channel_axis=-1`` for NHWC)."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None,
                 *, bias=True, channel_axis=1):
        super().__init__(num_groups, num_channels, eps, affine, device, dtype, bias=bias)
        self.channel_axis = channel_axis

    def forward(self, x):
        return group_norm(x, self.num_groups, self.weight, self.bias, channel_axis=self.channel_axis,
                          eps=self.eps)

    def extra_repr(self):
        return f"{super().extra_repr()}, channel_axis={self.channel_axis}"


class InstanceNorm(_InstanceNorm):
    """``torch.nn.InstanceNorm1d/2d/3d`` in one class: batched inputs of any spatial rank.

    Statistics always come from the input (``track_running_stats=True`` raises
    NotImplementedError); ``channel_axis=-1`` serves channels-last inputs.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False,
                 device=None, dtype=None, *, bias=True, channel_axis=1):
        if track_running_stats:
            raise NotImplementedError("anynorm.nn.InstanceNorm does not track running statistics: "
                                      "track_running_stats must be False")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self.channel_axis = channel_axis

    def forward(self, x):
        if -x.ndim <= self.channel_axis < x.ndim and x.shape[self.channel_axis] != self.num_features:
            raise ValueError(f"x must have num_features={self.num_features} channels on axis "
                             f"{self.channel_axis}, got shape {tuple(x.shape)}")
        return instance_norm(x, self.weight, self.bias, channel_axis=self.channel_axis, eps=self.eps)

    def extra_repr(self):
        return f"{super().extra_repr()}, channel_axis={self.channel_axis}"
