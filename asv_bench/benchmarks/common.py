"""Shapes, inputs and timing helpers shared by the benchmark modules.

``ANYNORM_BENCH_TINY=1`` swaps every shape for a tiny one of the same layout, so a test can
run each benchmark body once in seconds (``tests/test_benchmarks_smoke.py``).
"""

from __future__ import annotations

import os
import time

import numpy as np

TINY = os.environ.get("ANYNORM_BENCH_TINY", "") not in ("", "0")

# name: (op, full shape, tiny shape, keyword arguments of the anynorm function)
CASES = {
    # transformer rows: tokens x hidden
    "ln rows 8192x768": ("layer_norm", (8192, 768), (8, 24), {}),
    "ln rows 8192x1024": ("layer_norm", (8192, 1024), (8, 32), {}),
    "ln rows 8192x4096": ("layer_norm", (8192, 4096), (8, 64), {}),
    "ln rows 4096x8192": ("layer_norm", (4096, 8192), (4, 128), {}),
    "rms rows 8192x4096": ("rms_norm", (8192, 4096), (8, 64), {}),
    # ConvNeXt-T channels-first LayerNorm, stages 1 and 3
    "ln convnext 32x96x56x56": ("layer_norm", (32, 96, 56, 56), (2, 6, 5, 5), {"axis": 1}),
    "ln convnext 32x384x14x14": ("layer_norm", (32, 384, 14, 14), (2, 12, 3, 3), {"axis": 1}),
    # convolution outputs, channels first and channels last
    "in nchw 32x64x56x56": ("instance_norm", (32, 64, 56, 56), (2, 4, 5, 5), {}),
    "in nhwc 32x56x56x64": ("instance_norm", (32, 56, 56, 64), (2, 5, 5, 4), {"channel_axis": -1}),
    "gn32 nchw 32x64x56x56": ("group_norm", (32, 64, 56, 56), (2, 32, 3, 3), {"num_groups": 32}),
    "gn32 nhwc 32x56x56x64": ("group_norm", (32, 56, 56, 64), (2, 3, 3, 32),
                              {"num_groups": 32, "channel_axis": -1}),
    # tiny and odd
    "ln tiny 4x8": ("layer_norm", (4, 8), (4, 8), {}),
    "ln odd 1000x37": ("layer_norm", (1000, 37), (10, 37), {}),
    "ln odd axes 7x130x33 (0,2)": ("layer_norm", (7, 130, 33), (3, 5, 4), {"axis": (0, 2)}),
    "gn odd 3x30x7x9 g5": ("group_norm", (3, 30, 7, 9), (3, 10, 2, 3), {"num_groups": 5}),
}
CASE_NAMES = list(CASES)
# the cases whose figures the issue asks for, for benchmarks too slow to run on every shape
MAIN_CASES = ["ln rows 8192x4096", "ln convnext 32x96x56x56", "in nchw 32x64x56x56",
              "in nhwc 32x56x56x64", "gn32 nchw 32x64x56x56", "gn32 nhwc 32x56x56x64"]
EPS = 1e-5


def case(name):
    """``(op, shape, kwargs)`` of a case, at the size this run uses."""
    op, full, tiny, kwargs = CASES[name]
    return op, (tiny if TINY else full), dict(kwargs)


def param_shape(op, shape, kwargs):
    """Shape of weight/bias: the normalized axes (layer/RMS norm) or the channels."""
    if op in ("layer_norm", "rms_norm"):
        axis = kwargs.get("axis", -1)
        axes = sorted(a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,)))
        return tuple(shape[a] for a in axes)
    return (shape[kwargs.get("channel_axis", 1)],)


_CACHE = {}


def numpy_inputs(name, dtype):
    """``(x, weight, bias, dy)`` as NumPy arrays; made once per process and case."""
    key = (name, dtype)
    if key not in _CACHE:
        _CACHE.clear()  # one case's arrays at a time: the big ones are 128 MiB each
        op, shape, kwargs = case(name)
        rng = np.random.default_rng(0)
        x = (rng.random(shape, dtype=np.float32) * 4 - 2).astype(dtype)
        pshape = param_shape(op, shape, kwargs)
        weight = (rng.random(pshape, dtype=np.float32) + 0.5).astype(dtype)
        bias = (rng.random(pshape, dtype=np.float32) - 0.5).astype(dtype)
        dy = (rng.random(shape, dtype=np.float32) - 0.5).astype(dtype)
        _CACHE[key] = (x, weight, bias, dy)
    return _CACHE[key]


def call_anynorm(anynorm, name, x, weight, bias):
    """The anynorm function of case ``name`` on ``x`` (any library)."""
    op, _, kwargs = case(name)
    fn = getattr(anynorm, op)
    if op == "group_norm":
        kwargs = dict(kwargs)
        return fn(x, kwargs.pop("num_groups"), weight, bias, **kwargs)
    if op == "rms_norm":
        return fn(x, weight, **kwargs)
    return fn(x, weight, bias, **kwargs)


def call_anynorm_backward(anynorm, name, dy, x, weight):
    op, _, kwargs = case(name)
    fn = getattr(anynorm, f"{op}_backward")
    if op == "group_norm":
        kwargs = dict(kwargs)
        return fn(dy, x, kwargs.pop("num_groups"), weight, **kwargs)
    return fn(dy, x, weight, **kwargs)


def best_time(fn, repeat=None, sync=None):
    """Smallest wall time of ``fn()`` over a few calls (after one warm-up), in seconds."""
    repeat = repeat or (1 if TINY else 3)
    fn()
    best = float("inf")
    for _ in range(repeat):
        if sync:
            sync()
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        best = min(best, time.perf_counter() - start)
    return best
