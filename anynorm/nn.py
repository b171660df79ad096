"""PyTorch modules: drop-ins for their ``torch.nn`` namesakes, run by anynorm.

Each subclasses the torch module it replaces, so constructor arguments, defaults, parameter
names, ``state_dict`` keys and ``reset_parameters`` are PyTorch's own; ``forward`` runs
anynorm's function (autograd on CPU and CUDA), and one keyword is added: ``axis=``
(LayerNorm, RMSNorm; default the trailing ``len(normalized_shape)`` axes) or
``channel_axis=`` (GroupNorm, InstanceNorm; default 1).  Each call checks the input's sizes
on those axes against the module's and names the input's shape when they differ.
"""

from __future__ import annotations

import torch
from torch.nn.modules.instancenorm import _InstanceNorm

from ._functional import group_norm, instance_norm, layer_norm, rms_norm
from ._modules import check_axes_input, check_channel_input, axes_picker

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm"]

_Proxy = torch.fx.Proxy


# torch.fx symbolic tracing (torchvision's feature extraction, FX quantization) records each
# module's call as one node of these (torch.nn's own modules are FX leaves; these are not,
# and tracing into anynorm's shape checks would fail on proxies)
@torch.fx.wrap
def _fx_layer_norm(x, weight, bias, axis, eps, residual):
    return layer_norm(x, weight, bias, axis=axis, eps=eps, residual=residual)


@torch.fx.wrap
def _fx_rms_norm(x, weight, axis, eps, residual):
    return rms_norm(x, weight, axis=axis, eps=eps, residual=residual)


@torch.fx.wrap
def _fx_group_norm(x, num_groups, weight, bias, channel_axis, eps):
    return group_norm(x, num_groups, weight, bias, channel_axis=channel_axis, eps=eps)


@torch.fx.wrap
def _fx_instance_norm(x, weight, bias, channel_axis, eps):
    return instance_norm(x, weight, bias, channel_axis=channel_axis, eps=eps)


def _default_axis(normalized_shape, axis):
    return tuple(range(-len(normalized_shape), 0)) if axis is None else axis


class _AxisInput:
    """``axis`` as a property: setting it works out once how each call reads the input's sizes."""

    @property
    def axis(self):
        """The normalized axes: an int or a tuple of ints, negatives allowed."""
        return self.__dict__["_axis"]

    @axis.setter
    def axis(self, value):
        self.__dict__["_axis"] = value
        self.__dict__["_pick"], self.__dict__["_want"] = axes_picker(value, tuple(self.normalized_shape))

    # the picker is a closure (torch.compile traces it, not operator.itemgetter): pickling
    # (torch.save of a whole model, multiprocessing) leaves it out and remakes it on load
    def __getstate__(self):
        state = super().__getstate__()
        return {k: v for k, v in state.items() if k not in ("_pick", "_want")}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.axis = state["_axis"]


class LayerNorm(_AxisInput, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` over any axes, run by :func:`anynorm.layer_norm`.

    For the n elements x of each slice over ``axis``::

        mean = sum(x) / n
        var  = sum((x - mean)^2) / n          # biased, as in PyTorch
        y    = (x - mean) / sqrt(var + eps) * weight + bias

    Args:
        normalized_shape (int or tuple): the input's sizes on the normalized axes;
            ``weight`` and ``bias`` have this shape.
        eps (float): added to the variance inside the square root; default 1e-5.
        elementwise_affine (bool): learnable ``weight`` (ones) and ``bias`` (zeros); default True.
        bias (bool): with ``elementwise_affine``, whether ``bias`` exists; default True.
        device, dtype: of the parameters, as in torch.
        axis (int or tuple of ints, keyword-only): the axes to normalize, any order,
            negatives allowed; default the trailing ``len(normalized_shape)`` axes, as
            ``torch.nn.LayerNorm``.  ``axis=1`` on NCHW input is ConvNeXt's channels-first
            LayerNorm, without the two permutes.

    ``forward(x, residual=None)``: ``y``, or with ``residual`` (same shape as ``x``) the pair
    ``(y, h)`` where ``h = x + residual`` and ``y`` is its norm: the residual add of a pre-norm
    transformer block fused into the norm; gradients flow to ``x`` and ``residual``.

    Example::

        >>> import torch, anynorm.nn
        >>> norm = anynorm.nn.LayerNorm(768)            # same arguments and state_dict as torch's
        >>> norm.load_state_dict(torch.nn.LayerNorm(768).state_dict())
        <All keys matched successfully>
        >>> x, r = torch.randn(4, 128, 768), torch.randn(4, 128, 768)
        >>> y = norm(x)
        >>> y, h = norm(x, residual=r)                  # y = LN(x + r), h = x + r
        >>> anynorm.nn.LayerNorm(96, axis=1)(torch.randn(8, 96, 56, 56)).shape
        torch.Size([8, 96, 56, 56])
        >>> import numpy as np, anynorm                 # NumPy: the same module without autograd
        >>> anynorm.LayerNorm(768)(np.ones((4, 768), dtype=np.float32)).shape
        (4, 768)

    Raises:
        ValueError: the input's sizes on ``axis`` are not ``normalized_shape`` (the message
            names the input's shape and what was expected, e.g. ``expected an input of shape
            [*, 128] ..., got an input of shape (2, 64)``); an axis out of range or repeated;
            ``residual`` of another shape; a 0-d input; tensors on different devices.
        TypeError: ``x`` is not a tensor; its dtype is integer, bool or complex; ``residual``
            from another library.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None, *, axis=None):
        """Arguments as ``torch.nn.LayerNorm``'s, plus ``axis=`` (see the class docstring)."""
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.axis = _default_axis(self.normalized_shape, axis)

    def forward(self, x, residual=None):
        """``y = layer_norm(x, weight, bias, axis=axis, eps=eps)``; with ``residual``:
        ``(y, h)``, ``h = x + residual``, ``y`` its norm.  Raises ValueError naming ``x``'s
        shape when its sizes on ``axis`` are not ``normalized_shape``."""
        if type(x) is _Proxy:
            return _fx_layer_norm(x, self.weight, self.bias, self._axis, self.eps, residual)
        check_axes_input(self, x)
        return layer_norm(x, self.weight, self.bias, axis=self._axis, eps=self.eps, residual=residual)

    def _signature(self):
        return f"anynorm.nn.LayerNorm({self.extra_repr()})"

    def extra_repr(self):
        """torch's description of the module, plus the anynorm keyword."""
        return f"{super().extra_repr()}, axis={self.axis}"


class RMSNorm(_AxisInput, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` over any axes, run by :func:`anynorm.rms_norm`.

    For the n elements x of each slice over ``axis``::

        y = x / sqrt(sum(x^2) / n + eps) * weight

    Args:
        normalized_shape (int or tuple): the input's sizes on the normalized axes (``weight``'s shape).
        eps (float or None): default None, ``torch.finfo(x.dtype).eps``, as in PyTorch.
        elementwise_affine (bool): a learnable ``weight`` (ones); default True.
        device, dtype: of the parameters, as in torch.
        axis (int or tuple of ints, keyword-only): the axes to normalize; default the
            trailing ``len(normalized_shape)`` axes.

    ``forward(x, residual=None)``: ``y``, or ``(y, h)`` with ``h = x + residual``.

    Example::

        >>> import torch, anynorm.nn
        >>> norm = anynorm.nn.RMSNorm(4096)
        >>> norm.load_state_dict(torch.nn.RMSNorm(4096).state_dict())
        <All keys matched successfully>
        >>> y, h = norm(torch.randn(2, 16, 4096), residual=torch.randn(2, 16, 4096))
        >>> import numpy as np, anynorm                 # NumPy: anynorm.RMSNorm, no autograd
        >>> anynorm.RMSNorm(4096)(np.ones((2, 4096), dtype=np.float32)).shape
        (2, 4096)

    Raises:
        ValueError: the input's sizes on ``axis`` are not ``normalized_shape`` (the message
            names the input's shape and what was expected); an axis out of range or
            repeated; ``residual`` of another shape; a 0-d input; tensors on different devices.
        TypeError: ``x`` is not a tensor; its dtype is integer, bool or complex; ``residual``
            from another library.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None,
                 *, axis=None):
        """Arguments as ``torch.nn.RMSNorm``'s, plus ``axis=`` (see the class docstring)."""
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.axis = _default_axis(self.normalized_shape, axis)

    def forward(self, x, residual=None):
        """``y = rms_norm(x, weight, axis=axis, eps=eps)``; with ``residual``: ``(y, h)``,
        ``h = x + residual``.  Raises ValueError naming ``x``'s shape when its sizes on
        ``axis`` are not ``normalized_shape``."""
        if type(x) is _Proxy:
            return _fx_rms_norm(x, self.weight, self._axis, self.eps, residual)
        check_axes_input(self, x)
        return rms_norm(x, self.weight, axis=self._axis, eps=self.eps, residual=residual)

    def _signature(self):
        return f"anynorm.nn.RMSNorm({self.extra_repr()})"

    def extra_repr(self):
        """torch's description of the module, plus the anynorm keyword."""
        return f"{super().extra_repr()}, axis={self.axis}"


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` with the channels on any axis, run by :func:`anynorm.group_norm`.

    The C channels split into ``num_groups`` consecutive groups; for the n elements x of one
    (sample, group), over the group's channels and every other non-batch axis::

        mean = sum(x) / n;  var = sum((x - mean)^2) / n
        y    = (x - mean) / sqrt(var + eps) * weight[c] + bias[c]

    Args:
        num_groups (int): a positive divisor of ``num_channels``.
        num_channels (int): C, the input's size on ``channel_axis``; ``weight``/``bias`` are ``(C,)``.
        eps (float): default 1e-5.
        affine (bool): learnable ``weight`` (ones) and ``bias`` (zeros); default True.
        device, dtype: of the parameters, as in torch.
        bias (bool, keyword-only): with ``affine``, whether ``bias`` exists; default True.
        channel_axis (int, keyword-only): default 1 (NCHW); ``-1`` for channels-last (NHWC)
            tensors, without permutes.

    Example::

        >>> import torch, anynorm.nn
        >>> gn = anynorm.nn.GroupNorm(32, 256)
        >>> gn.load_state_dict(torch.nn.GroupNorm(32, 256).state_dict())
        <All keys matched successfully>
        >>> gn(torch.randn(2, 256, 16, 16)).shape
        torch.Size([2, 256, 16, 16])
        >>> anynorm.nn.GroupNorm(32, 256, channel_axis=-1)(torch.randn(2, 16, 16, 256)).shape
        torch.Size([2, 16, 16, 256])
        >>> import numpy as np, anynorm                 # NumPy: anynorm.GroupNorm, no autograd
        >>> anynorm.GroupNorm(32, 256)(np.ones((2, 256, 4, 4), dtype=np.float32)).shape
        (2, 256, 4, 4)

    Raises:
        ValueError: ``num_groups`` does not divide ``num_channels`` (at construction, from
            torch); the input does not have ``num_channels`` channels on ``channel_axis``
            (the message names the input's shape); ``channel_axis`` is 0 (the batch) or out
            of range; a 0-d input; tensors on different devices.
        TypeError: ``x`` is not a tensor; its dtype is integer, bool or complex; ``residual``
            from another library.
    """

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None,
                 *, bias=True, channel_axis=1):
        """Arguments as ``torch.nn.GroupNorm``'s, plus ``channel_axis=`` (see the class docstring)."""
        super().__init__(num_groups, num_channels, eps, affine, device, dtype, bias=bias)
        self.channel_axis = channel_axis

    def forward(self, x):
        """``group_norm(x, num_groups, weight, bias, channel_axis=channel_axis, eps=eps)``.
        Raises ValueError naming ``x``'s shape when it lacks ``num_channels`` channels on
        ``channel_axis``."""
        if type(x) is _Proxy:
            return _fx_group_norm(x, self.num_groups, self.weight, self.bias, self.channel_axis, self.eps)
        check_channel_input(self, x, self.num_channels)
        return group_norm(x, self.num_groups, self.weight, self.bias, channel_axis=self.channel_axis,
                          eps=self.eps)

    def _signature(self):
        return f"anynorm.nn.GroupNorm({self.extra_repr()})"

    def extra_repr(self):
        """torch's description of the module, plus the anynorm keyword."""
        return f"{super().extra_repr()}, channel_axis={self.channel_axis}"


class InstanceNorm(_InstanceNorm):
    """``torch.nn.InstanceNorm1d/2d/3d`` in one class, run by :func:`anynorm.instance_norm`.

    Takes batched inputs of any spatial rank, and a 2-d input as one unbatched sample
    ``(C, L)`` (``(L, C)`` with ``channel_axis=-1``), as ``torch.nn.InstanceNorm1d`` does
    (3-d inputs are batched ``(N, C, L)``: the class has no fixed spatial rank to tell an
    unbatched image by).  Axis 0 is the batch; for the n elements x of one (sample, channel),
    over every other axis::

        mean = sum(x) / n;  var = sum((x - mean)^2) / n
        y    = (x - mean) / sqrt(var + eps) * weight[c] + bias[c]

    Statistics always come from the input: ``track_running_stats=True`` raises
    NotImplementedError, and ``momentum`` is accepted for torch's signature only.

    Args:
        num_features (int): C, the input's size on ``channel_axis``.
        eps (float): default 1e-5.
        momentum (float): unused (no running statistics).
        affine (bool): learnable ``weight`` (ones) and ``bias`` (zeros); default False, as torch.
        track_running_stats (bool): must be False.
        device, dtype: of the parameters, as in torch.
        bias (bool, keyword-only): with ``affine``, whether ``bias`` exists; default True.
        channel_axis (int, keyword-only): default 1; ``-1`` for channels-last tensors.

    Example::

        >>> import torch, anynorm.nn
        >>> inorm = anynorm.nn.InstanceNorm(64, affine=True)       # InstanceNorm1d/2d/3d
        >>> inorm.load_state_dict(torch.nn.InstanceNorm2d(64, affine=True).state_dict())
        <All keys matched successfully>
        >>> inorm(torch.randn(2, 64, 32, 32)).shape
        torch.Size([2, 64, 32, 32])
        >>> inorm(torch.randn(2, 64, 8, 8, 8)).shape                  # 3-d images too
        torch.Size([2, 64, 8, 8, 8])
        >>> import numpy as np, anynorm            # NumPy: anynorm.InstanceNorm, no autograd
        >>> anynorm.InstanceNorm(64)(np.ones((2, 64, 5), dtype=np.float32)).shape
        (2, 64, 5)

    Raises:
        NotImplementedError: ``track_running_stats=True``.
        ValueError: the input does not have ``num_features`` channels on ``channel_axis``
            (the message names the input's shape); ``channel_axis`` is 0 (the batch); a 0-d
            input; tensors on different devices.
        TypeError: ``x`` is not a tensor; its dtype is integer, bool or complex; ``residual``
            from another library.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False,
                 device=None, dtype=None, *, bias=True, channel_axis=1):
        """Arguments as ``torch.nn.InstanceNorm2d``'s, plus ``channel_axis=`` (see the class docstring)."""
        if track_running_stats:
            raise NotImplementedError("anynorm.nn.InstanceNorm does not track running statistics: "
                                      "track_running_stats must be False")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        self.channel_axis = channel_axis

    def forward(self, x):
        """``instance_norm(x, weight, bias, channel_axis=channel_axis, eps=eps)``.  Raises
        ValueError naming ``x``'s shape when it lacks ``num_features`` channels on
        ``channel_axis``."""
        if type(x) is _Proxy:
            return _fx_instance_norm(x, self.weight, self.bias, self.channel_axis, self.eps)
        if x.dim() == 2:  # one unbatched sample, as torch.nn.InstanceNorm1d takes it
            return self.forward(x.unsqueeze(0)).squeeze(0)
        check_channel_input(self, x, self.num_features)
        return instance_norm(x, self.weight, self.bias, channel_axis=self.channel_axis, eps=self.eps)

    def _signature(self):
        return f"anynorm.nn.InstanceNorm(num_features={self.num_features}, channel_axis={self.channel_axis})"

    def extra_repr(self):
        """torch's description of the module, plus the anynorm keyword."""
        return f"{super().extra_repr()}, channel_axis={self.channel_axis}"
