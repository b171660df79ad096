"""anynorm on torch CPU tensors vs torch.nn.functional, forward and autograd backward.

``track_peer_ratio``: anynorm's time / torch.nn.functional's, both timed in the same run
(<= 1 means anynorm is at least as fast); float16 and bfloat16 run torch's kernels (float32
accumulation inside, their statistics checked for conditioning), RMS norm of half rows in
float32 blocks of rows (torch's CPU routine converts the whole array), float32 also the
NumPy executor on long rows.  ``track_copy_fraction``: as in ``numpy_cpu``.
``TorchCPUSmallCall``: the per-call cost on tiny inputs, where the call layer and the
conditioning check, not the kernel, set the ratio.
"""

from __future__ import annotations

import numpy as np

import anynorm

from .common import CASE_NAMES, MAIN_CASES, best_time, call_anynorm, case, numpy_inputs
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


class TorchCPUSmallCall:
    """Tiny calls, many per sample: anynorm's per-call cost against torch.nn.functional's."""

    timeout = 120
    params = [["ln tiny 4x8", "gn odd 3x30x7x9 g5"], DTYPES, [False, True]]
    param_names = ["case", "dtype", "return_stats"]
    number = 200

    def setup(self, name, dtype, stats):
        torch = _torch()
        arrays = numpy_inputs(name, np.dtype("float32"))
        self.x, self.weight, self.bias = (torch.from_numpy(a).to(getattr(torch, dtype)) for a in arrays[:3])
        self.name, self.stats = name, stats
        self.grad_mode = torch.no_grad()
        self.grad_mode.__enter__()

    def teardown(self, name, dtype, stats):
        mode = getattr(self, "grad_mode", None)
        if mode is not None:
            mode.__exit__(None, None, None)

    def ours(self):
        op, _, kwargs = case(self.name)
        if op == "group_norm":
            return anynorm.group_norm(self.x, kwargs.pop("num_groups"), self.weight, self.bias,
                                      return_stats=self.stats, **kwargs)
        return anynorm.layer_norm(self.x, self.weight, self.bias, return_stats=self.stats, **kwargs)

    def peer(self):
        return torch_functional(self.name, self.x, self.weight, self.bias)

    def time_anynorm(self, name, dtype, stats):
        self.ours()

    def time_torch_functional(self, name, dtype, stats):
        self.peer()

    def track_peer_ratio(self, name, dtype, stats):
        return best_time(lambda: [self.ours() for _ in range(100)], repeat=5) / best_time(
            lambda: [self.peer() for _ in range(100)], repeat=5)

    track_peer_ratio.unit = "anynorm time / torch time"
