"""The CUDA executor: ``kernels/*.cu`` compiled by CuPy (NVRTC), for CuPy arrays and CUDA
torch tensors.

``unsupported(plan, x)`` -> None or the reason the kernels cannot take the call;
``forward(plan, x, weight, bias, residual, stats=True)`` -> ``(y, h, mean, rstd)`` (with
``stats=False`` the statistics may be None: inference writes y only);
``backward(plan, dy, x, weight, mean, rstd)`` -> ``(dx, dweight, dbias)``;
``forward_runner(plan, x, stats)`` -> ``run(x, weight, bias, residual)``: ``forward`` for one
call signature (``anynorm._calls`` keeps it), which keeps what the signature fixes.

Importing needs CuPy only (no GPU); without a usable CuPy it raises ImportError.
"""

try:
    import cupy  # noqa: F401
except Exception as exc:  # CuPy missing, or present but broken (wrong CUDA wheel, ...)
    raise ImportError(f"anynorm's CUDA kernels need CuPy: {type(exc).__name__}: {exc}") from exc

from ._executor import backward, forward, forward_runner, unsupported

__all__ = ["forward", "backward", "forward_runner", "unsupported"]
