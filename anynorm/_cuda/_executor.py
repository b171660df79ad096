"""The CUDA executor's entry points: which inputs it takes, and dispatch by array library.

CuPy arrays run directly on CuPy's current stream; CUDA torch tensors go through the
``anynorm::forward`` / ``anynorm::backward`` custom ops (autograd, torch.compile) on torch's
current stream.

Importing this module needs CuPy only (no GPU); without a usable CuPy it raises ImportError.
"""

from __future__ import annotations

import sys

try:
    import cupy  # noqa: F401
except Exception as exc:  # CuPy missing, or present but broken (wrong CUDA wheel, ...)
    raise ImportError(f"anynorm's CUDA kernels need CuPy: {type(exc).__name__}: {exc}") from exc

from . import _cupy_exec
from ._interop import dtype_key

__all__ = ["forward", "backward", "forward_runner", "unsupported"]


def _once(make):
    """``make()``'s value, computed on the first call and kept. Not functools.lru_cache:
    Dynamo warns at every lru_cache-wrapped function it traces (and traces through it), where
    a value kept in a closure is read as a constant."""
    kept = []

    def value():
        if not kept:
            kept.append(make())
        return kept[0]

    value.__doc__ = make.__doc__
    return value


_TENSOR = []  # torch.Tensor, once torch is imported


def _is_torch(x) -> bool:
    """``x`` is a torch tensor (none exists before torch is imported). Not
    array_api_compat.is_torch_array, whose lru_cache Dynamo warns at when it traces it."""
    if not _TENSOR:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _TENSOR.append(torch.Tensor)
    return isinstance(x, _TENSOR[0])


@_once
def _runtime_problem():
    """Why CuPy cannot drive a GPU here, or None (checked once)."""
    import cupy

    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # driver or runtime missing or too old
        return f"CuPy cannot use CUDA: {exc}"
    return None


# torch.compile's Dynamo runs it, rather than tracing CuPy's runtime call, where a process'
# first CUDA call is compiled (torch.compiler.assume_constant_result's mark: a process' answer)
_runtime_problem._dynamo_marked_constant = True


@_once
def _torch_ops():
    from . import _torch_ops

    return _torch_ops


def _torch_problem():
    try:
        _torch_ops()
    except Exception as exc:  # torch too old for torch.library.custom_op, ...
        return f"anynorm's torch custom ops are unavailable: {exc}"
    return None


def unsupported(plan, x):
    """None when the kernels can run ``plan`` on ``x``, else the reason (never raises)."""
    if dtype_key(plan.dtype) is None:
        return (f"the CUDA kernels take float16, bfloat16, float32 and float64 inputs, "
                f"got {plan.dtype}")
    if _is_torch(x):
        problem = _torch_problem()
        if problem is not None:
            return problem
        if _is_fake(x):
            return None
    return _runtime_problem()


def _is_fake(x) -> bool:
    """A FakeTensor under torch.compile tracing: no device needed to trace it (``x`` a torch
    tensor: _is_torch has seen torch.Tensor)."""
    return type(x) is not _TENSOR[0] and _fake_test()(x)


@_once
def _fake_test():
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:
        return lambda x: False
    return is_fake


def forward(plan, x, weight=None, bias=None, residual=None, stats=True):
    """``(y, h, mean, rstd)`` as :func:`anynorm._reference.forward` returns them; with
    ``stats=False`` the statistics may be None (not written) where nothing needs them."""
    if _is_torch(x):
        return _torch_ops().forward(plan, x, weight, bias, residual, stats)
    return _cupy_exec.forward(plan, x, weight, bias, residual, stats)


def forward_runner(plan, x, weight, bias, stats):
    """``run(x, weight, bias, residual)``: :func:`forward` for the call signature of ``x``,
    which ``anynorm._calls`` keeps (its library is part of it, so the choice between torch
    and CuPy is made here once), with a ``site`` dict where the launch its first call binds
    is kept."""
    forward = _torch_ops().forward if _is_torch(x) else _cupy_exec.forward
    site = {}

    def run(x, weight, bias, residual):
        return forward(plan, x, weight, bias, residual, stats, site)

    return run


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """``(dx, dweight, dbias)`` as :func:`anynorm._reference.backward` returns them."""
    if _is_torch(x):
        return _torch_ops().backward(plan, dy, x, weight, mean, rstd)
    return _cupy_exec.backward(plan, dy, x, weight, mean, rstd)
