#!/usr/bin/env python
"""Where a training call's host time goes on a GPU host: anynorm's layer norm against
torch.nn.functional's, forward + ``torch.autograd.grad`` on small CUDA tensors (the kernels
take microseconds, so the host sets the pace), and cProfile of anynorm's call.

    python asv_bench/gpu_host_profile.py [--rows 64] [--hidden 768] [--calls 2000] [--device cuda]

Printed: wall microseconds per call (each variant's rounds interleaved, median and min-max)
of the training step with autograd's device threads (torch's default: the backward of CUDA
tensors runs on the engine's thread for that device) and with
``torch.autograd.set_multithreading_enabled(False)`` (the backward on the calling thread), of
the forward alone with a graph recorded, and of the forward without grad; then cProfile of
anynorm's training step with the backward on the calling thread (so that the profiler sees
it), the functions with the most own time and the most cumulative time, in microseconds per
call. ``gpu_report.py --sections overhead`` gives the same steps' times against torch; this
says which Python they are spent in.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import anynorm


def _steps(x, w, b, dy):
    def ours_train():
        y = anynorm.layer_norm(x, w, b)
        return torch.autograd.grad(y, (x, w, b), dy)

    def torch_train():
        y = F.layer_norm(x, x.shape[-1:], w, b)
        return torch.autograd.grad(y, (x, w, b), dy)

    def ours_forward():
        return anynorm.layer_norm(x, w, b)

    def torch_forward():
        return F.layer_norm(x, x.shape[-1:], w, b)

    def ours_no_grad():
        with torch.no_grad():
            return anynorm.layer_norm(x, w, b)

    def torch_no_grad():
        with torch.no_grad():
            return F.layer_norm(x, x.shape[-1:], w, b)

    return {"train": (ours_train, torch_train), "forward (graph recorded)": (ours_forward, torch_forward),
            "forward, no grad": (ours_no_grad, torch_no_grad)}


def _per_call_us(fn, calls, sync):
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.hidden, generator=g).to(dev).requires_grad_()
    w = (torch.rand(args.hidden, generator=g) + 0.5).to(dev).requires_grad_()
    b = torch.randn(args.hidden, generator=g).to(dev).requires_grad_()
    dy = torch.randn(args.rows, args.hidden, generator=g).to(dev)
    steps = _steps(x, w, b, dy)
    for ours, theirs in steps.values():  # compile, plan, allocator pools, autograd threads
        for _ in range(50):
            ours(), theirs()
    print(f"host per call, layer_norm {args.rows}x{args.hidden} float32 on {dev} "
          f"(torch {torch.__version__}); wall us per call of {args.calls} calls then a synchronize, "
          f"median (min-max) of {args.rounds} interleaved rounds")
    print("| step | autograd threads | anynorm us | torch us | anynorm/torch |")
    print("|---|---|---|---|---|")
    for name, (ours, theirs) in steps.items():
        for threads in ((True, False) if name == "train" else (True,)):
            times = {"ours": [], "torch": []}
            with torch.autograd.set_multithreading_enabled(threads):
                for _ in range(args.rounds):
                    times["ours"].append(_per_call_us(ours, args.calls, sync))
                    times["torch"].append(_per_call_us(theirs, args.calls, sync))
            o, t = (statistics.median(times[k]) for k in ("ours", "torch"))
            spread = {k: f"{min(v):.1f}-{max(v):.1f}" for k, v in times.items()}
            print(f"| {name} | {'device threads' if threads else 'calling thread'} | {o:.1f} ({spread['ours']}) "
                  f"| {t:.1f} ({spread['torch']}) | {o / t:.2f} |")
    ours_train = steps["train"][0]
    profile = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        sync()
        profile.enable()
        for _ in range(args.calls):
            ours_train()
        sync()
        profile.disable()
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats(key).print_stats(30)
        print(f"\ncProfile of anynorm's training step (backward on the calling thread), sorted by {key}; "
              f"divide the times by {args.calls} calls (x 1e6 for us per call):")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
