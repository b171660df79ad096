"""NumPy executor vs tutorial NumPy code and vs a copy of the same bytes.

``track_copy_fraction``: achieved bandwidth as a fraction of ``np.copyto`` on the same
data, both timed in the same run (1.0 = as fast as a copy; x read once and y written once
is the most any normalization can do).  ``track_torch_ratio``: anynorm's time / that of
``torch.nn.functional`` on the same memory (``torch.from_numpy``, zero-copy), when torch is
installed (float32/float64; torch's float16 CPU kernels compute in float32 too).  ``track_extra_memory``: peak memory allocated
during the call (tracemalloc, which NumPy reports to) in units of the output's size.
"""

from __future__ import annotations

import time
import tracemalloc

import numpy as np

import anynorm

from .common import (CASE_NAMES, MAIN_CASES, TINY, best_time, call_anynorm, call_anynorm_backward,
                     numpy_inputs)
from .peers import naive_numpy

DTYPES = ["float32", "float64", "float16"]


class _NumpyCase:
    timeout = 300
    params = [CASE_NAMES, DTYPES]
    param_names = ["case", "dtype"]

    def setup(self, name, dtype):
        self.name = name
        self.x, self.weight, self.bias, self.dy = numpy_inputs(name, np.dtype(dtype))
        self.out = np.empty_like(self.x)

    def ours(self):
        return call_anynorm(anynorm, self.name, self.x, self.weight, self.bias)

    def copy(self):
        np.copyto(self.out, self.x)


class NumpyForward(_NumpyCase):
    """Forward pass: anynorm, the tutorial version and a plain copy, per case and dtype."""

    def time_anynorm(self, name, dtype):
        self.ours()

    def time_naive_numpy(self, name, dtype):
        naive_numpy(self.name, self.x, self.weight, self.bias)

    def time_copy(self, name, dtype):
        self.copy()

    def peakmem_anynorm(self, name, dtype):
        self.ours()

    def peakmem_naive_numpy(self, name, dtype):
        naive_numpy(self.name, self.x, self.weight, self.bias)

    def track_copy_fraction(self, name, dtype):
        return best_time(self.copy) / best_time(self.ours)

    track_copy_fraction.unit = "fraction of copy bandwidth"

    def track_naive_speedup(self, name, dtype):
        return best_time(lambda: naive_numpy(self.name, self.x, self.weight, self.bias)) / best_time(self.ours)

    track_naive_speedup.unit = "tutorial time / anynorm time"

    def track_torch_ratio(self, name, dtype):
        try:
            import torch
        except ImportError:
            return float("nan")
        from .peers import torch_functional

        x, w, b = (torch.from_numpy(a) for a in (self.x, self.weight, self.bias))
        with torch.no_grad():
            return best_time(self.ours) / best_time(lambda: torch_functional(self.name, x, w, b))

    track_torch_ratio.unit = "anynorm time / torch time"

    def track_extra_memory(self, name, dtype):
        self.ours()
        tracemalloc.start()
        try:
            self.ours()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return peak / self.x.nbytes

    track_extra_memory.unit = "output sizes"


class NumpyBackward(_NumpyCase):
    """Backward pass (dx, dweight, dbias) with the statistics recomputed.

    ``track_copy_ratio``: its time / ``np.copyto`` of x (it reads x and dy and writes dx:
    1.5 is the floor); ``track_torch_ratio``: / torch's backward of ``torch.nn.functional``'s
    graph on the same memory (``peers.torch_backward``: its kernel and permutes)."""

    params = [MAIN_CASES + ["ln rows 8192x768", "ln odd axes 7x130x33 (0,2)"], ["float32", "float16"]]

    def ours_backward(self):
        return call_anynorm_backward(anynorm, self.name, self.dy, self.x, self.weight)

    def time_anynorm_backward(self, name, dtype):
        self.ours_backward()

    def peakmem_anynorm_backward(self, name, dtype):
        self.ours_backward()

    def track_copy_ratio(self, name, dtype):
        return best_time(self.ours_backward) / best_time(self.copy)

    track_copy_ratio.unit = "backward time / copy time"

    def track_torch_ratio(self, name, dtype):
        try:
            import torch
        except ImportError:
            return float("nan")
        from .peers import torch_backward

        x, w, b, dy = (torch.from_numpy(a) for a in (self.x, self.weight, self.bias, self.dy))
        peer = torch_backward(self.name, x, w, b, dy)
        if peer is None:
            return float("nan")
        return best_time(self.ours_backward) / best_time(peer)

    track_torch_ratio.unit = "anynorm time / torch time"


def _cpu_seconds(fn, batch):
    """CPU seconds of this thread per call of ``fn``, over ``batch`` calls."""
    start = time.thread_time()
    for _ in range(batch):
        fn()
    return max(time.thread_time() - start, 1e-9) / batch


class NumpyCpuTime(_NumpyCase):
    """Single-thread CPU time ratios (what issue 16's NumPy targets are stated in).

    The executor is held to the calling thread (``_numpy.NUM_THREADS = 1``; run asv with
    ``OPENBLAS_NUM_THREADS=1``) and each ratio is the median over interleaved rounds of
    ``time.thread_time()``, which other jobs on a shared machine disturb far less than wall
    time.  Peers in the same rounds: ``np.copyto`` into a preallocated array (the issue's
    yardstick), the same copy into a fresh array (the output's page faults, which ours pays
    too), the tutorial formula, and (``track_half_ratio``) the float32 call of the same case.
    ``asv_bench/numpy_speed.py`` prints the same ratios with their min-max.
    """

    params = [MAIN_CASES + ["ln tiny 4x8"], ["float32"]]
    rounds = 1 if TINY else 7

    def setup(self, name, dtype):
        super().setup(name, dtype)
        from anynorm import _numpy

        self._threads, _numpy.NUM_THREADS = _numpy.NUM_THREADS, 1
        self.batch = 1 if TINY else (200 if self.x.size < 4096 else 1)
        x16, w16, b16, _ = numpy_inputs(name, np.dtype("float16"))
        self.half = tuple(a.copy() for a in (x16, w16, b16))
        self.x, self.weight, self.bias, _ = (a.copy() for a in numpy_inputs(name, np.dtype(dtype)))

    def teardown(self, name, dtype):
        from anynorm import _numpy

        _numpy.NUM_THREADS = self._threads

    def _ratio(self, fn, peer):
        """Median over interleaved rounds of ``fn``'s CPU time / ``peer``'s."""
        fn()
        peer()
        ratios = []
        for _ in range(self.rounds):
            ours = _cpu_seconds(fn, self.batch)
            ratios.append(ours / _cpu_seconds(peer, self.batch))
        return float(np.median(ratios))

    def track_cpu_vs_copy(self, name, dtype):
        return self._ratio(self.ours, self.copy)

    track_cpu_vs_copy.unit = "anynorm CPU time / np.copyto's"

    def track_cpu_vs_fresh_copy(self, name, dtype):
        return self._ratio(self.ours, lambda: np.copyto(np.empty_like(self.x), self.x))

    track_cpu_vs_fresh_copy.unit = "anynorm CPU time / (np.empty_like + np.copyto)'s"

    def track_cpu_vs_naive(self, name, dtype):
        return self._ratio(self.ours, lambda: naive_numpy(self.name, self.x, self.weight, self.bias))

    track_cpu_vs_naive.unit = "anynorm CPU time / tutorial NumPy's"

    def track_half_ratio(self, name, dtype):
        return self._ratio(lambda: call_anynorm(anynorm, self.name, *self.half), self.ours)

    track_half_ratio.unit = "float16 CPU time / float32's"
