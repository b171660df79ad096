"""Validate a call once and describe it as one normalization problem.

Every public function reduces to: view ``x`` as ``view_shape`` (identical to ``x.shape``
except for group norm, whose channel axis is split into ``(G, C/G)``), take statistics
over ``reduce_axes`` of that view, and scale/shift by parameters laid along
``param_axes``.  Executors receive a :class:`Plan` and never re-validate.
"""

from __future__ import annotations

import functools
import math
import operator
import sys
from dataclasses import dataclass, field
from typing import Any

import array_api_compat
import numpy as np

__all__ = ["Plan", "make_plan", "plan_for", "namespace_of", "array_kind"]

_OPS = ("layer_norm", "rms_norm", "instance_norm", "group_norm")


@dataclass(frozen=True)
class Plan:
    """Everything an executor needs to run one call, with no further checking.

    Shapes are Python tuples; ``*_axes`` index ``view_shape`` and are sorted.
    """

    op: str
    xp: Any
    shape: tuple  # x.shape
    dtype: Any  # x.dtype, also the output dtype
    acc_dtype: Any  # dtype the statistics are accumulated and returned in
    center: bool  # False for RMS norm
    eps: float
    view_shape: tuple
    reduce_axes: tuple
    param_axes: tuple
    param_shape: tuple  # public weight/bias shape
    param_view_shape: tuple  # weight/bias reshaped to broadcast against the view
    stats_view_shape: tuple  # statistics with keepdims in the view
    stats_shape: tuple  # public statistics shape
    count: int  # elements per normalized slice
    has_weight: bool
    has_bias: bool
    has_residual: bool
    channel_axis: int | None = None  # canonical, for instance/group norm
    num_groups: int | None = None
    # what executors derive from the plan alone (kernel layouts per strides, ...); plans are
    # shared between calls with the same arguments, so this is worked out once
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def nonparam_axes(self) -> tuple:
        """View axes that dweight/dbias sum over."""
        return tuple(a for a in range(len(self.view_shape)) if a not in self.param_axes)

    @property
    def normalized_axes(self) -> tuple:
        """For layer/rms norm: the caller's normalized axes in ``x`` (sorted)."""
        return self.reduce_axes


def _describe(obj) -> str:
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"{type(obj).__module__}.{type(obj).__name__} of shape {tuple(obj.shape)} and dtype {obj.dtype}"
    return f"{type(obj).__name__} {obj!r}"


# Array types already seen, with their namespace: array_api_compat decides by type, so a
# type it accepted once is accepted again (this keeps make_plan's cost per call small).
_NAMESPACES = {}
# namespace name -> {dtype: bits of a real floating dtype, else 0}. One dict per library:
# torch.compile cannot hash another library's dtypes (NumPy's), and a dict holding them as
# keys makes every lookup in it a graph break under fullgraph=True.
_FLOAT_BITS = {}


def namespace_of(x, **others):
    """Return the array-API namespace of ``x``; check that ``others`` share it.

    ``others`` maps argument names to arrays or None, so that errors can name them.
    """
    xp = _NAMESPACES.get(type(x))
    if xp is None:
        if not array_api_compat.is_array_api_obj(x) or isinstance(x, (int, float, complex, bool)):
            raise TypeError(f"x must be an array of an array-API library, got {_describe(x)}")
        _check_unmasked("x", x)
        xp = array_api_compat.array_namespace(x)
        _NAMESPACES[type(x)] = xp
    for name, arr in others.items():
        if arr is None or type(arr) is type(x) or _NAMESPACES.get(type(arr)) is xp:
            continue
        if not array_api_compat.is_array_api_obj(arr):
            raise TypeError(f"{name} must be an array of the same library as x, got {_describe(arr)}")
        _check_unmasked(name, arr)
        try:
            other = array_api_compat.array_namespace(arr)
        except TypeError as exc:  # an unsupported array type
            raise TypeError(f"{name} must be an array of the same library as x: {exc}") from None
        if other is not xp:
            raise TypeError(
                f"{name} must be an array of the same library as x ({xp.__name__}), "
                f"got {_describe(arr)} from {other.__name__}"
            )
    return xp


def _check_unmasked(name, arr):
    """NumPy's masked arrays pass for NumPy arrays, but the formula would run over the data
    under the mask too, and np.ma would then mask whole slices of the result."""
    ma = sys.modules.get("numpy.ma")
    if ma is not None and isinstance(arr, ma.MaskedArray):
        raise TypeError(f"{name} must not be a numpy.ma.MaskedArray: its masked elements would "
                        f"enter the statistics; pass {name}.filled(value) or {name}.data")


def _float_bits(xp, dtype):
    """Bits of a real floating ``dtype`` of ``xp``, 0 for any other dtype (cached)."""
    # by name: torch.compile cannot compare modules as dict keys
    known = _FLOAT_BITS.get(xp.__name__)
    if known is None:
        known = _FLOAT_BITS[xp.__name__] = {}
    try:
        return known[dtype]
    except KeyError:
        bits = known[dtype] = _bits_of(xp, dtype)
        return bits
    except TypeError:  # an unhashable dtype
        return _bits_of(xp, dtype)


def _bits_of(xp, dtype) -> int:
    try:
        return xp.finfo(dtype).bits if xp.isdtype(dtype, "real floating") else 0
    except TypeError:  # not a dtype the namespace knows: NumPy's extension floats
        info = _extension_finfo(dtype)
        return 0 if info is None else info.bits


def _epsilon(xp, dtype) -> float:
    """``finfo(dtype).eps`` (also of an ml_dtypes float, whose finfo NumPy's refuses)."""
    try:
        return float(xp.finfo(dtype).eps)
    except (TypeError, AttributeError, ValueError):
        return float(_extension_finfo(dtype).eps)


def _extension_finfo(dtype):
    """ml_dtypes' ``finfo`` of one of its floats (``bfloat16``, ``float8_*``: JAX's arrays as
    NumPy holds them), else None; NumPy's own ``isdtype``/``finfo`` refuse these."""
    ml_dtypes = sys.modules.get("ml_dtypes")  # imported wherever such an array exists
    if ml_dtypes is None:
        return None
    try:
        return ml_dtypes.finfo(dtype)
    except (TypeError, ValueError):
        return None


def _check_strided(name, arr):
    """torch tensors of a sparse (COO, CSR, ...) or MKL-DNN layout: everything here reads
    strided memory, and torch's kernels would fail on them with messages about strides."""
    layout = getattr(arr, "layout", None)
    if layout is not None and array_kind(arr) == "torch" and str(layout) != "torch.strided":
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {layout}")


def check_float(xp, name, arr):
    if not _float_bits(xp, arr.dtype):
        raise TypeError(f"{name} must have a real floating-point dtype, got {arr.dtype}")


# Array type -> "cupy" | "torch" | "numpy" | "other": array_api_compat decides by type, so
# each type is asked once (its checks cost microseconds per call).
_KINDS: dict = {}


def remember_type(array_type, xp, kind) -> None:
    """Seed the per-type caches (torch.compile traces through array_api_compat's otherwise)."""
    _NAMESPACES[array_type] = xp
    _KINDS[array_type] = kind


def array_kind(x) -> str:
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = ("cupy" if array_api_compat.is_cupy_array(x) else
                "torch" if array_api_compat.is_torch_array(x) else
                "numpy" if array_api_compat.is_numpy_array(x) else
                "dask" if array_api_compat.is_dask_array(x) else "other")
        _KINDS[type(x)] = kind
    return kind


def _device(arr):
    # torch and CuPy arrays' own .device is what array_api_compat.device returns, for less
    return arr.device if array_kind(arr) in ("torch", "cupy") else array_api_compat.device(arr)


def _check_device(name, arr, x):
    if arr is None or type(arr) is type(x) is np.ndarray:  # NumPy has one device
        return
    have, want = _device(arr), _device(x)
    # None: a device not known yet (a JAX tracer inside jit/grad: the concrete arrays it
    # meets there are placed by JAX itself)
    if have != want and have is not None and want is not None:
        raise ValueError(f"{name} must be on the same device as x ({want}), got {have}")


def _as_int(name, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _canonical_axis(name, axis, ndim) -> int:
    a = _as_int(name, axis)
    if not -ndim <= a < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of {ndim} dimensions "
                         f"(expected -{ndim} <= {name} < {ndim})")
    return a % ndim


def _canonical_axes(axis, ndim) -> tuple:
    """Sorted, non-negative, unique axes from an int or a sequence of ints."""
    items = (axis,) if not isinstance(axis, (tuple, list)) else tuple(axis)
    if not items:
        raise ValueError("axis must name at least one axis, got ()")
    axes = [_canonical_axis("axis", a, ndim) for a in items]
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis={axis!r} repeats an axis (as non-negative axes: {axes})")
    return tuple(sorted(axes))


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) and not hasattr(eps, "__float__"):
        raise TypeError(f"eps must be a float, got {type(eps).__name__} {eps!r}")
    value = float(eps)
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) eps may be a SymFloat
    if not 0.0 <= value < math.inf:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    return value


def make_plan(op, x, weight=None, bias=None, residual=None, *, axis=-1, channel_axis=1,
              num_groups=None, eps=1e-5, cache=True) -> Plan:
    """Validate the arguments of ``op`` and canonicalize its axes into a :class:`Plan`.

    The arrays are checked on every call; the rest depends on shapes and arguments only
    and is planned once per distinct call (:func:`plan_for`; ``cache=False``: planned anew,
    as torch.compile's tracing needs, which would trace through the cache).
    """
    assert op in _OPS
    if getattr(x, "is_nested", False):
        raise NestedInput("a nested tensor takes layer_norm and rms_norm, not the *_backward "
                          "functions: autograd gives its gradients")
    xp = namespace_of(x, weight=weight, bias=bias, residual=residual)
    check_float(xp, "x", x)
    _check_strided("x", x)
    for name, arr in (("weight", weight), ("bias", bias), ("residual", residual)):
        if arr is not None:
            check_float(xp, name, arr)
            _check_strided(name, arr)
            _check_device(name, arr, x)
    shape = _int_shape(x)
    if residual is not None and (not _same_shape(tuple(residual.shape), shape)
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must have x's shape {shape} and dtype {x.dtype}, "
                         f"got shape {tuple(residual.shape)} and dtype {residual.dtype}")
    if eps is None:  # rms_norm's default, as in PyTorch
        eps = _epsilon(xp, x.dtype)
    eps = check_eps(eps)
    args = (op, xp, shape, x.dtype, axis, channel_axis, num_groups, eps,
            None if weight is None else tuple(weight.shape),
            None if bias is None else tuple(bias.shape), residual is not None)
    if cache and _cacheable(axis, channel_axis, num_groups, x.dtype):
        return plan_for(*args)
    return _build_plan(*args)


def _same_shape(a: tuple, b: tuple) -> bool:
    """``a == b`` size by size: torch.compile compares two tuples of symbolic sizes as
    different objects (a tuple's ``!=``), but each pair of sizes by value."""
    return len(a) == len(b) and all(p == q for p, q in zip(a, b))


class NestedInput(TypeError):
    """x is a nested torch tensor: the forward call runs on its values (``_torch_nested``)."""


def unknown_size(size) -> bool:
    """None or NaN: a size Dask does not know (after boolean indexing)."""
    return size is None or size != size


class UnknownSizes(ValueError):
    """x's shape has unknown (NaN or None) sizes: Dask after boolean indexing."""


def _int_shape(x) -> tuple:
    """``x.shape`` as a tuple of Python ints; a ValueError for unknown sizes."""
    shape = tuple(x.shape)
    for s in shape:
        if type(s) is not int:
            break
    else:
        return shape
    if any(unknown_size(s) for s in shape):
        raise UnknownSizes(f"x must have known sizes on the axes it is normalized over, got "
                           f"shape {shape}: for a Dask array, call x.compute_chunk_sizes() first")
    # torch.compile's symbolic sizes stay symbolic: int() would specialize them
    return tuple(s if type(s).__name__ == "SymInt" else int(s) for s in shape)


def _cacheable(axis, channel_axis, num_groups, dtype) -> bool:
    """True when the arguments can key the plan cache: exact ints (``True == 1`` must not
    hit a cached ``1``; a list is unhashable), a hashable dtype."""
    if type(axis) is not int:
        if type(axis) is not tuple:
            return False
        for a in axis:
            if type(a) is not int:
                return False
    if type(channel_axis) is not int or not (num_groups is None or type(num_groups) is int):
        return False
    try:
        hash(dtype)
    except TypeError:
        return False
    return True


def _build_plan(op, xp, shape, dtype, axis=-1, channel_axis=1, num_groups=None, eps=1e-5,
                weight_shape=None, bias_shape=None, has_residual=False) -> Plan:
    """The :class:`Plan` of a call whose arrays are already checked (``shape``: ints)."""
    ndim = len(shape)
    if ndim == 0:
        raise ValueError("x must have at least one dimension, got a 0-d array")
    # By width, not by name: float16 is no array-API dtype, so namespaces such as
    # array_api_compat.dask.array do not export it, yet their arrays can hold it.
    half = _float_bits(xp, dtype) < 32
    acc_dtype = xp.float32 if half else dtype
    center = op != "rms_norm"
    canon_channel = groups = None

    if op in ("layer_norm", "rms_norm"):
        reduce_axes = _canonical_axes(axis, ndim)
        view_shape = shape
        param_axes = reduce_axes
        param_shape = tuple(shape[a] for a in reduce_axes)
        stats_view_shape = tuple(1 if a in reduce_axes else s for a, s in enumerate(shape))
        stats_shape = stats_view_shape
    else:
        if ndim < 2:
            raise ValueError(f"x must have a batch and a channel axis (ndim >= 2), got shape {shape}")
        c = _canonical_axis("channel_axis", channel_axis, ndim)
        if c == 0:
            raise ValueError("channel_axis must not be 0: axis 0 is the batch axis")
        canon_channel, channels = c, shape[c]
        if op == "instance_norm":
            if ndim < 3:
                raise ValueError(f"instance_norm needs at least one spatial axis (ndim >= 3), got shape {shape}")
            view_shape = shape
            reduce_axes = tuple(a for a in range(ndim) if a not in (0, c))
            param_axes = (c,)
            stats_view_shape = tuple(s if a in (0, c) else 1 for a, s in enumerate(shape))
            stats_shape = stats_view_shape
        else:
            groups = _as_int("num_groups", num_groups)
            if groups <= 0 or channels % groups:
                raise ValueError(f"num_groups must be a positive divisor of the channel count "
                                 f"{channels} (x.shape[{c}]), got {num_groups!r}")
            view_shape = shape[:c] + (groups, channels // groups) + shape[c + 1:]
            reduce_axes = tuple(a for a in range(len(view_shape)) if a not in (0, c))
            param_axes = (c, c + 1)
            stats_view_shape = tuple(s if a in (0, c) else 1 for a, s in enumerate(view_shape))
            stats_shape = (shape[0], groups)
        param_shape = (channels,)

    param_view_shape = tuple(s if a in param_axes else 1 for a, s in enumerate(view_shape))
    count = math.prod([view_shape[a] for a in reduce_axes])
    if count == 0:
        raise ValueError(f"the normalized extent of x is empty: x.shape={shape}, "
                         f"normalized axes {reduce_axes if op in ('layer_norm', 'rms_norm') else 'of each slice'} "
                         f"hold 0 elements")
    for name, got in (("weight", weight_shape), ("bias", bias_shape)):
        if got is not None and not _same_shape(got, param_shape):
            raise ValueError(f"{name} must have shape {param_shape}, got shape {got}")
    return Plan(op=op, xp=xp, shape=shape, dtype=dtype, acc_dtype=acc_dtype, center=center,
                eps=eps, view_shape=view_shape, reduce_axes=reduce_axes, param_axes=param_axes,
                param_shape=param_shape, param_view_shape=param_view_shape,
                stats_view_shape=stats_view_shape, stats_shape=stats_shape, count=count,
                has_weight=weight_shape is not None, has_bias=bias_shape is not None,
                has_residual=has_residual, channel_axis=canon_channel, num_groups=groups)


# The plan of a call whose arrays are already checked, shared by every call with the same
# (hashable, exact-int) arguments.
plan_for = functools.lru_cache(maxsize=1024)(_build_plan)
