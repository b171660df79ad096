"""Theoretical occupancy of the row kernels on an H100 (sm_90), without a GPU.

ptxas's resource report (NVRTC with CuPy's options and ``--ptxas-options=-v``, as
``test_kernels_compile.py``) gives each instantiation's registers and static shared memory;
the launch schedules ``_schedule`` computes for an H100 (as ``test_schedules.py``)
give the block size and dynamic shared memory each one runs with. Per SM (sm_90)::

    warps/block  = ceil(threads / 32)
    regs/warp    = ceil(regs * 32 / 256) * 256                  (allocation unit: 256 per warp)
    blocks       = min(floor(floor(65536 / regs/warp) / warps/block),   registers
                       floor(64 / warps/block), 32,                      warps, blocks
                       floor(228 KiB / (ceil(smem / 128) * 128 + 1 KiB)))  shared memory (+1 KiB reserved)
    occupancy    = blocks * warps/block / 64

``TARGETS`` holds the floor per kernel (forward 50%, backward 37.5%: enough warps in flight to
cover DRAM latency, issue 14), checked at every configuration the launcher uses for it;
float64 is correct but not tuned (reported, only spills checked). Kernels of other families
(tiles, columns) join by adding their rows to ``TARGETS`` and their layouts to ``CALLS``.
Run as a script to print the table.
"""

from __future__ import annotations

import math
import re
import sys
from concurrent.futures import ProcessPoolExecutor
import multiprocessing

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", exc_type=ImportError)
try:
    from anynorm._cuda import _compile, _layout, _schedule
    cupy.cuda.nvrtc.getVersion()
except Exception as exc:  # CuPy without NVRTC, or anynorm._cuda unusable
    pytest.skip(f"NVRTC or anynorm._cuda unavailable: {exc}", allow_module_level=True)
from anynorm._plan import make_plan  # noqa: E402

pytestmark = pytest.mark.slow

FORWARD, BACKWARD = 0.5, 0.375
TARGETS = {
    "rows_fwd_warp": FORWARD, "rows_fwd_block": FORWARD, "rows_fwd_lean": FORWARD, "rows_fwd_multi": FORWARD, "rows_bwd_multi": BACKWARD, "rows_fwd_smem": FORWARD,
    "rows_fwd_cluster": FORWARD, "rows_bwd_cluster": BACKWARD,
    "rows_stats_partial": FORWARD,
    "rows_stats_finalize": FORWARD, "rows_apply_fwd": FORWARD,
    "rows_bwd_warp": BACKWARD, "rows_bwd_block": BACKWARD,
    "rows_bwd_block_params": BACKWARD, "rows_bwd_smem": BACKWARD, "rows_bwd_warp_row_params": BACKWARD,
    "rows_bwd_block_row_params": BACKWARD, "rows_grad_partial": BACKWARD,
    "rows_grad_finalize": BACKWARD,
    "segment_grad_finalize": BACKWARD, "apply_bwd": BACKWARD, "param_grad_finish": BACKWARD,
    "param_grad_rows": BACKWARD, "param_grad_cols": BACKWARD,
}
SM90 = {"regs": 65536, "reg_unit": 256, "warps": 64, "blocks": 32, "smem": 228 * 1024,
        "smem_reserved": 1024, "smem_unit": 128}
H100 = _schedule.DeviceInfo(sm_count=132, smem_optin=227 * 1024, cluster_max=8)
TUNED = ("float16", "bfloat16", "float32")
# Row lengths across every boundary of the launcher's choices (warp/block ITEMS, the split path).
COUNTS = (1, 8, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 768, 1024, 1025, 2048, 2049, 4096, 4097,
          8192, 8193, 12288, 16384, 16385, 40960, 65536, 262144)
# (op, shape for a row length n, kwargs): the row layouts (inner == 1) these kernels serve.
CALLS = (
    ("layer_norm", lambda n: (512, n), {}),
    ("rms_norm", lambda n: (512, n), {"axis": -1}),
    ("instance_norm", lambda n: (8, 64, n), {"channel_axis": 1}),  # p = the row's channel
    ("group_norm", lambda n: (8, 64, n), {"channel_axis": 1, "num_groups": 32}),  # rows of 2 channels
)


def occupancy(regs: int, threads: int, smem: int, sm=SM90) -> float:
    """Theoretical occupancy (active warps / 64) of blocks of ``threads`` using ``regs``
    registers per thread and ``smem`` bytes of shared memory (static + dynamic)."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(regs * 32 / sm["reg_unit"]) * sm["reg_unit"]
    by_regs = (sm["regs"] // per_warp) // warps if regs else sm["blocks"]
    smem_block = math.ceil(smem / sm["smem_unit"]) * sm["smem_unit"] + sm["smem_reserved"]
    blocks = min(by_regs, sm["warps"] // warps, sm["blocks"], sm["smem"] // smem_block)
    return blocks * warps / sm["warps"]


def _strides(shape):
    return tuple(int(np.prod(shape[k + 1:])) for k in range(len(shape)))


def launch_configs():
    """{(kernel, dtype, items): {(threads, dynamic smem)}} over the H100 schedules of CALLS."""
    configs: dict = {}
    for dtype in _compile.CTYPES:
        for op, shape_of, kw in CALLS:
            for n in COUNTS:
                x = np.zeros(shape_of(n), np.float32)
                w = np.ones(make_plan(op, x, **kw).param_shape, np.float32)
                plan = make_plan(op, x, w, None if op == "rms_norm" else w, **kw)
                fwd = _layout.plan_layout(plan, _strides(x.shape))
                bwd = _layout.plan_layout(plan, _strides(x.shape), True)
                if not fwd.rows:
                    continue
                schedules = [
                    _schedule.schedule_forward(plan, dtype, fwd, {"w", "b", "mean", "rstd"}, device=H100),
                    _schedule.schedule_forward(plan, dtype, fwd, {"w", "b"}, device=H100),
                    _schedule.schedule_backward(plan, dtype, bwd, {"w", "mean", "rstd", "dw", "db"}, device=H100),
                    _schedule.schedule_backward(plan, dtype, bwd, {"mean", "rstd"}, device=H100),
                ]
                for schedule in schedules:
                    for step in schedule.steps:
                        threads = math.prod(step.block)
                        configs.setdefault((step.name, dtype, step.items), set()).add((threads, step.smem))
    return configs


_MANGLED_T = {"6__half": "float16", "13__nv_bfloat16": "bfloat16", "f": "float32", "d": "float64"}


def _demangle(symbol):
    """(kernel, dtype, items or None) of ``_Z13rows_fwd_warpI13__nv_bfloat16Li32EEv...``."""
    m = re.match(r"_Z(\d+)", symbol)
    start = m.end()
    name = symbol[start:start + int(m.group(1))]
    rest = symbol[start + int(m.group(1)) + 1:]  # past the "I"
    code = next(c for c in _MANGLED_T if rest.startswith(c))
    items = re.match(r"Li(\d+)E", rest[len(code):])
    return name, _MANGLED_T[code], int(items.group(1)) if items else None


_REPORT = re.compile(r"Compiling entry function '(\S+)' for 'sm_90'.*?"
                     r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
                     r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?", re.S)


def _ptxas(job):
    """{(kernel, dtype, items): (registers, static smem, stack+spill bytes)} of one file/dtype."""
    file, dtype = job
    from anynorm._cuda import _compile as compile_module

    log = compile_module.nvrtc_check(file, dtype, "90", extra_options=("--ptxas-options=-v",))
    out = {}
    for symbol, frame, stores, loads, regs, smem in _REPORT.findall(log):
        out[_demangle(symbol)] = (int(regs), int(smem or 0), int(frame) + int(stores) + int(loads))
    return out


def ptxas_report(files=("rows.cu", "finish.cu", "params.cu")):
    jobs = [(f, d) for f in files for d in _compile.CTYPES]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        report = {}
        for part in pool.map(_ptxas, jobs):
            report.update(part)
    return report


def table(configs, report):
    """Rows (kernel, dtype, items, registers, threads, smem bytes, occupancy, spill bytes) at the
    worst configuration of each instantiation the schedules launch."""
    rows = []
    for (kernel, dtype, items), launches in sorted(configs.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)):
        regs, static, spill = report[(kernel, dtype, items)]
        threads, smem, occ = min(((t, s + static, occupancy(regs, t, s + static)) for t, s in launches),
                                 key=lambda r: r[2])
        rows.append((kernel, dtype, items, regs, threads, smem, occ, spill))
    return rows


@pytest.fixture(scope="module")
def configs():
    return launch_configs()


@pytest.fixture(scope="module")
def report():
    return ptxas_report()


@pytest.fixture(scope="module")
def rows(configs, report):
    return table(configs, report)


def test_occupancy_formula():
    """Known sm_90 figures: 32 registers x 128 threads fill the SM; 92 x 128 give 5 blocks
    (20 warps, 31%); 128 x 256 two blocks (25%); shared memory of 100 KiB two blocks."""
    assert occupancy(32, 128, 0) == 1.0
    assert occupancy(92, 128, 0) == 20 / 64
    assert occupancy(128, 256, 0) == 16 / 64
    assert occupancy(64, 1024, 0) == 0.5
    assert occupancy(32, 256, 100 * 1024) == 16 / 64


def test_every_row_kernel_has_a_target(rows):
    assert {r[0] for r in rows} <= set(TARGETS), {r[0] for r in rows} - set(TARGETS)


def test_no_spills(rows):
    spilled = [r for r in rows if r[7]]
    assert not spilled, spilled


def test_row_kernels_reach_their_occupancy(rows):
    short = [r for r in rows if r[1] in TUNED and r[6] < TARGETS[r[0]]]
    assert not short, "\n".join(_format(r) for r in short)


class _Function:
    """A CUDA function's dynamic shared memory limit as the driver keeps it: until the
    attribute is set, 48 KiB less the function's static shared memory."""

    def __init__(self, static):
        self.max_dynamic_shared_size_bytes = 48 * 1024 - static


def test_every_launch_gets_its_shared_memory(configs, report):
    """Each launch's static (ptxas) plus dynamic (schedule) shared memory fits the H100's
    opt-in limit, and the launcher has raised the function's limit to its dynamic share: the
    ring past 16 KiB of static sums (rows_bwd_multi in 16-bit types) was refused on an H100
    when the launcher opted in only past 48 KiB less the tiles' static share."""
    from anynorm._cuda import _launcher

    refused = []
    for (kernel, dtype, items), launches in configs.items():
        static = report[(kernel, dtype, items)][1]
        for threads, dynamic in launches:
            function = _Function(static)
            _launcher.opt_in(function, dynamic)
            if static + dynamic > H100.smem_optin or dynamic > function.max_dynamic_shared_size_bytes:
                refused.append((kernel, dtype, items, threads, static, dynamic))
    assert not refused, refused


def _format(r):
    kernel, dtype, items, regs, threads, smem, occ, spill = r
    return (f"{kernel:27s} {dtype:9s} {'' if items is None else items:>5} {regs:5d} {threads:5d} "
            f"{smem:7d} {occ:6.1%} {spill:4d}  (target {TARGETS.get(kernel, 0):.1%})")


if __name__ == "__main__":
    print(f"{'kernel':27s} {'dtype':9s} {'items':>5} {'regs':>5} {'thr':>5} {'smem':>7} {'occ':>6} spill")
    for r in table(launch_configs(), ptxas_report(tuple(sys.argv[1:]) or ("rows.cu", "finish.cu", "params.cu"))):
        print(_format(r))
