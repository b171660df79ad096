"""anynorm on torch CPU tensors vs torch.nn.functional, forward and autograd backward.

``track_peer_ratio``: anynorm's time / torch.nn.functional's, both timed in the same run
(<= 1 means anynorm is at least as fast); each dtype runs torch's kernels (float32
accumulation inside, their statistics checked for conditioning) or, where those measured
slower, anynorm's CPU kernels through the NumPy executor (``anynorm._torch._native_first``:
RMS rows, channels-first layer norm, long rows from 24 MiB, outputs of 32 MiB; bfloat16 as
ml_dtypes' arrays on the same memory).  ``track_copy_fraction``: as in ``numpy_cpu``.
``TorchCPUSmallCall``: the per-call cost on tiny inputs, where the call layer and the
conditioning check, not the kernel, set the ratio.
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

    params = [MAIN_CASES + ["ln rows 8192x768", "rms rows 8192x4096"], ["float32", "bfloat16"]]

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


# tiny calls: (op, shape, keyword arguments), the asv small-call shapes of issue 16
SMALL_CASES = {
    "ln tiny 4x8": ("layer_norm", (4, 8), {}),
    "rms tiny 4x8": ("rms_norm", (4, 8), {}),
    "gn odd 3x30x7x9 g5": ("group_norm", (3, 30, 7, 9), {"num_groups": 5}),
}


class TorchCPUSmallCall:
    """Tiny calls, many per sample: anynorm's per-call cost against torch.nn.functional's.

    The peer is the plain ``F.layer_norm(x, (8,), w, b, eps)`` (``F.rms_norm``,
    ``F.group_norm``) a user writes, bound once, not the general ``peers.torch_functional``
    (whose own Python steps would add ~2 us to the peer); ``grad``: the inputs require grad
    and each sample is a forward and a backward."""

    timeout = 120
    params = [list(SMALL_CASES), DTYPES, [False, True], [False, True]]
    param_names = ["case", "dtype", "return_stats", "grad"]
    number = 200

    def setup(self, name, dtype, stats, grad):
        torch = _torch()
        import torch.nn.functional as F

        op, shape, kwargs = SMALL_CASES[name]
        gen = np.random.default_rng(0)
        tdtype = getattr(torch, dtype)
        pshape = (shape[1],) if op == "group_norm" else shape[-1:]
        self.x, self.weight, self.bias = (
            torch.from_numpy(gen.standard_normal(s).astype(np.float32)).to(tdtype).requires_grad_(grad)
            for s in (shape, pshape, pshape))
        x, w, b = self.x, self.weight, self.bias
        if op == "group_norm":
            g = kwargs["num_groups"]
            self._ours = lambda: anynorm.group_norm(x, g, w, b, return_stats=stats)
            self._peer = lambda: F.group_norm(x, g, w, b, 1e-5)
        elif op == "rms_norm":
            self._ours = lambda: anynorm.rms_norm(x, w, return_stats=stats)
            self._peer = lambda: F.rms_norm(x, pshape, w, None)
        else:
            self._ours = lambda: anynorm.layer_norm(x, w, b, return_stats=stats)
            self._peer = lambda: F.layer_norm(x, pshape, w, b, 1e-5)
        self.grad = grad
        self.grad_mode = torch.enable_grad() if grad else torch.no_grad()
        self.grad_mode.__enter__()

    def teardown(self, name, dtype, stats, grad):
        mode = getattr(self, "grad_mode", None)
        if mode is not None:
            mode.__exit__(None, None, None)

    def _run(self, fn):
        if not self.grad:
            return fn()
        for t in (self.x, self.weight, self.bias):
            t.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    def ours(self):
        return self._run(self._ours)

    def peer(self):
        return self._run(self._peer)

    def time_anynorm(self, name, dtype, stats, grad):
        self.ours()

    def time_torch_functional(self, name, dtype, stats, grad):
        self.peer()

    def track_peer_ratio(self, name, dtype, stats, grad):
        return best_time(lambda: [self.ours() for _ in range(100)], repeat=5) / best_time(
            lambda: [self.peer() for _ in range(100)], repeat=5)

    track_peer_ratio.unit = "anynorm time / torch time"
