"""Compile ``kernels/*.cu`` with NVRTC through CuPy: one lazily built, cached
``cupy.RawModule`` per instantiation (kernel, dtype, ITEMS), named through
``name_expressions``, so a first call compiles only what it launches (a few seconds; CuPy
keeps the cubin in its disk cache). Thread-safe.

:func:`instantiations` lists every (file, dtype, name expression) the executor can request;
:func:`nvrtc_check` compiles one file and dtype without a GPU with the options CuPy's
RawModule uses, for the CPU compile test.
"""

from __future__ import annotations

import threading

from ._sources import SOURCE_FILES, read_source

__all__ = ["CTYPES", "KERNELS", "WARP_ITEMS", "BLOCK_ITEMS", "MULTI_ITEMS", "CLUSTER_SIZES", "items_of", "block_threads_max",
           "name_expression", "name_expressions", "instantiations", "get_kernel", "nvrtc_options", "nvrtc_check"]

# Kernel dtype key (the dtype's name) -> C++ element type.
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
# Register-cache sizes (elements per thread) of the warp-per-row kernels (rows of up to
# 32 * ITEMS elements) and of the block-per-row kernels (blocks of a power of two of threads,
# up to BLOCK_THREADS_MAX: rows of up to 1024 * 16). ITEMS stop where ptxas would need more
# registers than the occupancy floors allow (tests/test_kernels_occupancy.py): warp rows past
# 512 elements go to the block kernels.
WARP_ITEMS = (1, 2, 4, 8, 16)
BLOCK_ITEMS = (8, 16)
# rows_fwd_multi/rows_bwd_multi (several short rows per block, teams sized to the row): one 16-byte vector
# per thread, ITEMS = 16 / sizeof(T) (float64 spills past 2 under its 64-register bound).
MULTI_ITEMS = {"float16": 8, "bfloat16": 8, "float32": 4, "float64": 2}
# Thread-block clusters (sm_90) of the kernels that hold a row (rows.cu) or a sample (samples.cu)
# across several blocks' shared memory: the cluster size is their ITEMS (the portable sizes: 8
# blocks take 8 SMs of one GPC).
CLUSTER_SIZES = (2, 4, 8)
KERNELS = {
    "rows.cu": ("rows_fwd_warp", "rows_bwd_warp", "rows_fwd_block", "rows_fwd_lean", "rows_bwd_block", "rows_fwd_multi",
                "rows_bwd_multi", "rows_fwd_smem", "rows_fwd_cluster", "rows_bwd_cluster", "rows_bwd_smem",
                "rows_bwd_block_params", "rows_bwd_warp_row_params",
                "rows_bwd_block_row_params", "rows_stats_partial", "rows_grad_partial"),
    "cols.cu": ("cols_stats_partial", "cols_grad_partial", "cols_apply_fwd", "cols_grad_finalize",
                "cols_param_grad_rows"),
    "tiles.cu": ("cols_fwd_tile", "cols_bwd_tile", "cols_bwd_tile_vec"),
    "finish.cu": ("stats_finalize", "segment_grad_finalize", "apply_bwd",
                  "rows_stats_finalize", "rows_apply_fwd", "rows_grad_finalize"),
    "params.cu": ("param_grad_cols", "param_grad_rows", "param_grad_finish"),
    "samples.cu": ("cols_fwd_cluster", "cols_bwd_cluster"),
}
_ITEMS = {"rows_fwd_warp": WARP_ITEMS, "rows_bwd_warp": WARP_ITEMS,
          "rows_fwd_block": BLOCK_ITEMS, "rows_fwd_lean": BLOCK_ITEMS, "rows_bwd_block": BLOCK_ITEMS, "rows_fwd_multi": tuple(sorted(set(MULTI_ITEMS.values()))),
          "rows_bwd_multi": tuple(sorted(set(MULTI_ITEMS.values()))),
          "rows_fwd_cluster": CLUSTER_SIZES, "rows_bwd_cluster": CLUSTER_SIZES,
          "cols_fwd_cluster": CLUSTER_SIZES, "cols_bwd_cluster": CLUSTER_SIZES,
          "rows_bwd_block_params": BLOCK_ITEMS,
          "rows_bwd_warp_row_params": WARP_ITEMS, "rows_bwd_block_row_params": BLOCK_ITEMS}
# The float32 block backwards at ITEMS=16 would spill under their 64-register bound, but for
# rows_bwd_block_params (its sums in shared memory, no stage: rows.cu's ParamsAhead): float32
# rows of 8193-16384 elements take it where dweight is wanted, else rows_bwd_smem.
_ITEMS_MAX = {(k, "float32"): 8 for k in ("rows_bwd_block", "rows_bwd_block_row_params")}
# Kernels built for one ITEMS per dtype.
_ITEMS_ONLY = {(kernel, dtype): (items,) for dtype, items in MULTI_ITEMS.items()
               for kernel in ("rows_fwd_multi", "rows_bwd_multi")}
# rows_fwd_lean: where rows_fwd_block stages at two 16-byte vectors a thread (rows.cu's FwdLean;
# its float64 instantiation, which the schedule never picks, only reads rows as they go)
_ITEMS_ONLY.update({("rows_fwd_lean", "float16"): (16,), ("rows_fwd_lean", "bfloat16"): (16,),
                    ("rows_fwd_lean", "float32"): (8,), ("rows_fwd_lean", "float64"): (8,)})
# Threads of a block-per-row kernel (rows.cu's launch bounds: ROW_BLOCK_MAX, BwdBlockMax).
BLOCK_THREADS_MAX = 1024
_BLOCK_THREADS_MAX = {(k, "float64"): 256 for k in ("rows_bwd_block", "rows_bwd_block_params",
                                                     "rows_bwd_block_row_params")}
_FILE_OF = {kernel: file for file, kernels in KERNELS.items() for kernel in kernels}
# Our own NVRTC options; CuPy adds its include paths, -std=c++17, -ftz=true and -arch.
OPTIONS = ("-DANYNORM_NVRTC=1",)

assert set(KERNELS) == set(SOURCE_FILES)


def items_of(kernel: str, dtype: str | None = None) -> tuple:
    """The ITEMS values a kernel is instantiated for (for ``dtype``, or its largest list when
    None; empty: no ITEMS parameter)."""
    items = _ITEMS_ONLY.get((kernel, dtype), _ITEMS.get(kernel, ()))
    limit = _ITEMS_MAX.get((kernel, dtype))
    return items if limit is None else tuple(k for k in items if k <= limit)


def block_threads_max(kernel: str, dtype: str) -> int:
    """The largest block a block-per-row kernel is compiled for (its launch bound)."""
    return _BLOCK_THREADS_MAX.get((kernel, dtype), BLOCK_THREADS_MAX)


def name_expression(kernel: str, dtype: str, items: int | None = None) -> str:
    """``"rows_fwd_warp<float, 4>"``: the C++ name of one instantiation."""
    ctype = CTYPES[dtype]
    if kernel in _ITEMS:
        assert items in items_of(kernel, dtype), (kernel, dtype, items)
        return f"{kernel}<{ctype}, {items}>"
    return f"{kernel}<{ctype}>"


def name_expressions(file: str, dtype: str) -> tuple:
    """Every instantiation that one (file, dtype) module holds."""
    out = []
    for kernel in KERNELS[file]:
        if kernel in _ITEMS:
            out += [name_expression(kernel, dtype, items) for items in items_of(kernel, dtype)]
        else:
            out.append(name_expression(kernel, dtype))
    return tuple(out)


def instantiations():
    """All (file, dtype, name expression) triples the executor may launch."""
    return [(file, dtype, expr) for file in KERNELS for dtype in CTYPES
            for expr in name_expressions(file, dtype)]


_lock = threading.Lock()
_kernels: dict = {}


def get_kernel(kernel: str, dtype: str, items: int | None = None):
    """The compiled ``cupy.RawKernel`` for one instantiation on the current device."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), kernel, dtype, items)
    function = _kernels.get(key)
    if function is None:
        expr = name_expression(kernel, dtype, items)
        with _lock:
            function = _kernels.get(key)
            if function is None:
                module = cupy.RawModule(code=read_source(_FILE_OF[kernel]), options=OPTIONS,
                                        name_expressions=[expr])
                function = module.get_function(expr)
                _kernels[key] = function
    return function


def nvrtc_options(arch: str) -> tuple:
    """The NVRTC option list CuPy's RawModule builds for ``OPTIONS`` on ``sm_<arch>``.

    Mirrors ``cupy.cuda.compiler``: ``assemble_cupy_compiler_options`` (include paths,
    ``--std=c++17``), then ``-ftz=true``, ``-arch=sm_XX`` and
    ``--device-as-default-execution-space``.
    """
    from cupy._core.core import assemble_cupy_compiler_options

    return tuple(assemble_cupy_compiler_options(OPTIONS)) + (
        "-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space")


def nvrtc_check(file: str, dtype: str, arch: str = "90", extra_options: tuple = (),
                kernels: tuple | None = None) -> str:
    """Compile ``file``'s instantiations for ``dtype`` (all, or those of ``kernels``) to a
    cubin for ``sm_<arch>`` without a GPU; return NVRTC's log.

    Raises ``cupy.cuda.compiler.CompileException`` on errors.
    """
    import io

    from cupy.cuda import compiler

    names = [expr for expr in name_expressions(file, dtype)
             if kernels is None or expr.split("<", 1)[0] in kernels]
    log = io.StringIO()
    program = compiler._NVRTCProgram(read_source(file), f"anynorm_{file}", name_expressions=names,
                                     method="cubin")
    program.compile(nvrtc_options(arch) + tuple(extra_options), log)
    return log.getvalue()
