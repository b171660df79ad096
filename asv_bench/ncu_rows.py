#!/usr/bin/env python
"""One forward + backward of bfloat16 layer norm rows inside a profiler range, for ncu.

    ncu --profile-from-start off --kernel-name regex:rows_ --section SourceCounters \\
        --section WarpStateStats --section SpeedOfLight -o rows python asv_bench/ncu_rows.py
    ncu --import rows.ncu-rep --page source --csv --print-source sass > rows_sass.csv
    python asv_bench/ncu_rows.py --count rows_sass.csv

Rows of 8192 x 4096 and 32768 x 1024 (weight and bias, x = 3 + 2 randn), after three warm-up
calls (compilation, the launch plans) outside the range. ``--count`` reads ncu's per-instruction
CSV back: per kernel, the thread instructions executed per element of x (2^25 elements each)
and the opcodes most issued, the figures that showed the row kernels bound by issue
(``asv_bench/gpu_results/h100-2026-11-26/ncu_rows.md``).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

SHAPES = ((8192, 4096), (32768, 1024))


def profile():
    import torch

    import anynorm

    cases = []
    for m, n in SHAPES:
        x = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 2 + 3).requires_grad_()
        w = (torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_()
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16).requires_grad_()
        cases.append((x, w, b, torch.randn_like(x)))
    for _ in range(3):
        for x, w, b, dy in cases:
            anynorm.layer_norm(x, w, b).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for x, w, b, dy in cases:
        anynorm.layer_norm(x, w, b).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def count(path, elements=2 ** 25, top=10):
    """Print, per kernel of ncu's source-page CSV, thread instructions per element and the
    opcodes most issued (warp instructions per 32 elements)."""
    kernel, header, rows = None, None, []
    for row in csv.reader(open(path)):
        if row and row[0] == "Kernel Name":
            kernel, header = row[1], None
            rows.append((kernel, []))
        elif row and row[0] == "Address":
            header = row
        elif row and header:
            rows[-1][1].append(dict(zip(header, row)))
    for kernel, instructions in rows:
        threads = sum(int(i["Thread Instructions Executed"]) for i in instructions)
        ops = collections.Counter()
        for i in instructions:
            source = i["Source"].strip()
            if source:
                ops[re.sub(r"^@!?U?P\w+\s+", "", source).split()[0].split(".")[0]] += int(i["Instructions Executed"])
        name = re.sub(r"^void ", "", re.sub(r">\(.*", ">", kernel)).replace("(int)", "")
        print(f"{name}: {threads / elements:.1f} thread instructions an element; "
              + ", ".join(f"{op} {n / (elements / 32):.2f}" for op, n in ops.most_common(top)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", metavar="CSV", help="read ncu's --page source CSV instead of profiling")
    args = parser.parse_args()
    count(args.count) if args.count else profile()
