"""Which executor runs a plan: the one dispatch point.

``"auto"`` (default): CUDA kernels for CuPy arrays and CUDA torch tensors where they apply,
a library's fast executor for NumPy and torch CPU, the array-API core for everything else.
``"kernels"``: the CUDA kernels or a ValueError.  ``"reference"``: the array-API core always.
The start-up choice comes from the environment variable ``ANYNORM_BACKEND``.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import array_api_compat

from . import _numpy, _reference
from ._plan import array_kind

__all__ = ["set_backend", "get_backend", "use_backend", "choose", "BACKENDS"]

BACKENDS = ("auto", "kernels", "reference")


def _checked(name, source):
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name


_default = _checked(os.environ.get("ANYNORM_BACKEND", "auto").strip().lower() or "auto",
                   "the environment variable ANYNORM_BACKEND")
# set_backend changes the process-wide default; use_backend overrides it in one context only.
_override = contextvars.ContextVar("anynorm_backend", default=None)


def set_backend(name: str) -> None:
    """Choose the executor family for later calls in this process.

    ``"auto"`` (default): CUDA kernels for CuPy arrays and CUDA torch tensors, NumPy's and
    torch's executors on the CPU, the array-API core for every other library; ``"kernels"``:
    the CUDA kernels, or a ValueError for an input they cannot take; ``"reference"``: the
    array-API core always.

    Example::

        >>> import anynorm
        >>> anynorm.set_backend("reference")
        >>> anynorm.get_backend()
        'reference'
        >>> anynorm.set_backend("auto")

    Raises:
        ValueError: ``name`` is not one of ``"auto"``, ``"kernels"``, ``"reference"``.
    """
    global _default
    _default = _checked(name, "backend")


def get_backend() -> str:
    """The backend in force here: the innermost :func:`use_backend`, else
    :func:`set_backend`'s, else the environment variable ``ANYNORM_BACKEND`` (``"auto"``).

    Example::

        >>> import anynorm
        >>> with anynorm.use_backend("reference"):
        ...     anynorm.get_backend()
        'reference'
    """
    return _override.get() or _default


@contextlib.contextmanager
def use_backend(name: str):
    """``with use_backend(name): ...`` sets the backend (see :func:`set_backend`) for the block
    only, in this thread or task (a context variable), and restores the previous one after.

    Example::

        >>> import numpy as np, anynorm
        >>> with anynorm.use_backend("reference"):   # the array-API core, whatever the library
        ...     y = anynorm.layer_norm(np.arange(6.0).reshape(2, 3))

    Raises:
        ValueError: ``name`` is not one of ``"auto"``, ``"kernels"``, ``"reference"``.
    """
    token = _override.set(_checked(name, "backend"))
    try:
        yield
    finally:
        _override.reset(token)


def on_cuda(x) -> bool:
    """True for CuPy arrays and CUDA torch tensors, the inputs the kernels take."""
    kind = array_kind(x)
    return kind == "cupy" or (kind == "torch" and x.is_cuda)


def _cuda_executor():
    try:
        from ._cuda import _executor
    except ImportError:  # CuPy missing or unusable
        return None
    return _executor


def choose(plan, x, backend=None):
    """Return the executor module (``forward``/``backward``) that runs ``plan`` on ``x``
    under ``backend`` (default: the one in force)."""
    backend = backend or get_backend()
    if backend == "reference":
        return _reference
    if on_cuda(x):
        cuda = _cuda_executor()
        reason = "CuPy with its CUDA kernels could not be imported" if cuda is None else cuda.unsupported(plan, x)
        if reason is None:
            return cuda
        if backend == "kernels":
            raise ValueError(f"backend 'kernels' cannot run this call: {reason}")
        return _reference
    if backend == "kernels":
        raise ValueError("backend 'kernels' needs a CuPy array or a CUDA torch tensor, "
                         f"got {type(x).__module__}.{type(x).__name__} on {array_api_compat.device(x)}")
    kind = array_kind(x)
    if kind == "numpy":
        return _numpy
    if kind == "torch":  # imported on first use: torch and Dask take seconds to import
        from . import _torch

        return _torch
    if kind == "dask":
        from . import _dask

        return _dask
    return _reference
