"""anynorm on torch CPU tensors vs torch.nn.functional, forward and autograd backward.

``track_peer_ratio``: anynorm's time / torch.nn.functional's, both timed in the same run
(<= 1 means anynorm is at least as fast); float16 and bfloat16 run torch's kernels with
float32 statistics, float32 also the NumPy executor on long rows.  ``track_copy_fraction``: as in ``numpy_cpu``.
"""

from __future__ import annotations

import numpy as np

import anynorm

from .common import CASE_NAMES, MAIN_CASES, best_time, call_anynorm, numpy_inputs
from .peers import torch_functional

DTYPES = ["float32", "bfloat16", "float16"]


def _torch():
    try:
        import torch
    except ImportError:  # asv's skip
        raise NotImplementedError("torch is not installed") from None
    return torch


class _TorchCase:
    timeout = 300
    params = [CASE_NAMES, DTYPES]
    param_names = ["case", "dtype"]
    device = "cpu"

    def setup(self, name, dtype):
        torch = self.torch = _torch()
        self.name = name
        arrays = numpy_inputs(name, np.dtype("float32"))
        tdtype = getattr(torch, dtype)
        self.x, self.weight, self.bias, self.dy = (
            torch.from_numpy(a).to(device=self.device, dtype=tdtype) for a in arrays)
        self.out = torch.empty_like(self.x)
        self.sync()

    def sync(self):
        pass

    def ours(self):
        return call_anynorm(anynorm, self.name, self.x, self.weight, self.bias)

    def peer(self):
        return torch_functional(self.name, self.x, self.weight, self.bias)

    def copy(self):
        self.out.copy_(self.x)


class TorchCPUForward(_TorchCase):
    """Forward pass without autograd: anynorm, torch.nn.functional and a copy."""

    def setup(self, name, dtype):
        super().setup(name, dtype)
        self.grad_mode = self.torch.no_grad()
        self.grad_mode.__enter__()

    def teardown(self, name, dtype):
        mode = getattr(self, "grad_mode", None)  # asv tears down skipped setups too
        if mode is not None:
            mode.__exit__(None, None, None)

    def time_anynorm(self, name, dtype):
        self.ours()
        self.sync()

    def time_torch_functional(self, name, dtype):
        self.peer()
        self.sync()

    def time_copy(self, name, dtype):
        self.copy()
        self.sync()

    def peakmem_anynorm(self, name, dtype):
        self.ours()

    def track_peer_ratio(self, name, dtype):
        return best_time(self.ours, sync=self.sync) / best_time(self.peer, sync=self.sync)

    track_peer_ratio.unit = "anynorm time / torch time"

    def track_copy_fraction(self, name, dtype):
        return best_time(self.copy, sync=self.sync) / best_time(self.ours, sync=self.sync)

    track_copy_fraction.unit = "fraction of copy bandwidth"


class TorchCPUBackward(_TorchCase):
    """Forward + autograd backward to x, weight and bias."""

    params = [MAIN_CASES + ["ln rows 8192x768"], ["float32", "bfloat16"]]

    def setup(self, name, dtype):
        super().setup(name, dtype)
        for t in (self.x, self.weight, self.bias):
            t.requires_grad_(True)

    def _step(self, fn):
        for t in (self.x, self.weight, self.bias):
            t.grad = None
        fn().backward(self.dy)
        self.sync()

    def time_anynorm(self, name, dtype):
        self._step(self.ours)

    def time_torch_functional(self, name, dtype):
        self._step(self.peer)

    def track_peer_ratio(self, name, dtype):
        return (best_time(lambda: self._step(self.ours))
                / best_time(lambda: self._step(self.peer)))

    track_peer_ratio.unit = "anynorm time / torch time"
