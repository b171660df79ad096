"""Launch the kernels of one forward or backward call on CuPy's current stream.

Inputs and outputs are CuPy arrays (or torch tensors as ``_interop.TensorRef``), outputs
preallocated by the caller: ``y``/``h``/``dx``
with ``x``'s shape and dtype (any strides), statistics contiguous in the public statistics
shape and the accumulation dtype, ``dweight``/``dbias`` contiguous ``(p_len,)`` in the
accumulation dtype or x's (``grad_in_t``). ``weight``/``bias`` arrive contiguous, in the
accumulation dtype or x's (``param_in_t``). ``dtype`` is the kernel dtype key ("float16",
"bfloat16", "float32", "float64").
Which kernels run for which layout: kernels/README.md.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import cupy
import numpy as np

from . import _buffers
from ._args import NULL, f64, i32, i64
from ._compile import MULTI_ITEMS, block_threads_max, get_kernel, items_of
from ._interop import TensorRef
from ._layout import plan_layout

__all__ = ["forward", "backward", "acc_dtype", "param_in_t", "kernel_params", "DeviceInfo", "device_info", "opt_in"]

_ROWS_BLOCK, _BLOCK = 128, 256  # warp-per-row block, others (block-per-row: sized to the row)
_MAX_Y = 65535  # gridDim.y / gridDim.z limit
_VECTOR = {"float16": 8, "bfloat16": 8, "float32": 4, "float64": 2}  # elements per 16 bytes
_MAX_X = 2**31 - 1
_BLOCKS_PER_SM = 4  # what a launch aims for (_target_blocks)
_TILE_THREADS = 256  # tiles.cu's block
# Dynamic shared memory per tile block, tried in turn: first the share of an SM that keeps
# _TILE_BLOCKS_PER_SM blocks on it (the forward's register allocation allows 4: 50% occupancy;
# 52 KiB on an H100, 36 KiB on an A100), then the device's whole opt-in limit (227 KiB on
# H100, 163 KiB on A100; 1-2 blocks per SM), which still reads x once where the split path
# reads it twice; that one is taken when it gives at least a block per SM (with fewer, the
# split path, which also cuts the reduced axis, spreads the work wider).
_TILE_BLOCKS_PER_SM = 4
_SMEM_RESERVED = 1024  # per block, taken by the driver on sm_80 and sm_90


class _SMShare:
    """A tile budget: the share of an SM's shared memory that keeps ``blocks`` blocks on it."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __repr__(self):
        return f"_SMShare({self.blocks})"


# The budgets in turn: an _SMShare, a byte count, or None (the opt-in limit).
_TILE_SMEM_CAPS = (_SMShare(_TILE_BLOCKS_PER_SM), None)
_DEFAULT_SMEM = 48 * 1024  # static + dynamic shared memory a block gets without opting in
_SECTOR = 32  # bytes: a tile row narrower than one DRAM sector wastes bandwidth
_FINISH_BLOCK = (32, 16)  # param_grad_finish: 32 parameters x 16 lanes over the chunks
# Rows per team, where the row backward also sums dweight/dbias: each block writes one partial
# row of 2 x count sums, which must stay small next to the dy and x it saves reading again
# (16 rows per team, bfloat16: 1/8 of them). Few rows still get a block per SM.
_PARAM_ROWS_PER_TEAM = 16


def acc_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def param_in_t(x_dtype, acc, *params) -> int:
    """The kernels' ``param_in_t`` flags: bit k set when the k-th of ``params`` (weight, bias;
    None allowed) holds x's own dtype where that is not the accumulation dtype ``acc``, which
    the kernels then read as it is; the others are passed in ``acc``."""
    flags = 0
    for k, p in enumerate(params):
        if p is not None and p.dtype == x_dtype and p.dtype != acc:
            flags |= 1 << k
    return flags


def kernel_params(x_dtype, acc, as_dtype, weight, bias=None):
    """``(weight, bias, param_in_t)`` as the kernels read them: each in x's dtype where it
    holds that (see :func:`param_in_t`), else in ``acc``; ``as_dtype(array, dtype)`` makes
    an array contiguous in a dtype (a no-op where it already is)."""
    flags = param_in_t(x_dtype, acc, weight, bias)
    return (as_dtype(weight, x_dtype if flags & 1 else acc), as_dtype(bias, x_dtype if flags & 2 else acc),
            flags)


def _ptr(arr):
    return NULL if arr is None else arr


@dataclass(frozen=True)
class DeviceInfo:
    """What the schedules depend on of a GPU: its SM count and the shared memory one block
    may opt in to (an H100: ``DeviceInfo(132, 227 * 1024)``)."""

    sm_count: int
    smem_optin: int


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return int(cupy.cuda.Device(device_id).attributes["MultiProcessorCount"])


def _described_device():
    """The DeviceInfo a schedule is being recorded for (``_bound.schedule_for``), else None."""
    recorder = getattr(_recording, "recorder", None)
    return None if recorder is None else recorder.device


def _target_blocks() -> int:
    """Enough blocks to fill the device a few times over."""
    device = _described_device()
    if device is not None:
        return _BLOCKS_PER_SM * device.sm_count
    return _BLOCKS_PER_SM * _sm_count(cupy.cuda.runtime.getDevice())


def device_info() -> DeviceInfo:
    """The current CUDA device's DeviceInfo."""
    device = cupy.cuda.runtime.getDevice()
    return DeviceInfo(_sm_count(device), _smem_optin(device))


def _ceil(a, b):
    return -(-a // b)


def _grid_1d(n, per_block, cap=None):
    blocks = max(1, _ceil(n, per_block))
    return min(blocks, cap or 64 * _target_blocks(), _MAX_X)


def _row_kernel(prefix, rows, count, dtype, warp=None):
    """(kernel, grid, block, ITEMS) of the register-resident row kernels for ``count``, or
    None when the row is longer than they hold in ``dtype``: the warp kernel (``warp``, else
    ``{prefix}_warp``, whose ITEMS decide how long a row it takes) with the smallest ITEMS
    that holds the row, else the block kernel with the smallest ITEMS and a power of two of
    threads holding it (powers of two keep the SM's warps whole: 64 registers x any of them
    is 32 warps, 50%)."""
    for items in items_of(warp or f"{prefix}_warp", dtype):
        if 32 * items >= count:
            return f"{prefix}_warp", (_grid_1d(rows, _ROWS_BLOCK // 32),), (_ROWS_BLOCK,), items
    kernel = f"{prefix}_block"
    for items in items_of(kernel, dtype):
        threads = 1 << max(5, (_ceil(count, items) - 1).bit_length())
        if threads <= block_threads_max(kernel, dtype):
            return kernel, (_grid_1d(rows, 1),), (threads,), items
    return None


_MULTI_BLOCK = 256  # rows_fwd_multi's block (rows.cu: MULTI_BLOCK)


def _multi_rows(layout, dtype, has_params):
    """(kernel, grid, block, ITEMS) of rows_fwd_multi, or None: rows whose team (ITEMS = one
    16-byte vector per thread, a power of two of threads) fits its block, plain (p = position
    in the row) where there are parameters. A persistent grid: at most ``_target_blocks()``
    blocks (4 per SM: 32 warps at the kernel's 64 registers), each taking groups of
    ``256 / team`` rows in turn, its weight and bias loaded once."""
    count = layout.reduced
    if not layout.rows or (has_params and (layout.p_div != 1 or layout.p_len != count)):
        return None
    items = MULTI_ITEMS[dtype]
    team = 1 << (_ceil(count, items) - 1).bit_length()
    if team > _MULTI_BLOCK:
        return None
    groups = _ceil(layout.outer, _MULTI_BLOCK // team)
    return "rows_fwd_multi", (min(groups, _target_blocks()),), (_MULTI_BLOCK,), items


def _split(length, parallel, target, min_chunk, align=1):
    """(chunk, nchunk): cut ``length`` into at most 65535 chunks so that ``parallel`` blocks
    per chunk make about ``target`` blocks, chunks of at least ``min_chunk`` elements."""
    want = max(1, min(_ceil(target, max(parallel, 1)), _ceil(length, min_chunk), _MAX_Y))
    chunk = _ceil(_ceil(length, want), align) * align
    return chunk, _ceil(length, chunk)


_smem_allowed: dict = {}
# While a schedule is recorded (``_bound``), the recorder of this thread: launches and
# workspaces are noted instead of run and allocated.
_recording = threading.local()


def _workspace(shape, dtype):
    """Scratch memory for partial sums: a CuPy array, or a slot of the recorded call's scratch."""
    recorder = getattr(_recording, "recorder", None)
    if recorder is not None:
        return recorder.workspace(shape, dtype)
    return cupy.empty(shape, dtype=dtype)


def _launch(kernel, dtype, grid, block, args, items=None, smem=0):
    recorder = getattr(_recording, "recorder", None)
    if recorder is not None:  # a schedule: which kernel, not yet which compiled function
        recorder.launch(kernel, dtype, items, grid, block, args, smem)
        return
    function = get_kernel(kernel, dtype, items)
    opt_in(function, smem)
    function(grid, block, tuple([a.kernel_arg if type(a) is TensorRef else a for a in args]),
             shared_mem=smem)


def opt_in(function, smem) -> None:
    """Let ``function`` take ``smem`` bytes of dynamic shared memory where that is near or
    past the default limit (cuFuncSetAttribute)."""
    if smem > _DEFAULT_SMEM - _MAX_STATIC_SMEM:
        # near or past the default limit: opt the kernel in (cuFuncSetAttribute), once per
        # function and size; the entry holds the function, so its id cannot be reused
        allowed = _smem_allowed.get(id(function))
        if allowed is None or allowed[0] is not function or allowed[1] < smem:
            function.max_dynamic_shared_size_bytes = smem
            _smem_allowed[id(function)] = (function, smem)


# ---- shared-memory tiles of the columns family (tiles.cu) ---------------------------------

@functools.lru_cache(maxsize=None)
def _smem_optin(device_id: int) -> int:
    runtime = cupy.cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id))


def _smem_limit() -> int:
    """Shared memory (static + dynamic) one block may opt in to on the current device."""
    device = _described_device()
    if device is not None:
        return device.smem_optin
    return _smem_optin(cupy.cuda.runtime.getDevice())


def _tile_static_smem(dtype) -> int:
    """tiles.cu's static shared memory: two (2, 256) arrays of A and the IndexMap."""
    return 4 * _TILE_THREADS * np.dtype(acc_dtype(dtype)).itemsize + 128


_MAX_STATIC_SMEM = _tile_static_smem("float64")
_ROW_STATIC_SMEM = 64 * 8 + 128  # rows_bwd_block_params: its block sum and IndexMap


def _tile_budgets(dtype) -> tuple:
    """Dynamic shared memory one tile block may take on the current device, per tier of
    ``_TILE_SMEM_CAPS``. An SM holds the opt-in limit plus one block's reservation (228 KiB
    on H100, 164 KiB on A100), so ``_SMShare(4)`` is 52 KiB on an H100."""
    static = _tile_static_smem(dtype)
    limit = _smem_limit() - static
    budgets = []
    for cap in _TILE_SMEM_CAPS:
        if isinstance(cap, _SMShare):
            cap = (_smem_limit() + _SMEM_RESERVED) // cap.blocks - _SMEM_RESERVED - static
        budgets.append(limit if cap is None else max(0, min(cap, limit)))
    return tuple(budgets)


def tile_params_fit(layout) -> bool:
    """Whether tiles.cu finds the parameter index ``p = (e / p_div) % p_len`` of its
    elements: from the column alone (``p_div * p_len`` divides inner: NHWC instance and
    group norm, or no parameters) or as the row (``p = r``: channels-first layer norm)."""
    return (layout.inner % (layout.p_div * layout.p_len) == 0
            or (layout.p_div == layout.inner and layout.p_len == layout.reduced))


def tile_width(outer, reduced, inner, group, itemsize, copies, budget, target):
    """Inner positions per block of tiles.cu (a multiple of ``group``), or None: the tile
    (``copies`` arrays of ``reduced x width`` elements) must fit ``budget`` bytes with rows
    of at least one sector (or all of ``inner``). Of the widths that fit, the widest that
    still makes ``target`` blocks, else the narrowest (small grids wait on load latency).
    Narrower than those come widths in whole 16-byte vectors (multiples of
    ``lcm(group, 16 / itemsize)``, at least 16 bytes) that are not whole sectors, for small
    spatial extents with many channels (ConvNeXt's 64x768x7x7 makes 256 tiles of 16
    bfloat16 columns, 448 of 8): the neighbouring tile, which reads the rest of a sector,
    runs at the same time (adjacent blockIdx.x) and finds it in L2."""
    fit = min(budget // (copies * reduced * itemsize), _TILE_THREADS)
    sector = max(1, _SECTOR // itemsize)
    step = math.lcm(group, sector)
    step = step if step <= fit else group
    widths = [w for w in range(fit - fit % step, 0, -step) if w < inner and w * itemsize >= _SECTOR]
    if inner <= fit:
        widths.insert(0, inner)
    vector = math.lcm(group, max(1, 16 // itemsize))
    below = min(widths[-1] if widths else fit + 1, fit + 1, inner)
    widths += [w for w in range((below - 1) // vector * vector, 0, -vector) if w * itemsize >= 16]
    for width in widths:
        if outer * _ceil(inner, width) >= target:
            return width
    return widths[-1] if widths else None


def _tile(layout, dtype, copies):
    """(width, grid, dynamic smem bytes) of the tile kernels, or None when no tile fits:
    the first budget of ``_tile_budgets`` that holds one wins, a later one only with at
    least a block per SM."""
    if layout.rows or not tile_params_fit(layout):
        return None
    itemsize = 16 // _VECTOR[dtype]
    target = _target_blocks()
    for tier, budget in enumerate(_tile_budgets(dtype)):
        width = tile_width(layout.outer, layout.reduced, layout.inner, layout.group, itemsize, copies,
                           budget, target)
        if width is not None:
            break
    else:
        return None
    tiles = _ceil(layout.inner, width)
    if tier and layout.outer * tiles < target // _BLOCKS_PER_SM:
        return None
    grid = (tiles, min(layout.outer, _MAX_Y))
    return width, grid, copies * layout.reduced * width * itemsize


# ---- statistics --------------------------------------------------------------------------

def _stats(plan, layout, dtype, src, res, h, y, w, b, mean, rstd, param_in_t=0):
    """Fill ``mean``/``rstd`` (and ``h``, ``y`` unless None) from the buffer ``src``;
    ``rstd`` None (with ``mean``): no statistics are written, only ``y``. ``param_in_t``:
    bit 0 when ``w``, bit 1 when ``b`` hold x's dtype rather than the accumulation dtype."""
    acc = acc_dtype(dtype)
    center, eps, pin = i32(plan.center), f64(plan.eps), i32(param_in_t)
    outer, reduced, inner, group = layout.outer, layout.reduced, layout.inner, layout.group
    multi = _multi_rows(layout, dtype, w is not None or b is not None)
    if multi is not None:
        kernel, grid, block, items = multi
        _launch(kernel, dtype, grid, block,
                (src, _ptr(res), _ptr(h), _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer),
                 i64(reduced), center, eps, pin), items=items)
        return
    row = _row_kernel("rows_fwd", outer, reduced, dtype) if layout.rows else None
    if row is not None:
        kernel, grid, block, items = row
        _launch(kernel, dtype, grid, block,
                (src, _ptr(res), _ptr(h), _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer),
                 i64(reduced), i64(layout.p_div), i64(layout.p_len), center, eps, pin), items=items)
        return
    tile = _tile(layout, dtype, 1)
    if tile is not None:
        width, grid, smem = tile
        _launch("cols_fwd_tile", dtype, grid, (_TILE_THREADS,),
                (src, _ptr(res), _ptr(h), _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer),
                 i64(reduced), i64(inner), i64(group), i64(width), i64(layout.p_div),
                 i64(layout.p_len), center, eps, pin), smem=smem)
        return
    if rstd is None:  # no statistics wanted, but the split paths' apply reads them
        rstd = _workspace(layout.slices, acc)
        mean = _workspace(layout.slices, acc) if plan.center else None
    if layout.rows:
        _split_row_stats(plan, layout, dtype, src, res, h, y, w, b, mean, rstd, param_in_t)
    else:
        _split_columns(plan, layout, dtype, src, res, h, y, w, b, mean, rstd, pin)


def _split_row_stats(plan, layout, dtype, src, res, h, y, w, b, mean, rstd, param_in_t):
    """Long rows: rows_stats_partial (chunks of a row, statistics of ``d = v - v[0]``) ->
    rows_stats_finalize (the true mean, and its rounding ``mean_lo``) -> rows_apply_fwd
    (``((v - mean) - mean_lo) * rstd``: no half ulp of the rows' offset in y)."""
    acc = acc_dtype(dtype)
    center, eps, pin = i32(plan.center), f64(plan.eps), i32(param_in_t)
    outer, reduced = layout.outer, layout.reduced
    chunk, nchunk = _split(reduced, min(outer, _MAX_Y), _target_blocks(), 4096, align=256)
    ws = _workspace((3, outer * nchunk), dtype=acc)
    _launch("rows_stats_partial", dtype, (nchunk, min(outer, _MAX_Y)), (_BLOCK,),
            (src, _ptr(res), _ptr(h), ws[0], ws[1], ws[2], i64(outer), i64(reduced), i64(chunk)))
    lo = _workspace(outer, dtype=acc) if plan.center and y is not None else None
    _launch("rows_stats_finalize", dtype, (_grid_1d(outer, _BLOCK, _MAX_Y),), (_BLOCK,),
            (h if res is not None else src, ws[0], ws[1], ws[2], _ptr(mean), rstd, _ptr(lo), i64(outer),
             i64(reduced), i64(nchunk), center, eps))
    if y is not None:
        _launch("rows_apply_fwd", dtype, (_grid_1d(_ceil(layout.total, _VECTOR[dtype]), _BLOCK),), (_BLOCK,),
                (h if res is not None else src, y, _ptr(w), _ptr(b), _ptr(mean), _ptr(lo), rstd,
                 i64(layout.total), i64(reduced), i64(layout.p_div), i64(layout.p_len), center, pin))


def _split_columns(plan, layout, dtype, src, res, h, y, w, b, mean, rstd, pin):
    """The columns' split forward: cols_stats_partial (Welford states of v - shift per
    (o, chunk, i), shift = the slice's first element) -> stats_finalize (the mean of
    v - shift, into scratch, and rstd) -> cols_apply_fwd (y from v - shift, and the mean)."""
    acc = acc_dtype(dtype)
    center, eps = i32(plan.center), f64(plan.eps)
    outer, reduced, inner, group = layout.outer, layout.reduced, layout.inner, layout.group
    tiles, zdim = _ceil(inner, 32), min(outer, _MAX_Y)
    chunk, nchunk = _split(reduced, tiles * zdim, _target_blocks(), 64)
    ws = _workspace((3, outer * nchunk * inner), dtype=acc)
    grid = (tiles, nchunk, zdim)
    _launch("cols_stats_partial", dtype, grid, (32, 8),
            (src, _ptr(res), _ptr(h), ws[0], ws[1], ws[2], i64(outer), i64(reduced), i64(inner),
             i64(chunk), i64(group), center))
    slices = layout.slices
    shifted = _workspace((1, slices), dtype=acc)[0] if plan.center else None
    _launch("stats_finalize", dtype, (_grid_1d(slices, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], ws[2], _ptr(shifted), rstd, i64(outer), i64(nchunk), i64(inner),
             i64(group), center, eps))
    if y is None and mean is None:
        return
    _launch("cols_apply_fwd", dtype, grid, (32, 8),
            (h if res is not None else src, _ptr(y), _ptr(w), _ptr(b), _ptr(shifted), rstd, _ptr(mean),
             i64(outer), i64(reduced), i64(inner), i64(group), i64(chunk), i64(layout.p_div),
             i64(layout.p_len), center, pin))


def forward(plan, dtype, x, weight, bias, residual, y, h, mean, rstd, param_in_t=0):
    """y = (v - mean) * rstd * weight + bias with v = x (+ residual -> h); fills outputs.
    ``param_in_t``: as in :func:`_stats`."""
    layout = plan_layout(plan, _buffers.element_strides(x))
    xb = _buffers.input_buffer(plan, layout, x)
    rb = None if residual is None else _buffers.input_buffer(plan, layout, residual)
    hb = None if h is None else _buffers.output_buffer(plan, layout, h)
    yb = _buffers.output_buffer(plan, layout, y)
    _stats(plan, layout, dtype, xb, rb, hb, yb, weight, bias, mean, rstd, param_in_t)
    _buffers.store(plan, layout, yb, y)
    if h is not None:
        _buffers.store(plan, layout, hb, h)


# ---- gradients -------------------------------------------------------------------------

def _tile_param_mode(layout):
    """tiles.cu's ``param_rows`` when its backward can sum dweight/dbias in the same pass:
    0 when the parameter index is the column (p = i), 1 when it is the row (p = r), else None."""
    if layout.p_div == 1 and layout.p_len == layout.inner:
        return 0
    if layout.p_div == layout.inner and layout.p_len == layout.reduced:
        return 1
    return None


def _row_params(layout, dtype, kernel, grid, block, items):
    """``(kernel, grid, dynamic smem bytes, nchunk, extra args)`` of the row backward that also
    sums dweight/dbias into ``nchunk`` partial rows of ``p_len``, or None where none applies:
    per position and block for plain rows (p = position in the row; sums in registers for
    warp teams, in shared memory for a block, which must fit the device), per row where p is
    the row's own (p = row % p_len: NCHW instance norm)."""
    if layout.p_div == layout.reduced:  # part[row] = part[(row // p_len) * p_len + p]
        fused = f"{kernel}_row_params"
        if items not in items_of(fused, dtype):
            return None
        return fused, grid, 0, layout.a_len, (i64(layout.p_len),)
    fused = f"{kernel}_params"
    if layout.p_div != 1 or layout.p_len != layout.reduced or items not in items_of(fused, dtype):
        return None
    warps = kernel.endswith("_warp")
    smem = 0 if warps else 2 * layout.reduced * np.dtype(acc_dtype(dtype)).itemsize
    if smem > _smem_limit() - _ROW_STATIC_SMEM:
        return None
    teams = block[0] // 32 if warps else 1
    target = _target_blocks()
    wanted = max(target // _BLOCKS_PER_SM, _ceil(layout.outer, teams * _PARAM_ROWS_PER_TEAM))
    blocks = min(grid[0], target, wanted)
    return fused, (blocks,), smem, blocks, ()


def _dx(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_grads=None, param_in_t=0):
    """dx into ``dxb``. ``param_grads`` (bool: with dbias) asks the row and tile kernels to add
    up the parameter gradients' partial sums too: returns (part, nchunk) when they did, else None.
    ``param_in_t``: 1 when ``w`` holds x's dtype rather than the accumulation dtype."""
    center, pin = i32(plan.center), i32(param_in_t)
    acc = acc_dtype(dtype)
    outer, reduced, inner, group = layout.outer, layout.reduced, layout.inner, layout.group
    pdiv, plen = i64(layout.p_div), i64(layout.p_len)
    # plain rows whose warp kernel keeps dweight/dbias sums in registers: shorter ones only
    plain_sums = param_grads is not None and layout.p_div == 1 and layout.p_len == reduced
    row = (_row_kernel("rows_bwd", outer, reduced, dtype, "rows_bwd_warp_params" if plain_sums else None)
           if layout.rows else None)
    if row is not None:
        kernel, grid, block, items = row
        fused = None if param_grads is None else _row_params(layout, dtype, kernel, grid, block, items)
        if fused is not None:
            kernel, grid, smem, nchunk, extra = fused
            part = _workspace((2, nchunk * layout.p_len), dtype=acc)
            _launch(kernel, dtype, grid, block,
                    (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, part[0], _ptr(part[1] if param_grads else None),
                     i64(outer), i64(reduced)) + extra + (center, pin), items=items, smem=smem)
            return part, nchunk
        _launch(kernel, dtype, grid, block,
                (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, i64(outer), i64(reduced), pdiv, plen,
                 center, pin), items=items)
        return None
    tile = _tile(layout, dtype, 2)
    if tile is not None:
        width, grid, smem = tile
        mode = None if param_grads is None else _tile_param_mode(layout)
        part, part_w, part_b, nchunk = None, None, None, 0
        if mode is not None:  # partial sums per o (p = i) or per (o, tile) (p = r)
            nchunk = outer if mode == 0 else outer * grid[0]
            part = _workspace((2, nchunk * layout.p_len), dtype=acc)
            part_w, part_b = part[0], (part[1] if param_grads else None)
        _launch("cols_bwd_tile", dtype, grid, (_TILE_THREADS,),
                (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, _ptr(part_w), _ptr(part_b), i64(outer),
                 i64(reduced), i64(inner), i64(group), i64(width), pdiv, plen, i32(mode or 0),
                 center, pin), smem=smem)
        return None if part is None else (part, nchunk)
    if not layout.rows:
        return _split_columns_dx(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_grads, param_in_t)
    if param_grads is not None and _segmented(layout):
        return _dx_by_segments(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_grads,
                               param_in_t)
    return _split_row_dx(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_in_t)


def _split_columns_dx(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_grads, param_in_t):
    """The columns' split backward: cols_grad_partial (per (o, chunk, i): sum(g),
    sum(g * (x - mean) * rstd) and, centred, sum(x - mean)) -> cols_grad_finalize (the saved
    mean's rounding c = mean(x - mean) taken out of the slices' means of g and g * xhat) ->
    apply_bwd (5 transfers of x's size). Where the parameter is the column (p = i: NHWC
    instance/group norm) and dweight is wanted, the partial sums leave the weight out, so that
    cols_grad_finalize applies it per column and also hands the columns' sums on as
    dweight/dbias partials per (o, i) (5 transfers with them instead of 7 with
    param_grad_cols): returns (part, outer) then. Where it is the row (p = r: channels-first
    layer norm), cols_param_grad_rows sums dweight/dbias per (o, 32 columns, r) with the
    mean's rounding that cols_grad_finalize found (param_grad_rows would form xhat from the
    rounded mean): returns (part, outer * ceil(inner / 32)). Else None."""
    by_column = param_grads is not None and _tile_param_mode(layout) == 0
    by_row = param_grads is not None and _tile_param_mode(layout) == 1 and layout.group == 1
    acc = acc_dtype(dtype)
    center, pin = i32(plan.center), i32(param_in_t)
    outer, reduced, inner, group = layout.outer, layout.reduced, layout.inner, layout.group
    tiles, zdim = _ceil(inner, 32), min(outer, _MAX_Y)
    chunk, nchunk = _split(reduced, tiles * zdim, _target_blocks(), 64)
    ws = _workspace((3 if plan.center else 2, outer * nchunk * inner), dtype=acc)
    ws_x = ws[2] if plan.center else None
    _launch("cols_grad_partial", dtype, (tiles, nchunk, zdim), (32, 8),
            (dyb, xb, NULL if by_column else _ptr(w), _ptr(mean), rstd, ws[0], ws[1], _ptr(ws_x), i64(outer),
             i64(reduced), i64(inner), i64(group), i64(chunk), i64(layout.p_div), i64(layout.p_len), center,
             pin))
    slices = layout.slices
    means = _workspace((2, slices), dtype=acc)
    part = _workspace((2, outer * inner), dtype=acc) if by_column else None
    lo = _workspace((1, slices), dtype=acc)[0] if by_row and plan.center else None
    _launch("cols_grad_finalize", dtype, (_grid_1d(slices, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], _ptr(ws_x), _ptr(w) if by_column else NULL, _ptr(mean), rstd, means[0], means[1],
             _ptr(lo), part[0] if by_column else NULL, part[1] if by_column and param_grads else NULL,
             i64(outer), i64(nchunk), i64(inner), i64(group), f64(plan.count), center, pin))
    _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t)
    if by_row:
        part = _workspace((2, outer * tiles * reduced), dtype=acc)
        _launch("cols_param_grad_rows", dtype, (tiles, nchunk, zdim), (32, 8),
                (dyb, xb, _ptr(mean), _ptr(lo), rstd, part[0], part[1] if param_grads else NULL, i64(outer),
                 i64(reduced), i64(inner), i64(chunk)))
        return part, outer * tiles
    return (part, outer) if by_column else None


def _split_row_dx(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_in_t=0):
    """Long rows' dx: rows_grad_partial (per (row, chunk): sum(g), sum(g * xhat) and, centred,
    sum(x - mean)) -> rows_grad_finalize (the means of g and g * xhat about the exact mean:
    the saved mean's rounding, mean(x - mean), taken out) -> apply_bwd."""
    acc = acc_dtype(dtype)
    outer, reduced = layout.outer, layout.reduced
    chunk, nchunk = _split(reduced, min(outer, _MAX_Y), _target_blocks(), 4096, align=256)
    ws = _workspace((3 if plan.center else 2, outer * nchunk), dtype=acc)
    _launch("rows_grad_partial", dtype, (nchunk, min(outer, _MAX_Y)), (_BLOCK,),
            (dyb, xb, _ptr(w), _ptr(mean), rstd, ws[0], ws[1], ws[2] if plan.center else NULL, i64(outer),
             i64(reduced), i64(chunk), i64(layout.p_div), i64(layout.p_len), i64(1), i32(plan.center),
             i32(param_in_t)))
    means = _workspace((2, outer), dtype=acc)
    _launch("rows_grad_finalize", dtype, (_grid_1d(outer, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], ws[2] if plan.center else NULL, rstd, means[0], means[1], i64(outer),
             i64(nchunk), f64(plan.count)))
    _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t)
    return None


def _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t=0):
    """dx elementwise from the per-slice means of g = dy * w and g * xhat (``means[0]``, ``[1]``)."""
    _launch("apply_bwd", dtype, (_grid_1d(_ceil(layout.total, _VECTOR[dtype]), _BLOCK),), (_BLOCK,),
            (dyb, xb, _ptr(w), _ptr(mean), rstd, means[0], means[1], dxb, i64(layout.total),
             i64(layout.reduced), i64(layout.inner), i64(layout.group), i64(layout.p_div),
             i64(layout.p_len), i32(plan.center), i32(param_in_t)))


def _segmented(layout) -> bool:
    """Rows made of whole segments of ``p_div`` elements with one parameter each (NCHW group
    norm: C/G channels of HW; NCHW instance norm: one channel), segments long enough to give
    a block of rows_grad_partial a full pass of its threads."""
    return layout.p_div >= _BLOCK and layout.reduced % layout.p_div == 0


def _dx_by_segments(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, with_bias, param_in_t=0):
    """Split rows of parameter segments, with dweight/dbias: rows_grad_partial sums dy and
    dy*xhat per (segment, chunk), unweighted; segment_grad_finalize makes of them both the
    slices' means of g and g*xhat (the weight applied per segment) and per-segment
    dweight/dbias partials; apply_bwd writes dx. dy and x are read twice in all (5 transfers
    of x's size; the split path followed by param_grad_rows: 7). Returns (part, batch)."""
    acc = acc_dtype(dtype)
    seg, per_row = layout.p_div, layout.reduced // layout.p_div
    segs = layout.outer * per_row
    chunk, nchunk = _split(seg, min(segs, _MAX_Y), _target_blocks(), 4096, align=256)
    ws = _workspace((2, segs * nchunk), dtype=acc)
    _launch("rows_grad_partial", dtype, (nchunk, min(segs, _MAX_Y)), (_BLOCK,),
            (dyb, xb, NULL, _ptr(mean), rstd, ws[0], ws[1], NULL, i64(segs), i64(seg), i64(chunk),
             i64(1), i64(1), i64(per_row), i32(plan.center), i32(0)))
    slices = layout.slices
    means = _workspace((2, slices), dtype=acc)
    part = _workspace((2, segs), dtype=acc)
    _launch("segment_grad_finalize", dtype, (_grid_1d(slices, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], _ptr(w), means[0], means[1], part[0], _ptr(part[1] if with_bias else None),
             i64(slices), i64(per_row), i64(nchunk), i64(layout.p_len), f64(plan.count),
             i32(param_in_t)))
    _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t)
    return part, layout.a_len


def _finish_param_grads(part, nchunk, p_len, dtype, dweight, dbias, grad_in_t=0):
    """dweight/dbias from per-chunk partial sums ``part[k][c * p_len + p]``; ``grad_in_t``:
    bit 0 / bit 1 when dweight / dbias hold x's dtype (else the accumulation dtype)."""
    _launch("param_grad_finish", dtype, (_grid_1d(p_len, _FINISH_BLOCK[0], _MAX_Y),), _FINISH_BLOCK,
            (part[0], _ptr(part[1] if dbias is not None else None), dweight, _ptr(dbias),
             i64(p_len), i64(nchunk), i32(grad_in_t)))


def _param_grads(plan, layout, dtype, dyb, xb, mean, rstd, dweight, dbias, grad_in_t=0):
    acc = acc_dtype(dtype)
    center = i32(plan.center)
    a_len, p_len, b_len = layout.a_len, layout.p_len, layout.b_len
    target = _target_blocks()
    geometry = (i64(layout.reduced), i64(layout.inner), i64(layout.group))
    if b_len == 1:
        tiles = _ceil(p_len, 32)
        chunk, nchunk = _split(a_len, tiles, target, 32)
        part = _workspace((2, nchunk * p_len), dtype=acc)
        _launch("param_grad_cols", dtype, (tiles, nchunk), (32, 8),
                (dyb, xb, _ptr(mean), rstd, part[0], _ptr(part[1] if dbias is not None else None),
                 i64(a_len), i64(p_len)) + geometry + (i64(chunk), center))
    else:
        chunk, nchunk = _split(a_len, p_len, target, 1)
        part = _workspace((2, nchunk * p_len), dtype=acc)
        _launch("param_grad_rows", dtype, (p_len, nchunk), (_BLOCK,),
                (dyb, xb, _ptr(mean), rstd, part[0], _ptr(part[1] if dbias is not None else None),
                 i64(a_len), i64(p_len), i64(b_len)) + geometry + (i64(chunk), center))
    _finish_param_grads(part, nchunk, p_len, dtype, dweight, dbias, grad_in_t)


def backward(plan, dtype, dy, x, weight, mean, rstd, dx, dweight, dbias, param_in_t=0,
             grad_in_t=0):
    """dx (and dweight/dbias unless None); ``mean``/``rstd`` None to recompute them;
    ``param_in_t`` 1 when ``weight`` holds x's dtype; ``grad_in_t`` bit 0 / bit 1 when
    ``dweight`` / ``dbias`` do (else they hold the accumulation dtype)."""
    need_params = plan.has_weight or dweight is not None
    layout = plan_layout(plan, _buffers.element_strides(x), need_params)
    xb = _buffers.input_buffer(plan, layout, x)
    dyb = _buffers.input_buffer(plan, layout, dy)
    if rstd is None:
        acc = acc_dtype(dtype)
        mean = _workspace(layout.slices, dtype=acc) if plan.center else None
        rstd = _workspace(layout.slices, dtype=acc)
        _stats(plan, layout, dtype, xb, None, None, None, None, None, mean, rstd)
    dxb = _buffers.output_buffer(plan, layout, dx)
    fused = _dx(plan, layout, dtype, dyb, xb, weight, mean, rstd, dxb,
                None if dweight is None else dbias is not None, param_in_t)
    _buffers.store(plan, layout, dxb, dx)
    if fused is not None:
        _finish_param_grads(*fused, layout.p_len, dtype, dweight, dbias, grad_in_t)
    elif dweight is not None:
        _param_grads(plan, layout, dtype, dyb, xb, mean, rstd, dweight, dbias, grad_in_t)
