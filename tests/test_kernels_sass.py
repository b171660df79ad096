"""The row kernels' sm_90 machine code (SASS), without a GPU: nvcc compiles a file that
includes ``kernels/rows.cu`` and takes the address of every instantiation the executor may
launch (``-cubin -arch=sm_90 -ftz=true -std=c++17``, CuPy's RawModule options; NVRTC's own
cubins are not read by the CUDA 13 tools here), ``cuobjdump -sass`` lists it.

* No local memory (``LDL``/``STL``): a register-cached row that spilled would be read from
  memory again, and the one pass over x lost.
* 16-byte accesses where the launch path promises them (ITEMS a multiple of the vector
  length ``V = 16 / sizeof(T)``, count a multiple of V, aligned buffers: rows.cu's ``vec``):
  each thread's x (and dy) loads are ``LDG.E.128``, one per V items, and y (dx) stores
  ``STG.E.128``; the scalar fallback is there too, so these are counted, not required alone.
* the forward reads weight/bias of plain rows in 16-byte vectors too (``param_vec``; the
  backward still reads the weight element by element, and neither keeps them in registers
  across the rows a thread handles).

nvcc (CUDA 13.0 here) is not the NVRTC (13.5) that compiles at run time: a proxy of the
code a GPU runs, not that code.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from support import sass_loops

pytest.importorskip("cupy", exc_type=ImportError)  # anynorm._cuda imports CuPy (no GPU needed)
from anynorm._cuda import _compile  # noqa: E402

pytestmark = pytest.mark.slow


def _find(tool):
    """``tool`` on PATH, in CUDA_HOME/bin, /usr/local/cuda/bin, or the nvidia-cuda-* wheels."""
    candidates = [shutil.which(tool)]
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.append(str(Path(root) / "bin" / tool))
    try:
        import nvidia

        for base in nvidia.__path__:
            candidates += [str(p) for p in Path(base).glob(f"*/bin/{tool}")]
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


NVCC, CUOBJDUMP = _find("nvcc"), _find("cuobjdump")
if NVCC is None or CUOBJDUMP is None:
    pytest.skip("nvcc or cuobjdump not found", allow_module_level=True)

ROW_KERNELS = ("rows_fwd_warp", "rows_fwd_block", "rows_fwd_lean", "rows_fwd_multi", "rows_bwd_warp", "rows_bwd_block", "rows_bwd_multi",
               "rows_bwd_block_params", "rows_bwd_warp_row_params", "rows_bwd_block_row_params")
SMEM_ROWS = ("rows_fwd_smem", "rows_bwd_smem")  # rows held in shared memory (no ITEMS)
CLUSTER_ROWS = ("rows_fwd_cluster", "rows_bwd_cluster")  # rows held across a cluster's blocks (ITEMS: the cluster size)
VEC = {"float16": 8, "bfloat16": 8, "float32": 4, "float64": 2}


def sass(dtype, arch="90"):
    """{name expression: SASS text} of every row-kernel instantiation for ``dtype`` (and of
    the shared-memory row kernels)."""
    names = ([name for _, _, name in _instantiations(dtype)] + [_compile.name_expression(k, dtype) for k in SMEM_ROWS]
             + [_compile.name_expression(k, dtype, c) for k in CLUSTER_ROWS for c in _compile.items_of(k, dtype)])
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.cu"
        probe.write_text('#include "rows.cu"\nvoid* anynorm_sass_probe[] = {\n'
                         + ",\n".join(f"    (void*)&{name}" for name in names) + "};\n")
        cubin = Path(tmp) / "probe.cubin"
        subprocess.run([NVCC, "-cubin", f"-arch=sm_{arch}", "-std=c++17", "-ftz=true", "-DANYNORM_NVRTC=1",
                        f"-I{kernels}", str(probe), "-o", str(cubin)], check=True, capture_output=True)
        text = subprocess.run([CUOBJDUMP, "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout
    parts = re.split(r"\n\s*Function : (\S+)", text)
    by_name = {_name_of(symbol, dtype): body for symbol, body in zip(parts[1::2], parts[2::2])}
    return {name: by_name[name] for name in names}


def _name_of(symbol, dtype):
    """``rows_fwd_warp<__nv_bfloat16, 8>`` of ``_Z13rows_fwd_warpI13__nv_bfloat16Li8EEv...``."""
    m = re.match(r"_Z(\d+)", symbol)
    kernel = symbol[m.end():m.end() + int(m.group(1))]
    items = re.search(r"Li(\d+)E", symbol)
    return _compile.name_expression(kernel, dtype, int(items.group(1)) if items else None)


@pytest.fixture(scope="module", params=sorted(_compile.CTYPES))
def rows_sass(request):
    return request.param, sass(request.param)


def _instantiations(dtype):
    for kernel in ROW_KERNELS:
        for items in _compile.items_of(kernel, dtype):
            yield kernel, items, _compile.name_expression(kernel, dtype, items)


def test_no_local_memory(rows_sass):
    dtype, code = rows_sass
    local = {name: len(re.findall(r"\b(?:LDL|STL)\b", text)) for name, text in code.items()}
    assert not {n: c for n, c in local.items() if c}, local


def test_rows_move_in_16_byte_vectors(rows_sass):
    """x (forward), x and dy (backward): one LDG.E.128 (or cp.async's LDGSTS.E.BYPASS.128 into
    shared memory) per V items and operand; y/dx: one STG.E.128 per V items, wherever ITEMS
    holds whole vectors."""
    dtype, code = rows_sass
    short = []
    for kernel, items, name in _instantiations(dtype):
        if items % VEC[dtype]:
            continue
        vectors = items // VEC[dtype]
        loads = len(re.findall(r"\b(?:LDG\.E|LDGSTS\.E\.BYPASS)\.128\b", code[name]))
        stores = len(re.findall(r"\bSTG\.E\.128\b", code[name]))
        want_loads = vectors * (2 if kernel.startswith("rows_bwd") else 1)
        if loads < want_loads or stores < vectors:
            short.append((name, loads, want_loads, stores, vectors))
    assert not short, short


def test_forward_reads_weight_and_bias_in_16_byte_vectors(rows_sass):
    """Plain rows in vectors (forward_row's param_vec): x, w and b, at least one LDG.E.128 per
    V items each (w and b in the accumulation type take sizeof(A)/sizeof(T) each)."""
    dtype, code = rows_sass
    for kernel, items, name in _instantiations(dtype):
        if kernel.startswith("rows_fwd") and items % VEC[dtype] == 0:
            loads = len(re.findall(r"\bLDG\.E\.128\b", code[name]))
            assert loads >= 3 * items // VEC[dtype], (name, loads)


def test_backward_reads_the_weight_in_16_byte_vectors(rows_sass):
    """Plain rows in vectors (backward_row): dy, x and w, at least one 16-byte load per V
    items each (LDG.E.128; rows_bwd_multi copies x and dy into shared memory by cp.async,
    LDGSTS.E.BYPASS.128) (but rows_bwd_block_params at ITEMS=16, rows.cu's WeightVec: it
    spilled on sm_80)."""
    dtype, code = rows_sass
    for kernel, items, name in _instantiations(dtype):
        if kernel == "rows_bwd_block_params" and items == 16:
            continue
        if kernel.startswith("rows_bwd") and not kernel.endswith("row_params") and items % VEC[dtype] == 0:
            loads = len(re.findall(r"\b(?:LDG\.E|LDGSTS\.E\.BYPASS)\.128\b", code[name]))
            assert loads >= 3 * items // VEC[dtype], (name, loads)


def test_multi_row_forward_loads_weight_and_bias_once(rows_sass):
    """rows_fwd_multi keeps its weight and bias in registers for all its rows: one 16-byte
    vector of x (and of the residual) per row, the parameters' vectors once (in T: one each,
    in A: sizeof(A) / sizeof(T) each, both layouts compiled): at least 3 LDG.E.128 and no
    more than 2 + 2 * (1 + sizeof(A) / sizeof(T))."""
    dtype, code = rows_sass
    name = _compile.name_expression("rows_fwd_multi", dtype, _compile.MULTI_ITEMS[dtype])
    loads = len(re.findall(r"\bLDG\.E\.128\b", code[name]))
    per_a = VEC[dtype] * (8 if dtype == "float64" else 4) // 16  # A vectors per V weights
    assert 3 <= loads <= 2 + 2 * (1 + per_a), (name, loads)


def test_block_backward_copies_the_next_row_ahead(rows_sass):
    """The block backwards (sm_90) copy the next row's x and dy into shared memory by cp.async
    (LDGSTS.E.BYPASS.128), one per vector a thread and operand, before the row loop and in
    it: at least 4 * ITEMS / V, where rows.cu's BlockAhead and ParamsAhead let them
    (rows_bwd_block_params but float32 at ITEMS=16; rows_bwd_block and _row_params but at
    16-bit ITEMS=16); float64 has none."""
    dtype, code = rows_sass
    for kernel in ("rows_bwd_block", "rows_bwd_block_params", "rows_bwd_block_row_params"):
        for items in _compile.items_of(kernel, dtype):
            name = _compile.name_expression(kernel, dtype, items)
            copies = len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", code[name]))
            no_stage = (kernel != "rows_bwd_block_params") if VEC[dtype] == 8 else kernel == "rows_bwd_block_params"
            if dtype == "float64" or (items == 16 and no_stage):
                assert copies == 0, (name, copies)
            else:
                assert copies >= 4 * items // VEC[dtype], (name, copies)


def test_block_forward_copies_its_next_rows_ahead(rows_sass):
    """rows_fwd_block (sm_90) copies the rows ahead of the one it sums into a ring of slots
    in shared memory by cp.async (LDGSTS.E.BYPASS.128), one per vector a thread of x and of
    the residual, before the row loop and in it (4 * ITEMS / V at least), and reads them
    back as 16-byte vectors (LDS.128), where rows.cu's FwdStaged lets it (16-bit ITEMS=16,
    float32); 16-bit ITEMS=8 and float64 read as they go (no LDGSTS)."""
    dtype, code = rows_sass
    for items in _compile.items_of("rows_fwd_block", dtype):
        name = _compile.name_expression("rows_fwd_block", dtype, items)
        copies = len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", code[name]))
        reads = len(re.findall(r"\bLDS\.128\b", code[name]))
        if dtype == "float64" or (VEC[dtype] == 8 and items == 8):
            assert copies == 0, (name, copies)
        else:
            vectors = items // VEC[dtype]
            assert copies >= 4 * vectors and reads >= 2 * vectors, (name, copies, reads)


def _staged_row_loops(text):
    """The row loops of a staged forward: the loops (sass_loops) that copy rows ahead
    (LDGSTS.E.BYPASS.128) and sum across the block (BAR.SYNC)."""
    return [loop for loop in sass_loops(text)
            if any("LDGSTS.E.BYPASS.128" in i for i in loop) and any(i.startswith("BAR.SYNC") for i in loop)]


def test_lean_forward_holds_its_parameters(rows_sass):
    """rows_fwd_lean (16-bit ITEMS=16, float32 ITEMS=8) loads a thread's weight and bias
    vectors once, before its row loop (16-bit rows: two loops, the parameters in registers or
    in the stash): each loop issues no global 16-byte load (x and the residual come by
    cp.async, 2 per vector a thread at most: one row's), stores y (and h) as STG.E.128, and is
    under 75% of rows_fwd_block's staged loop in instructions (every branch counted: the
    per-row parameter loads, conversions and tests and the 64-bit row arithmetic it leaves
    out; the stash loop reads 16-byte words of shared memory instead); float64 is built but
    never staged."""
    dtype, code = rows_sass
    if dtype == "float64":
        return
    items = _compile.items_of("rows_fwd_lean", dtype)[0]
    loops = _staged_row_loops(code[_compile.name_expression("rows_fwd_lean", dtype, items)])
    (block,) = _staged_row_loops(code[_compile.name_expression("rows_fwd_block", dtype, items)])
    assert len(loops) == (2 if VEC[dtype] == 8 else 1), len(loops)
    vectors = items // VEC[dtype]
    for lean in loops:
        assert not [i for i in lean if re.search(r"\bLDG\.E\.128", i)], dtype
        assert 0 < sum("LDGSTS.E.BYPASS.128" in i for i in lean) <= 2 * vectors
        assert sum(bool(re.search(r"\bSTG\.E\.128\b", i)) for i in lean) >= vectors
        assert len(lean) < 0.75 * len(block), (dtype, len(lean), len(block))


def test_multi_row_backward_loads_the_weight_once(rows_sass):
    """rows_bwd_multi keeps its weight and its dweight/dbias sums in registers for all its
    rows: per row one 16-byte vector each of x and dy (copied a row ahead into shared memory
    by cp.async, LDGSTS.E.BYPASS.128: the first row's before the loop, the next in it; float64
    loads them as it goes) and one STG.E.128 of dx, the weight's vectors once (1 + sizeof(A)
    / sizeof(T) for both parameter types), no local memory."""
    dtype, code = rows_sass
    name = _compile.name_expression("rows_bwd_multi", dtype, _compile.MULTI_ITEMS[dtype])
    text = code[name]
    loads = len(re.findall(r"\bLDG\.E\.128\b", text))
    copies = len(re.findall(r"\bLDGSTS\.E\.BYPASS\.128\b", text))
    per_a = VEC[dtype] * (8 if dtype == "float64" else 4) // 16  # A vectors per V weights
    if dtype == "float64":
        assert 3 <= loads <= 2 + 1 + per_a and copies == 0, (name, loads, copies)
    else:  # float32: the weight in T and in A is one type, one load
        assert (1 if dtype == "float32" else 1 + per_a) <= loads <= 1 + per_a + 2 and copies == 4, (name, loads, copies)
    assert len(re.findall(r"\bSTG\.E\.128\b", text)) >= 1, name
    assert not re.search(r"\b(LDL|STL)\b", text), name


def _barrier_spans(text):
    """The instructions between each pair of consecutive BAR.SYNC, as (address, line) lists."""
    spans, span = [], None
    for line in text.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if not m:
            continue
        if "BAR.SYNC" in m.group(2):
            if span is not None:
                spans.append(span)
            span = []
        elif span is not None:
            span.append((int(m.group(1), 16), m.group(2)))
    return spans


def test_multi_row_team_sums_take_no_loop(rows_sass):
    """The multi-row kernels' team sums (teams of 64-256 threads meet in shared memory
    between two barriers) read the team's warp sums in one or two vector loads (LDS.64 /
    LDS.128) for each team size, with no loop: no branch back between the two barriers of a
    team sum (a span with no shuffle, global store or copy: between two sums, and around the
    row loop's own branch back, come the next sum's shuffles and the row's stores). The loop
    they had (a load, an add and a generic unrolled loop's setup and branches a team sum) was
    ~25 instructions of a backward row's ~490 a thread."""
    dtype, code = rows_sass
    for kernel in ("rows_fwd_multi", "rows_bwd_multi"):
        name = _compile.name_expression(kernel, dtype, _compile.MULTI_ITEMS[dtype])
        sums = _sum_spans(code[name])
        assert len(sums) >= (1 if kernel == "rows_fwd_multi" else 2), (name, len(sums))
        _assert_no_loop(name, sums)


def _sum_spans(text):
    """The barrier spans with no shuffle, global store or copy (see below)."""
    return [span for span in _barrier_spans(text)
            if not any(re.search(r"\b(SHFL|STG|LDGSTS)\b", t) for _, t in span)]


def _assert_no_loop(name, spans):
    for span in spans:
        for address, text in span:
            m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
            assert not (m and int(m.group(1), 16) < address), (name, hex(address), text)


def test_block_backward_sums_take_no_loop_over_the_warps(rows_sass):
    """The block backwards at ITEMS=16 (and float64), whose block sums are added by warp 0
    (common.cuh's block_allsums_by_warp0: a butterfly over the warps' sums, the totals read
    back by all), loop over nothing between a sum's two barriers: every thread's loop over the
    32 warps' sums of a block of 1024 (64 instructions a sum, 128 for dg and dg * xhat) was a
    quarter of a 16-element row's instructions."""
    dtype, code = rows_sass
    for kernel in ("rows_bwd_block", "rows_bwd_block_params", "rows_bwd_block_row_params"):
        for items in _compile.items_of(kernel, dtype):
            name = _compile.name_expression(kernel, dtype, items)
            _assert_no_loop(name, _sum_spans(code[name]))


def test_rows_held_in_shared_memory_move_in_16_byte_vectors(rows_sass):
    """rows_fwd_smem: x into shared memory by cp.async (LDGSTS.E.BYPASS.128; with a residual
    LDG.E.128 and STS.128, h = x + res), back out of it (LDS.128: the statistics passes and
    the y pass), y out (STG.E.128), w and b in vectors too."""
    dtype, code = rows_sass
    text = code[_compile.name_expression("rows_fwd_smem", dtype)]
    ops = ("LDG.E.128", "STG.E.128", "STS.128", "LDS.128", "LDGSTS.E.BYPASS.128")
    counts = {op: len(re.findall(rf"\b{re.escape(op)}\b", text)) for op in ops}
    # x, residual, weight, bias (a float32 weight of a 16-bit row: two vectors per V items)
    assert counts["LDG.E.128"] >= 4 and counts["STG.E.128"] >= 2, counts  # y and h
    assert counts["LDGSTS.E.BYPASS.128"] >= 1 and counts["STS.128"] >= 1 and counts["LDS.128"] >= 2, counts


def test_rows_held_across_a_cluster_move_in_16_byte_vectors(rows_sass):
    """rows_fwd_cluster / rows_bwd_cluster: as rows_fwd_smem / rows_bwd_smem (x, and dy, in
    16-byte vectors, through shared memory, y or dx out), and the cluster's barrier
    (UCGABAR_ARV/WAIT: barrier.cluster arrive and wait) around the sums read from the other
    blocks; no local memory."""
    dtype, code = rows_sass
    # (LDG.E.128, STG.E.128, STS.128, LDS.128, LDGSTS.E.BYPASS.128) at least: forward x (by
    # cp.async), res, w, b in and y, h out; backward x and dy by cp.async, w in, dx out
    least = {"rows_fwd_cluster": (4, 2, 1, 2, 1), "rows_bwd_cluster": (1, 1, 0, 2, 2)}
    ops = ("LDG.E.128", "STG.E.128", "STS.128", "LDS.128", "LDGSTS.E.BYPASS.128")
    for kernel in CLUSTER_ROWS:
        for c in _compile.items_of(kernel, dtype):
            text = code[_compile.name_expression(kernel, dtype, c)]
            counts = {op: len(re.findall(rf"\b{re.escape(op)}\b", text)) for op in ops + ("UCGABAR_ARV", "UCGABAR_WAIT")}
            assert all(counts[op] >= k for op, k in zip(ops, least[kernel])), (kernel, c, counts)
            assert counts["UCGABAR_ARV"] >= 2 and counts["UCGABAR_WAIT"] >= 2, (kernel, c, counts)
            assert not re.search(r"\b(LDL|STL)\b", text), (kernel, c)


def test_backward_rows_held_in_shared_memory_move_in_16_byte_vectors(rows_sass):
    """rows_bwd_smem: x and dy into shared memory by cp.async (LDGSTS.E.BYPASS.128) and back
    out of it (LDS.128: the statistics, segment and dx passes), w in (LDG.E.128), dx out
    (STG.E.128)."""
    dtype, code = rows_sass
    text = code[_compile.name_expression("rows_bwd_smem", dtype)]
    ops = ("LDG.E.128", "STG.E.128", "LDS.128", "LDGSTS.E.BYPASS.128")
    counts = {op: len(re.findall(rf"\b{re.escape(op)}\b", text)) for op in ops}
    assert counts["LDG.E.128"] >= 1 and counts["STG.E.128"] >= 1, counts  # w; dx
    assert counts["LDGSTS.E.BYPASS.128"] >= 2 and counts["LDS.128"] >= 4, counts


def _row_loops(text):
    """The loops whose body shuffles (row loops: their team sums), as lists of instructions."""
    return [body for body in sass_loops(text) if any("SHFL" in i for i in body)]


# The row kernels whose float16/bfloat16 statistics take common.cuh's RowStats approximations
# (rows_fwd_warp and the block and warp backwards keep the exact forms: with RowStats ptxas
# took 76 registers for rows_fwd_warp<16-bit, 16>, and the ITEMS=16 block backwards spilled on
# sm_80 under their 64-register bound).
APPROX_STATS = ("rows_fwd_block", "rows_fwd_multi", "rows_bwd_multi")


def test_16_bit_row_statistics_take_no_ieee_slow_path(rows_sass):
    """common.cuh's RowStats: the float16/bfloat16 row kernels of APPROX_STATS take mean = sum
    * (1 / n) (the reciprocal made once a launch) and rstd = rsqrtf (MUFU.RSQ) in their row
    loops, so no IEEE division or square root subroutine is called there (CALL.REL: each
    division by n and 1 / sqrt had one, ~30 instructions a row between them, in kernels bound
    by the instructions they issue), and every forward row loop takes its rstd by MUFU.RSQ.
    float32 and float64 keep the correctly rounded forms: their row loops call the
    subroutines."""
    dtype, code = rows_sass
    for kernel in APPROX_STATS:
        for items in _compile.items_of(kernel, dtype):
            name = _compile.name_expression(kernel, dtype, items)
            loops = _row_loops(code[name])
            assert loops, name
            calls = [sum("CALL.REL" in i for i in body) for body in loops]
            if VEC[dtype] == 8:
                assert not any(calls), (name, calls)
                if kernel.startswith("rows_fwd"):
                    assert all(any("MUFU.RSQ" in i for i in body) for body in loops), name
            else:
                assert any(calls), (name, calls)
