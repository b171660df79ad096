#!/usr/bin/env python
"""Every GPU figure the open issues ask for, from one command (for a session with a borrowed GPU).

    python asv_bench/gpu_report.py [--out DIR] [--quick] [--device cuda|cpu] [--tiny]
                                   [--sections rows,strided,overhead,e2e] [--budget-s S]

Sections, each a markdown table (``--sections`` picks some; ``kernels`` = rows,strided):

1. rows (issues 3 and 14): layer_norm and rms_norm over the last axis of M x N (N = 512 ...
   262144, M*N = 2^25), forward and forward + autograd backward on CUDA torch tensors
   (bfloat16, float16, float32), layer_norm forward on CuPy arrays (float16, float32); against
   torch.nn.functional, Liger-Kernel's Triton kernels (``liger-kernel``, where installed) and a
   device-to-device copy of the same bytes.
2. strided (issues 4 and 15): ConvNeXt's channels-first layer_norm (axis=1) at its four stages,
   NCHW and channels_last memory; channels-last (NHWC) instance_norm and 32-group group_norm at
   ResNet/UNet stages; 32-group group_norm on Stable Diffusion's UNet NCHW shapes; forward and
   forward + backward, against torch's best (permuted) equivalent and Liger's layer/group norm.
   Rows and strided cases give each variant's kernel-only time (every kernel, memcpy and
   memset of one call, from CUPTI records through torch.profiler) next to its call time (wall
   clock of a loop of calls and one synchronize), each variant's fraction of copy bandwidth
   from those, and anynorm's ratio to each peer.
3. overhead (issue 13): wall-clock microseconds per call of small float32 layer norms (1000 calls,
   one synchronize; interleaved rounds, median and spread): torch forward without grad, forward +
   autograd backward, CuPy forward, next to a bare CuPy RawKernel launch and torch.empty_like;
   the targets with pass/miss.
4. e2e (issue 13): a bf16-autocast training step of timm's convnext_tiny (NCHW, channels_last),
   a pre-norm nn.TransformerEncoder, and the same pre-norm layers with anynorm's fused residual
   and with explicit adds, native vs anynorm.nn.LayerNorm swapped in: ms per step, ratio, target, output differences;
   ConvNeXt-T NCHW and the fused pre-norm layers again with forward and backward replayed as
   CUDA graphs (the eager steps are host-bound: the graphed ones compare device time).

Each anynorm result is checked against torch (max abs error) before it is timed, and so is
Liger's (a note where it differs). ``--quick`` runs subsets of the sweeps (QUICK_ROW_WIDTHS,
QUICK_KERNEL_DTYPES, each network's first and last stage) with fewer repeats. All variants
of a case are timed in this process, their repeats interleaved: CUDA events around a loop of
calls (perf_counter on CPU), the minimum per-call time of several repeats. The tables go to
stdout and DIR/gpu_report.md, everything measured to DIR/gpu_report.json; both are rewritten
after every case, so a run cut short keeps what it measured. A failing case shows its error in
its row and the run goes on; the exit status is 1 when any case failed, was wrong or was
skipped for time (a Liger call that fails, as on rows past 65536, is a note only). ``--device cpu`` (torch CPU tensors) and ``--tiny`` (small shapes of the same
layouts) let CI smoke-test this script without a GPU (tests/test_gpu_report_smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import gc
import importlib
import json
import math
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import types
from typing import Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
EPS = 1e-5
ROW_ELEMENTS = 2 ** 25
# issue 14: row widths N of M x N (M = 2^25 // N); --quick takes QUICK_ROW_WIDTHS
ROW_WIDTHS = (512, 768, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
QUICK_ROW_WIDTHS = (512, 1024, 4096, 16384, 65536, 262144)
# the dtypes of the rows and strided sections on torch tensors; --quick leaves float16 to CuPy
KERNEL_DTYPES = ("bfloat16", "float16", "float32")
QUICK_KERNEL_DTYPES = ("bfloat16", "float32")
CUPY_DTYPES = ("float16", "float32")  # CuPy has no bfloat16
# issue 15: ConvNeXt's four stages (NCHW shapes, each also on channels_last memory)
CONVNEXT_NCHW = ((64, 96, 56, 56), (64, 192, 28, 28), (64, 384, 14, 14), (64, 768, 7, 7))
# ResNet/UNet stages on NHWC memory (N, H, W, C); 32 groups divide every C
CHANNELS_LAST_NHWC = ((32, 56, 56, 64), (32, 28, 28, 256), (32, 28, 28, 512), (32, 14, 14, 1024),
                      (32, 7, 7, 2048))
# Stable Diffusion's UNet GroupNorm(32, C) on NCHW at its four resolutions
SD_GROUP_NCHW = ((8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16), (8, 1280, 8, 8))
GROUPS = 32
# the passes of the rows and strided sections and the transfers of x's size each moves at
# least: forward reads x and writes y; forward + backward also reads x and dy and writes dx
PASSES = ("fwd", "fwd+bwd")
TRANSFERS = {"fwd": 2, "fwd+bwd": 5}
# peers that may be absent or refuse a shape (Liger: rows past 65536): their errors are notes,
# not failures of the run
OPTIONAL_PEERS = ("liger",)
OVERHEAD_SHAPES = ((4, 8), (64, 768))
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# max abs error allowed, relative to max(1, largest |reference|): a few units in the last place
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 6e-2}
TARGETS = {
    "rows": "kernel-only, of copy bandwidth: forward >= 0.90 and forward + backward >= 0.80 for N <= 16384, "
            ">= 0.80 and >= 0.70 beyond; faster than torch and Liger (ours/peer < 1) everywhere",
    "strided": "kernel-only: forward >= 0.80 and forward + backward >= 0.70 of copy bandwidth, >= 2x faster "
               "than torch (ours/torch <= 0.5) and faster than Liger (ours/liger < 1) where it runs",
    "overhead": "on 64x768 float32: torch forward without grad <= 1.3x F.layer_norm's call time, "
                "forward + autograd backward <= 1.0x torch's, CuPy forward <= 15 us per call",
    "e2e": "bf16-autocast training step with anynorm's LayerNorm <= 1.05x native for the transformers, "
           "<= 1.0x for ConvNeXt-T",
}
# issue 13: the overhead section's targets (on OVERHEAD_TARGET_SHAPE), per mode: (text, test of a row)
OVERHEAD_TARGET_SHAPE = (64, 768)
OVERHEAD_TARGETS = {
    "no_grad": ("ours/torch <= 1.3", lambda row: row["ratio_torch"] <= 1.3),
    "train": ("ours/torch <= 1.0", lambda row: row["ratio_torch"] <= 1.0),
    "cupy": ("ours <= 15 us", lambda row: row["times_us"]["ours"]["median_us"] <= 15.0),
}
E2E_TARGETS = {"transformer": 1.05, "convnext": 1.0}
# e2e: max |native - anynorm| of the model output (and the loss), relative to max(1, max |native|),
# in bf16 autocast (a bfloat16 ulp is 2^-8 = 3.9e-3; differences grow through the layers)
E2E_TOLERANCE = 5e-2
# "kernels" (kernel-only time, CUPTI) is measured for every row of the "rows" and "strided" sections
SECTIONS = ("rows", "strided", "overhead", "e2e")
SECTION_ALIASES = {"all": SECTIONS, "kernels": ("rows", "strided")}


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
    sections: tuple = SECTIONS
    kernel_calls: int = 10      # calls profiled (CUPTI through torch.profiler) for kernel-only time
    call_calls: int = 50        # calls then one synchronize, for the wall-clock call time
    overhead_rounds: int = 11   # interleaved rounds of the overhead section (median, spread)
    e2e_warmup: int = 5         # training steps per model before timing
    e2e_rounds: int = 7         # interleaved rounds of e2e_steps steps per model
    e2e_steps: int = 3
    e2e_profile_steps: int = 2  # steps per model under torch.profiler (0: no profile)

    @classmethod
    def from_args(cls, args):
        region = 1.0 if args.tiny else (10.0 if args.quick else 25.0)
        quick = args.quick or args.tiny
        return cls(device=args.device, tiny=args.tiny, quick=args.quick,
                   repeats=3 if args.quick else 7, region_ms=region,
                   overhead_calls=30 if args.tiny else 1000, budget_s=args.budget_s,
                   sections=tuple(args.sections),
                   kernel_calls=3 if args.tiny else 10, call_calls=5 if args.tiny else (20 if args.quick else 50),
                   overhead_rounds=3 if args.tiny else (5 if args.quick else 11),
                   e2e_warmup=1 if args.tiny else (3 if args.quick else 5),
                   e2e_rounds=2 if args.tiny else (3 if quick else 7),
                   e2e_steps=1 if args.tiny else (2 if args.quick else 3),
                   e2e_profile_steps=args.e2e_profile_steps)


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


LIGER_FUNCTIONS = ("liger_layer_norm", "liger_rms_norm", "liger_group_norm")


def load_liger(device):
    """``(liger_kernel.transformers.functional, None)`` or ``(None, why not)``. Its Triton kernels
    run on CUDA only; the functional API (``liger_layer_norm(X, W, B, eps)``,
    ``liger_rms_norm(X, W, eps, ...)``, ``liger_group_norm(X, W, B, num_channels, num_groups,
    eps)``) has kept these signatures since liger-kernel 0.5."""
    if device != "cuda":
        return None, "not used (--device cpu: Liger's Triton kernels need a CUDA device)"
    try:
        functional = importlib.import_module("liger_kernel.transformers.functional")
    except Exception as exc:  # ImportError, or Triton failing underneath
        return None, f"not usable ({short_error(exc)}; pip install liger-kernel, or anynorm[e2e])"
    missing = [name for name in LIGER_FUNCTIONS if not hasattr(functional, name)]
    if missing:
        return None, f"not usable (liger_kernel.transformers.functional lacks {', '.join(missing)})"
    return functional, None


def describe_liger(functional, problem):
    """The header's words for Liger: its version and the modules of the autograd Functions it
    calls (liger_kernel.ops may swap in another implementation per device), or why it is absent."""
    if functional is None:
        return f"Liger {problem}"
    try:
        from importlib.metadata import version

        found = f"liger-kernel {version('liger-kernel')}"
    except Exception:  # run from a source tree without metadata
        found = "liger-kernel (version unknown)"
    impls = [f"{name} from {getattr(getattr(functional, name, None), '__module__', '?')}"
             for name in ("LigerLayerNormFunction", "LigerRMSNormFunction", "LigerGroupNormFunction")]
    return f"{found} ({'; '.join(impls)})"


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
        self.anynorm_nn = importlib.import_module("anynorm.nn")
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
        self.liger, self.liger_problem = load_liger(self.device)

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
            "settings": dataclasses.asdict(s), "backend": env.anynorm.get_backend(),
            "liger": describe_liger(env.liger, env.liger_problem), "liger_available": env.liger is not None}
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
        f"- peers: torch.nn.functional (permuted views where the layout needs them); {meta['liger']}",
        f"- timing: {timer}; per case every variant's repeats interleaved; {s['repeats']} repeats of "
        f">= {s['region_ms']:g} ms (at most {meta['max_calls_per_region']} calls per region), "
        f"minimum per-call time{'; tiny shapes' if s['tiny'] else ''}",
        f"- {meta['planned_cases']} cases; those not started within {s['budget_s']:g} s are skipped",
        "- `of copy`: (bytes a variant moves / its time) / (bytes the copy moves / copy time); forward "
        "moves 2 x bytes(x) (read x, write y), forward + backward 5 x bytes(x) (also read x and dy, "
        "write dx); `ours/torch`, `ours/liger`: anynorm's time over the peer's (< 1: anynorm faster).",
        f"- `kernel us`: {'GPU time of every kernel, memcpy and memset of one call (CUPTI records through torch.profiler)' if meta['device'] == 'cuda' else 'self time of the torch ops of one call (torch.profiler; CPU: no kernels, NumPy work not seen)'}, "
        f"mean of {s['kernel_calls']} calls; `call us`: wall clock per call of {s['call_calls']} calls then one "
        "synchronize (host and GPU), median of 3; `of copy` and the ratios come from the kernel-only times; "
        "`(events)`: the same from CUDA-event loop times (GPU time of back-to-back calls).",
        f"- sections: {', '.join(s['sections'])}",
    ]


# --------------------------------------------------------------------------- workloads

@dataclasses.dataclass
class Workload:
    """One normalization: anynorm's call and torch's equivalents, on x of ``shape``."""

    name: str
    shape: tuple
    param_shape: tuple
    ours: Callable                # (x, w, b) -> y
    peers: dict                   # name -> (x, w, b) -> y of x's shape; "torch" first
    has_bias: bool = True
    channels_last: bool = False   # x (and dy) on channels_last memory (NCHW shape, NHWC strides)

    def x_bytes(self, dtype):
        return math.prod(self.shape) * ITEMSIZE[dtype]


def shape_text(shape):
    return "x".join(map(str, shape))


def with_liger(env, peers, make):
    """``peers`` and, where Liger loaded, ``"liger": make(liger_kernel.transformers.functional)``."""
    return peers if env.liger is None else {**peers, "liger": make(env.liger)}


def nhwc_view(x):
    """An NCHW tensor (or an NHWC-shaped result of a channels-last call) as NHWC."""
    return x.permute(0, 2, 3, 1)


def nchw_view(x):
    return x.permute(0, 3, 1, 2)


def layer_norm_rows(env, M, N):
    an, F = env.anynorm, env.F
    peers = {"torch": lambda x, w, b: F.layer_norm(x, (N,), w, b, EPS)}
    return Workload(f"layer_norm {M}x{N}", (M, N), (N,),
                    ours=lambda x, w, b: an.layer_norm(x, w, b, eps=EPS),
                    peers=with_liger(env, peers, lambda L: lambda x, w, b: L.liger_layer_norm(x, w, b, EPS)))


def rms_norm_rows(env, M, N):
    """Liger with ``in_place=False``: its default writes dx into dy, which the benches reuse."""
    an, F = env.anynorm, env.F
    peers = {"torch": lambda x, w, b: F.rms_norm(x, (N,), w, EPS)}
    return Workload(f"rms_norm {M}x{N}", (M, N), (N,),
                    ours=lambda x, w, b: an.rms_norm(x, w, eps=EPS),
                    peers=with_liger(env, peers, lambda L: lambda x, w, b: L.liger_rms_norm(x, w, EPS, in_place=False)),
                    has_bias=False)


def convnext_layer_norm(env, shape, channels_last=False):
    """Channels-first LayerNorm; torch's equivalent (timm's LayerNorm2d) and Liger's normalize the
    NHWC view and permute back; on NCHW memory also torch's result made contiguous NCHW."""
    an, F = env.anynorm, env.F
    C = shape[1]

    def torch_permuted(x, w, b):
        return nchw_view(F.layer_norm(nhwc_view(x), (C,), w, b, EPS))

    peers = {"torch": torch_permuted}
    if not channels_last:  # on channels_last memory the permuted result is already that layout
        peers["torch_contig"] = lambda x, w, b: torch_permuted(x, w, b).contiguous()
    peers = with_liger(env, peers, lambda L: lambda x, w, b: nchw_view(L.liger_layer_norm(nhwc_view(x), w, b, EPS)))
    memory = " channels_last" if channels_last else ""
    return Workload(f"convnext layer_norm axis=1{memory} {shape_text(shape)}", shape, (C,),
                    ours=lambda x, w, b: an.layer_norm(x, w, b, axis=1, eps=EPS), peers=peers,
                    channels_last=channels_last)


def nhwc_instance_norm(env, shape):
    """On NHWC memory; torch's F.instance_norm takes the channels_last NCHW view of it."""
    an, F = env.anynorm, env.F
    return Workload(f"instance_norm NHWC {shape_text(shape)}", shape, (shape[-1],),
                    ours=lambda x, w, b: an.instance_norm(x, w, b, channel_axis=-1, eps=EPS),
                    peers={"torch": lambda x, w, b: nhwc_view(F.instance_norm(nchw_view(x), weight=w, bias=b, eps=EPS))})


def nhwc_group_norm(env, shape):
    """On NHWC memory; torch and Liger take the channels_last NCHW view (Liger copies it to
    contiguous NCHW first: its kernels read contiguous groups)."""
    an, F = env.anynorm, env.F
    C = shape[-1]
    peers = {"torch": lambda x, w, b: nhwc_view(F.group_norm(nchw_view(x), GROUPS, w, b, EPS))}
    return Workload(f"group_norm {GROUPS} NHWC {shape_text(shape)}", shape, (C,),
                    ours=lambda x, w, b: an.group_norm(x, GROUPS, w, b, channel_axis=-1, eps=EPS),
                    peers=with_liger(env, peers, lambda L: lambda x, w, b: nhwc_view(
                        L.liger_group_norm(nchw_view(x), w, b, C, GROUPS, EPS))))


def nchw_group_norm(env, shape):
    an, F = env.anynorm, env.F
    C = shape[1]
    peers = {"torch": lambda x, w, b: F.group_norm(x, GROUPS, w, b, EPS)}
    return Workload(f"group_norm {GROUPS} NCHW {shape_text(shape)}", shape, (C,),
                    ours=lambda x, w, b: an.group_norm(x, GROUPS, w, b, eps=EPS),
                    peers=with_liger(env, peers, lambda L: lambda x, w, b: L.liger_group_norm(x, w, b, C, GROUPS, EPS)))


def kernel_dtypes(settings):
    return QUICK_KERNEL_DTYPES if settings.quick else KERNEL_DTYPES


def stage_shapes(shapes, settings, tiny):
    """A network's stage shapes (under ``--tiny`` each made small by ``tiny(*shape)``, keeping its
    layout): all of them, or under ``--quick`` the first and the last (the largest and the
    smallest spatial extent)."""
    if settings.tiny:
        shapes = [tiny(*shape) for shape in shapes]
    return [shapes[0], shapes[-1]] if settings.quick and len(shapes) > 2 else list(shapes)


def sd_group_shapes(settings):
    return stage_shapes(SD_GROUP_NCHW, settings, lambda N, C, H, W: (2, C // 10, max(1, H // 8), max(1, W // 8)))


def convnext_shapes(settings):
    return stage_shapes(CONVNEXT_NCHW, settings, lambda N, C, H, W: (2, C // 16, max(2, H // 8), max(2, W // 8)))


def channels_last_shapes(settings):
    # tiny: channels kept, 32 groups must divide them
    return stage_shapes(CHANNELS_LAST_NHWC, settings, lambda N, H, W, C: (2, max(2, H // 8), max(2, W // 8), C))


def row_shapes(settings):
    """``(M, N)``: M = 2^25 // N rows of N (tiny: N / 32 wide, 2^14 elements)."""
    widths = QUICK_ROW_WIDTHS if settings.quick else ROW_WIDTHS
    if settings.tiny:
        return [(2 ** 14 // (N // 32), N // 32) for N in widths]
    return [(ROW_ELEMENTS // N, N) for N in widths]


# --------------------------------------------------------------------------- benches

@dataclasses.dataclass
class Variant:
    """A timed thing: ``make()`` returns ``fn(i)``, the i-th call of a loop."""

    make: Callable
    lib: str = "torch"


@dataclasses.dataclass
class Bench:
    variants: dict                # "ours", the peers, "copy" -> Variant
    outputs: Callable             # (variant name) -> {output name: torch tensor} of one call, for the checks


def rotating(fn, arg_sets):
    """``fn`` over the argument sets in turn: call i takes set i mod len."""
    return lambda i: fn(*arg_sets[i % len(arg_sets)])


def random_inputs(env, work, dtype, copies, grad=False):
    """``(xs, weight, bias, dys)``: x uniform in [-2, 2), dy in [-0.5, 0.5), weight in
    [0.5, 1.5), bias in [-0.5, 0.5); ``copies`` of x and dy (different values), on channels_last
    memory where the workload asks for it."""
    torch = env.torch
    gen = torch.Generator(device=env.device).manual_seed(0)
    memory = torch.channels_last if work.channels_last else torch.contiguous_format

    def uniform(shape, low, high, requires_grad, memory_format=torch.contiguous_format):
        t = torch.rand(shape, generator=gen, device=env.device) * (high - low) + low
        return t.to(env.dtype(dtype), memory_format=memory_format).requires_grad_(requires_grad)

    xs = [uniform(work.shape, -2, 2, grad, memory) for _ in range(copies)]
    weight = uniform(work.param_shape, 0.5, 1.5, grad)
    bias = uniform(work.param_shape, -0.5, 0.5, grad)
    dys = [uniform(work.shape, -0.5, 0.5, False, memory) for _ in range(copies)] if grad else []
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
    peers on the tensors, and a copy of x into a preallocated array of the same library."""
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

    def outputs(name):
        if name != "ours":
            return {"y": work.peers[name](*torch_sets[0])}
        y = as_torch(work.ours(*ours_sets[0]))
        env.clock.sync()
        return {"y": y}

    return Bench(variants, outputs)


def train_bench(env, work, dtype):
    """Forward + autograd backward, each call: ``y = f(x, weight, bias)``, then
    ``torch.autograd.grad`` of y for x, weight (and bias) with ``dy``; all three require grad."""
    torch = env.torch
    xs, w, b, dys = random_inputs(env, work, dtype, env.copies(2 * work.x_bytes(dtype)), grad=True)
    params = (w, b) if work.has_bias else (w,)
    fns = {"ours": work.ours, **work.peers}

    def step(fn, x, dy):
        return torch.autograd.grad(fn(x, w, b), (x, *params), dy)

    sets = list(zip(xs, dys))
    variants = {name: Variant(lambda fn=fn: rotating(functools.partial(step, fn), sets)) for name, fn in fns.items()}
    out = torch.empty_like(xs[0])
    detached = [(x.detach(),) for x in xs]
    variants["copy"] = Variant(lambda: rotating(out.copy_, detached))

    def outputs(name):
        return dict(zip(("dx", "dweight", "dbias"), step(fns[name], xs[0], dys[0])))

    return Bench(variants, outputs)


BENCHES = {"fwd": lambda env, case: forward_bench(env, case.work, case.dtype, case.lib),
           "fwd+bwd": lambda env, case: train_bench(env, case.work, case.dtype)}


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
    for name, timing in timings.items():
        try:
            timing.update(call_and_kernel_time(env, loops[name]))
        except Exception as exc:  # the profiler failed: the event timings above still stand
            timing["kernel_error"] = short_error(exc)
    return timings, errors


def is_device_record(event, device):
    """Whether a ``torch.profiler`` event is one the device ran: on CUDA a kernel, memcpy or
    memset (CUPTI records; the GPU ranges of ``record_function`` annotations are left out);
    on CPU an op (its self time: the op time without Python, CPU runs have no kernels)."""
    kind = str(getattr(event, "device_type", "")).rsplit(".", 1)[-1].upper()
    if device == "cuda":
        return kind == "CUDA" and not getattr(event, "is_user_annotation", False)
    return kind == "CPU" and not getattr(event, "is_async", False)


def record_us(event, device):
    if device == "cuda":
        return event.time_range.elapsed_us()
    return event.self_cpu_time_total


def profiled_us_per_call(env, fn, calls):
    """``(us, records)`` per call of ``fn(0) .. fn(calls - 1)``: the summed duration of what the
    device ran for them (see ``is_device_record``) through ``torch.profiler``, divided by calls."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if env.device == "cuda" else ProfilerActivity.CPU
    env.clock.sync()
    with profile(activities=[activity]) as prof:
        for i in range(calls):
            fn(i)
        env.clock.sync()
    records = [e for e in prof.events() if is_device_record(e, env.device)]
    return sum(record_us(e, env.device) for e in records) / calls, len(records) / calls


def wall_us(env, fn, calls):
    """Wall-clock microseconds per call of ``fn(0) .. fn(calls - 1)`` and one synchronize."""
    env.clock.sync()
    start = time.perf_counter()
    for i in range(calls):
        fn(i)
    env.clock.sync()
    return (time.perf_counter() - start) / calls * 1e6


def call_and_kernel_time(env, fn):
    """Call time (wall clock, median of 3 loops of ``call_calls`` calls then a synchronize: host
    and GPU together) and kernel-only time (profiled, host cost excluded) of one call."""
    s = env.settings
    call = statistics.median(wall_us(env, fn, s.call_calls) for _ in range(3))
    kernel_us, records = profiled_us_per_call(env, fn, s.kernel_calls)
    return {"call_us": call, "kernel_us": kernel_us, "kernel_records_per_call": records}


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
    direction: str        # "fwd" | "fwd+bwd" (PASSES)
    lib: str = "torch"    # the library of anynorm's input
    tile_caps: tuple | None = None  # anynorm's shared-memory tile budgets for this case (None: as shipped)

    @property
    def bytes_moved(self):
        return TRANSFERS[self.direction] * self.work.x_bytes(self.dtype)


def check_ok(errors, dtype):
    return all(e["max_abs"] <= TOLERANCE[dtype] * max(1.0, e["scale"]) for e in errors.values())


def new_row(case):
    return {"section": case.section, "name": case.work.name, "shape": list(case.work.shape),
            "dtype": case.dtype, "pass": case.direction, "lib": case.lib, "error": None,
            "variant_errors": {}, "errors": {}, "max_err": None, "check_ok": None, "peer_checks": {},
            "times": {}, "kernels": [], "notes": []}


def compare_outputs(outputs, expected):
    return {name: compare(value, expected[name]) for name, value in outputs.items()}


def peer_check(bench, name, expected, dtype):
    """A peer's outputs against torch's: ``{"errors", "ok"}``, or ``{"error"}`` where it failed."""
    try:
        errors = compare_outputs(bench.outputs(name), expected)
    except Exception as exc:
        return {"error": short_error(exc)}
    return {"errors": errors, "ok": check_ok(errors, dtype)}


def check_case(env, bench, case, row):
    """anynorm's outputs against torch's (``errors``, ``max_err``, ``check_ok``; without a torch
    reference ``check_error``), and each optional peer's (``peer_checks``: notes, not failures)."""
    try:
        expected = reference(bench.outputs, "torch")
    except PeerError as exc:
        row["check_error"] = f"no torch reference: {exc}"
        return
    with kernels_launched(env, row["kernels"]):
        row["errors"] = compare_outputs(bench.outputs("ours"), expected)
    row["max_err"] = row["errors"]["y" if case.direction == "fwd" else "dx"]["max_abs"]
    row["check_ok"] = check_ok(row["errors"], case.dtype)
    for name in bench.variants:
        if name in OPTIONAL_PEERS:
            row["peer_checks"][name] = peer_check(bench, name, expected, case.dtype)


def run_timed_case(env, case):
    """Build, check against torch, time; the row for the JSON and the table."""
    row = new_row(case)
    try:
        with tile_caps(env, case.tile_caps, row["notes"]):
            bench = BENCHES[case.direction](env, case)
            check_case(env, bench, case, row)
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


def private_cuda_module(name):
    """``anynorm._cuda.<name>`` (a private module the CUDA path may rename), or None."""
    try:
        return importlib.import_module(f"anynorm._cuda.{name}")
    except Exception:  # ImportError, or CuPy missing underneath
        return None


@contextlib.contextmanager
def launch_attribute(env, name, value, notes=None, module="_launcher"):
    """``anynorm._cuda.<module>.<name>`` set to ``value`` for the block, on CUDA (else
    nothing), with nothing bound before the block reused in it (``_launcher._memo`` and the
    call cache ``anynorm._calls``: a schedule bound earlier would not see the change).

    A private attribute: where it is gone (the CUDA path was rewritten) the block runs as
    shipped and ``notes`` gets a line saying so."""
    target = private_cuda_module(module) if env.device == "cuda" else None
    launcher = private_cuda_module("_launcher") if env.device == "cuda" else None
    if target is None or not hasattr(target, name) or not hasattr(launcher, "_memo"):
        if env.device == "cuda" and notes is not None:
            notes.append(f"anynorm._cuda.{module}.{name} not found: run as shipped")
        yield
        return
    shipped, memo = getattr(target, name), launcher._memo
    memos = {}  # the block's own: bound once per plan in the block, as shipped code would
    setattr(target, name, value)
    launcher._memo = lambda plan: memos.setdefault(id(plan), {})
    calls = importlib.import_module("anynorm._calls")
    calls.clear()  # the call signatures' runners keep their bound launches too
    try:
        yield
    finally:
        setattr(target, name, shipped)
        launcher._memo = memo
        calls.clear()


def kernels_launched(env, names):
    """Append to ``names`` each anynorm kernel (``name<ITEMS>``) the block launches, once, on CUDA
    (through the private ``anynorm._cuda._launcher.get_kernel``; nothing where that is gone)."""
    launch = private_cuda_module("_launcher") if env.device == "cuda" else None
    fetch = getattr(launch, "get_kernel", None)
    if fetch is None:
        return contextlib.nullcontext()

    def recording(kernel, dtype, items=None):
        name = kernel if items is None else f"{kernel}<{items}>"
        if name not in names:
            names.append(name)
        return fetch(kernel, dtype, items)

    return launch_attribute(env, "get_kernel", recording)


def tile_caps(env, caps, notes=None):
    """anynorm's shared-memory tile budgets (``_schedule._TILE_SMEM_CAPS``) set to ``caps`` for
    the block; ``None`` leaves them as shipped."""
    return (contextlib.nullcontext() if caps is None
            else launch_attribute(env, "_TILE_SMEM_CAPS", caps, notes, module="_schedule"))


def fractions_of_copy(times, bytes_moved, copy_bytes):
    """Each variant's bandwidth over the copy's, ``{name: fraction}``, from ``{name: time}``."""
    copy = times.get("copy")
    return {name: (bytes_moved / t) / (copy_bytes / copy)
            for name, t in times.items() if name != "copy" and t and copy}


def ratios_to_peers(times):
    """anynorm's time over each peer's, ``{peer: ratio}`` (< 1: anynorm faster)."""
    ours = times.get("ours")
    return {name: ours / t for name, t in times.items() if name not in ("ours", "copy") and t and ours}


def add_derived(row, case):
    """Bandwidth, each variant's fraction of copy bandwidth and anynorm's ratio to each peer,
    from the kernel-only times and from the event times; the issue's target."""
    events = {name: t["min_ms"] for name, t in row["times"].items()}
    kernel = {name: t.get("kernel_us") for name, t in row["times"].items()}
    copy_bytes = 2 * case.work.x_bytes(case.dtype)
    row["bytes_moved"], row["copy_bytes"] = case.bytes_moved, copy_bytes
    row["of_copy"] = fractions_of_copy(events, case.bytes_moved, copy_bytes)
    row["kernel_of_copy"] = fractions_of_copy(kernel, case.bytes_moved, copy_bytes)
    row["ratios"], row["kernel_ratios"] = ratios_to_peers(events), ratios_to_peers(kernel)
    ours = events.get("ours")
    row["gbps"] = case.bytes_moved / ours / 1e6 if ours else None
    row["copy_fraction"], row["kernel_copy_fraction"] = row["of_copy"].get("ours"), row["kernel_of_copy"].get("ours")
    for peer in ("torch", "torch_contig"):
        row[f"ratio_{peer}"] = row["ratios"].get(peer)
    row["kernel_ratio_torch"] = row["kernel_ratios"].get("torch")
    row["target_basis"] = "kernel" if "ours" in row["kernel_of_copy"] and "torch" in row["kernel_ratios"] else "events"
    row["target_met"] = target_met(row, case)


def copy_target(case):
    """The fraction of copy bandwidth the issue asks of a case (issue 14 rows, issue 15 strided)."""
    if case.section == "strided":
        return {"fwd": 0.80, "fwd+bwd": 0.70}[case.direction]
    short = case.work.shape[-1] <= 16384
    return {"fwd": 0.90 if short else 0.80, "fwd+bwd": 0.80 if short else 0.70}[case.direction]


def target_met(row, case):
    """The issue's target, on the kernel-only figures (the event figures where the profiler gave
    none): the fraction of copy bandwidth, faster than Liger where it ran, and faster than torch
    (strided: at least 2x)."""
    kernel = row["target_basis"] == "kernel"
    frac = (row["kernel_of_copy"] if kernel else row["of_copy"]).get("ours")
    ratios = row["kernel_ratios"] if kernel else row["ratios"]
    if frac is None or "torch" not in ratios or row["error"] or not row["check_ok"]:
        return None  # a wrong or unchecked result meets no target
    beats_torch = ratios["torch"] <= 0.5 if case.section == "strided" else ratios["torch"] < 1
    return frac >= copy_target(case) and beats_torch and all(ratios[p] < 1 for p in OPTIONAL_PEERS if p in ratios)


def skipped_row(env, case):
    row = new_row(case)
    row.update(error=f"skipped: time budget of {env.settings.budget_s:g} s spent", skipped=True)
    add_derived(row, case)
    return row


def rows_cases(env):
    """Issue 14: forward and forward + backward of layer and RMS norm over rows; CuPy forward."""
    s = env.settings
    shapes = row_shapes(s)
    for direction in PASSES:
        for make in (layer_norm_rows, rms_norm_rows):
            for dtype in kernel_dtypes(s):
                for M, N in shapes:
                    yield Case("rows", make(env, M, N), dtype, direction)
    if env.device == "cuda":
        for dtype in CUPY_DTYPES:
            for M, N in shapes:
                yield Case("rows", layer_norm_rows(env, M, N), dtype, "fwd", lib="cupy")


def strided_cases(env):
    """Issue 15: ConvNeXt's channels-first layer norm (NCHW and channels_last memory), NHWC
    instance and group norm, Stable Diffusion's NCHW group norm."""
    s = env.settings
    nhwc = ([nhwc_instance_norm(env, shape) for shape in channels_last_shapes(s)]
            + [nhwc_group_norm(env, shape) for shape in channels_last_shapes(s)])
    workloads = ([convnext_layer_norm(env, shape, memory) for shape in convnext_shapes(s) for memory in (False, True)]
                 + nhwc + [nchw_group_norm(env, shape) for shape in sd_group_shapes(s)])
    for direction in PASSES:
        for work in workloads:
            for dtype in kernel_dtypes(s):
                yield Case("strided", work, dtype, direction)
    if env.device == "cuda" and not s.quick:
        # The channels-last cases with tiles of at most 64 KiB: where the shipped launcher takes a
        # larger tile, this row is its alternative (the split path), timed in this process.
        capped = [dataclasses.replace(work, name=f"{work.name} [tiles <= 64 KiB]") for work in nhwc]
        for direction in PASSES:
            for work in capped:
                for dtype in QUICK_KERNEL_DTYPES:
                    yield Case("strided", work, dtype, direction, tile_caps=(64 * 1024,))


# --------------------------------------------------------------------------- overhead

# a kernel that does nothing, launched with 4 arguments as a call of anynorm's passes them
# (two arrays, an int64, a float32): the floor of a CuPy launch
BARE_KERNEL = 'extern "C" __global__ void bare(const float* x, float* y, long long n, float eps) {}'


def overhead_modes(env):
    modes = ["no_grad", "train"]
    return modes + ["cupy"] if env.device == "cuda" else modes


def wall_us_per_call(env, fn, calls):
    """Wall-clock microseconds per call of ``calls`` calls ``fn()`` followed by one synchronize."""
    return wall_us(env, lambda i: fn(), calls)


def bare_launch(env, x):
    """``fn()``: a CuPy RawKernel launch of ``BARE_KERNEL`` on ``x`` (a CuPy array)."""
    import numpy as np

    cp = env.need_cupy()
    kernel = cp.RawKernel(BARE_KERNEL, "bare")
    args = (x, cp.empty_like(x), np.int64(x.size), np.float32(EPS))
    return lambda: kernel((1,), (32,), args)


def overhead_callables(env, shape, mode):
    """``({variant: fn()}, check())`` of float32 layer norm on ``shape`` in ``mode``: "ours",
    "torch" (F.layer_norm on the same tensors), the floors "empty_like" (``torch.empty_like(x)``)
    and, for CuPy, "rawkernel" (a bare launch, ``bare_launch``). ``train``: forward and
    ``torch.autograd.grad`` for x, weight and bias."""
    torch, F, an = env.torch, env.F, env.anynorm
    work = layer_norm_rows(env, *shape)
    (x,), w, b, dys = random_inputs(env, work, "float32", 1, grad=mode == "train")
    peer = lambda: F.layer_norm(x, (shape[-1],), w, b, EPS)
    variants = {}
    if mode == "train":
        dy = dys[0]
        variants["ours"] = lambda: torch.autograd.grad(an.layer_norm(x, w, b, eps=EPS), (x, w, b), dy)
        variants["torch"] = lambda: torch.autograd.grad(peer(), (x, w, b), dy)

        def check():
            ours, theirs = variants["ours"](), reference(variants["torch"])
            return {name: compare(a, r) for name, a, r in zip(("dx", "dweight", "dbias"), ours, theirs)}
    else:
        ours_args = (x, w, b)
        if mode == "cupy":
            cp = env.need_cupy()
            ours_args = tuple(cp.from_dlpack(t) for t in ours_args)
        variants["ours"] = lambda: an.layer_norm(*ours_args, eps=EPS)
        variants["torch"] = peer
        as_torch = torch.from_dlpack if mode == "cupy" else (lambda y: y)
        check = lambda: {"y": compare(as_torch(variants["ours"]()), reference(peer))}
        if mode == "cupy":
            variants["rawkernel"] = bare_launch(env, ours_args[0])
    variants["empty_like"] = lambda: torch.empty_like(x)
    return variants, check


def overhead_target(row):
    """``(text, met)`` of the issue's target for the row (only on OVERHEAD_TARGET_SHAPE)."""
    if tuple(row["shape"]) != OVERHEAD_TARGET_SHAPE or row["mode"] not in OVERHEAD_TARGETS:
        return None, None
    text, test = OVERHEAD_TARGETS[row["mode"]]
    if row["error"] or row["check_ok"] is False or "ours" not in row["times_us"] or row["ratio_torch"] is None:
        return text, None
    return text, bool(test(row))


def new_overhead_row(env, shape, mode):
    return {"section": "overhead", "name": f"layer_norm {shape[0]}x{shape[1]}", "shape": list(shape),
            "dtype": "float32", "pass": "train" if mode == "train" else "fwd",
            "lib": "cupy" if mode == "cupy" else "torch", "mode": mode, "calls": env.settings.overhead_calls,
            "rounds": env.settings.overhead_rounds, "error": None, "errors": {}, "max_err": None,
            "check_ok": None, "times_us": {}, "ratio_torch": None, "target": None, "target_met": None,
            "notes": []}


def run_overhead_case(env, shape, mode):
    """Call time of each variant: rounds of ``overhead_calls`` calls then one synchronize, the
    variants interleaved within each round; median, min and max over the rounds."""
    s = env.settings
    row = new_overhead_row(env, shape, mode)
    grad_mode = env.torch.enable_grad() if mode == "train" else env.torch.no_grad()
    try:
        with grad_mode:
            variants, check = overhead_callables(env, shape, mode)
            try:
                row["errors"] = check()
                row["max_err"] = row["errors"]["y" if mode != "train" else "dx"]["max_abs"]
                row["check_ok"] = check_ok(row["errors"], "float32")
            except PeerError as exc:
                row["check_error"] = f"no torch reference: {exc}"
            samples = {name: [] for name in variants}
            for fn in variants.values():  # warm-up: compiles kernels, fills caches
                wall_us_per_call(env, fn, 5 if s.tiny else 50)
            for _ in range(s.overhead_rounds):
                for name, fn in variants.items():
                    samples[name].append(wall_us_per_call(env, fn, s.overhead_calls))
        row["times_us"] = {name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v),
                                  "samples_us": v} for name, v in samples.items()}
        row["ratio_torch"] = row["times_us"]["ours"]["median_us"] / row["times_us"]["torch"]["median_us"]
        for floor in ("rawkernel", "empty_like"):
            if floor in row["times_us"]:
                row[f"ratio_{floor}"] = row["times_us"]["ours"]["median_us"] / row["times_us"][floor]["median_us"]
                row["notes"].append(f"ours/{floor} {row[f'ratio_{floor}']:.1f}x")
    except Exception as exc:
        row["error"] = short_error(exc)
        row["traceback"] = traceback.format_exc(limit=8)
    row["target"], row["target_met"] = overhead_target(row)
    release_memory(env, failed=row["error"] is not None)
    return row


# --------------------------------------------------------------------------- end to end

# issue 13: a bf16-autocast training step (forward, backward, SGD step) with anynorm's norms in
E2E_CONVNEXT = {"batch": 64, "image": 224}
E2E_TRANSFORMER = {"layers": 12, "d_model": 1024, "nhead": 16, "dim_feedforward": 4096, "batch": 8, "tokens": 1024}
E2E_TINY_CONVNEXT = {"batch": 2, "image": 32}
E2E_TINY_TRANSFORMER = {"layers": 2, "d_model": 64, "nhead": 4, "dim_feedforward": 128, "batch": 2, "tokens": 16}


@functools.lru_cache(maxsize=None)
def model_classes():
    """The torch modules of the e2e section (made on first use: this file imports without torch).

    - ``LayerNorm2d``: timm's channels-first LayerNorm of NCHW (permute, F.layer_norm, permute back);
    - ``ConvNeXtBlock``, ``MiniConvNeXt``: a small timm-like ConvNeXt (stem, stages with
      LayerNorm2d before each downsampling conv, blocks with an NHWC ``nn.LayerNorm``, a head with
      a LayerNorm2d), the stand-in for ``timm.create_model("convnext_tiny")`` in CPU smoke runs;
    - ``PreNormLayer``, ``PreNormStack``: ``nn.TransformerEncoder`` of ``norm_first=True``
      layers (dropout 0, ReLU) with the residual stream carried beside each layer's output, so
      that ``fused=True`` can call ``norm(hidden, residual=residual) -> (y, hidden + residual)``
      (anynorm's fused residual) where ``fused=False`` adds explicitly. Same ``state_dict`` keys
      as ``nn.TransformerEncoder``.
    """
    import torch
    import torch.nn.functional as F

    nn = torch.nn

    class LayerNorm2d(nn.LayerNorm):
        def forward(self, x):
            x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
            return x.permute(0, 3, 1, 2)

    class ConvNeXtBlock(nn.Module):
        def __init__(self, dim, ls_init_value=1.0):
            super().__init__()
            self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
            self.norm = nn.LayerNorm(dim, eps=1e-6)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            self.gamma = nn.Parameter(torch.full((dim,), ls_init_value))

        def forward(self, x):
            shortcut = x
            x = self.mlp(self.norm(self.conv_dw(x).permute(0, 2, 3, 1)))
            return x.mul(self.gamma).permute(0, 3, 1, 2) + shortcut

    class MiniConvNeXt(nn.Module):
        def __init__(self, dims=(8, 16), depths=(1, 1), num_classes=10, in_chans=3):
            super().__init__()
            self.num_classes = num_classes
            self.stem = nn.Sequential(nn.Conv2d(in_chans, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
            stages = []
            for i, (dim, depth) in enumerate(zip(dims, depths)):
                down = (nn.Identity() if i == 0 else
                        nn.Sequential(LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, stride=2)))
                stages.append(nn.Sequential(down, *(ConvNeXtBlock(dim) for _ in range(depth))))
            self.stages = nn.Sequential(*stages)
            self.head_norm = LayerNorm2d(dims[-1], eps=1e-6)
            self.fc = nn.Linear(dims[-1], num_classes)

        def forward(self, x):
            x = self.stages(self.stem(x))
            return self.fc(self.head_norm(x.mean((2, 3), keepdim=True)).flatten(1))

    class PreNormLayer(nn.Module):
        def __init__(self, d_model, nhead, dim_feedforward, norm_cls=nn.LayerNorm, fused=False):
            super().__init__()
            self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0, batch_first=True)
            self.linear1 = nn.Linear(d_model, dim_feedforward)
            self.linear2 = nn.Linear(dim_feedforward, d_model)
            self.norm1, self.norm2 = norm_cls(d_model), norm_cls(d_model)
            self.fused = fused

        def add_norm(self, norm, hidden, residual):
            """``(norm(hidden + residual), hidden + residual)``; the first layer: ``hidden`` alone.
            The residual stream keeps the input's dtype (float32 under autocast, as in
            TransformerEncoderLayer): the fused call gets ``hidden`` cast to it."""
            if residual is None:
                return norm(hidden), hidden
            if self.fused:
                return norm(hidden.to(residual.dtype), residual=residual)
            residual = residual + hidden
            return norm(residual), residual

        def forward(self, hidden, residual=None):
            y, residual = self.add_norm(self.norm1, hidden, residual)
            hidden = self.self_attn(y, y, y, need_weights=False)[0]
            y, residual = self.add_norm(self.norm2, hidden, residual)
            return self.linear2(F.relu(self.linear1(y))), residual

    class PreNormStack(nn.Module):
        def __init__(self, num_layers, d_model, nhead, dim_feedforward, norm_cls=nn.LayerNorm, fused=False):
            super().__init__()
            self.layers = nn.ModuleList(PreNormLayer(d_model, nhead, dim_feedforward, norm_cls, fused)
                                        for _ in range(num_layers))

        def forward(self, x):
            hidden, residual = x, None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual)
            return residual + hidden

    return types.SimpleNamespace(LayerNorm2d=LayerNorm2d, ConvNeXtBlock=ConvNeXtBlock, MiniConvNeXt=MiniConvNeXt,
                                 PreNormLayer=PreNormLayer, PreNormStack=PreNormStack)


def swap_layer_norms(model, anynorm_nn):
    """Replace, in place, every ``torch.nn.LayerNorm`` in ``model`` (subclasses included: timm's
    ``LayerNorm``, and its channels-first ``LayerNorm2d``, which becomes ``axis=1``) by
    ``anynorm.nn.LayerNorm`` with the same arguments, weights (through ``state_dict``), device,
    dtype and training flag. Returns how many were replaced; ``model.state_dict()`` keeps its keys."""
    import torch

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.LayerNorm) or isinstance(child, anynorm_nn.LayerNorm):
                continue
            channels_first = type(child).__name__.endswith("2d")  # timm: LayerNorm2d on NCHW
            like = child.weight if child.weight is not None else next(model.parameters(), None)
            new = anynorm_nn.LayerNorm(child.normalized_shape, eps=child.eps,
                                       elementwise_affine=child.elementwise_affine, bias=child.bias is not None,
                                       device=None if like is None else like.device,
                                       dtype=None if child.weight is None else child.weight.dtype,
                                       axis=1 if channels_first else None)
            new.load_state_dict(child.state_dict())
            new.train(child.training)
            setattr(parent, name, new)
            count += 1
    return count


def build_transformer_encoder(torch, cfg):
    layer = torch.nn.TransformerEncoderLayer(cfg["d_model"], cfg["nhead"], cfg["dim_feedforward"], dropout=0.0,
                                             batch_first=True, norm_first=True)
    return torch.nn.TransformerEncoder(layer, cfg["layers"], enable_nested_tensor=False)


class Unavailable(Exception):
    """A case this machine cannot run (timm missing): reported, not a failure."""


@dataclasses.dataclass
class E2EModels:
    native: object
    ours: object
    swapped: int
    x: object
    loss: Callable        # model output -> scalar loss
    config: dict
    notes: list
    autocast_cache: bool = True  # False for CUDA-graphed models (torch.cuda.make_graphed_callables)


def load_timm():
    try:
        import timm
        return timm, None
    except Exception as exc:  # ImportError, or a torchvision mismatch underneath
        return None, f"timm is not usable ({short_error(exc)})"


def convnext_models(env, channels_last):
    """timm's convnext_tiny (random init), native and with its norms swapped; without timm, in a
    ``--tiny`` run, the small timm-like stand-in (``model_classes().MiniConvNeXt``)."""
    torch, F = env.torch, env.F
    cfg = dict(E2E_TINY_CONVNEXT if env.settings.tiny else E2E_CONVNEXT)
    timm, problem = load_timm()
    notes = []
    if timm is not None:
        model = timm.create_model("convnext_tiny", pretrained=False)
        cfg["model"] = f"timm {timm.__version__} convnext_tiny"
    elif env.settings.tiny:
        model = model_classes().MiniConvNeXt()
        cfg["model"] = "MiniConvNeXt (timm-like stand-in)"
        notes.append(f"{problem}: a small timm-like ConvNeXt stands in")
    else:
        raise Unavailable(f"{problem}: ConvNeXt-T not run (pip install timm)")
    native = model.to(env.device).train()
    ours = copy.deepcopy(native)
    swapped = swap_layer_norms(ours, env.anynorm_nn)
    gen = torch.Generator(device=env.device).manual_seed(0)
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], device=env.device, generator=gen)
    if channels_last:
        native, ours = (m.to(memory_format=torch.channels_last) for m in (native, ours))
        x = x.contiguous(memory_format=torch.channels_last)
    cfg["memory_format"] = "channels_last" if channels_last else "NCHW"
    labels = torch.randint(0, getattr(model, "num_classes", 10), (cfg["batch"],), device=env.device, generator=gen)
    return E2EModels(native, ours, swapped, x, lambda out: F.cross_entropy(out.float(), labels), cfg, notes)


def transformer_input(env, cfg):
    torch = env.torch
    gen = torch.Generator(device=env.device).manual_seed(0)
    shape = (cfg["batch"], cfg["tokens"], cfg["d_model"])
    x = torch.randn(shape, device=env.device, generator=gen)
    target = torch.randn(shape, device=env.device, generator=gen)
    return x, lambda out: env.F.mse_loss(out.float(), target)


def transformer_models(env):
    """``nn.TransformerEncoder`` (pre-norm), native and with its ``nn.LayerNorm``s swapped."""
    cfg = dict(E2E_TINY_TRANSFORMER if env.settings.tiny else E2E_TRANSFORMER, model="nn.TransformerEncoder")
    native = build_transformer_encoder(env.torch, cfg).to(env.device).train()
    ours = copy.deepcopy(native)
    swapped = swap_layer_norms(ours, env.anynorm_nn)
    x, loss = transformer_input(env, cfg)
    return E2EModels(native, ours, swapped, x, loss, cfg, [])


def fused_prenorm_models(env, fused=True):
    """The same pre-norm layers as ``PreNormStack``: torch's LayerNorm and explicit residual adds,
    against anynorm's LayerNorm with the fused residual (``fused=False``: with the same explicit
    adds, the A/B of the fusion); the same weights."""
    cfg = dict(E2E_TINY_TRANSFORMER if env.settings.tiny else E2E_TRANSFORMER, model="PreNormStack")
    classes = model_classes()
    dims = (cfg["layers"], cfg["d_model"], cfg["nhead"], cfg["dim_feedforward"])
    native = classes.PreNormStack(*dims).to(env.device).train()
    ours = classes.PreNormStack(*dims, norm_cls=env.anynorm_nn.LayerNorm, fused=fused).to(env.device).train()
    ours.load_state_dict(native.state_dict())
    x, loss = transformer_input(env, cfg)
    note = ("fused: norm(hidden.to(float32), residual=residual) per norm; native: residual + hidden, then norm"
            if fused else "both: residual + hidden, then norm")
    return E2EModels(native, ours, 2 * cfg["layers"], x, loss, cfg, [note])


def e2e_cases(env):
    """``(name, kind, build)``: kind picks the target (E2E_TARGETS)."""
    return [
        ("convnext_tiny NCHW", "convnext", lambda: convnext_models(env, channels_last=False)),
        ("convnext_tiny channels_last", "convnext", lambda: convnext_models(env, channels_last=True)),
        ("TransformerEncoder pre-norm", "transformer", lambda: transformer_models(env)),
        ("pre-norm blocks, fused residual", "transformer", lambda: fused_prenorm_models(env)),
        ("pre-norm blocks, explicit adds", "transformer", lambda: fused_prenorm_models(env, fused=False)),
        ("convnext_tiny NCHW, graphed", "convnext",
         lambda: graphed_models(env, lambda: convnext_models(env, channels_last=False))),
        ("pre-norm blocks, fused residual, graphed", "transformer",
         lambda: graphed_models(env, lambda: fused_prenorm_models(env))),
    ]


def graphed_models(env, build):
    """``build()``'s models with forward and backward each captured as a CUDA graph
    (``torch.cuda.make_graphed_callables``, a model at a time, under autocast without its cast
    cache, as torch requires): a step replays two graphs and runs the optimizer, so the host's
    Python no longer sets the pace (the eager steps are host-bound on an H200: the device idle
    40-70% of them) and the step's time is the models' device time."""
    if env.device != "cuda":
        raise Unavailable("CUDA graphs need a CUDA device")
    models = build()
    torch = env.torch
    with autocast(env, cache=False):
        native, ours = (torch.cuda.make_graphed_callables(m, (models.x,)) for m in (models.native, models.ours))
    notes = models.notes + ["forward and backward replayed as CUDA graphs (make_graphed_callables), "
                            "autocast without its cast cache; the optimizer step eager"]
    return dataclasses.replace(models, native=native, ours=ours, notes=notes, autocast_cache=False)


def autocast(env, cache=True):
    return env.torch.autocast(env.device, dtype=env.torch.bfloat16, cache_enabled=cache)


def e2e_compare(env, models):
    """Max abs difference anynorm - native of the output (bf16 autocast) and of the loss."""
    with env.torch.no_grad(), autocast(env, models.autocast_cache):
        outs = [m(models.x) for m in (models.native, models.ours)]
        losses = [models.loss(out) for out in outs]
    return {"output": compare(outs[1], outs[0]), "loss": compare(losses[1], losses[0])}


def training_step(env, model, optimizer, models):
    """One bf16-autocast training step: forward, loss, backward, SGD step."""
    with autocast(env, models.autocast_cache):
        loss = models.loss(model(models.x))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def e2e_times(env, models):
    """ms per training step of each model: warm-up, then rounds of ``e2e_steps`` steps (wall
    clock, synchronized) with the models interleaved in each round."""
    s, torch = env.settings, env.torch
    steps = {}
    for name, model in (("native", models.native), ("anynorm", models.ours)):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        steps[name] = lambda model=model, optimizer=optimizer: training_step(env, model, optimizer, models)
    for step in steps.values():
        for _ in range(s.e2e_warmup):
            step()
    samples = {name: [] for name in steps}
    for _ in range(s.e2e_rounds):
        for name, step in steps.items():
            samples[name].append(wall_us(env, lambda i: step(), s.e2e_steps) / 1e3)
    return {name: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "samples_ms": v}
            for name, v in samples.items()}


# runtime/driver calls that block the host until the device catches up (or may: allocation)
E2E_SYNC_CALLS = frozenset((
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cudaMalloc", "cudaFree", "cuStreamSynchronize", "cuCtxSynchronize",
    "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpyDtoH_v2", "cuMemAlloc", "cuMemAlloc_v2",
    "cuMemFree", "cuMemFree_v2"))
# normalization kernels: torch's (layer_norm, GammaBeta) and anynorm's (kernels/*.cu)
E2E_NORM_KERNEL = re.compile(r"layer_norm|LayerNorm|GammaBeta|\b(rows|cols|param_grad)_\w+|\bstats_finalize"
                             r"|\bapply_bwd|\bsegment_grad_finalize")


def e2e_profile(env, models, steps):
    """Per model, ``steps`` training steps under torch.profiler: the step's wall time there,
    the device time of its kernels, memcpys and memsets (on CPU: its ops' self time), the
    share of the step the device sat idle, the normalization kernels' device time, the
    synchronizing runtime calls per step and the heaviest kernels. What explains a slower
    step: more device time (kernels), or an idle device (host-bound, or a synchronization)."""
    from torch.profiler import ProfilerActivity, profile

    torch = env.torch
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device == "cuda" else [])
    result = {}
    for name, model in (("native", models.native), ("anynorm", models.ours)):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        training_step(env, model, optimizer, models)
        env.clock.sync()
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                training_step(env, model, optimizer, models)
            env.clock.sync()
            wall_ms = (time.perf_counter() - start) * 1e3 / steps
        per_kernel, syncs = {}, 0
        for event in prof.events():
            if event.name in E2E_SYNC_CALLS:
                syncs += 1
            elif is_device_record(event, env.device):
                per_kernel[event.name] = per_kernel.get(event.name, 0.0) + record_us(event, env.device) / 1e3 / steps
        device_ms = sum(per_kernel.values())
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:6]
        result[name] = {
            "wall_ms": wall_ms, "device_ms": device_ms,
            "idle": max(0.0, 1.0 - device_ms / wall_ms) if wall_ms > 0 else None,
            "norm_ms": sum(v for k, v in per_kernel.items() if E2E_NORM_KERNEL.search(k)),
            "syncs_per_step": syncs / steps,
            "top_kernels_ms": [(k[:70], v) for k, v in top]}
    return result


def new_e2e_row(env, name, kind):
    return {"section": "e2e", "name": name, "kind": kind, "shape": None, "dtype": "bfloat16 autocast",
            "pass": "train step", "lib": "torch", "error": None, "errors": {}, "max_err": None,
            "check_ok": None, "times_ms": {}, "ratio": None, "target": f"anynorm/native <= {E2E_TARGETS[kind]}",
            "target_met": None, "norms_swapped": None, "config": {}, "notes": [], "unavailable": None}


def run_e2e_case(env, name, kind, build):
    row = new_e2e_row(env, name, kind)
    models = None
    try:
        models = build()
        row.update(norms_swapped=models.swapped, config=models.config)
        row["notes"].extend(models.notes)
        if models.swapped == 0:
            raise RuntimeError("no LayerNorm found to swap")
        row["errors"] = e2e_compare(env, models)
        row["max_err"] = row["errors"]["output"]["max_abs"]
        row["check_ok"] = all(e["max_abs"] <= E2E_TOLERANCE * max(1.0, e["scale"]) for e in row["errors"].values())
        row["times_ms"] = e2e_times(env, models)
        row["ratio"] = row["times_ms"]["anynorm"]["median_ms"] / row["times_ms"]["native"]["median_ms"]
        if env.settings.e2e_profile_steps > 0:
            try:
                row["profile"] = e2e_profile(env, models, env.settings.e2e_profile_steps)
            except Exception as exc:  # the profiler failed: the timings above still stand
                row["notes"].append(f"profile failed: {short_error(exc)}")
        if row["check_ok"]:
            row["target_met"] = row["ratio"] <= E2E_TARGETS[kind]
    except Unavailable as exc:
        row["unavailable"] = str(exc)
    except Exception as exc:
        row["error"] = short_error(exc)
        row["traceback"] = traceback.format_exc(limit=8)
    models = None
    release_memory(env, failed=True)  # models and optimizers hold reference cycles: collect them
    return row


# --------------------------------------------------------------------------- report

def fmt(value, spec):
    return "—" if value is None else format(value, spec)


def us_of(row, name, key):
    """A variant's ``call_us`` or ``kernel_us``, formatted; ``error`` where it failed."""
    if name in row.get("variant_errors", {}):
        return "error"
    return fmt(row["times"].get(name, {}).get(key), ".1f")


def figure_of(row, key, name):
    """``row[key][name]`` (a fraction of copy or a ratio), formatted."""
    return fmt(row.get(key, {}).get(name), ".2f")


def check_text(row):
    return {None: "—", True: "ok", False: "WRONG"}[row["check_ok"]]


def errors_text(errors):
    return ", ".join(f"{k} {v['max_abs']:.2g} (reference up to {v['scale']:.2g})" for k, v in errors.items())


def peer_check_notes(row):
    """An optional peer's failure (where timing it did not already say so) or its results beyond
    the tolerance against torch."""
    notes = []
    for name, check in row.get("peer_checks", {}).items():
        if "error" in check and name not in row.get("variant_errors", {}):
            notes.append(f"{name}: {check['error']}")
        elif check.get("ok") is False:
            notes.append(f"{name} beyond tolerance against torch: {errors_text(check['errors'])}")
    return notes


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
        notes.append("errors: " + errors_text(row["errors"]))
    notes.extend(peer_check_notes(row))
    ours = row.get("times", {}).get("ours")
    if launch_bound and ours and ours["host_ms_per_call"] > ours["min_ms"]:
        notes.append(f"launch-bound: host {ours['host_ms_per_call'] * 1e3:.0f} us/call")
    if row.get("kernels"):
        notes.append("kernels " + " ".join(row["kernels"]))
    notes.extend(row.get("notes", []))
    for name, timing in row.get("times", {}).items():
        if timing.get("kernel_error"):
            notes.append(f"{name} kernel-only time: {timing['kernel_error']}")
    return "; ".join(notes).replace("|", "/")


def target_text(row):
    return {None: "—", True: "yes", False: "no"}[row["target_met"]]


PEER_LABELS = {"torch_contig": "torch+contig"}


def timed_columns(peers, with_lib, launch_notes):
    """The rows and strided tables: per variant kernel-only us, fraction of copy (kernel-only),
    anynorm's ratio to each peer (kernel-only), call us; then the event-timed fraction and
    ratio to torch, the check, the target and notes. ``peers``: the peer columns, in order."""
    label = lambda name: PEER_LABELS.get(name, name)
    timed = ("ours", *peers)
    columns = [("case", lambda r: r["name"]), ("dtype", lambda r: r["dtype"]), ("pass", lambda r: r["pass"])]
    if with_lib:
        columns.append(("lib", lambda r: r["lib"]))
    columns += [(f"{label(n)} kernel us", functools.partial(us_of, name=n, key="kernel_us")) for n in (*timed, "copy")]
    columns += [(f"{label(n)} of copy", functools.partial(figure_of, key="kernel_of_copy", name=n)) for n in timed]
    columns += [(f"ours/{label(n)}", functools.partial(figure_of, key="kernel_ratios", name=n)) for n in peers]
    columns += [(f"{label(n)} call us", functools.partial(us_of, name=n, key="call_us")) for n in timed]
    columns += [("ours of copy (events)", lambda r: fmt(r["copy_fraction"], ".2f")),
                ("ours/torch (events)", lambda r: fmt(r["ratio_torch"], ".2f")),
                ("max err", lambda r: fmt(r["max_err"], ".1e")), ("check", check_text),
                ("target", target_text), ("notes", lambda r: notes_text(r, launch_notes))]
    return columns


def median_us(row, name):
    return fmt(row["times_us"].get(name, {}).get("median_us"), ".1f")


def spread_us(row, name):
    """``min-max`` over the rounds."""
    t = row["times_us"].get(name)
    return "—" if not t else f"{t['min_us']:.1f}-{t['max_us']:.1f}"


def pass_text(row):
    return {None: "—", True: "pass", False: "miss"}[row["target_met"]]


OVERHEAD_COLUMNS = [
    ("case", lambda r: r["name"]), ("mode", lambda r: r["mode"]),
    ("ours us", lambda r: median_us(r, "ours")), ("ours min-max", lambda r: spread_us(r, "ours")),
    ("torch us", lambda r: median_us(r, "torch")), ("torch min-max", lambda r: spread_us(r, "torch")),
    ("ours/torch", lambda r: fmt(r["ratio_torch"], ".2f")),
    ("RawKernel us", lambda r: median_us(r, "rawkernel")),
    ("empty_like us", lambda r: median_us(r, "empty_like")),
    ("max err", lambda r: fmt(r["max_err"], ".1e")), ("check", check_text),
    ("target", lambda r: r["target"] or "—"), ("pass/miss", pass_text),
    ("notes", lambda r: notes_text(r, launch_bound=False)),
]


def e2e_ms(row, name):
    return fmt(row["times_ms"].get(name, {}).get("median_ms"), ".2f")


def e2e_spread(row, name):
    t = row["times_ms"].get(name)
    return "—" if not t else f"{t['min_ms']:.2f}-{t['max_ms']:.2f}"


def e2e_notes(row):
    notes = [f"not run: {row['unavailable']}"] if row.get("unavailable") else []
    if row.get("error"):
        notes.append(f"ERROR {row['error']}")
    if row["check_ok"] is False:
        notes.append("differences beyond tolerance")
    notes.extend(row.get("notes", []))
    prof = row.get("profile")
    if prof:
        for name in ("native", "anynorm"):
            heavy = ", ".join(f"{k} {v:.2f}" for k, v in prof[name]["top_kernels_ms"][:4])
            notes.append(f"{name} heaviest (ms/step): {heavy}")
    return "; ".join(notes).replace("|", "/")


E2E_COLUMNS = [
    ("case", lambda r: r["name"]),
    ("model", lambda r: r["config"].get("model", "—")),
    ("norms swapped", lambda r: fmt(r["norms_swapped"], "d")),
    ("native ms/step", lambda r: e2e_ms(r, "native")), ("native min-max", lambda r: e2e_spread(r, "native")),
    ("anynorm ms/step", lambda r: e2e_ms(r, "anynorm")), ("anynorm min-max", lambda r: e2e_spread(r, "anynorm")),
    ("anynorm/native", lambda r: fmt(r["ratio"], ".3f")),
    ("target", lambda r: r["target"]), ("pass/miss", pass_text),
    ("output max diff", lambda r: fmt(r["errors"].get("output", {}).get("max_abs"), ".1e")),
    ("output max", lambda r: fmt(r["errors"].get("output", {}).get("scale"), ".2g")),
    ("loss diff", lambda r: fmt(r["errors"].get("loss", {}).get("max_abs"), ".1e")),
    ("check", check_text),
    ("device ms/step native, anynorm", lambda r: e2e_profiled(r, "device_ms", ".1f")),
    ("device idle native, anynorm", lambda r: e2e_profiled(r, "idle", ".0%")),
    ("norm kernels ms/step native, anynorm", lambda r: e2e_profiled(r, "norm_ms", ".2f")),
    ("syncs/step native, anynorm", lambda r: e2e_profiled(r, "syncs_per_step", ".1f")),
    ("notes", e2e_notes),
]


def e2e_profiled(row, key, spec):
    """``native, anynorm`` of a figure of ``e2e_profile`` (— where no profile ran)."""
    prof = row.get("profile")
    if not prof:
        return "—"
    return ", ".join(fmt(prof[name].get(key), spec) for name in ("native", "anynorm"))


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

    def section(self, title, target, columns, intro=()):
        self.columns = columns
        self.say()
        self.say(f"## {title}")
        self.say()
        self.say(f"Target: {target}.")
        self.say()
        for line in intro:
            self.say(line)
        if intro:
            self.say()
        self.say("| " + " | ".join(name for name, _ in columns) + " |")
        self.say("|" + "|".join("---" for _ in columns) + "|")
        self.save()

    def add(self, row):
        self.cases.append(row)
        self.say("| " + " | ".join(str(cell(row)) for _, cell in self.columns) + " |")
        self.save()

    def failures(self):
        """Cases with an error, a wrong result, or a peer that failed (an incomplete row); an
        optional peer's failure (OPTIONAL_PEERS: Liger refuses rows past 65536) is a note only."""
        return [c for c in self.cases if c["error"] or c["check_ok"] is False or c.get("check_error")
                or set(c.get("variant_errors", {})) - set(OPTIONAL_PEERS)]

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


def liger_intro(env, calls):
    """The section's line on Liger: the calls timed, or why its columns are blank."""
    if env.liger is None:
        return [f"Liger {env.liger_problem}: the liger columns are blank."]
    return [f"Liger (`liger_kernel.transformers.functional`): {calls}; a shape its kernels refuse is a note, "
            "not a failure. Its results are checked against torch too (a note where beyond tolerance)."]


def report_rows(env, report):
    M_of = ", ".join(f"{N}: {M}" for M, N in row_shapes(env.settings))
    columns = timed_columns(("torch", "liger"), with_lib=True, launch_notes=env.device == "cuda")
    intro = liger_intro(env, "`liger_layer_norm(x, w, b, eps)`, `liger_rms_norm(x, w, eps, in_place=False)` "
                             "(rows past 65536 are beyond its fused block)")
    report.section(f"Issue 14: rows, normalized over the last axis (M x N; M for each N: {M_of})",
                   TARGETS["rows"], columns, intro)
    run_section(env, report, rows_cases(env), run_timed_case)


def report_strided(env, report):
    columns = timed_columns(("torch", "torch_contig", "liger"), with_lib=False, launch_notes=env.device == "cuda")
    intro = liger_intro(env, "`liger_layer_norm` on the NHWC view of ConvNeXt's input (a contiguous copy "
                             "first on NCHW memory), `liger_group_norm(x, w, b, C, 32, eps)` on NCHW and on the "
                             "NCHW view of NHWC memory (copied to contiguous NCHW inside); no instance norm")
    report.section("Issue 15: channels-first layer norm (NCHW and channels_last memory), channels-last "
                   "instance and group norm, NCHW group norm (torch: permuted views; torch+contig: the "
                   "result made contiguous NCHW)", TARGETS["strided"], columns, intro)
    run_section(env, report, strided_cases(env), run_timed_case)


def report_overhead(env, report):
    s = env.settings
    report.section(f"Per-call overhead (issue 13): float32 layer norm, wall clock per call of {s.overhead_calls} "
                   f"calls then one synchronize, median (and min-max) of {s.overhead_rounds} rounds, the "
                   "variants interleaved in each round; `train`: forward + torch.autograd.grad for x, weight, "
                   "bias; floors: a bare CuPy RawKernel launch of 4 arguments, torch.empty_like(x)",
                   TARGETS["overhead"], OVERHEAD_COLUMNS)
    for shape in OVERHEAD_SHAPES:
        for mode in overhead_modes(env):
            if env.elapsed() > s.budget_s:
                row = new_overhead_row(env, shape, mode)
                row.update(error="skipped: time budget spent", skipped=True)
                row["target"], row["target_met"] = overhead_target(row)
                report.add(row)
                continue
            report.add(run_overhead_case(env, shape, mode))


def report_e2e(env, report):
    s, torch = env.settings, env.torch
    timm, problem = load_timm()
    tf = E2E_TINY_TRANSFORMER if s.tiny else E2E_TRANSFORMER
    cn = E2E_TINY_CONVNEXT if s.tiny else E2E_CONVNEXT
    intro = [
        f"Each model: {s.e2e_warmup} warm-up steps, then {s.e2e_rounds} rounds of {s.e2e_steps} steps "
        "(wall clock, synchronized), native and anynorm interleaved in each round; median ms per step "
        "and min-max over the rounds. A step: forward and loss under "
        f"`torch.autocast({env.device!r}, dtype=torch.bfloat16)`, backward, SGD step. Diffs: "
        "max |anynorm - native| of the output (bf16 autocast) and of the loss, same input and weights, "
        f"before any step; `check` ok within {E2E_TOLERANCE:g} x max(1, max |native|).",
        f"ConvNeXt: batch {cn['batch']}, {cn['image']}x{cn['image']}, random init; LayerNorm2d -> "
        "anynorm.nn.LayerNorm(C, axis=1), NHWC nn.LayerNorm -> anynorm.nn.LayerNorm(C), weights through "
        f"state_dict. timm: {timm.__version__ if timm else problem}.",
        f"Transformers: {tf['layers']} layers, d_model {tf['d_model']}, {tf['nhead']} heads, feed-forward "
        f"{tf['dim_feedforward']}, batch {tf['batch']} x {tf['tokens']} tokens, dropout 0, MSE loss. "
        "`pre-norm blocks, fused residual`: the same layers (gpu_report's PreNormStack), torch LayerNorm "
        "and explicit adds vs anynorm.nn.LayerNorm(d)(x, residual=r); `explicit adds`: the same, "
        "anynorm.nn.LayerNorm after the same adds.",
    ]
    report.section("End to end (issue 13): bf16-autocast training step, norms swapped for anynorm.nn.LayerNorm",
                   TARGETS["e2e"], E2E_COLUMNS, intro)
    cudnn = getattr(torch.backends, "cudnn", None)
    benchmark = getattr(cudnn, "benchmark", None)
    if env.device == "cuda" and cudnn is not None:
        cudnn.benchmark = True  # both models share the conv shapes, so the same algorithms
    try:
        for name, kind, build in e2e_cases(env):
            if env.elapsed() > s.budget_s:
                row = new_e2e_row(env, name, kind)
                row.update(error="skipped: time budget spent", skipped=True)
                report.add(row)
                continue
            report.add(run_e2e_case(env, name, kind, build))
    finally:
        if env.device == "cuda" and cudnn is not None:
            cudnn.benchmark = benchmark


SECTION_RUNNERS = {"rows": report_rows, "strided": report_strided, "overhead": report_overhead, "e2e": report_e2e}


def parse_sections(text):
    """``"overhead,e2e"`` -> the sections in SECTIONS order; ``kernels`` = rows,strided; ``all``."""
    chosen = set()
    for name in (part.strip() for part in text.split(",")):
        if name in SECTION_ALIASES:
            chosen.update(SECTION_ALIASES[name])
        elif name in SECTIONS:
            chosen.add(name)
        else:
            raise argparse.ArgumentTypeError(
                f"unknown section {name!r}: choose from {', '.join(SECTIONS + tuple(SECTION_ALIASES))}")
    return tuple(name for name in SECTIONS if name in chosen)


def planned_cases(env):
    counts = {"rows": lambda: len(list(rows_cases(env))), "strided": lambda: len(list(strided_cases(env))),
              "overhead": lambda: len(OVERHEAD_SHAPES) * len(overhead_modes(env)),
              "e2e": lambda: len(e2e_cases(env))}
    return sum(counts[name]() for name in env.settings.sections)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for gpu_report.json and gpu_report.md (default: .)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter timed regions")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small shapes of the same layouts (smoke test)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="skip the cases not started after this many seconds (default 420)")
    parser.add_argument("--e2e-profile-steps", type=int, default=2, metavar="N",
                        help="e2e: training steps per model under torch.profiler, for the device time, "
                             "GPU idle share, synchronizing calls and heaviest kernels of a step "
                             "(default 2; 0: none)")
    parser.add_argument("--sections", type=parse_sections, default=SECTIONS, metavar="LIST",
                        help="comma-separated sections to run, in this order: rows, strided (both with "
                             "kernel-only times; 'kernels' = rows,strided), overhead, e2e; default: all")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        env = Env(args)
    except SetupError as exc:
        print(f"gpu_report: {exc}", file=sys.stderr)
        return 2
    meta = describe_machine(env)
    meta["planned_cases"] = planned_cases(env)
    report = Report(args.out, meta)
    for name in env.settings.sections:
        SECTION_RUNNERS[name](env, report)
    report.finish(env.elapsed())
    print(f"wrote {report.out_dir / 'gpu_report.md'} and {report.out_dir / 'gpu_report.json'}")
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
