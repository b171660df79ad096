#!/usr/bin/env python
"""Host-side cost per call of anynorm's CUDA torch path, measured without a GPU.

    python asv_bench/host_overhead.py [--rows M] [--hidden N] [--profile]

On a GPU a call costs its Python work (validation, plan, route, output allocation, launch
arguments) plus the kernels; once the host takes longer than the kernels, the host sets the
pace (a 64 x 768 layer norm runs in a few microseconds on an H100). This runs the same Python
on CPU tensors with the CUDA-only steps replaced: the kernel launch by CuPy's own per-argument
conversion (``CScalar`` for every argument that is not already a CuPy holder, which is what
``RawKernel`` does before it calls the driver), the stream switch by nothing, CuPy workspaces
by torch CPU tensors. Allocations are CPU ones, so figures are close to, not equal to, those
on a GPU host. Printed per route of ``anynorm._cuda._torch_ops``: inference (the runner),
training forward + backward (``_EagerNorm``) and both again through the registered custom op,
the route torch.compile and dispatch modes take; and torch's own ``F.layer_norm`` on the same
CPU tensors (which includes its CPU arithmetic, so it is a ceiling on torch's host cost).
The real figure on a GPU is ``gpu_report.py``'s overhead section.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import timeit

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from cupy._core._scalar import CScalar  # noqa: E402
from cupy.cuda.function import CPointer  # noqa: E402

import anynorm  # noqa: E402
from anynorm import _backend  # noqa: E402
from anynorm._cuda import _executor, _interop, _launch  # noqa: E402


class _ConvertingKernel:
    """Stands in for a RawKernel: converts the arguments as CuPy's launch does, no driver."""

    max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        return [a if isinstance(a, CPointer) else CScalar(a) for a in args]


class _NoCupy:
    class cuda:
        class runtime:
            getDevice = staticmethod(lambda: 0)

    @staticmethod
    def empty(shape, dtype=None):
        return _Workspace(torch.empty(shape))


class _Workspace:
    """A CuPy workspace as the launcher uses it here: row by row."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __getitem__(self, row):
        return _interop.ref(self.tensor[row])


def _stub_cuda():
    """Route CPU tensors through the CUDA executor with the GPU-only steps replaced."""
    kernel = _ConvertingKernel()
    _launch.get_kernel = lambda *args, **kw: kernel
    _launch._sm_count = lambda device: 132
    _launch._smem_optin = lambda device: 227 * 1024
    _launch.cupy = _NoCupy
    _interop.on_torch_stream = lambda device: contextlib.nullcontext()
    _backend.on_cuda = lambda x: True
    _executor._runtime_problem = lambda: None
    ops = _executor._torch_ops()
    ops.RUNNERS["cpu"] = ops.RUNNERS["cuda"]
    ops._forward_op.register_kernel("cpu")(ops._forward_impl)
    ops._backward_op.register_kernel("cpu")(ops._backward_impl)
    return ops


def _per_call_us(fn, number):
    return min(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the inference and training calls")
    args = parser.parse_args(argv)
    ops = _stub_cuda()
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

    rows = [("inference", infer, torch_infer), ("training forward + backward", train, torch_train)]
    eager = {name: _per_call_us(fn, args.number) for name, fn, _ in rows}
    route = ops._route
    ops._route = lambda *tensors: ops.OP
    via_op = {name: _per_call_us(fn, args.number) for name, fn, _ in rows}
    ops._route = route
    peer = {name: _per_call_us(fn, args.number) for name, _, fn in rows}
    print(f"host microseconds per call, layer_norm of {m} x {n} float32 (torch {torch.__version__})")
    print(f"| call | anynorm eager route | through the custom op | eager / op | F.layer_norm on CPU (incl. arithmetic) |")
    print("|---|---|---|---|---|")
    for name, _, _ in rows:
        print(f"| {name} | {eager[name]:.1f} | {via_op[name]:.1f} | {eager[name] / via_op[name]:.2f} | "
              f"{peer[name]:.1f} |")
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
