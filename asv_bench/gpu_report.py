#!/usr/bin/env python
"""Every GPU figure the open issues ask for, from one command (for a session with a borrowed GPU).

    python asv_bench/gpu_report.py [--out DIR] [--quick] [--device cuda|cpu] [--tiny]

Sections, each a markdown table:

1. rows (issue 3): layer_norm and rms_norm over the last axis of M x N (M*N = 2^25), forward and
   autograd backward on CUDA torch tensors (bfloat16, float32), layer_norm forward on CuPy arrays
   (float16, float32), 32-group group_norm on Stable Diffusion's NCHW shapes; against
   torch.nn.functional and a device-to-device copy of the same bytes.
2. strided (issue 4): ConvNeXt's channels-first layer_norm (axis=1), channels-last (NHWC)
   instance_norm and 32-group group_norm, forward and backward, against torch's best equivalent.
3. overhead: wall-clock microseconds per call of small layer norms (1000 calls, one synchronize).

Each anynorm result is checked against torch (max abs error) before it is timed. All variants
of a case are timed in this process, their repeats interleaved: CUDA events around a loop of
calls (perf_counter on CPU), the minimum per-call time of several repeats. The tables go to
stdout and DIR/gpu_report.md, everything measured to DIR/gpu_report.json; both are rewritten
after every case, so a run cut short keeps what it measured. A failing case shows its error in
its row and the run goes on; the exit status is 1 when any case failed, was wrong or was
skipped for time. ``--device cpu`` (torch CPU tensors) and ``--tiny`` (small shapes of the same
layouts) let CI smoke-test this script without a GPU (tests/test_gpu_report_smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
EPS = 1e-5
ROW_ELEMENTS = 2 ** 25
HIDDEN = (768, 1024, 2048, 4096, 8192, 16384)
CONVNEXT_NCHW = ((64, 96, 56, 56), (64, 192, 28, 28), (64, 384, 14, 14), (64, 768, 7, 7))
CHANNELS_LAST_NHWC = ((32, 56, 56, 64), (32, 28, 28, 256))
# Stable Diffusion's UNet GroupNorm(32, C) on NCHW: rows of 40960 and 20480 elements take the
# split path (backward: per-channel segment sums), 10240 the register kernels
SD_GROUP_NCHW = ((8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16))
GROUPS = 32
OVERHEAD_SHAPES = ((4, 8), (64, 768))
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# max abs error allowed, relative to max(1, largest |reference|): a few units in the last place
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 6e-2}
TARGETS = {
    "rows": "ours >= 85% of copy bandwidth for N >= 1024, and faster than torch (ours/torch < 1) everywhere",
    "strided": "ours >= 2x faster than torch (ours/torch <= 0.5) and >= 75% of copy bandwidth",
    "overhead": "none set; launch cost per call (lower is better)",
}


# --------------------------------------------------------------------------- setup

@dataclasses.dataclass
class Settings:
    device: str
    tiny: bool
    quick: bool
    repeats: int
    region_ms: float      # each timed region loops calls between two events for at least this long
    overhead_calls: int
    budget_s: float       # cases not started by then are skipped, so the command ends in time

    @classmethod
    def from_args(cls, args):
        region = 1.0 if args.tiny else (10.0 if args.quick else 25.0)
        return cls(device=args.device, tiny=args.tiny, quick=args.quick,
                   repeats=3 if args.quick else 7, region_ms=region,
                   overhead_calls=100 if args.tiny else 1000, budget_s=args.budget_s)


class SetupError(Exception):
    """The run cannot start (no CUDA device, no torch)."""


def import_anynorm():
    """anynorm as installed, else from this checkout (a device machine without ``pip install``)."""
    try:
        import anynorm
    except ImportError:
        sys.path.insert(0, str(REPO))
        import anynorm
    return anynorm


def load_cupy():
    """``(cupy, None)`` or ``(None, why not)``."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy, None
    except Exception as exc:  # ImportError, no driver
        return None, f"CuPy is not usable: {exc}"


class HostClock:
    """perf_counter around a loop of calls (CPU tensors)."""

    max_calls = 1000

    def sync(self):
        pass

    def region(self, fn, calls, lib, ahead_ms=0.0):
        """``(ms, host ms)`` of ``calls`` calls ``fn(0) .. fn(calls - 1)``."""
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        ms = (time.perf_counter() - start) * 1e3
        return ms, ms


class CudaClock:
    """CUDA events around a loop of calls on the current stream.

    A GPU-side sleep queued before the start event keeps the GPU busy while the host enqueues
    the calls, so the events measure GPU time even where launching costs more than the kernel
    (the overhead section measures launch cost). Few enough calls per region that the launch
    queue (about a thousand kernels) does not fill up before the sleep ends.
    """

    max_calls = 100

    def __init__(self, torch, cupy):
        self.torch, self.cupy = torch, cupy
        self.sleep_cycles_per_ms = self._sleep_rate()

    def _sleep_rate(self):
        """Cycles of ``torch.cuda._sleep`` per ms, measured after some work raised the clocks."""
        torch = self.torch
        try:
            scratch = torch.empty(2 ** 26, device="cuda")
            for _ in range(20):
                scratch.mul_(1.0)
            start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            torch.cuda._sleep(20_000_000)
            stop.record()
            stop.synchronize()
            ms = start.elapsed_time(stop)
            return 2e7 / ms if ms > 0 else None
        except Exception:  # a private function: time without it
            return None

    def sync(self):
        self.torch.cuda.synchronize()

    def _events(self, lib):
        if lib == "cupy":
            cp = self.cupy
            return cp.cuda.Event(), cp.cuda.Event(), cp.cuda.get_elapsed_time
        torch = self.torch
        start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        return start, stop, lambda a, b: a.elapsed_time(b)

    def region(self, fn, calls, lib, ahead_ms=0.0):
        start, stop, elapsed = self._events(lib)
        self.sync()
        if ahead_ms > 0 and self.sleep_cycles_per_ms:
            self.torch.cuda._sleep(int(min(ahead_ms, 50.0) * self.sleep_cycles_per_ms))
        start.record()  # torch's default stream is CuPy's null stream: one stream for both
        host_start = time.perf_counter()
        for i in range(calls):
            fn(i)
        host_ms = (time.perf_counter() - host_start) * 1e3
        stop.record()
        stop.synchronize()
        return elapsed(start, stop), host_ms


class Env:
    """The libraries, device, clock and settings of this run."""

    def __init__(self, args):
        try:
            import torch
            import torch.nn.functional as F
        except ImportError as exc:
            raise SetupError(f"torch is needed: {exc}") from None
        self.torch, self.F = torch, F
        self.anynorm = import_anynorm()
        self.settings = Settings.from_args(args)
        self.device = args.device
        self.started = time.perf_counter()
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise SetupError("--device cuda: torch sees no CUDA device (use --device cpu for a smoke run)")
            self.cupy, self.cupy_problem = load_cupy()
            # measure the kernels or fail loudly: "auto" would quietly fall back to the array-API core
            self.anynorm.set_backend("kernels")
            self.clock = CudaClock(torch, self.cupy)
            self.l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
        else:
            self.cupy, self.cupy_problem = None, "not used (--device cpu)"
            self.clock = HostClock()
            self.l2_bytes = 0

    def elapsed(self):
        return time.perf_counter() - self.started

    def need_cupy(self):
        if self.cupy is None:
            raise RuntimeError(self.cupy_problem)
        return self.cupy

    def copies(self, set_bytes):
        """How many input sets to rotate through so that a loop of calls reads memory, not L2."""
        return max(1, min(16, math.ceil(3 * self.l2_bytes / max(set_bytes, 1))))

    def dtype(self, name):
        return getattr(self.torch, name)


def git_commit():
    """Short commit of this checkout, with '+dirty' for uncommitted changes to tracked files."""
    try:
        run = lambda *cmd: subprocess.run(["git", "-C", str(REPO), *cmd], capture_output=True,
                                          text=True, timeout=10, check=True).stdout.strip()
        commit = run("rev-parse", "--short=12", "HEAD")
        return commit + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except Exception:  # no git, or a copy without .git
        return "unknown"


def cpu_name():
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def describe_machine(env):
    """Device, versions and settings, for the top of the report."""
    torch, s = env.torch, env.settings
    meta = {"device": env.device, "torch": torch.__version__, "anynorm": env.anynorm.__version__,
            "anynorm_path": str(pathlib.Path(env.anynorm.__file__).parent), "git_commit": git_commit(),
            "python": platform.python_version(), "argv": sys.argv[1:],
            "settings": dataclasses.asdict(s), "backend": env.anynorm.get_backend()}
    if env.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update(device_name=props.name, sms=props.multi_processor_count, l2_bytes=env.l2_bytes,
                    torch_cuda=torch.version.cuda, cupy=getattr(env.cupy, "__version__", env.cupy_problem),
                    max_calls_per_region=env.clock.max_calls,
                    sleep_cycles_per_ms=env.clock.sleep_cycles_per_ms)
    else:
        meta.update(device_name=cpu_name(), cupy=env.cupy_problem,
                    torch_threads=torch.get_num_threads(), max_calls_per_region=env.clock.max_calls)
    return meta


def header_lines(meta):
    s = meta["settings"]
    timer = ("CUDA events on the current stream, GPU work queued behind a GPU-side sleep"
             if meta["device"] == "cuda" else "time.perf_counter")
    extra = (f", {meta['sms']} SMs, L2 {meta['l2_bytes'] >> 20} MiB, torch CUDA {meta['torch_cuda']}"
             if meta["device"] == "cuda" else f", {meta['torch_threads']} torch threads")
    return [
        "# anynorm GPU report",
        "",
        f"- device: {meta['device_name']} ({meta['device']}{extra})",
        f"- torch {meta['torch']}, cupy {meta['cupy']}, anynorm {meta['anynorm']} from {meta['anynorm_path']}, "
        f"anynorm backend {meta['backend']!r}, python {meta['python']}",
        f"- git commit {meta['git_commit']}",
        f"- timing: {timer}; per case every variant's repeats interleaved; {s['repeats']} repeats of "
        f">= {s['region_ms']:g} ms (at most {meta['max_calls_per_region']} calls per region), "
        f"minimum per-call time{'; tiny shapes' if s['tiny'] else ''}",
        f"- {meta['planned_cases']} cases; those not started within {s['budget_s']:g} s are skipped",
        "- `of copy`: (bytes ours moves / ours time) / (bytes the copy moves / copy time); forward "
        "moves 2 x bytes(x) (read x, write y), backward 3 x bytes(x) (read x and dy, write dx).",
    ]


# --------------------------------------------------------------------------- workloads

@dataclasses.dataclass
class Workload:
    """One normalization: anynorm's call and torch's equivalents, on x of ``shape``."""

    name: str
    shape: tuple
    param_shape: tuple
    ours: Callable                # (x, w, b) -> y
    peers: dict                   # name -> (x, w, b) -> y of x's shape and layout; "torch" first
    has_bias: bool = True

    def x_bytes(self, dtype):
        return math.prod(self.shape) * ITEMSIZE[dtype]


def layer_norm_rows(env, M, N):
    an, F = env.anynorm, env.F
    return Workload(f"layer_norm {M}x{N}", (M, N), (N,),
                    ours=lambda x, w, b: an.layer_norm(x, w, b, eps=EPS),
                    peers={"torch": lambda x, w, b: F.layer_norm(x, (N,), w, b, EPS)})


def rms_norm_rows(env, M, N):
    an, F = env.anynorm, env.F
    return Workload(f"rms_norm {M}x{N}", (M, N), (N,),
                    ours=lambda x, w, b: an.rms_norm(x, w, eps=EPS),
                    peers={"torch": lambda x, w, b: F.rms_norm(x, (N,), w, EPS)}, has_bias=False)


def convnext_layer_norm(env, shape):
    """Channels-first LayerNorm; torch's equivalent permutes to channels-last and back."""
    an, F = env.anynorm, env.F
    C = shape[1]

    def torch_permuted(x, w, b):
        return F.layer_norm(x.permute(0, 2, 3, 1), (C,), w, b, EPS).permute(0, 3, 1, 2)

    return Workload(f"convnext layer_norm axis=1 {'x'.join(map(str, shape))}", shape, (C,),
                    ours=lambda x, w, b: an.layer_norm(x, w, b, axis=1, eps=EPS),
                    peers={"torch": torch_permuted,
                           "torch_contig": lambda x, w, b: torch_permuted(x, w, b).contiguous()})


def nhwc_instance_norm(env, shape):
    """On NHWC memory; torch's F.instance_norm takes the channels_last NCHW view of it."""
    an, F = env.anynorm, env.F
    return Workload(f"instance_norm NHWC {'x'.join(map(str, shape))}", shape, (shape[-1],),
                    ours=lambda x, w, b: an.instance_norm(x, w, b, channel_axis=-1, eps=EPS),
                    peers={"torch": lambda x, w, b: F.instance_norm(
                        x.permute(0, 3, 1, 2), weight=w, bias=b, eps=EPS).permute(0, 2, 3, 1)})


def nhwc_group_norm(env, shape):
    an, F = env.anynorm, env.F
    return Workload(f"group_norm {GROUPS} NHWC {'x'.join(map(str, shape))}", shape, (shape[-1],),
                    ours=lambda x, w, b: an.group_norm(x, GROUPS, w, b, channel_axis=-1, eps=EPS),
                    peers={"torch": lambda x, w, b: F.group_norm(
                        x.permute(0, 3, 1, 2), GROUPS, w, b, EPS).permute(0, 2, 3, 1)})


def nchw_group_norm(env, shape):
    an, F = env.anynorm, env.F
    return Workload(f"group_norm {GROUPS} NCHW {'x'.join(map(str, shape))}", shape, (shape[1],),
                    ours=lambda x, w, b: an.group_norm(x, GROUPS, w, b, eps=EPS),
                    peers={"torch": lambda x, w, b: F.group_norm(x, GROUPS, w, b, EPS)})


def sd_group_shapes(tiny):
    if tiny:
        return [(2, C // 10, H // 16, W // 16) for _, C, H, W in SD_GROUP_NCHW]
    return list(SD_GROUP_NCHW)


def row_shapes(tiny):
    """``(M, N)``: M = 2^25 // N rows of N (tiny: N / 32 wide, 2^14 elements)."""
    if tiny:
        return [(2 ** 14 // (N // 32), N // 32) for N in HIDDEN]
    return [(ROW_ELEMENTS // N, N) for N in HIDDEN]


def convnext_shapes(tiny):
    if tiny:
        return [(2, C // 16, max(2, H // 8), max(2, W // 8)) for _, C, H, W in CONVNEXT_NCHW]
    return list(CONVNEXT_NCHW)


def channels_last_shapes(tiny):
    if tiny:  # channels kept: 32 groups must divide them
        return [(2, max(2, H // 8), max(2, W // 8), C) for _, H, W, C in CHANNELS_LAST_NHWC]
    return list(CHANNELS_LAST_NHWC)


# --------------------------------------------------------------------------- benches

@dataclasses.dataclass
class Variant:
    """A timed thing: ``make()`` returns ``fn(i)``, the i-th call of a loop."""

    make: Callable
    lib: str = "torch"


@dataclasses.dataclass
class Bench:
    variants: dict                # "ours", the peers, "copy" -> Variant
    check: Callable               # () -> {output name: {"max_abs", "scale"}}


def rotating(fn, arg_sets):
    """``fn`` over the argument sets in turn: call i takes set i mod len."""
    return lambda i: fn(*arg_sets[i % len(arg_sets)])


def random_inputs(env, work, dtype, copies, grad=False):
    """``(xs, weight, bias, dys)``: x uniform in [-2, 2), dy in [-0.5, 0.5), weight in
    [0.5, 1.5), bias in [-0.5, 0.5); ``copies`` of x and dy (different values)."""
    torch = env.torch
    gen = torch.Generator(device=env.device).manual_seed(0)

    def uniform(shape, low, high, requires_grad):
        t = torch.rand(shape, generator=gen, device=env.device) * (high - low) + low
        return t.to(env.dtype(dtype)).requires_grad_(requires_grad)

    xs = [uniform(work.shape, -2, 2, grad) for _ in range(copies)]
    weight = uniform(work.param_shape, 0.5, 1.5, grad)
    bias = uniform(work.param_shape, -0.5, 0.5, grad)
    dys = [uniform(work.shape, -0.5, 0.5, False) for _ in range(copies)] if grad else []
    return xs, weight, bias, dys


class PeerError(Exception):
    """torch's reference call failed: anynorm is still timed, unchecked."""


def reference(fn, *args):
    """torch's result, or PeerError."""
    try:
        return fn(*args)
    except Exception as exc:
        raise PeerError(short_error(exc)) from exc


def compare(ours, expected):
    """Max abs difference and the expected result's largest magnitude, in float32."""
    ours, expected = ours.detach().float(), expected.detach().float()
    if ours.shape != expected.shape:
        raise AssertionError(f"shape {tuple(ours.shape)} != torch's {tuple(expected.shape)}")
    return {"max_abs": (ours - expected).abs().max().item(), "scale": expected.abs().max().item()}


def forward_bench(env, work, dtype, lib):
    """anynorm on torch tensors (``lib="torch"``) or on CuPy views of them (``"cupy"``), the
    torch peers on the tensors, and a copy of x into a preallocated array of the same library."""
    xs, w, b, _ = random_inputs(env, work, dtype, env.copies(work.x_bytes(dtype)))
    torch_sets = [(x, w, b) for x in xs]
    if lib == "cupy":
        cp = env.need_cupy()
        ours_sets = [tuple(cp.from_dlpack(t) for t in s) for s in torch_sets]
        out = cp.empty_like(ours_sets[0][0])
        copy = rotating(lambda x, w, b: cp.copyto(out, x), ours_sets)
        as_torch = env.torch.from_dlpack
    else:
        ours_sets = torch_sets
        out = env.torch.empty_like(xs[0])
        copy = rotating(lambda x, w, b: out.copy_(x), torch_sets)
        as_torch = lambda y: y

    variants = {"ours": Variant(lambda: rotating(work.ours, ours_sets), lib)}
    for name, peer in work.peers.items():
        variants[name] = Variant(lambda peer=peer: rotating(peer, torch_sets))
    variants["copy"] = Variant(lambda: copy, lib)

    def check():
        y = as_torch(work.ours(*ours_sets[0]))
        env.clock.sync()
        return {"y": compare(y, reference(work.peers["torch"], *torch_sets[0]))}

    return Bench(variants, check)


def backward_bench(env, work, dtype):
    """Autograd backward only: each variant's graphs are built once and run again and again
    (retain_graph) for dx, dweight (and dbias) of ``dy``; x, weight, bias require grad."""
    torch = env.torch
    x_bytes = work.x_bytes(dtype)
    xs, w, b, dys = random_inputs(env, work, dtype, env.copies(2 * x_bytes), grad=True)
    params = (w, b) if work.has_bias else (w,)

    def grads(y, x, dy, retain=True):
        return torch.autograd.grad(y, (x, *params), dy, retain_graph=retain)

    def make(forward):
        sets = [(forward(x, w, b), x, dy) for x, dy in zip(xs, dys)]
        return rotating(grads, sets)

    variants = {"ours": Variant(lambda: make(work.ours))}
    for name, peer in work.peers.items():
        variants[name] = Variant(lambda peer=peer: make(peer))
    out = torch.empty_like(xs[0])
    detached = [(x.detach(),) for x in xs]
    variants["copy"] = Variant(lambda: rotating(out.copy_, detached))

    def check():
        ours = grads(work.ours(xs[0], w, b), xs[0], dys[0], retain=False)
        theirs = reference(lambda: grads(work.peers["torch"](xs[0], w, b), xs[0], dys[0], retain=False))
        return {name: compare(a, r) for name, a, r in zip(("dx", "dweight", "dbias"), ours, theirs)}

    return Bench(variants, check)


# --------------------------------------------------------------------------- timing

def short_error(exc):
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def calibrate(clock, fn, lib, region_ms):
    """``(calls per region, host ms per call)``: calls enough for ``region_ms`` of GPU time."""
    fn(0)  # compiles kernels, fills the allocator's caches
    fn(1)
    clock.sync()
    calls, host_per_call = 1, 0.0
    while True:
        ms, host_ms = clock.region(fn, calls, lib, ahead_ms=2 * host_per_call * calls)
        host_per_call = host_ms / calls
        if ms >= region_ms / 4 or calls >= clock.max_calls:
            break
        calls = min(clock.max_calls, calls * 8)
    per_call = max(ms / calls, 1e-6)
    return max(1, min(clock.max_calls, math.ceil(region_ms / per_call))), host_per_call


def time_variants(env, variants):
    """``({name: timing}, {name: error})``; a variant that fails leaves the others timed."""
    clock, s = env.clock, env.settings
    loops, plans, errors = {}, {}, {}
    for name, variant in variants.items():
        try:
            loops[name] = variant.make()
            plans[name] = calibrate(clock, loops[name], variant.lib, s.region_ms)
        except Exception as exc:
            errors[name] = short_error(exc)
            loops.pop(name, None)
    samples = {name: ([], []) for name in plans}
    for _ in range(s.repeats):
        for name in list(samples):
            calls, host_per_call = plans[name]
            try:
                ms, host_ms = clock.region(loops[name], calls, variants[name].lib,
                                           ahead_ms=2 * host_per_call * calls)
            except Exception as exc:
                errors[name] = short_error(exc)
                del samples[name]
                continue
            samples[name][0].append(ms / calls)
            samples[name][1].append(host_ms / calls)
    timings = {name: {"min_ms": min(ms), "median_ms": statistics.median(ms), "calls": plans[name][0],
                      "repeats": len(ms), "host_ms_per_call": statistics.median(host)}
               for name, (ms, host) in samples.items()}
    return timings, errors


def release_memory(env, failed=False):
    """Give the case's memory back; after a failure its traceback's frames hold cycles."""
    if failed:
        gc.collect()  # about 0.1 s with torch loaded: not after every case
    if env.device == "cuda":
        env.torch.cuda.empty_cache()
    if env.cupy is not None:
        env.cupy.get_default_memory_pool().free_all_blocks()


# --------------------------------------------------------------------------- cases

@dataclasses.dataclass
class Case:
    section: str
    work: Workload
    dtype: str
    direction: str        # "fwd" | "bwd"
    lib: str = "torch"    # the library of anynorm's input
    tile_caps: tuple | None = None  # anynorm's shared-memory tile budgets for this case (None: as shipped)

    @property
    def bytes_moved(self):
        return (2 if self.direction == "fwd" else 3) * self.work.x_bytes(self.dtype)


def check_ok(errors, dtype):
    return all(e["max_abs"] <= TOLERANCE[dtype] * max(1.0, e["scale"]) for e in errors.values())


def new_row(case):
    return {"section": case.section, "name": case.work.name, "shape": list(case.work.shape),
            "dtype": case.dtype, "pass": case.direction, "lib": case.lib, "error": None,
            "variant_errors": {}, "errors": {}, "max_err": None, "check_ok": None, "times": {},
            "kernels": []}


def run_timed_case(env, case):
    """Build, check against torch, time; the row for the JSON and the table."""
    row = new_row(case)
    try:
        with tile_caps(env, case.tile_caps):
            bench = (forward_bench(env, case.work, case.dtype, case.lib) if case.direction == "fwd"
                     else backward_bench(env, case.work, case.dtype))
            try:
                with kernels_launched(env, row["kernels"]):
                    row["errors"] = bench.check()
                row["max_err"] = row["errors"]["y" if case.direction == "fwd" else "dx"]["max_abs"]
                row["check_ok"] = check_ok(row["errors"], case.dtype)
            except PeerError as exc:
                row["check_error"] = f"no torch reference: {exc}"
            row["times"], row["variant_errors"] = time_variants(env, bench.variants)
        if "ours" in row["variant_errors"]:
            row["error"] = row["variant_errors"]["ours"]
    except Exception as exc:
        row["error"] = short_error(exc)
        row["traceback"] = traceback.format_exc(limit=8)
    bench = None
    release_memory(env, failed=bool(row["error"] or row["variant_errors"]))
    add_derived(row, case)
    return row


@contextlib.contextmanager
def launch_attribute(env, name, value):
    """``anynorm._cuda._launch.<name>`` set to ``value`` for the block, on CUDA (else nothing)."""
    if env.device != "cuda":
        yield
        return
    launch = importlib.import_module("anynorm._cuda._launch")
    shipped = getattr(launch, name)
    setattr(launch, name, value)
    try:
        yield
    finally:
        setattr(launch, name, shipped)


def kernels_launched(env, names):
    """Append to ``names`` each anynorm kernel (``name<ITEMS>``) the block launches, once, on CUDA."""
    if env.device != "cuda":
        return contextlib.nullcontext()
    fetch = importlib.import_module("anynorm._cuda._launch").get_kernel

    def recording(kernel, dtype, items=None):
        name = kernel if items is None else f"{kernel}<{items}>"
        if name not in names:
            names.append(name)
        return fetch(kernel, dtype, items)

    return launch_attribute(env, "get_kernel", recording)


def tile_caps(env, caps):
    """anynorm's shared-memory tile budgets (``_launch._TILE_SMEM_CAPS``) set to ``caps`` for
    the block; ``None`` leaves them as shipped."""
    return contextlib.nullcontext() if caps is None else launch_attribute(env, "_TILE_SMEM_CAPS", caps)


def add_derived(row, case):
    """Bandwidth, fraction of copy bandwidth, ratios to the peers, the issue's target."""
    ms = {name: t["min_ms"] for name, t in row["times"].items()}
    copy_bytes = 2 * case.work.x_bytes(case.dtype)
    row["bytes_moved"], row["copy_bytes"] = case.bytes_moved, copy_bytes
    ours = ms.get("ours")
    row["gbps"] = case.bytes_moved / ours / 1e6 if ours else None
    row["copy_fraction"] = (case.bytes_moved / ours) / (copy_bytes / ms["copy"]) if ours and "copy" in ms else None
    for peer in ("torch", "torch_contig"):
        row[f"ratio_{peer}"] = ours / ms[peer] if ours and peer in ms else None
    row["target_met"] = target_met(row, case)


def target_met(row, case):
    frac, ratio = row["copy_fraction"], row["ratio_torch"]
    if frac is None or ratio is None or row["error"] or not row["check_ok"]:
        return None  # a wrong or unchecked result meets no target
    if case.section == "rows":
        return ratio < 1 and (case.work.shape[-1] < 1024 or frac >= 0.85)
    return ratio <= 0.5 and frac >= 0.75


def skipped_row(env, case):
    row = new_row(case)
    row.update(error=f"skipped: time budget of {env.settings.budget_s:g} s spent", skipped=True)
    add_derived(row, case)
    return row


def rows_cases(env):
    """Issue 3: forward and backward of layer/RMS norm on rows and of NCHW group norm; CuPy forward."""
    shapes = row_shapes(env.settings.tiny)
    for make, direction in ((layer_norm_rows, "fwd"), (rms_norm_rows, "fwd"),
                            (layer_norm_rows, "bwd"), (rms_norm_rows, "bwd")):
        for dtype in ("bfloat16", "float32"):
            for M, N in shapes:
                yield Case("rows", make(env, M, N), dtype, direction)
    for direction in ("fwd", "bwd"):  # channels-first group norm, also a rows layout
        for shape in sd_group_shapes(env.settings.tiny):
            for dtype in ("bfloat16", "float32"):
                yield Case("rows", nchw_group_norm(env, shape), dtype, direction)
    if env.device == "cuda":
        for dtype in ("float16", "float32"):  # CuPy has no bfloat16
            for M, N in shapes:
                yield Case("rows", layer_norm_rows(env, M, N), dtype, "fwd", lib="cupy")


def strided_cases(env):
    """Issue 4: channels-first layer norm, channels-last instance and group norm."""
    tiny = env.settings.tiny
    workloads = ([convnext_layer_norm(env, s) for s in convnext_shapes(tiny)]
                 + [nhwc_instance_norm(env, s) for s in channels_last_shapes(tiny)]
                 + [nhwc_group_norm(env, s) for s in channels_last_shapes(tiny)])
    for direction in ("fwd", "bwd"):
        for work in workloads:
            for dtype in ("bfloat16", "float32"):
                yield Case("strided", work, dtype, direction)
    if env.device == "cuda":
        # The same channels-last cases with tiles of at most 64 KiB: where the shipped launcher
        # takes a larger tile, this row is its alternative (the split path), timed in this process.
        capped = [dataclasses.replace(work, name=f"{work.name} [tiles <= 64 KiB]")
                  for work in workloads if "NHWC" in work.name]
        for direction in ("fwd", "bwd"):
            for work in capped:
                for dtype in ("bfloat16", "float32"):
                    yield Case("strided", work, dtype, direction, tile_caps=(64 * 1024,))


# --------------------------------------------------------------------------- overhead

def overhead_modes(env):
    modes = ["no_grad", "requires_grad"]
    return modes + ["cupy"] if env.device == "cuda" else modes


def wall_us_per_call(env, fn, calls):
    """Wall-clock microseconds per call of ``calls`` calls followed by one synchronize."""
    env.clock.sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    env.clock.sync()
    return (time.perf_counter() - start) / calls * 1e6


def overhead_callables(env, shape, mode):
    """``(ours(), torch(), check())`` of float32 layer norm on ``shape`` in ``mode``."""
    torch, F, an = env.torch, env.F, env.anynorm
    work = layer_norm_rows(env, *shape)
    (x,), w, b, _ = random_inputs(env, work, "float32", 1)
    if mode == "requires_grad":
        for t in (x, w, b):
            t.requires_grad_(True)
    ours_args = (x, w, b)
    if mode == "cupy":
        cp = env.need_cupy()
        ours_args = tuple(cp.from_dlpack(t) for t in ours_args)
    ours = lambda: an.layer_norm(*ours_args, eps=EPS)
    peer = lambda: F.layer_norm(x, (shape[-1],), w, b, EPS)
    as_torch = torch.from_dlpack if mode == "cupy" else (lambda y: y)
    check = lambda: {"y": compare(as_torch(ours()), reference(peer))}
    return ours, peer, check


def run_overhead_case(env, shape, mode):
    s = env.settings
    row = {"section": "overhead", "name": f"layer_norm {shape[0]}x{shape[1]}", "shape": list(shape),
           "dtype": "float32", "pass": "fwd", "lib": "cupy" if mode == "cupy" else "torch",
           "mode": mode, "calls": s.overhead_calls, "error": None, "errors": {}, "max_err": None,
           "check_ok": None, "times_us": {}, "ratio_torch": None}
    grad_mode = env.torch.no_grad() if mode != "requires_grad" else env.torch.enable_grad()
    try:
        with grad_mode:
            ours, peer, check = overhead_callables(env, shape, mode)
            try:
                row["errors"] = check()
                row["max_err"] = row["errors"]["y"]["max_abs"]
                row["check_ok"] = check_ok(row["errors"], "float32")
            except PeerError as exc:
                row["check_error"] = f"no torch reference: {exc}"
            samples = {"ours": [], "torch": []}
            for fn in (ours, peer):  # warm-up: compiles kernels
                wall_us_per_call(env, fn, 50)
            for _ in range(s.repeats):
                samples["ours"].append(wall_us_per_call(env, ours, s.overhead_calls))
                samples["torch"].append(wall_us_per_call(env, peer, s.overhead_calls))
        row["times_us"] = {name: {"min_us": min(v), "median_us": statistics.median(v)}
                           for name, v in samples.items()}
        row["ratio_torch"] = row["times_us"]["ours"]["min_us"] / row["times_us"]["torch"]["min_us"]
    except Exception as exc:
        row["error"] = short_error(exc)
        row["traceback"] = traceback.format_exc(limit=8)
    release_memory(env, failed=row["error"] is not None)
    return row


# --------------------------------------------------------------------------- report

def fmt(value, spec):
    return "—" if value is None else format(value, spec)


def ms_of(row, name):
    return fmt(row["times"].get(name, {}).get("min_ms"), ".4g") if name not in row["variant_errors"] else "error"


def check_text(row):
    return {None: "—", True: "ok", False: "WRONG"}[row["check_ok"]]


def notes_text(row, launch_bound=True):
    notes = []
    if row.get("error"):
        notes.append(f"ERROR {row['error']}")
    for name, error in row.get("variant_errors", {}).items():
        if name != "ours":
            notes.append(f"{name}: {error}")
    if row.get("check_error") and "torch" not in row.get("variant_errors", {}):
        notes.append(row["check_error"])
    if row["check_ok"] is False:
        notes.append("errors: " + ", ".join(f"{k} {v['max_abs']:.2g} (reference up to {v['scale']:.2g})"
                                            for k, v in row["errors"].items()))
    ours = row.get("times", {}).get("ours")
    if launch_bound and ours and ours["host_ms_per_call"] > ours["min_ms"]:
        notes.append(f"launch-bound: host {ours['host_ms_per_call'] * 1e3:.0f} us/call")
    if row.get("kernels"):
        notes.append("kernels " + " ".join(row["kernels"]))
    return "; ".join(notes).replace("|", "/")


def target_text(row):
    return {None: "—", True: "yes", False: "no"}[row["target_met"]]


def timed_columns(with_lib, with_contig, launch_notes):
    columns = [("case", lambda r: r["name"]), ("dtype", lambda r: r["dtype"]), ("pass", lambda r: r["pass"])]
    if with_lib:
        columns.append(("lib", lambda r: r["lib"]))
    columns += [("ours ms", lambda r: ms_of(r, "ours")), ("torch ms", lambda r: ms_of(r, "torch"))]
    if with_contig:
        columns.append(("torch+contig ms", lambda r: ms_of(r, "torch_contig")))
    columns += [("copy ms", lambda r: ms_of(r, "copy")), ("ours GB/s", lambda r: fmt(r["gbps"], ".1f")),
                ("of copy", lambda r: fmt(r["copy_fraction"], ".2f")),
                ("ours/torch", lambda r: fmt(r["ratio_torch"], ".2f"))]
    if with_contig:
        columns.append(("ours/(torch+contig)", lambda r: fmt(r["ratio_torch_contig"], ".2f")))
    columns += [("max err", lambda r: fmt(r["max_err"], ".1e")), ("check", check_text),
                ("target", target_text), ("notes", lambda r: notes_text(r, launch_notes))]
    return columns


OVERHEAD_COLUMNS = [
    ("case", lambda r: r["name"]), ("mode", lambda r: r["mode"]),
    ("ours us/call", lambda r: fmt(r["times_us"].get("ours", {}).get("min_us"), ".1f")),
    ("torch us/call", lambda r: fmt(r["times_us"].get("torch", {}).get("min_us"), ".1f")),
    ("ours/torch", lambda r: fmt(r["ratio_torch"], ".2f")),
    ("max err", lambda r: fmt(r["max_err"], ".1e")), ("check", check_text),
    ("notes", lambda r: notes_text(r, launch_bound=False)),
]


class Report:
    """Markdown on stdout and in DIR/gpu_report.md, rows in DIR/gpu_report.json."""

    def __init__(self, out_dir, meta):
        self.out_dir = pathlib.Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.meta, self.lines, self.cases = meta, [], []
        self.columns = None
        for line in header_lines(meta):
            self.say(line)

    def say(self, line=""):
        print(line, flush=True)
        self.lines.append(line)

    def section(self, title, target, columns):
        self.columns = columns
        self.say()
        self.say(f"## {title}")
        self.say()
        self.say(f"Target: {target}.")
        self.say()
        self.say("| " + " | ".join(name for name, _ in columns) + " |")
        self.say("|" + "|".join("---" for _ in columns) + "|")
        self.save()

    def add(self, row):
        self.cases.append(row)
        self.say("| " + " | ".join(str(cell(row)) for _, cell in self.columns) + " |")
        self.save()

    def failures(self):
        """Cases with an error, a wrong result, or a peer that failed (an incomplete row)."""
        return [c for c in self.cases
                if c["error"] or c["check_ok"] is False or c.get("check_error") or c.get("variant_errors")]

    def finish(self, elapsed_s):
        self.meta["elapsed_s"] = elapsed_s
        failed = self.failures()
        self.say()
        self.say(f"{len(self.cases)} cases, {len(failed)} failed or wrong; elapsed {elapsed_s:.1f} s")
        self.save()

    def save(self):
        (self.out_dir / "gpu_report.md").write_text("\n".join(self.lines) + "\n")
        data = {"meta": self.meta, "targets": TARGETS, "cases": self.cases}
        tmp = self.out_dir / "gpu_report.json.tmp"
        tmp.write_text(json.dumps(data, indent=1, default=str))
        tmp.replace(self.out_dir / "gpu_report.json")


def run_section(env, report, cases, run_case):
    for case in cases:
        over_budget = env.elapsed() > env.settings.budget_s
        report.add(skipped_row(env, case) if over_budget else run_case(env, case))


def report_rows(env, report):
    M_of = ", ".join(f"{N}: {M}" for M, N in row_shapes(env.settings.tiny))
    columns = timed_columns(with_lib=True, with_contig=False, launch_notes=env.device == "cuda")
    report.section(f"Issue 3: rows, normalized over the last axis (M x N; M for each N: {M_of})",
                   TARGETS["rows"], columns)
    run_section(env, report, rows_cases(env), run_timed_case)


def report_strided(env, report):
    columns = timed_columns(with_lib=False, with_contig=True, launch_notes=env.device == "cuda")
    report.section("Issue 4: channels-first layer norm, channels-last instance and group norm "
                   "(torch: permuted views; torch+contig: the result made contiguous NCHW)",
                   TARGETS["strided"], columns)
    run_section(env, report, strided_cases(env), run_timed_case)


def report_overhead(env, report):
    calls = env.settings.overhead_calls
    report.section(f"Per-call overhead: float32 layer norm, wall clock of {calls} calls then one "
                   "synchronize", TARGETS["overhead"], OVERHEAD_COLUMNS)
    for shape in OVERHEAD_SHAPES:
        for mode in overhead_modes(env):
            if env.elapsed() > env.settings.budget_s:
                report.add({"section": "overhead", "name": f"layer_norm {shape[0]}x{shape[1]}", "mode": mode,
                            "shape": list(shape), "dtype": "float32", "error": "skipped: time budget spent",
                            "skipped": True, "errors": {}, "max_err": None, "check_ok": None,
                            "times_us": {}, "ratio_torch": None})
                continue
            report.add(run_overhead_case(env, shape, mode))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_report.json and gpu_report.md (default: .)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter timed regions")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes of the same layouts (smoke test)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip the cases not started after this many seconds (default 420)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        env = Env(args)
    except SetupError as exc:
        print(f"gpu_report: {exc}", file=sys.stderr)
        return 2
    meta = describe_machine(env)
    meta["planned_cases"] = (len(list(rows_cases(env))) + len(list(strided_cases(env)))
                             + len(OVERHEAD_SHAPES) * len(overhead_modes(env)))
    report = Report(args.out, meta)
    for section in (report_rows, report_strided, report_overhead):
        section(env, report)
    report.finish(env.elapsed())
    print(f"wrote {report.out_dir / 'gpu_report.md'} and {report.out_dir / 'gpu_report.json'}")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
