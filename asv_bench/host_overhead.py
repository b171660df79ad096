#!/usr/bin/env python
"""Host-side cost per call of anynorm's CUDA torch path, measured without a GPU.

    python asv_bench/host_overhead.py [--rows M] [--hidden N] [--profile]

On a GPU a call costs its Python work (validation, plan, route, output allocation, launch
arguments) plus the kernels; once the host takes longer than the kernels, the host sets the
pace (a 64 x 768 layer norm runs in a few microseconds on an H100). This runs the same Python
on CPU tensors with the CUDA-only steps replaced: the driver's launch (``cuLaunchKernel``, which
``_launcher.DirectStep`` calls with its argument words), the context, stream and device
lookups by stand-ins that count them, CuPy workspaces by torch CPU tensors. Allocations are CPU ones, so figures are close to, not equal to, those
on a GPU host. Printed per route of ``anynorm._cuda._torch_ops``: inference (the runner),
training forward + backward (``_EagerNorm``) and both again through the registered custom op,
the route torch.compile and dispatch modes take; and torch's own ``F.layer_norm`` on the same
CPU tensors (which includes its CPU arithmetic, so it is a ceiling on torch's host cost),
and the floor of the design: an empty Python ``autograd.Function`` over the same tensors.
Times are this thread's CPU time (interleaved rounds, medians), which other processes on a
shared machine disturb far less than wall time.
The real figure on a GPU is ``gpu_report.py``'s overhead section.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import anynorm  # noqa: E402
from anynorm import _backend  # noqa: E402
from anynorm._cuda import _executor, _interop, _launcher, _schedule  # noqa: E402


_STUBBED = {"launches": 0, "context checks": 0, "stream lookups": 0, "device checks": 0}


class _StubFunction:
    """Stands in for a CUDA function (its handle): ``_launcher`` binds it as a direct
    ``cuLaunchKernel`` step, whose driver call ``_launch_kernel`` stands in for."""

    max_dynamic_shared_size_bytes = 0
    ptr = 0


def _launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """Stands in for CuPy's driver.launchKernel (cuLaunchKernel: a C call on a GPU host),
    where _launcher launches a bound step's words directly."""
    _STUBBED["launches"] += 1


def _context_now():
    """CuPy's driver.ctxGetCurrent: a C call (a context is current on a GPU host's thread)."""
    _STUBBED["context checks"] += 1
    return 1


def _raw_stream(device):
    """torch._C._cuda_getCurrentRawStream: a C call returning the legacy stream (0) here."""
    _STUBBED["stream lookups"] += 1
    return 0


def _device_now():
    """cupy.cuda.runtime.getDevice: a C call; x.get_device() is -1 for CPU tensors."""
    _STUBBED["device checks"] += 1
    return -1


def _stub_cuda():
    """Route CPU tensors through the CUDA executor with the GPU-only steps replaced."""
    function = _StubFunction()
    _launcher.get_kernel = lambda *args, **kw: function
    _launcher._Function = _StubFunction  # bound as CUDA functions are: direct launches
    _launcher._launch_kernel = _launch_kernel
    _launcher._current_context = _context_now
    _launcher.device_info = lambda device: _schedule.DeviceInfo(132, 227 * 1024, 8)  # an H100
    _launcher._current_device = lambda: -1  # x.get_device() of a CPU tensor
    _interop.torch_stream = _raw_stream
    _interop.current_device = _device_now
    _backend.on_cuda = lambda x: True
    _executor._runtime_problem = lambda: None
    ops = _executor._torch_ops()
    ops.RUNNERS["cpu"] = ops.RUNNERS["cuda"]
    ops._forward_op.register_kernel("cpu")(ops._forward_impl)
    ops._backward_op.register_kernel("cpu")(ops._backward_impl)
    return ops


def _thread_us(fn, number):
    """Microseconds of this thread's CPU time per call: all of a call's work runs on it here
    (torch has one thread, and the autograd engine runs CPU backward on the caller's), and
    unlike wall time it does not count the time other processes of a shared machine hold
    the core."""
    start = time.thread_time_ns()
    for _ in range(number):
        fn()
    return (time.thread_time_ns() - start) / number / 1e3


def _interleaved_us(fns, number, rounds):
    """Per function: the median and the (min, max) over ``rounds`` of microseconds per call,
    the functions timed in turn within each round (shared machines drift between rounds)."""
    samples = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            samples[key].append(_thread_us(fn, number))
    return {key: (statistics.median(v), min(v), max(v)) for key, v in samples.items()}


class _EmptyNorm(torch.autograd.Function):
    """The floor of any Python ``autograd.Function`` over (x, weight, bias): allocates y
    and the three gradients, computes nothing."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.empty_like(dy), dy.new_empty(dy.shape[-1:]), dy.new_empty(dy.shape[-1:])


def _op_route(ops, fn):
    """``fn`` with every call sent through the registered custom op."""
    def through_op():
        route = ops._route
        ops._route = lambda *tensors: ops.OP
        try:
            fn()
        finally:
            ops._route = route
    return through_op


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--number", type=int, default=2000, help="calls per function in all")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (median taken)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the inference and training calls")
    args = parser.parse_args(argv)
    ops = _stub_cuda()
    # the stubbed kernels leave outputs uninitialised; gradients accumulate them call after
    # call, and denormal garbage would make the CPU's additions, not the host path, the cost
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)  # host cost is one Python thread's; keep torch's arithmetic off the other core
    torch.manual_seed(0)
    m, n = args.rows, args.hidden
    x, w, b = torch.randn(m, n), torch.ones(n), torch.zeros(n)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    dy = torch.randn(m, n)
    F = torch.nn.functional

    def infer():
        anynorm.layer_norm(x, w, b)

    def train():
        anynorm.layer_norm(xg, wg, bg).backward(dy)

    def torch_infer():
        F.layer_norm(x, (n,), w, b)

    def torch_train():
        F.layer_norm(xg, (n,), wg, bg).backward(dy)

    def empty_function_train():
        _EmptyNorm.apply(xg, wg, bg).backward(dy)

    rows = [("inference", infer, torch_infer), ("training forward + backward", train, torch_train)]
    fns = {}
    for name, mine, theirs in rows:
        fns[name, "eager"] = mine
        fns[name, "op"] = _op_route(ops, mine)
        fns[name, "torch"] = theirs
    fns["floor"] = empty_function_train
    times = _interleaved_us(fns, max(1, args.number // args.rounds), args.rounds)
    eager = {name: times[name, "eager"][0] for name, _, _ in rows}
    via_op = {name: times[name, "op"][0] for name, _, _ in rows}
    peer = {name: times[name, "torch"][0] for name, _, _ in rows}
    _STUBBED.update(dict.fromkeys(_STUBBED, 0))
    infer()
    per_infer = dict(_STUBBED)
    _STUBBED.update(dict.fromkeys(_STUBBED, 0))
    train()
    per_train = dict(_STUBBED)
    print(f"host microseconds per call, layer_norm of {m} x {n} float32 (torch {torch.__version__})")
    print("stubbed per call (a C call or driver launch each on a GPU host): "
          f"inference {per_infer}, training {per_train}; allocations are torch CPU ones")
    print(f"medians of {args.rounds} interleaved rounds")
    print(f"| call | anynorm eager route | through the custom op | eager / op | F.layer_norm on CPU (incl. arithmetic) | spread (min-max: eager / op / torch) |")
    print("|---|---|---|---|---|---|")
    for name, _, _ in rows:
        spread = " / ".join(f"{times[name, k][1]:.0f}-{times[name, k][2]:.0f}" for k in ("eager", "op", "torch"))
        print(f"| {name} | {eager[name]:.1f} | {via_op[name]:.1f} | {eager[name] / via_op[name]:.2f} | "
              f"{peer[name]:.1f} | {spread} |")
    floor = times["floor"][0]
    print(f"floor of a Python autograd.Function: {floor:.1f} us for forward + backward of an "
          f"empty one over (x, w, b) (its four allocations, autograd's recording and engine); "
          f"anynorm's training call spends {eager['training forward + backward'] - floor:.1f} us "
          f"above it")
    print(f"host ratio: inference {eager['inference'] / peer['inference']:.2f}x, "
          f"training {eager['training forward + backward'] / peer['training forward + backward']:.2f}x")
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.number):
            infer()
            train()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
