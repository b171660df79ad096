"""The CUDA executor: ``kernels/*.cu`` compiled by CuPy (NVRTC), for CuPy arrays and CUDA
torch tensors. Its modules, by life cycle:

* ``_layout``: a plan and x's strides -> the kernels' (outer, reduced, inner) factorization;
* ``_schedule``: which kernels a call launches, with which grid, block, shared memory and
  workspaces, as data computed from a ``DeviceInfo`` (pure: no CuPy, no device);
* ``_sources``, ``_compile``, ``_args``: the kernel sources, their NVRTC instantiations, the
  launch arguments in CuPy's form;
* ``_launcher``: a schedule bound to compiled kernels, launched per call on new pointers
  (copies around it where x's memory is not the layout's buffer);
* ``_interop``: torch tensors and streams as the launcher takes them;
* ``_cupy_exec`` and ``_torch_ops``: the executors for CuPy arrays and for torch tensors
  (custom ops, autograd), which keep one bound launch per call signature;
* ``_executor``: the entry points ``unsupported``, ``forward``, ``backward`` and
  ``forward_runner``; importing it needs CuPy (no GPU) and raises ImportError without a
  usable CuPy. This package itself imports nothing, so ``_layout`` and ``_schedule`` work
  without CuPy.
"""

__all__ = ["forward", "backward", "forward_runner", "unsupported"]


def __getattr__(name):
    if name in __all__:
        from . import _executor

        return getattr(_executor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
