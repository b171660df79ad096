"""NumPy executor vs tutorial NumPy code and vs a copy of the same bytes.

``track_copy_fraction``: achieved bandwidth as a fraction of ``np.copyto`` on the same
data, both timed in the same run (1.0 = as fast as a copy; x read once and y written once
is the most any normalization can do).  ``track_torch_ratio``: anynorm's time / that of
``torch.nn.functional`` on the same memory (``torch.from_numpy``, zero-copy), when torch is
installed (float32/float64; torch's float16 CPU kernels compute in float32 too).  ``track_extra_memory``: peak memory allocated
during the call (tracemalloc, which NumPy reports to) in units of the output's size.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

import anynorm

from .common import CASE_NAMES, MAIN_CASES, best_time, call_anynorm, call_anynorm_backward, numpy_inputs
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
    """Backward pass (dx, dweight, dbias) with the statistics recomputed."""

    params = [MAIN_CASES + ["ln rows 8192x768", "ln odd axes 7x130x33 (0,2)"], ["float32", "float16"]]

    def time_anynorm_backward(self, name, dtype):
        call_anynorm_backward(anynorm, self.name, self.dy, self.x, self.weight)

    def peakmem_anynorm_backward(self, name, dtype):
        call_anynorm_backward(anynorm, self.name, self.dy, self.x, self.weight)
