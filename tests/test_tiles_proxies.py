"""Blind performance proxies for the columns kernels (``kernels/tiles.cu``, ``kernels/cols.cu``):
what ptxas and the disassembler say, without a GPU (issue 15).

* Registers, static shared memory and spills of every instantiation on sm_90 (NVRTC with
  CuPy's options, ``--ptxas-options=-v``), and from them, at the launcher's launch
  configuration (block size, dynamic shared memory of the first tile budget on an H100),
  the theoretical occupancy under sm_90's limits: 65536 registers per SM allocated per warp
  in units of 256, 64 warps and 32 blocks per SM, 228 KiB of shared memory per SM with 1 KiB
  reserved per block. ``OCCUPANCY`` is the table keyed by kernel name: forward kernels at
  least 50%, backward kernels at least 37.5%, in float16, bfloat16 and float32 (float64 is
  correct, not tuned); nothing spills.
* The SASS of the sm_90 cubins (``cuobjdump -sass``; from the ``nvidia-cuda-cuobjdump``
  wheel or a CUDA toolkit, else skipped): the tile kernels load their tiles and store y / dx
  with 128-bit instructions (``LDG.E.128``, ``STG.E.128``) and touch no local memory
  (``LDL``/``STL``).

Whether these figures reach the bandwidth targets is for the GPU benchmarks to show.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from support import sass_loops

cupy = pytest.importorskip("cupy", exc_type=ImportError)
try:
    from anynorm._cuda import _compile, _schedule
    from anynorm._cuda._sources import read_source
except ImportError as exc:  # CuPy present but unusable
    pytest.skip(f"anynorm._cuda cannot be imported: {exc}", allow_module_level=True)
try:
    cupy.cuda.nvrtc.getVersion()
except Exception as exc:  # libnvrtc missing
    pytest.skip(f"NVRTC cannot be loaded: {exc}", allow_module_level=True)

FILES = ("tiles.cu", "cols.cu", "samples.cu")
DTYPES = ("float16", "bfloat16", "float32", "float64")
TUNED = ("float16", "bfloat16", "float32")
# Least theoretical occupancy (%) on sm_90 at the launcher's configuration, per kernel.
OCCUPANCY = {"cols_fwd_tile": 50.0, "cols_stats_partial": 50.0, "cols_apply_fwd": 50.0,
             "cols_bwd_tile": 37.5, "cols_bwd_tile_vec": 37.5, "cols_grad_partial": 37.5, "cols_grad_finalize": 37.5,
             "cols_param_grad_rows": 37.5, "cols_fwd_cluster": 50.0, "cols_bwd_cluster": 50.0}
# Threads per block, as _schedule.py launches them.
THREADS = {"cols_fwd_tile": _schedule._TILE_THREADS, "cols_bwd_tile": _schedule._TILE_THREADS,
           "cols_bwd_tile_vec": _schedule._TILE_THREADS,
           "cols_stats_partial": 32 * 8, "cols_grad_partial": 32 * 8, "cols_apply_fwd": 32 * 8,
           "cols_grad_finalize": _schedule._BLOCK, "cols_param_grad_rows": 32 * 8,
           "cols_fwd_cluster": _schedule._SAMPLE_THREADS, "cols_bwd_cluster": _schedule._SAMPLE_THREADS}


class SM90:
    """sm_90 (H100) per-SM limits for the occupancy calculation."""

    regs = 65536
    reg_unit = 256  # registers are allocated per warp in units of 256
    warps = 64
    blocks = 32
    smem = 228 * 1024
    smem_reserved = 1024  # per block
    optin = 227 * 1024


def occupancy(regs, threads, smem_per_block, sm=SM90):
    """(blocks per SM, theoretical occupancy %) of a kernel of ``regs`` registers per thread,
    ``threads`` per block and ``smem_per_block`` bytes of static + dynamic shared memory."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(regs * 32 / sm.reg_unit) * sm.reg_unit
    by_regs = (sm.regs // 4 // per_warp) * 4 // warps  # four schedulers, each its own file
    by_smem = sm.smem // (smem_per_block + sm.smem_reserved)
    blocks = min(by_regs, by_smem, sm.warps // warps, sm.blocks)
    return blocks, 100.0 * blocks * warps / sm.warps


def test_occupancy_calculator():
    """The calculator on the H100 figures ncu reported (kernel_profile.md, ncu_digest.md)."""
    assert occupancy(78, 256, 4128 + 36864) == (3, 37.5)  # cols_fwd_tile bf16 before issue 15
    assert occupancy(40, 256, 64 * 8 + 128) == (6, 75.0)  # rows_fwd_block bf16
    assert occupancy(92, 128, 0) == (5, 31.25)  # rows_fwd_warp bf16
    assert occupancy(167, 128, 0) == (3, 18.75)  # the first H100 run's rows_bwd_warp_params (ncu)
    assert occupancy(128, 256, 1024) == (2, 25.0)  # rows_bwd_block_params
    assert occupancy(32, 256, 0) == (8, 100.0)


_ENTRY = re.compile(r"Compiling entry function '_Z\d+(\w+?)I")
_REPORT = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\s*\n"
                     r"[^\n]*Used (\d+) registers(?:[^\n]*?(\d+) bytes smem)?")  # no smem: not said


def _ptxas(job):
    """{kernel: (registers, static smem, stack, spill stores, spill loads)} for one (file, dtype)."""
    file, dtype = job
    log = _compile.nvrtc_check(file, dtype, "90", extra_options=("--ptxas-options=-v",))
    names, reports = _ENTRY.findall(log), _REPORT.findall(log)
    assert names and len(names) == len(reports), log
    return {name: (int(r[3]), int(r[4] or 0), int(r[0]), int(r[1]), int(r[2])) for name, r in zip(names, reports)}


@pytest.fixture(scope="module")
def reports():
    return {(file, dtype): _ptxas((file, dtype)) for file in FILES for dtype in DTYPES}


def _dynamic_smem(kernel, dtype):
    """The largest dynamic shared memory the launcher gives ``kernel`` in its first tier on
    an H100 (tiles: the budget that keeps 4 blocks per SM; a cluster a sample: ConvNeXt's
    7x7 stage, 768 channels over clusters of 8; split kernels: none)."""
    if kernel in ("cols_fwd_cluster", "cols_bwd_cluster"):
        return _schedule.sample_smem(768, 49, dtype, 8, 1 if kernel == "cols_fwd_cluster" else 2, False)
    if kernel not in ("cols_fwd_tile", "cols_bwd_tile", "cols_bwd_tile_vec"):
        return 0
    saved = _schedule._smem_limit
    _schedule._smem_limit = lambda: SM90.optin
    try:
        return _schedule._tile_budgets(dtype)[0]
    finally:
        _schedule._smem_limit = saved


def occupancy_table(reports):
    """{(kernel, dtype): (registers, static smem, dynamic smem, blocks per SM, occupancy %)}."""
    table = {}
    for (file, dtype), kernels in sorted(reports.items()):
        for kernel, (regs, smem, *_rest) in kernels.items():
            dynamic = _dynamic_smem(kernel, dtype)
            table[kernel, dtype] = (regs, smem, dynamic) + occupancy(regs, THREADS[kernel], smem + dynamic)
    return table


@pytest.mark.parametrize("file", FILES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nothing_spills(reports, file, dtype):
    for kernel, (regs, _smem, stack, stores, loads) in reports[file, dtype].items():
        assert (stack, stores, loads) == (0, 0, 0), f"{kernel}<{dtype}>: {regs} registers, stack {stack}, " \
                                                    f"spills {stores}/{loads} bytes"


@pytest.mark.parametrize("dtype", TUNED)
@pytest.mark.parametrize("kernel", sorted(OCCUPANCY))
def test_theoretical_occupancy(reports, kernel, dtype):
    table = occupancy_table(reports)
    regs, smem, dynamic, blocks, occ = table[kernel, dtype]
    report = "\n".join(f"{k}<{d}>: {r} registers, {s}+{dyn} B smem: {b} blocks, {o:.1f}%"
                       for (k, d), (r, s, dyn, b, o) in sorted(table.items()))
    assert occ >= OCCUPANCY[kernel], f"{kernel}<{dtype}> below {OCCUPANCY[kernel]}%:\n{report}"


def test_tile_budget_keeps_four_blocks():
    """The first tile budget on an H100 leaves room for 4 blocks (static smem included)."""
    for dtype in TUNED:
        dynamic = _dynamic_smem("cols_fwd_tile", dtype)
        static = _schedule._tile_static_smem(dtype)
        assert 4 * (dynamic + static + SM90.smem_reserved) <= SM90.smem
        assert dynamic >= 48 * 1024


# ---- SASS ------------------------------------------------------------------------------------

def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for sub in ("nvidia/cu13/bin/cuobjdump", "nvidia/cuda_cuobjdump/bin/cuobjdump"):
            path = Path(root) / sub
            if path.exists():
                return str(path)
    return None


def _cubin(file, dtype):
    """The sm_90 cubin of one (file, dtype) module, as NVRTC builds it with CuPy's options."""
    from cupy.cuda import compiler

    names = list(_compile.name_expressions(file, dtype))
    program = compiler._NVRTCProgram(read_source(file), f"anynorm_{file}", name_expressions=names,
                                     method="cubin")
    program.compile(_compile.nvrtc_options("90"), io.StringIO())
    # nvrtcGetCUBIN through ctypes: the size comes from nvrtcGetCUBINSize
    lib = next((line.split()[-1] for line in open("/proc/self/maps")
                if re.search(r"/libnvrtc\.so[.\d]*$", line.strip())), None)
    if lib is None:
        pytest.skip("libnvrtc not found among the loaded libraries")
    nvrtc = ctypes.CDLL(lib)
    size = ctypes.c_size_t()
    assert nvrtc.nvrtcGetCUBINSize(ctypes.c_void_p(program.ptr), ctypes.byref(size)) == 0
    buf = ctypes.create_string_buffer(size.value)
    assert nvrtc.nvrtcGetCUBIN(ctypes.c_void_p(program.ptr), buf) == 0
    return buf.raw


def sass_by_kernel(file, dtype, tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    path = tmp_path / f"{file}.{dtype}.cubin"
    path.write_bytes(_cubin(file, dtype))
    text = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    out, name = {}, None
    for line in text.splitlines():
        match = re.search(r"Function : _Z\d+(\w+?)I", line)
        if match:
            name = match.group(1)
            out[name] = []
        elif name:
            out[name].append(line)
    assert out, text[:2000]
    return {k: "\n".join(v) for k, v in out.items()}


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_load_and_store_128_bits_and_no_local_memory(tmp_path, dtype):
    sass = sass_by_kernel("tiles.cu", dtype, tmp_path)
    for kernel in ("cols_fwd_tile", "cols_bwd_tile", "cols_bwd_tile_vec"):
        code = sass[kernel]
        # the tiles' vectors go from global to shared memory by cp.async, 16 bytes at a time
        assert re.search(r"\bLDGSTS\.E\.BYPASS\.128\b", code), f"{kernel}<{dtype}>: no 128-bit copies into the tile"
        if kernel == "cols_fwd_tile":  # h = x + res: the residual's vectors, h into the tile
            assert re.search(r"\bLDG\.E\.128\b", code), f"{kernel}<{dtype}>: no 128-bit global loads"
            assert re.search(r"\bSTS\.128\b", code), f"{kernel}<{dtype}>: tiles not stored 16 bytes at a time"
        # y / dx staged in the tile go out in vectors too
        assert re.search(r"\bSTG\.E\.128\b", code), f"{kernel}<{dtype}>: no 128-bit global stores"
        assert not re.search(r"\b(LDL|STL)\b", code), f"{kernel}<{dtype}>: local memory"


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_clusters_move_in_128_bits_and_no_local_memory(tmp_path, dtype):
    """samples.cu on sm_90: a block's part of a sample comes in by 16-byte cp.async
    (LDGSTS.E.BYPASS.128), y / dx go out in 16-byte stores (STG.E.128), the blocks meet at
    the cluster's barrier (UCGABAR_ARV/WAIT) around the columns' sums, no local memory."""
    sass = sass_by_kernel("samples.cu", dtype, tmp_path)
    for kernel in ("cols_fwd_cluster", "cols_bwd_cluster"):
        code = sass[kernel]
        assert re.search(r"\bLDGSTS\.E\.BYPASS\.128\b", code), f"{kernel}<{dtype}>: no 128-bit copies in"
        assert re.search(r"\bSTG\.E\.128\b", code), f"{kernel}<{dtype}>: no 128-bit global stores"
        assert re.search(r"\bUCGABAR_(ARV|WAIT)\b", code), f"{kernel}<{dtype}>: no cluster barrier"
        assert not re.search(r"\b(LDL|STL)\b", code), f"{kernel}<{dtype}>: local memory"


def vector_row_loops(code, loads=(1,)):
    """Sizes of the loops that walk a tile's rows in shared-memory vectors: ``loads`` (a count
    in) 64- or 128-bit shared loads and no other, float adds, no global memory."""
    sizes = []
    for body in sass_loops(code):
        shared = [b for b in body if re.search(r"\bLDS", b)]
        if (len(shared) in loads and all(re.search(r"\bLDS\.(64|128)\b", s) for s in shared)
                and not any(re.search(r"\b(LDG|STG|LDGSTS)", b) for b in body)
                and sum(bool(re.search(r"\bFADD", b)) for b in body) >= 2):
            sizes.append(len(body))
    return sorted(sizes)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
def test_forward_tile_arithmetic_in_vectors(tmp_path, dtype):
    """cols_fwd_tile's passes over a tile (the shifted sum, the centred sums, y with a weight
    per column) each walk the rows in 4-column shared-memory vectors at <= 8 instructions an
    element: the scalar form took 9, 11 and 13-42 (a load, a conversion and a dependent add per
    element), which bounded the kernel at about a third of copy bandwidth (issue 15)."""
    sizes = vector_row_loops(sass_by_kernel("tiles.cu", dtype, tmp_path)["cols_fwd_tile"])
    cpt = _schedule._TILE_CPT[2 if dtype != "float32" else 4]
    assert len(sizes) >= 3 and max(sizes[:3]) <= 8 * cpt, sizes


@pytest.mark.parametrize("dtype", ("float16", "bfloat16", "float32"))
def test_backward_tile_arithmetic_in_vectors(tmp_path, dtype):
    """cols_bwd_tile_vec's passes over an item's tiles (the mean's rounding: x alone; the sums
    and dx: dy and x) walk the rows in 4-column vectors at <= 14 instructions an element (the
    scalar cols_bwd_tile: 10, 17-22 and 28-33 in bfloat16), and the scalar kernel has none."""
    code = sass_by_kernel("tiles.cu", dtype, tmp_path)
    single, double = vector_row_loops(code["cols_bwd_tile_vec"]), vector_row_loops(code["cols_bwd_tile_vec"], (2,))
    assert single and max(single) <= 14 * 4, single  # the mean's rounding c
    assert len(double) >= 4 and max(double) <= 14 * 4, double  # sums and dx, per parameter storage
    assert not vector_row_loops(code["cols_bwd_tile"], (1, 2))


def test_bfloat16_tiles_widen_as_cheaply_as_float16(tmp_path):
    """tiles.cu's tile_acc widens a bfloat16 element in one bit operation on its 32-bit word (a
    shift or a mask), as float16's takes one conversion: the vector passes of the forward and
    of the backward's sums and dx are no longer in bfloat16 than in float16. __bfloat162float
    of a word's high half took two (a byte permute, then the shift): 2 more instructions a
    4-column vector and operand, 20, 27 and 28 a forward vector where float16 took 18, 25, 26."""
    loops = {}
    for dtype in ("float16", "bfloat16"):
        code = sass_by_kernel("tiles.cu", dtype, tmp_path)
        loops[dtype] = (vector_row_loops(code["cols_fwd_tile"]) + vector_row_loops(code["cols_bwd_tile_vec"])
                        + vector_row_loops(code["cols_bwd_tile_vec"], (2,)))
    assert len(loops["bfloat16"]) == len(loops["float16"]) >= 8, loops
    assert all(b <= h for b, h in zip(loops["bfloat16"], loops["float16"])), loops


if os.environ.get("ANYNORM_PRINT_PROXIES"):  # a table for notes: ANYNORM_PRINT_PROXIES=1 pytest -s -k table
    def test_print_table(reports):
        for (kernel, dtype), (regs, smem, dynamic, blocks, occ) in sorted(occupancy_table(reports).items()):
            print(f"| {kernel} | {dtype} | {regs} | {smem} + {dynamic} | {blocks} | {occ:.1f}% |")
