"""Array-API module classes (no autograd): parameters held in any library, PyTorch's keys.

``LayerNorm(normalized_shape, ...)``, ``RMSNorm``, ``GroupNorm``, ``InstanceNorm`` take the
constructor arguments of their ``torch.nn`` namesakes plus ``xp=`` (an array library module
or namespace, default NumPy), ``device=`` and ``dtype=`` (default float32).  ``weight`` starts
as ones and ``bias`` as zeros; ``state_dict()``/``load_state_dict()`` use PyTorch's keys and
accept arrays from any library.
"""

from __future__ import annotations

import functools
import importlib
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

    # pickling (multiprocessing, saving a model): the namespace goes by its module's name and
    # the input check's picker, a closure, is remade from the axis on load
    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_pick", "_want")}
        state["xp"] = self.xp.__name__
        return state

    def __setstate__(self, state):
        state = dict(state)
        state["xp"] = importlib.import_module(state["xp"])
        self.__dict__.update(state)
        if "_axis" in state:
            self.axis = state["_axis"]


# --- the per-call input check ------------------------------------------------------------------
#
# A module knows what its input must look like on the axes its parameters lie along; checking
# that per call costs one tuple compare, and lets the error name the input, not the weight.


def _axes_tuple(axis):
    """``axis`` as a tuple of ints, or None when it is not an int or a non-empty tuple of ints."""
    if isinstance(axis, numbers.Integral) and not isinstance(axis, bool):
        return (int(axis),)
    try:
        axes = tuple(axis)
    except TypeError:
        return None
    if not axes or not all(isinstance(a, numbers.Integral) and not isinstance(a, bool) for a in axes):
        return None
    return tuple(int(a) for a in axes)


def axes_picker(axis, normalized_shape):
    """How a module reads the sizes of ``x`` on its normalized axes, worked out once.

    Returns ``(pick, want)``: ``pick(x.shape) == want`` when ``x`` fits (``pick`` may raise
    IndexError when it does not).  Axes all negative or all non-negative sort the same at any
    rank, so ``pick`` indexes the shape directly (a fraction of a microsecond; a plain
    function, which torch.compile traces, where ``operator.itemgetter`` breaks its graph); mixed signs sort per
    call.  ``(None, None)`` when ``axis`` is not an int or a tuple of ints: then no module check
    runs and the function names the problem.
    """
    axes = _axes_tuple(axis)
    if axes is None or len(axes) != len(normalized_shape):
        return None, None
    want = tuple(normalized_shape)
    if all(a < 0 for a in axes) or all(a >= 0 for a in axes):
        if len(set(axes)) != len(axes):
            return None, None
        return _getter(sorted(axes)), (want[0] if len(want) == 1 else want)
    return functools.partial(sizes_on, where=axes), want


def _getter(axes):
    """``shape -> shape[a]`` for one axis, ``shape -> (shape[a], ...)`` for several."""
    if len(axes) == 1:
        axis = axes[0]
        return lambda shape: shape[axis]
    return lambda shape: tuple([shape[a] for a in axes])


def sizes_on(shape, where):
    """``shape``'s sizes at the axes ``where``, in ascending axis order; None when an axis is out
    of range or two name the same axis."""
    ndim = len(shape)
    if not all(-ndim <= a < ndim for a in where):
        return None
    axes = sorted(a % ndim for a in where)
    if len(set(axes)) != len(axes):
        return None
    return tuple(shape[a] for a in axes)


def wrong_input(module, shape, expected):
    """Raise the ValueError that names the input's shape and what ``module`` expected, unless a
    size of ``shape`` is unknown (Dask's nan, None): then the function checks the call."""
    shape = tuple(shape)
    if not all(isinstance(s, numbers.Integral) for s in shape):
        return
    raise ValueError(f"{module._signature()} expected {expected}, got an input of shape {shape}")


def expected_axes(normalized_shape, axis):
    """The words for what a LayerNorm/RMSNorm module expects of its input."""
    axes = _axes_tuple(axis) or ()
    if sorted(axes) == list(range(-len(normalized_shape), 0)):
        star = ", ".join(["*"] + [str(s) for s in normalized_shape])
        return f"an input of shape [{star}] (normalized_shape {normalized_shape} on the trailing axes)"
    return f"an input with sizes {normalized_shape} on axis={axis} (normalized_shape, in axis order)"


def expected_channels(count, channel_axis):
    return f"an input with {count} channels on channel_axis={channel_axis}"


def check_axes_input(module, x):
    """The per-call check of LayerNorm/RMSNorm: ``x``'s sizes on the normalized axes."""
    pick = module._pick
    shape = getattr(x, "shape", None)
    if pick is None or shape is None:  # an axis the function will reject, or not an array
        return
    try:
        got = pick(shape)
    except IndexError:  # fewer axes than the module normalizes
        got = None
    if got != module._want:
        wrong_input(module, shape, expected_axes(tuple(module.normalized_shape), module.axis))


def check_channel_input(module, x, count):
    """The per-call check of GroupNorm/InstanceNorm: ``x``'s size on the channel axis."""
    shape = getattr(x, "shape", None)
    if shape is None or type(module.channel_axis) is not int:
        return
    try:
        ok = shape[module.channel_axis] == count
    except IndexError:  # a 0-d input, or channel_axis past the input's axes
        ok = False
    if not ok:
        wrong_input(module, shape, expected_channels(count, module.channel_axis))


def _as_shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


class LayerNorm(_Module):
    """Layer norm over any axes, with ``weight``/``bias`` held in any array library (no autograd).

    Calls :func:`anynorm.layer_norm`.  For the n elements x of each slice over ``axis``::

        mean = sum(x) / n
        var  = sum((x - mean)^2) / n          # biased, as in PyTorch
        y    = (x - mean) / sqrt(var + eps) * weight + bias

    Args:
        normalized_shape: int or tuple: the input's sizes on the normalized axes; ``weight``
            and ``bias`` have this shape.
        eps: float >= 0 added to the variance (default 1e-5).
        elementwise_affine: hold ``weight`` (ones) and ``bias`` (zeros); default True.
        bias: with ``elementwise_affine``, whether ``bias`` exists (default True).
        axis: keyword-only int or tuple of ints, any order, negatives allowed: the axes to
            normalize; default the trailing ``len(normalized_shape)`` axes, as in PyTorch.
            ``axis=1`` on NCHW input is ConvNeXt's channels-first LayerNorm.
        xp: the array library of the parameters (a module such as ``numpy``, ``cupy``,
            ``torch``, ``jax.numpy``, or an array-API namespace); default NumPy.
        device, dtype: of the parameters; dtype default float32.

    Call: ``module(x)`` returns ``y``; ``module(x, residual=r)`` returns ``(y, h)``: the norm
    of ``h = x + r`` (pre-norm transformer blocks), reading each input once.
    ``state_dict()``/``load_state_dict()`` use PyTorch's keys (``weight``, ``bias``) and take
    arrays of any library, so the parameters of a ``torch.nn.LayerNorm`` load directly.

    Example::

        >>> import numpy as np, anynorm
        >>> norm = anynorm.LayerNorm(768)                          # NumPy float32 parameters
        >>> y = norm(np.random.default_rng(0).standard_normal((4, 768), dtype=np.float32))
        >>> y, h = norm(y, residual=y)                              # fused residual add
        >>> import torch
        >>> norm.load_state_dict(torch.nn.LayerNorm(768).state_dict())
        >>> t = anynorm.LayerNorm(96, axis=1, xp=torch)             # torch parameters, NCHW input
        >>> t(torch.randn(2, 96, 7, 7)).shape
        torch.Size([2, 96, 7, 7])

    Raises:
        ValueError: the input's sizes on ``axis`` are not ``normalized_shape`` (the message
            names the input's shape and the shape expected); an axis out of range or
            repeated; ``residual`` of another shape; a 0-d input.
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``x`` and the
            parameters come from different libraries.
        ValueError: ``eps`` negative or not finite; arrays on different devices.
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, *,
                 axis=None, xp=None, device=None, dtype=None):
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.axis = tuple(range(-len(self.normalized_shape), 0)) if axis is None else axis
        names = ("weight", "bias") if bias else ("weight",)
        self._init_params(self.normalized_shape, names if elementwise_affine else (), xp, device, dtype)

    @property
    def axis(self):
        """The normalized axes (an int or a tuple of ints)."""
        return self._axis

    @axis.setter
    def axis(self, value):
        self._axis = value
        self._pick, self._want = axes_picker(value, self.normalized_shape)

    def __call__(self, x, residual=None):
        """``y``, or ``(y, h)`` with ``residual``: the layer norm of ``x`` (plus ``residual``)."""
        check_axes_input(self, x)
        return layer_norm(x, self.weight, self.bias, axis=self.axis, eps=self.eps, residual=residual)

    def _signature(self):
        return f"anynorm.LayerNorm({self._extra_repr()})"

    def _extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, axis={self.axis}"


class RMSNorm(_Module):
    """RMS norm over any axes, with ``weight`` held in any array library (no autograd).

    Calls :func:`anynorm.rms_norm`.  For the n elements x of each slice over ``axis``::

        y = x / sqrt(sum(x^2) / n + eps) * weight

    Args:
        normalized_shape: int or tuple: the input's sizes on the normalized axes (``weight``'s shape).
        eps: float >= 0, or None (the default): ``finfo(x.dtype).eps``, as in PyTorch.
        elementwise_affine: hold ``weight`` (ones); default True.
        axis: keyword-only int or tuple of ints: the axes to normalize; default the trailing
            ``len(normalized_shape)`` axes.
        xp, device, dtype: the parameters' library (default NumPy), device and dtype (float32).

    Call: ``module(x)`` returns ``y``; ``module(x, residual=r)`` returns ``(y, h)``, ``h = x + r``.

    Example::

        >>> import numpy as np, torch, anynorm
        >>> norm = anynorm.RMSNorm(64)
        >>> y = norm(np.ones((2, 64), dtype=np.float32))
        >>> norm.load_state_dict(torch.nn.RMSNorm(64).state_dict())
        >>> anynorm.RMSNorm(64, xp=torch)(torch.randn(3, 64)).shape
        torch.Size([3, 64])

    Raises:
        ValueError: the input's sizes on ``axis`` are not ``normalized_shape`` (the message
            names the input's shape and the shape expected); an axis out of range or
            repeated; ``residual`` of another shape; a 0-d input.
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``x`` and the
            parameters come from different libraries.
        ValueError: ``eps`` negative or not finite; arrays on different devices.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, *,
                 axis=None, xp=None, device=None, dtype=None):
        self.normalized_shape = _as_shape(normalized_shape)
        self.eps = eps
        self.axis = tuple(range(-len(self.normalized_shape), 0)) if axis is None else axis
        self._init_params(self.normalized_shape, ("weight",) if elementwise_affine else (), xp, device, dtype)

    axis = LayerNorm.axis

    def __call__(self, x, residual=None):
        """``y``, or ``(y, h)`` with ``residual``: the RMS norm of ``x`` (plus ``residual``)."""
        check_axes_input(self, x)
        return rms_norm(x, self.weight, axis=self.axis, eps=self.eps, residual=residual)

    def _signature(self):
        return f"anynorm.RMSNorm({self._extra_repr()})"

    def _extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, axis={self.axis}"


class GroupNorm(_Module):
    """Group norm with the channels on any axis, ``weight``/``bias`` in any library (no autograd).

    Calls :func:`anynorm.group_norm`.  The C channels split into ``num_groups`` consecutive
    groups; for the n elements x of one (sample, group) over the group's channels and every
    other non-batch axis::

        mean = sum(x) / n;  var = sum((x - mean)^2) / n
        y    = (x - mean) / sqrt(var + eps) * weight[c] + bias[c]

    Args:
        num_groups: a positive divisor of ``num_channels``.
        num_channels: C, the input's size on ``channel_axis``; ``weight``/``bias`` have shape ``(C,)``.
        eps: float >= 0 (default 1e-5).
        affine: hold ``weight`` (ones) and ``bias`` (zeros); default True.
        bias: keyword-only; with ``affine``, whether ``bias`` exists (default True).
        channel_axis: keyword-only, default 1 (NCHW); -1 for channels-last (NHWC) input.
        xp, device, dtype: the parameters' library (default NumPy), device and dtype (float32).

    Example::

        >>> import numpy as np, torch, anynorm
        >>> gn = anynorm.GroupNorm(4, 16)
        >>> y = gn(np.zeros((2, 16, 8, 8), dtype=np.float32))                  # NCHW
        >>> gn.load_state_dict(torch.nn.GroupNorm(4, 16).state_dict())
        >>> nhwc = anynorm.GroupNorm(4, 16, channel_axis=-1, xp=torch)
        >>> nhwc(torch.randn(2, 8, 8, 16)).shape
        torch.Size([2, 8, 8, 16])

    Raises:
        ValueError: ``num_groups`` does not divide ``num_channels`` (at construction); the
            input does not have ``num_channels`` channels on ``channel_axis`` (the message
            names the input's shape); ``channel_axis`` is 0 (the batch); a 0-d input.
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``x`` and the
            parameters come from different libraries.
        ValueError: ``eps`` negative or not finite; arrays on different devices.
    """

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
        """The group norm of ``x``."""
        check_channel_input(self, x, self.num_channels)
        return group_norm(x, self.num_groups, self.weight, self.bias, channel_axis=self.channel_axis,
                          eps=self.eps)

    def _signature(self):
        return f"anynorm.GroupNorm({self._extra_repr()})"

    def _extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, channel_axis={self.channel_axis}"


class InstanceNorm(_Module):
    """Instance norm of inputs of any spatial rank, ``weight``/``bias`` in any library (no autograd).

    Calls :func:`anynorm.instance_norm`.  Axis 0 is the batch (a 2-d input is one unbatched
    sample ``(C, L)``, ``(L, C)`` channels-last, as ``torch.nn.InstanceNorm1d`` takes it);
    for the n elements x of one (sample, channel) over every other axis::

        mean = sum(x) / n;  var = sum((x - mean)^2) / n
        y    = (x - mean) / sqrt(var + eps) * weight[c] + bias[c]

    Args:
        num_features: C, the input's size on ``channel_axis``; ``weight``/``bias`` have shape ``(C,)``.
        eps: float >= 0 (default 1e-5).
        momentum: accepted for PyTorch's signature; unused (no running statistics).
        affine: hold ``weight`` (ones) and ``bias`` (zeros); default False, as in PyTorch.
        track_running_stats: must be False.
        bias: keyword-only; with ``affine``, whether ``bias`` exists (default True).
        channel_axis: keyword-only, default 1 (NCHW); -1 for channels-last input.
        xp, device, dtype: the parameters' library (default NumPy), device and dtype (float32).

    Example::

        >>> import numpy as np, torch, anynorm
        >>> inorm = anynorm.InstanceNorm(3, affine=True)
        >>> y = inorm(np.ones((2, 3, 5, 5), dtype=np.float32))
        >>> inorm.load_state_dict(torch.nn.InstanceNorm2d(3, affine=True).state_dict())
        >>> anynorm.InstanceNorm(3, channel_axis=-1, xp=torch)(torch.randn(2, 4, 4, 3)).shape
        torch.Size([2, 4, 4, 3])

    Raises:
        NotImplementedError: ``track_running_stats=True``.
        ValueError: the input does not have ``num_features`` channels on ``channel_axis``
            (the message names the input's shape); ``channel_axis`` is 0 (the batch); a 0-d input.
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``x`` and the
            parameters come from different libraries.
        ValueError: ``eps`` negative or not finite; arrays on different devices.
    """

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
        """The instance norm of ``x``."""
        if len(getattr(x, "shape", ())) == 2:  # one unbatched sample
            return self(x[None, ...])[0, ...]
        check_channel_input(self, x, self.num_features)
        return instance_norm(x, self.weight, self.bias, channel_axis=self.channel_axis, eps=self.eps)

    def _signature(self):
        return (f"anynorm.InstanceNorm(num_features={self.num_features}, eps={self.eps}, "
                f"channel_axis={self.channel_axis})")

    def _extra_repr(self):
        return f"{self.num_features}, eps={self.eps}, channel_axis={self.channel_axis}"
