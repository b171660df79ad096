"""CUDA: anynorm's kernels on CuPy arrays and CUDA torch tensors vs torch.nn.functional.

Without an NVIDIA driver (or with ``CUDA_VISIBLE_DEVICES`` empty or -1) these benchmarks are
not even discovered (asv's ``skip_benchmark`` mark, set at import), so a CPU run lists only
what ran instead of 15 tables of ``n/a``; where a driver is visible but no device or CuPy
answers, ``setup`` raises NotImplementedError (asv's skip, one ``n/a`` per case).  Kernels are
compiled in setup by a warm-up call; bodies end with a device synchronize so wall time
covers the GPU work, and ``track_*_ms`` time with CUDA events.  Run GPU benchmarks with
``--launch-method=spawn``: a CUDA context does not survive a fork.
"""

from __future__ import annotations

import functools
import os
import sys

import numpy as np

import anynorm

from . import torch_cpu
from .common import CASE_NAMES, TINY, call_anynorm, numpy_inputs

DTYPES = ["float32", "float16", "bfloat16"]


_CUPY = []


def _driver_visible():
    """False where no NVIDIA driver is visible (Linux) or ``CUDA_VISIBLE_DEVICES`` hides every
    device, so that benchmarks skip without importing CuPy, whose probe costs seconds in every
    benchmark process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"))


BENCHMARK_PREFIXES = ("time_", "timeraw_", "mem_", "peakmem_", "track_")


def _needs_gpu(cls):
    """Without a visible driver, mark every benchmark of ``cls`` with asv's ``skip_benchmark``
    (``asv_runner.benchmarks.mark.skip_benchmark_if``): asv's discovery then leaves it out.
    Each method is wrapped here, so that the CPU classes it is inherited from stay unmarked."""
    if _driver_visible():
        return cls
    for name in dir(cls):
        method = getattr(cls, name)
        if name.startswith(BENCHMARK_PREFIXES) and callable(method):
            @functools.wraps(method)
            def skipped(*args, _method=method, **kwargs):
                return _method(*args, **kwargs)

            skipped.skip_benchmark = True
            setattr(cls, name, skipped)
    return cls


def _cupy():
    """CuPy with a CUDA device, or NotImplementedError (asv's skip); probed once per process."""
    if not _CUPY and not _driver_visible():
        _CUPY.append(None)
    if not _CUPY:
        try:
            import cupy

            _CUPY.append(cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None)
        except Exception:  # ImportError, no driver, no device
            _CUPY.append(None)
    if _CUPY[0] is None:
        raise NotImplementedError("no CUDA GPU with CuPy")
    return _CUPY[0]


def _event_ms(start_event, stop_event, record, fn, repeat):
    """Smallest of ``repeat`` CUDA-event timings of ``fn`` (after one warm-up), in ms."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        record(start_event)
        fn()
        record(stop_event)
        stop_event.synchronize()
        best = min(best, start_event.elapsed_time(stop_event) if hasattr(start_event, "elapsed_time")
                   else _cupy().cuda.get_elapsed_time(start_event, stop_event))
    return best


class _EventTracks:
    """CUDA-event timings of ``ours`` and of ``copy`` (the class's ``_ms``), shared by the
    forward classes."""

    def track_anynorm_ms(self, name, dtype):
        return self._ms(self.ours)

    track_anynorm_ms.unit = "ms (CUDA events)"

    def track_copy_fraction(self, name, dtype):
        return self._ms(self.copy) / self._ms(self.ours)

    track_copy_fraction.unit = "fraction of copy bandwidth"


@_needs_gpu
class CupyForward(_EventTracks):
    """anynorm on CuPy arrays, and a device-to-device copy of the same bytes."""

    timeout = 300
    params = [CASE_NAMES, DTYPES]
    param_names = ["case", "dtype"]

    def setup(self, name, dtype):
        cp = self.cp = _cupy()
        if dtype == "bfloat16":
            raise NotImplementedError("CuPy has no bfloat16")
        self.name = name
        x, w, b, _ = numpy_inputs(name, np.dtype("float32"))
        self.x, self.weight, self.bias = (cp.asarray(a).astype(dtype) for a in (x, w, b))
        self.out = cp.empty_like(self.x)
        self.ours()  # compiles the kernels
        cp.cuda.Device().synchronize()

    def ours(self):
        return call_anynorm(anynorm, self.name, self.x, self.weight, self.bias)

    def copy(self):
        self.cp.copyto(self.out, self.x)

    def _ms(self, fn):
        cp = self.cp
        return _event_ms(cp.cuda.Event(), cp.cuda.Event(), lambda e: e.record(), fn, 1 if TINY else 20)

    def time_anynorm(self, name, dtype):
        self.ours()
        self.cp.cuda.Device().synchronize()

    def time_copy(self, name, dtype):
        self.copy()
        self.cp.cuda.Device().synchronize()


class _TorchCudaMixin:
    device = "cuda"

    def setup(self, name, dtype):
        torch = torch_cpu._torch()
        if not _driver_visible() or not torch.cuda.is_available():
            raise NotImplementedError("no CUDA GPU for torch")
        super().setup(name, dtype)
        self.ours()  # compiles the kernels
        self.peer()
        self.sync()

    def sync(self):
        self.torch.cuda.synchronize()

    def _ms(self, fn):
        torch = self.torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return _event_ms(start, stop, lambda e: e.record(), fn, 1 if TINY else 20)


@_needs_gpu
class TorchCudaForward(_TorchCudaMixin, _EventTracks, torch_cpu.TorchCPUForward):
    """anynorm on CUDA torch tensors vs torch.nn.functional (no autograd)."""

    params = [CASE_NAMES, DTYPES]

    def track_torch_functional_ms(self, name, dtype):
        return self._ms(self.peer)

    track_torch_functional_ms.unit = "ms (CUDA events)"

    def track_peer_ratio(self, name, dtype):
        return self._ms(self.ours) / self._ms(self.peer)

    track_peer_ratio.unit = "anynorm time / torch time"


@_needs_gpu
class TorchCudaBackward(_TorchCudaMixin, torch_cpu.TorchCPUBackward):
    """Forward + autograd backward on CUDA tensors."""

    params = [torch_cpu.TorchCPUBackward.params[0], ["float32", "bfloat16"]]

    def track_peer_ratio(self, name, dtype):
        return (self._ms(lambda: self._step(self.ours))
                / self._ms(lambda: self._step(self.peer)))

    track_peer_ratio.unit = "anynorm time / torch time"

