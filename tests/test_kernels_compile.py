"""Every kernel instantiation compiles with NVRTC, with the options CuPy's RawModule uses.

Needs no GPU: NVRTC is a host library. It needs CuPy, NVRTC and the CUDA headers
(cuda_fp16.h, cuda_bf16.h); from pip: ``cupy-cuda13x nvidia-cuda-nvrtc nvidia-cuda-runtime``
(the last one ships the headers into ``site-packages/nvidia/cu13/include``, where CuPy
looks). Skips only when CuPy or NVRTC cannot be loaded at all. The compilations run in
parallel worker processes (NVRTC holds the GIL), one job per (kernel, dtype, arch).
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

cupy = pytest.importorskip("cupy", exc_type=ImportError)
try:
    from anynorm._cuda import _compile
except ImportError as exc:  # CuPy present but unusable
    pytest.skip(f"anynorm._cuda cannot be imported: {exc}", allow_module_level=True)
try:
    NVRTC_VERSION = cupy.cuda.nvrtc.getVersion()
except Exception as exc:  # libnvrtc missing
    pytest.skip(f"NVRTC cannot be loaded: {exc}", allow_module_level=True)

# sm_80 (A100) and sm_90 (H100); ANYNORM_NVRTC_ARCHES="90" narrows it for a quick run.
ARCHES = tuple(a.strip() for a in os.environ.get("ANYNORM_NVRTC_ARCHES", "80,90").split(",") if a.strip())
LAUNCH_SOURCE = pathlib.Path(_compile.__file__).with_name("_schedule.py").read_text()
JOBS = [(file, kernel, dtype, arch) for file, kernels in _compile.KERNELS.items()
        for kernel in kernels for dtype in sorted(_compile.CTYPES) for arch in ARCHES]


def _compile_job(job):
    """(ok, NVRTC log or error) for one (file, kernel, dtype, arch); runs in a worker."""
    from cupy.cuda.compiler import CompileException

    from anynorm._cuda import _compile as compile_module

    file, kernel, dtype, arch = job
    try:
        return True, compile_module.nvrtc_check(file, dtype, arch, extra_options=("--ptxas-options=-v",),
                                                kernels=(kernel,))
    except CompileException as exc:
        return False, str(exc)


@pytest.fixture(scope="module")
def results():
    workers = max(1, min(len(JOBS), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(JOBS, pool.map(_compile_job, JOBS)))


@pytest.mark.parametrize("job", JOBS, ids=[f"{k}-{d}-sm{a}" for _, k, d, a in JOBS])
def test_compiles_without_warnings(results, job):
    ok, text = results[job]
    file, kernel, dtype, arch = job
    if not ok:
        hint = ""
        if "cannot open source file" in text:
            hint = ("\nNVRTC found no CUDA headers: install nvidia-cuda-runtime (pip) or a CUDA "
                    "toolkit where CuPy looks for it")
        pytest.fail(f"{kernel} ({file}) for {dtype} on sm_{arch} does not compile:\n{text}{hint}")
    warnings = [line for line in text.splitlines() if "warning" in line.lower()]
    assert not warnings, f"{kernel} ({file}) for {dtype} on sm_{arch}:\n{text}"


_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


@pytest.mark.parametrize("job", JOBS, ids=[f"{k}-{d}-sm{a}" for _, k, d, a in JOBS])
def test_keeps_everything_in_registers(results, job):
    """ptxas's resource report: no instantiation spills registers or needs a stack frame (a
    register-cached row that spills is read from local memory: the single pass is lost)."""
    ok, text = results[job]
    if not ok:
        pytest.skip("does not compile (test_compiles_without_warnings reports it)")
    entries = _ENTRY.findall(text)
    frames = [tuple(map(int, m)) for m in _FRAME.findall(text)]
    registers = [int(r) for r in _REGISTERS.findall(text)]
    assert entries and len(entries) == len(frames) == len(registers), text
    for name, frame, regs in zip(entries, frames, registers):
        assert frame == (0, 0, 0), f"{name} on sm_{job[3]}: {regs} registers, stack/spill bytes {frame}"


def test_instantiation_list_is_complete():
    """Every kernel the launcher names, at every ITEMS it may pick, is in the compiled list."""
    listed = {expr for _, _, expr in _compile.instantiations()}
    launched = set(re.findall(r'_step\(\s*"(\w+)"', LAUNCH_SOURCE))
    # _step("a" if cond else "b", ...): both
    launched |= set(re.findall(r'_step\(\s*"\w+"\s+if\s+\w+\s+else\s+"(\w+)"', LAUNCH_SOURCE))
    rows = {f"{prefix}_{kind}" for prefix in re.findall(r'_row_kernel\(\s*"(\w+)"', LAUNCH_SOURCE)
            for kind in ("warp", "block")}
    # the backward row kernels' variants that also sum dweight/dbias
    assert 'f"{kernel}_params"' in LAUNCH_SOURCE and 'f"{kernel}_row_params"' in LAUNCH_SOURCE
    launched |= rows | {f"{k}{suffix}" for k in rows if k.startswith("rows_bwd_")
                        for suffix in ("_params", "_row_params")} - {"rows_bwd_warp_params"}  # rows_bwd_multi's
    launched |= set(re.findall(r'return "(rows_(?:fwd|bwd)_multi)"', LAUNCH_SOURCE))  # _multi_rows
    launched |= set(re.findall(r'kernel = "(rows_fwd_lean)"', LAUNCH_SOURCE))  # _stats: rows_fwd_block's lean rows
    assert launched == {k for kernels in _compile.KERNELS.values() for k in kernels}
    for kernel in launched:
        for dtype in _compile.CTYPES:
            items = _compile.items_of(kernel, dtype) or (None,)
            exprs = [_compile.name_expression(kernel, dtype, k) for k in items]
            assert set(exprs) <= listed
    # float32's rows_bwd_block and rows_bwd_block_row_params stop at ITEMS=8 where ITEMS=16
    # would spill under their 64-register launch bound (2 fewer than 4 dtypes x the longest
    # lists); rows_fwd_multi and rows_bwd_multi have one ITEMS per dtype (their lists hold 3: 8
    # fewer each), rows_fwd_lean too (its list holds 2: 4 fewer)
    count = sum(len(_compile.items_of(k, d)) or 1 for ks in _compile.KERNELS.values() for k in ks
                for d in _compile.CTYPES)
    per_dtype = sum(len(_compile.items_of(k)) or 1 for ks in _compile.KERNELS.values() for k in ks)
    assert len(listed) == count == 4 * per_dtype - 2 - 2 * 8 - 4 == 234


def test_every_kernel_is_defined_in_its_file():
    from anynorm._cuda._sources import read_source

    for file, kernels in _compile.KERNELS.items():
        text = read_source(file)
        for kernel in kernels:
            assert re.search(rf"__global__\s+void\s+(ANYNORM_CLUSTER\(\w+\)\s+)?(__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+(//[^\n]*\s+)?)?{kernel}\s*\(",
                             text), (file, kernel)
