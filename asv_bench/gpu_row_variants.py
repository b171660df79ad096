#!/usr/bin/env python
"""Which row kernel is fastest for a row length: the shipped schedule against forced variants.

    python asv_bench/gpu_row_variants.py [--widths 512,768,1024,2048,4096] [--dtypes bfloat16,float32]
                                         [--train] [--variants shipped,ahead1] [--params float32]

For layer_norm and rms_norm over the last axis of M x N (M * N = 2^25) on CUDA torch tensors,
forward without grad (``--train``: forward + autograd backward with gradients for x, weight
and bias), each variant's GPU time per call (CUDA events around 40 back-to-back calls, the
minimum of 5 rounds, the variants interleaved in each round) and its fraction of a
device-to-device copy of the same bytes (read x, write y; with --train 5 transfers of x's
size against 2.5 copies). Variants:

- ``shipped``: the launcher's schedule as it stands;
- ``block8`` / ``block16``: neither the multi-row kernels nor the two-vector rule, the
  block-per-row kernels at ITEMS 8 / 16 where built for it (``_schedule``'s choice of ITEMS
  replaced);
- ``warp16``: the warp-per-row kernel at ITEMS 16 (rows of up to 512 elements);
- ``noahead`` (``--train``): the shipped schedule, its block backwards given no room to read
  the next row ahead (rows.cu's ``block_stage``): the read-ahead's share, in one process;
- ``ahead1`` / ``ahead2`` / ``ahead3``: the shipped schedule with room for 2 / 3 / 4 slots
  where it gives the block kernels a ring (``_FWD_STAGES``, ``_FWD_STAGES_16BIT``,
  ``_BWD_STAGES``): one to three rows in flight ahead (rows_fwd_block; 16-bit rows_bwd_block*
  at ITEMS=8; rows_bwd_multi, a group of rows at a time). The shipped schedule allows 4
  slots, 2 in rows_fwd_block's 16-bit rows;
- ``nolean``: the shipped schedule with rows_fwd_block where it picks rows_fwd_lean (plain
  rows, weight and bias in x's dtype, two vectors a thread): the lean loop's share;
- ``stash16``: rows_fwd_lean's 16-bit rows with weight and bias of x's dtype in its float32
  stash (shared memory) instead of registers, where the SM's share has room.

A lab for choosing ``_schedule``'s rules on a GPU; the results are checked against
torch.nn.functional before they are timed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch
import torch.nn.functional as F

import anynorm
from anynorm import _calls, _plan
from anynorm._cuda import _schedule


@contextlib.contextmanager
def variant(name):
    """The launcher forced to one kernel choice (no plan, and so no launch, cached from another)."""
    saved = (_schedule._multi_rows, _schedule.items_of, _schedule._two_vector_rows, _schedule._block_bwd,
             _schedule._FWD_STAGES, _schedule._BWD_STAGES, _schedule._FWD_STAGES_16BIT, _schedule._lean_rows,
             _schedule._lean_stash)
    _calls.clear()
    _plan.plan_for.cache_clear()
    try:
        if name.startswith("ahead"):
            slots = int(name[len("ahead"):]) + 1
            _schedule._FWD_STAGES = _schedule._BWD_STAGES = _schedule._FWD_STAGES_16BIT = slots
        elif name == "noahead":
            def no_stage(rows, dtype, threads, items, sums=0, _block_bwd=saved[3]):
                grid, _ = _block_bwd(rows, dtype, threads, items, sums)
                return grid, sums
            _schedule._block_bwd = no_stage
        elif name == "nolean":
            _schedule._lean_rows = lambda *a, **k: False
            _schedule._lean_stash = lambda *a, **k: 0
        elif name == "stash16":
            _schedule._lean_rows = lambda plain, dtype, *a, _lean_rows=saved[7]: (
                dtype == "float32" and _lean_rows(plain, dtype, *a))
        elif name != "shipped":
            _schedule._multi_rows = _schedule._two_vector_rows = lambda *a, **k: None
        if name in ("block8", "block16"):
            items = int(name[len("block"):])

            def only(kernel, dtype=None, _items_of=saved[1]):
                if kernel.endswith("_warp"):
                    return ()
                own = _items_of(kernel, dtype)
                return (items,) if "_block" in kernel and items in own else own
            _schedule.items_of = only
        if name == "warp16":
            _schedule.items_of = lambda kernel, dtype=None: (16,) if kernel.endswith("_warp") else saved[1](kernel, dtype)
        yield
    finally:
        (_schedule._multi_rows, _schedule.items_of, _schedule._two_vector_rows, _schedule._block_bwd,
         _schedule._FWD_STAGES, _schedule._BWD_STAGES, _schedule._FWD_STAGES_16BIT, _schedule._lean_rows,
         _schedule._lean_stash) = saved
        _calls.clear()
        _plan.plan_for.cache_clear()


def train(forward, dy, x):
    """forward() and its backward for x, weight and bias; returns dx (for the check)."""
    def step():
        x.grad = None
        forward().backward(dy)
        return x.grad
    return step


def gpu_us(fn, calls=40):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="512,768,1024,2048,4096")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train", action="store_true", help="forward + backward")
    parser.add_argument("--variants", help="a comma-separated subset of the variants (default: all)")
    parser.add_argument("--params", choices=("x", "float32"), default="x",
                        help="weight and bias in x's dtype or in float32 (16-bit rows: rows_fwd_lean's stash; "
                             "torch then times its mixed-dtype kernel where it has one, else parameters in x's dtype)")
    args = parser.parse_args()
    names = ("shipped", "nolean", "stash16", "block8", "block16", "warp16", "ahead1", "ahead2", "ahead3") + (
        ("noahead",) if args.train else ())
    if args.variants:
        unknown = set(args.variants.split(",")) - set(names)
        if unknown:
            parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(names)}")
        names = tuple(args.variants.split(","))
    print("| op | dtype | M x N | " + " | ".join(f"{n} of copy" for n in names) + " | torch of copy |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for dtype in args.dtypes.split(","):
        dt = getattr(torch, dtype)
        for n in map(int, args.widths.split(",")):
            m = 2 ** 25 // n
            x = torch.randn(m, n, device="cuda", dtype=dt) * 2 + 3
            pdt = dt if args.params == "x" else torch.float32
            w = torch.rand(n, device="cuda", dtype=pdt) + 0.5
            b = torch.randn(n, device="cuda", dtype=pdt)
            out, xd = torch.empty_like(x), x.detach()
            dy = torch.randn_like(x)
            for t in (x, w, b):
                t.requires_grad_(args.train)
            for op in ("layer_norm", "rms_norm"):
                if op == "layer_norm":
                    fwd_ref = lambda w=w, b=b: F.layer_norm(x, (n,), w, b)  # noqa: E731
                    fwd_ours = lambda: anynorm.layer_norm(x, w, b)  # noqa: E731
                else:
                    fwd_ref = lambda w=w, b=b: F.rms_norm(x, (n,), w, 1e-6)  # noqa: E731
                    fwd_ours = lambda: anynorm.rms_norm(x, w, eps=1e-6)  # noqa: E731
                if pdt is not dt:
                    try:  # torch's mixed-dtype kernel, where it has one
                        with torch.set_grad_enabled(args.train):
                            fwd_ref()
                    except RuntimeError:
                        wt, bt = w.detach().to(dt).requires_grad_(args.train), b.detach().to(dt).requires_grad_(args.train)
                        fwd_ref = functools.partial(fwd_ref, w=wt, b=bt)
                ref, ours = (train(fwd_ref, dy, x), train(fwd_ours, dy, x)) if args.train else (fwd_ref, fwd_ours)
                times = {k: [] for k in names + ("torch", "copy")}
                usable = [k for k in names if k != "warp16" or n <= 512]
                with torch.set_grad_enabled(args.train):
                    want = ref().float()
                    for k in usable:
                        with variant(k):
                            err = ((ours().float() - want).abs().max() / want.abs().max()).item()
                            assert err < (2e-2 if dtype != "float32" else 1e-5), (k, op, n, err)
                    for _ in range(args.rounds):
                        for k in usable:
                            with variant(k):
                                ours()  # plan and bind the launch outside the timed loop
                                times[k].append(gpu_us(ours))
                        times["torch"].append(gpu_us(ref))
                        times["copy"].append(gpu_us(lambda: out.copy_(xd)))
                best = {k: min(v) for k, v in times.items() if v}
                if args.train:  # 5 transfers of x's size against the copy's 2
                    best["copy"] *= 2.5
                cells = [f"{best['copy'] / best[k]:.2f}" if k in best else "-" for k in names + ("torch",)]
                print(f"| {op} | {dtype} | {m}x{n} | " + " | ".join(cells) + " |", flush=True)
            del x, w, b, out


if __name__ == "__main__":
    main()
