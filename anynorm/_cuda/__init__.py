"""The CUDA executor: ``kernels/*.cu`` compiled by CuPy (NVRTC), for CuPy arrays and CUDA
torch tensors.

``unsupported(plan, x)`` -> None or the reason the kernels cannot take the call;
``forward(plan, x, weight, bias, residual, stats=True)`` -> ``(y, h, mean, rstd)`` (with
``stats=False`` the statistics may be None: inference writes y only);
``backward(plan, dy, x, weight, mean, rstd)`` -> ``(dx, dweight, dbias)``.

Importing needs CuPy only (no GPU); without a usable CuPy it raises ImportError.
"""

try:
    import cupy  # noqa: F401
except Exception as exc:  # CuPy missing, or present but broken (wrong CUDA wheel, ...)
    raise ImportError(f"anynorm's CUDA kernels need CuPy: {type(exc).__name__}: {exc}") from exc

from ._executor import backward, forward, unsupported

__all__ = ["forward", "backward", "unsupported", "FORWARD_STATS_OPTIONAL"]

FORWARD_STATS_OPTIONAL = True  # forward takes stats=False (anynorm._calls)
