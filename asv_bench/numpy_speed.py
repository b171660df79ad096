"""NumPy executor speed in single-thread CPU time, against ``np.copyto`` and tutorial NumPy.

On a shared 2-core machine wall times swing by 2x, so this script times each variant by
``time.thread_time()`` of the calling thread with the executor and BLAS held to that thread
(``_numpy.NUM_THREADS = 1``, ``OPENBLAS_NUM_THREADS=1``), interleaves the variants per round,
and prints per case the median over rounds of each ratio with its min-max::

    python asv_bench/numpy_speed.py [--rounds 9] [--cases "ln rows 8192x4096,..."] [--json F]

Ratios: ``ours / copy`` (``np.copyto`` into a preallocated array of the same bytes: the
issue's yardstick; ``ours`` allocates its output, whose first touch is part of its time),
``ours / (empty + copy)`` (a copy into a freshly allocated array: the page faults of a fresh
output), ``uncached / copy`` (ours with the output cache off, ``anynorm._outputs``: outputs of
32 MiB and up then fault in their pages on every call, as ``empty + copy``'s), ``ours / naive`` (the tutorial formula, ``peers.naive_numpy``), float16 / float32
(ours), bfloat16 / float32 (ours on ml_dtypes' bfloat16, where installed), and the peak memory a call allocates (tracemalloc, the output's own block counted: the
cache is emptied first) in output sizes.

``--floors`` adds, per case and in the same rounds, what no NumPy executor can beat (each
as a ratio to ``copy``): ``fresh 1 pass`` (``np.add(x, 1.0)`` into a new array: one read,
one write by a ufunc, the output's page faults), ``minimal`` (rows cases: the fewest NumPy
calls a two-pass layer norm with weight and bias needs, in 512 KiB blocks of rows with the
ufunc buffer at the row length: BLAS row sums, ``x - m``, BLAS ``d . d``, ``* r``, ``* w``,
``+ b``, no correction, no checks) and ``f16 conversions`` (float16 -> float32 -> float16 of
the whole array in the executor's integer passes, per block: the least float16 adds).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anynorm
from anynorm import _numpy, _outputs
from benchmarks.common import MAIN_CASES, call_anynorm, numpy_inputs
from benchmarks.peers import naive_numpy

DEFAULT_CASES = MAIN_CASES + ["ln rows 8192x768", "ln convnext 32x384x14x14", "rms rows 8192x4096",
                              "ln tiny 4x8"]


def cpu_time(fn, min_seconds):
    """CPU seconds of this thread per call of ``fn``, over enough calls to last ``min_seconds``."""
    calls, total = 0, 0.0
    while total < min_seconds or calls < 1:
        start = time.thread_time()
        fn()
        total += time.thread_time() - start
        calls += 1
    return total / calls


def cpu_time_batched(fn, min_seconds, batch=200):
    """As :func:`cpu_time` for calls far shorter than the clock's resolution."""
    calls, total = 0, 0.0
    while total < min_seconds:
        start = time.thread_time()
        for _ in range(batch):
            fn()
        total += time.thread_time() - start
        calls += batch
    return total / calls


def peak_memory(fn, nbytes):
    fn()
    _outputs.clear()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / nbytes
    finally:
        tracemalloc.stop()


def minimal_rows(x, w, b, eps=1e-5, block_bytes=512 << 10):
    """The fewest NumPy calls of a two-pass layer norm over the rows of a 2-d ``x``."""
    rows, n = x.shape
    y = np.empty_like(x)
    ones = np.ones(n, x.dtype)
    m, v = np.empty(rows, x.dtype), np.empty(rows, x.dtype)
    rb = max(1, block_bytes // (n * x.itemsize))
    with np.errstate():
        if n < 8192:
            np.setbufsize(max(16, n // 16 * 16))
        for s in range(0, rows, rb):
            xb, yb, mb, vb = x[s:s + rb], y[s:s + rb], m[s:s + rb], v[s:s + rb]
            np.matmul(xb, ones, out=mb)
            mb *= 1.0 / n
            np.subtract(xb, mb[:, None], out=yb)
            np.vecdot(yb, yb, out=vb)
            vb *= 1.0 / n
            vb += eps
            np.sqrt(vb, out=vb)
            np.divide(1.0, vb, out=vb)
            np.multiply(yb, vb[:, None], out=yb)
            np.multiply(yb, w, out=yb)
            np.add(yb, b, out=yb)
    return y


def half_round_trip(x16, rows):
    """float16 -> float32 -> float16 of ``x16`` (as ``(rows, -1)``) in 512 KiB blocks."""
    from anynorm._numpy_half import float_to_half, half_to_float

    x2 = x16.reshape(rows, -1)
    y = np.empty_like(x2)
    rb = max(1, (512 << 10) // (x2.shape[1] * 4))
    f = np.empty((rb, x2.shape[1]), np.float32)
    t, u = np.empty(f.shape, np.uint32), np.empty(f.shape, np.uint32)
    for s in range(0, rows, rb):
        k = min(rb, rows - s)
        half_to_float(x2[s:s + k], f[:k])
        float_to_half(f[:k], y[s:s + k], t[:k], u[:k])
    return y


def uncached(fn):
    _outputs.ENABLED = False
    try:
        return fn()
    finally:
        _outputs.ENABLED = True


def measure(name, rounds, min_seconds, floors=False):
    """Per-round times of each variant of case ``name``; returns a dict of lists (seconds)."""
    x, w, b, _ = numpy_inputs(name, np.dtype("float32"))
    x16, w16, b16, _ = (a.copy() for a in numpy_inputs(name, np.dtype("float16")))
    try:
        import ml_dtypes
    except ImportError:
        xbf = None
    else:
        xbf = tuple(None if a is None else a.astype(ml_dtypes.bfloat16) for a in (x, w, b))
    out = np.empty_like(x)
    small = x.size < 4096
    timer = cpu_time_batched if small else cpu_time
    variants = {
        "copy": lambda: np.copyto(out, x),
        "empty+copy": lambda: np.copyto(np.empty_like(x), x),
        "ours": lambda: call_anynorm(anynorm, name, x, w, b),
        "naive": lambda: naive_numpy(name, x, w, b),
        "ours f16": lambda: call_anynorm(anynorm, name, x16, w16, b16),
        "uncached": lambda: uncached(lambda: call_anynorm(anynorm, name, x, w, b)),
    }
    if xbf is not None:
        variants["ours bf16"] = lambda: call_anynorm(anynorm, name, *xbf)
    if floors:
        variants["fresh 1 pass"] = lambda: np.add(x, 1.0)
        if x.ndim == 2 and w is not None and b is not None and name.startswith("ln rows"):
            variants["minimal"] = lambda: minimal_rows(x, w, b)
        variants["f16 conversions"] = lambda: half_round_trip(x16, x.shape[0])
    for fn in variants.values():
        fn()
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            times[k].append(timer(fn, min_seconds))
    times["memory"] = peak_memory(variants["ours"], x.nbytes)
    times["memory f16"] = peak_memory(variants["ours f16"], x16.nbytes)
    return times


def ratio(times, a, b):
    r = [p / q for p, q in zip(times[a], times[b])]
    return statistics.median(r), min(r), max(r)


def fmt(r):
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--min-seconds", type=float, default=0.15)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--json")
    parser.add_argument("--floors", action="store_true", help="also time the floors (see above)")
    args = parser.parse_args(argv)
    _numpy.NUM_THREADS = 1
    rows = {}
    extra = " fresh 1 pass/copy | minimal/copy | f16 conversions/copy |" if args.floors else ""
    print("| case | ours ms | copy ms | ours/copy | ours/(empty+copy) | uncached/copy | ours/naive | f16/f32"
          " | bf16/f32 | memory f32, f16 |" + extra)
    print("|---|---:|---:|---|---|---|---|---|---|---|" + "---|" * (3 if args.floors else 0))
    for name in args.cases.split(","):
        t = measure(name, args.rounds, args.min_seconds, args.floors)
        rows[name] = t
        floors = "".join(f" {fmt(ratio(t, k, 'copy')) if k in t else '-'} |"
                         for k in ("fresh 1 pass", "minimal", "f16 conversions")) if args.floors else ""
        print(f"| {name} | {statistics.median(t['ours']) * 1e3:.3f} | {statistics.median(t['copy']) * 1e3:.3f}"
              f" | {fmt(ratio(t, 'ours', 'copy'))} | {fmt(ratio(t, 'ours', 'empty+copy'))}"
              f" | {fmt(ratio(t, 'uncached', 'copy'))}"
              f" | {fmt(ratio(t, 'ours', 'naive'))} | {fmt(ratio(t, 'ours f16', 'ours'))}"
              f" | {fmt(ratio(t, 'ours bf16', 'ours')) if 'ours bf16' in t else '-'}"
              f" | {t['memory']:.2f}, {t['memory f16']:.2f} |" + floors, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
