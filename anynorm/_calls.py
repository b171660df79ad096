"""What a call's signature decides, worked out once: validation, plan and executor.

A call's *signature* is everything the validation, the plan and the choice of executor
depend on: the op, its keyword values, the backend in force, and per array its library
(type), shape, strides, dtype and device. The first call of a signature validates and plans
(:func:`anynorm._plan.make_plan`), chooses its executor and keeps the pair; a repeat call
builds the key from array attributes and goes straight to the executor. A changed stride,
dtype, device or library makes another key, never a stale hit.

Arguments that would make a key ambiguous (``True`` hashes like ``1``; lists do not hash)
and traced calls (torch.compile) take the uncached path, which checks everything.
"""

from __future__ import annotations

import sys
import threading
import warnings

from numpy import ndarray as _ndarray

from . import _backend
from ._plan import NestedInput, UnknownSizes, array_kind, make_plan, remember_type

__all__ = ["forward_call", "backward_call", "signature", "clear", "bind_torch"]

# key -> (plan, executor); a plain dict (atomic get/set under the GIL; two threads that
# miss together both build the same value)
_CALLS: dict = {}
_MAX_CALLS = 4096  # a program with more distinct signatures than this starts over
_lock = threading.Lock()


def clear() -> None:
    """Forget every cached call (tests; ``set_backend`` does not need it: the backend is keyed)."""
    _CALLS.clear()


def _numpy_signature(a):
    return a.shape, a.strides, a.dtype


def _cupy_signature(a):
    return a.shape, a.strides, a.dtype, a.data.device_id


def _other_signature(a):
    import array_api_compat

    shape = a.shape
    try:
        hash(shape)
    except TypeError:
        return None
    return shape, a.dtype, str(array_api_compat.device(a))


_is_compiling = None  # torch.compiler.is_compiling, bound when the first tensor is seen


def _backend_now():
    """The backend in force. Dynamo cannot trace its ContextVar read: bind_torch marks it so
    that torch.compile takes the result as a constant of the graph."""
    return _backend.get_backend()


def _jit_tracing() -> bool:
    """True while ``torch.jit.trace`` records the call (asked on a cache miss; never of
    torch's C function under torch.compile, which cannot trace it)."""
    torch = sys.modules.get("torch")
    return torch is not None and not torch.compiler.is_compiling() and torch._C._is_tracing()


def bind_torch():
    """Ready the torch-specific parts once torch is loaded (at ``import anynorm`` when torch
    already is, else when a call first meets an array type). Marked as a constant result, so
    that torch.compile runs it rather than tracing it when that call is traced (anynorm
    imported before torch, its first call inside a compiled function): the ops are then
    registered and the per-type caches seeded before the trace reads them."""
    global _is_compiling
    torch = sys.modules.get("torch")
    if _is_compiling is not None or torch is None:
        return
    from . import _register_torch_ops

    torch.compiler.assume_constant_result(_backend_now)
    import array_api_compat.torch as torch_namespace

    for tensor_type in (torch.Tensor, torch.nn.Parameter):
        remember_type(tensor_type, torch_namespace, "torch")
    _is_compiling = torch.compiler.is_compiling
    # torch.jit.trace hands out sizes as traced values: the plan's int() of them and its
    # shape comparisons specialize the trace to the traced shapes, as traced torch.nn layers
    # are (their sizes are Python ints); the data-dependent branches take the traced path
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module=r"anynorm\.")
    _register_torch_ops()  # torch was imported after anynorm: the ops exist from this call on


bind_torch._dynamo_marked_constant = True  # torch.compiler.assume_constant_result's mark


def _torch_signature(t):
    _TORCH_TYPES.add(type(t))
    return t.shape, t.stride(), t.dtype, t.device


_SIGNERS = {}  # array type -> its signature function
_TORCH_TYPES = set()  # the types _torch_signature signed once torch was bound (inlined then)


def _sign(a):
    """The signature of one array, or None when it cannot key a cache (a traced tensor,
    an unhashable shape, an object that is no array: the uncached path reports it)."""
    if a is None:
        return None
    sign = _SIGNERS.get(type(a))
    if sign is None:
        bind_torch()  # torch may have been loaded since the last new type
        try:
            kind = array_kind(a)
        except Exception:  # not an array at all: the uncached path raises the TypeError
            return False
        sign = {"numpy": _numpy_signature, "cupy": _cupy_signature,
                "torch": _torch_signature}.get(kind, _other_signature)
        _SIGNERS[type(a)] = sign
    try:
        signature = sign(a)
    except Exception:  # an array-like whose attributes do not answer: uncached path
        return False
    return False if signature is None else (type(a), signature)


def _exact_ints(axis) -> bool:
    if type(axis) is int:
        return True
    if type(axis) is not tuple:
        return False
    for a in axis:
        if type(a) is not int:
            return False
    return True


def _keyable(axis, channel_axis, num_groups, eps) -> bool:
    return (_exact_ints(axis) and type(channel_axis) is int
            and (num_groups is None or type(num_groups) is int)
            and (eps is None or type(eps) is float or type(eps) is int))


def signature(*arrays):
    """The arrays' part of a call's key, or None when one of them cannot key it (also when
    torch.compile traces the call: its shapes may be symbolic; asked once per call)."""
    out = []
    for a in arrays:
        if type(a) in _TORCH_TYPES:  # the hot case, _torch_signature inlined
            out.append((type(a), (a.shape, a.stride(), a.dtype, a.device)))
            continue
        s = _sign(a)
        if s is False:
            return None
        out.append(s)
    if type(arrays[0]) in _TORCH_TYPES and _is_compiling():
        return None
    return tuple(out)


def _remember(key, value):
    if len(_CALLS) >= _MAX_CALLS:
        with _lock:
            if len(_CALLS) >= _MAX_CALLS:
                _CALLS.clear()
    _CALLS[key] = value
    return value


def _torch_forward_key(op, x, weight, bias, residual, stats, axis, channel_axis, num_groups, eps):
    """A forward call's key when ``x`` is a tensor of a type already signed: one flat tuple,
    cheaper to build and hash than :func:`signature`'s nested one (its first item keeps it
    apart from those).  None where the arguments are not :func:`_keyable`, a parameter is
    not a tensor of a signed type (the general key then) or torch.compile traces the call."""
    if not ((type(axis) is int or _exact_ints(axis)) and type(channel_axis) is int
            and (num_groups is None or type(num_groups) is int)
            and (eps is None or type(eps) is float or type(eps) is int)):
        return None
    types = _TORCH_TYPES
    if ((weight is not None and type(weight) not in types)
            or (bias is not None and type(bias) not in types)
            or (residual is not None and type(residual) not in types) or _is_compiling()):
        return None
    return ("torch forward", op, _backend.get_backend(), axis, channel_axis, num_groups, eps,
            stats, type(x), x.shape, x.stride(), x.dtype, x.device,
            None if weight is None else (type(weight), weight.shape, weight.stride(),
                                         weight.dtype, weight.device),
            None if bias is None else (type(bias), bias.shape, bias.stride(), bias.dtype,
                                       bias.device),
            None if residual is None else (type(residual), residual.shape, residual.stride(),
                                           residual.dtype, residual.device))


def _numpy_forward_key(op, x, weight, bias, residual, stats, axis, channel_axis, num_groups, eps):
    """:func:`_torch_forward_key` for a NumPy ``x`` whose parameters (and residual) are NumPy
    arrays too (None otherwise, or where the arguments are not :func:`_keyable`)."""
    if not (_keyable(axis, channel_axis, num_groups, eps)
            and (weight is None or type(weight) is _ndarray) and (bias is None or type(bias) is _ndarray)
            and (residual is None or type(residual) is _ndarray)):
        return None
    return ("numpy forward", op, _backend.get_backend(), axis, channel_axis, num_groups, eps, stats,
            x.shape, x.strides, x.dtype,
            None if weight is None else (weight.shape, weight.strides, weight.dtype),
            None if bias is None else (bias.shape, bias.strides, bias.dtype),
            None if residual is None else (residual.shape, residual.strides, residual.dtype))


def _unknown_sizes(x, error):
    """:mod:`anynorm._dask_unknown` for a Dask ``x`` whose chunk sizes are unknown; for any
    other array ``error`` (:class:`anynorm._plan.UnknownSizes`) raised again."""
    if array_kind(x) != "dask":
        raise error
    from . import _dask_unknown

    return _dask_unknown


def forward_call(op, x, weight, bias, residual, stats, axis, channel_axis, num_groups, eps):
    """``(plan, run)`` for a forward call: ``run(x, weight, bias, residual) -> (y, h, mean,
    rstd)`` (statistics possibly None unless ``stats``)."""
    key = None
    if type(x) in _TORCH_TYPES:  # the hot case: a flat key, the tensors' attributes inline
        key = _torch_forward_key(op, x, weight, bias, residual, stats, axis, channel_axis,
                                 num_groups, eps)
    elif type(x) is _ndarray:  # likewise for NumPy arrays
        key = _numpy_forward_key(op, x, weight, bias, residual, stats, axis, channel_axis,
                                 num_groups, eps)
    if key is not None:
        call = _CALLS.get(key)
        if call is not None:
            return call
    # torch.jit.trace: a miss stays a miss (nothing signed or kept), so that the trace and
    # the re-trace that checks it record the same ops (a cached runner diverts a traced call)
    traced = _jit_tracing()
    if key is None and not traced and _keyable(axis, channel_axis, num_groups, eps):
        arrays = signature(x, weight, bias, residual)
        if arrays is not None:
            if type(x) in _TORCH_TYPES:  # signed just now: the key later calls will build
                key = _torch_forward_key(op, x, weight, bias, residual, stats, axis,
                                         channel_axis, num_groups, eps)
            if key is None:
                key = ("forward", op, _backend.get_backend(), axis, channel_axis, num_groups,
                       eps, stats, arrays)
            call = _CALLS.get(key)
            if call is not None:
                return call
    bind_torch()  # a first call that signature() did not see (a list axis, say)
    try:
        plan = make_plan(op, x, weight, bias, residual, axis=axis, channel_axis=channel_axis,
                         num_groups=num_groups, eps=eps, cache=key is not None)
    except UnknownSizes as error:
        return _unknown_sizes(x, error).forward_call(op, x, weight, bias, residual, stats, axis,
                                                     channel_axis, num_groups, eps, error)
    except NestedInput:
        from . import _torch_nested

        return _torch_nested.forward_call(op, x, weight, bias, residual, stats, axis,
                                          channel_axis, num_groups, eps)
    executor = _backend.choose(plan, x, _backend_now())
    runner = getattr(executor, "forward_runner", None)  # the CUDA executor's
    if runner is not None:
        run = runner(plan, x, weight, bias, stats)
    else:
        def run(x, weight, bias, residual, _forward=executor.forward, _plan=plan):
            return _forward(_plan, x, weight, bias, residual)
    call = (plan, run)
    return call if key is None or traced else _remember(key, call)


def backward_call(op, dy, x, weight, stats, axis, channel_axis, num_groups, eps, validate):
    """``(plan, executor)`` for a ``*_backward`` call; ``validate(plan, x, dy, stats)`` checks
    dy and stats on the first call of a signature (and on every uncached one)."""
    key = None
    if _keyable(axis, channel_axis, num_groups, eps) and (stats is None or type(stats) is tuple):
        arrays = signature(x, dy, weight, *(stats or ()))
        if arrays is not None:
            key = ("backward", op, _backend.get_backend(), axis, channel_axis, num_groups, eps,
                   stats is None, arrays)
            call = _CALLS.get(key)
            if call is not None:
                return call
    bind_torch()
    try:
        plan = make_plan(op, x, weight, axis=axis, channel_axis=channel_axis,
                         num_groups=num_groups, eps=eps, cache=key is not None)
    except UnknownSizes as error:
        return _unknown_sizes(x, error).backward_call(op, dy, x, weight, stats, axis,
                                                      channel_axis, num_groups, eps, validate,
                                                      error)
    validate(plan, x, dy, stats)
    call = (plan, _backend.choose(plan, x, _backend_now()))
    return call if key is None else _remember(key, call)
