"""Launch schedules as data: which kernels one call runs, with which grid, block, shared
memory, sizes and workspaces, worked out from a plan, a layout and a device description.

Nothing here touches a GPU or imports CuPy: a :class:`Schedule` depends only on the call's
signature and on a :class:`DeviceInfo` (SM count, opt-in shared memory), so tests compute
schedules for an H100 on a machine without one, and ``_launcher`` computes each one once per
call signature and binds it to compiled kernels. The decision code below reads like a launch
sequence: ``_step`` notes a kernel launch, ``_workspace`` a part of the call's one scratch
buffer; both add to the schedule being built for this thread (:func:`schedule_forward`,
:func:`schedule_backward`).

A step's arguments are a template: constants as NumPy scalars of the parameter's width
(``i64`` sizes, ``i32`` flags, ``f64`` eps), None for a null pointer, and :class:`Slot`s for
the call's buffers, which per call become addresses (``ptrs[slot] + offset``):

    forward slots:  x, res, h, y, w, b, mean, rstd, scratch
    backward slots: dy, x, w, mean, rstd, dx, dw, db, scratch

Inputs and outputs are dense buffers in the layout's order (``_layout``): ``y``/``h``/``dx``
with x's size and dtype, statistics in the accumulation dtype, ``dweight``/``dbias``
``(p_len,)`` in the accumulation dtype or x's (``grad_in_t``), ``weight``/``bias`` in the
accumulation dtype or x's (``param_in_t``). ``dtype`` is the kernel dtype key ("float16",
"bfloat16", "float32", "float64"). Which kernels run for which layout: kernels/README.md.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from ._compile import CLUSTER_SIZES, MULTI_ITEMS, block_threads_max, items_of

__all__ = ["DeviceInfo", "Slot", "Step", "Schedule", "schedule_forward", "schedule_backward", "acc_dtype",
           "param_in_t", "FORWARD_SLOTS", "BACKWARD_SLOTS", "ALIGN"]

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
_SECTOR = 32  # bytes: a tile row narrower than one DRAM sector wastes bandwidth
_FINISH_BLOCK = (32, 16)  # param_grad_finish: 32 parameters x 16 lanes over the chunks
# Where the row backward also sums dweight/dbias, each block writes one partial row of 2 x count
# sums (param_grad_finish reads it back): their bytes stay within this share of the
# backward's own traffic (x and dy read, dx written). See _param_row_blocks.
_PARTIAL_TRAFFIC = 0.25


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


# Kernel arguments as the schedule holds them (the launcher makes CuPy's holders of them once)
i64, i32, f64 = np.int64, np.int32, np.float64
NULL = None


def _ptr(arr):
    return NULL if arr is None else arr


@dataclass(frozen=True)
class DeviceInfo:
    """What the schedules depend on of a GPU: its SM count, the shared memory one block may
    opt in to and the largest thread-block cluster the row kernels may use (1: none, before
    sm_90); an H100: ``DeviceInfo(132, 227 * 1024, 8)``."""

    sm_count: int
    smem_optin: int
    cluster_max: int = 1


# ---- the schedule being built on this thread ----------------------------------------------

FORWARD_SLOTS = ("x", "res", "h", "y", "w", "b", "mean", "rstd", "scratch")
BACKWARD_SLOTS = ("dy", "x", "w", "mean", "rstd", "dx", "dw", "db", "scratch")
ALIGN = 256  # bytes: every workspace starts on a 256-byte boundary of the scratch buffer


class Slot:
    """A buffer of the call (``index`` into its pointer list) at a byte ``offset``; a
    workspace (a part of the scratch buffer) also knows its element ``dtype`` and ``count``."""

    __slots__ = ("index", "offset", "row_bytes", "dtype", "count")

    def __init__(self, index, offset=0, row_bytes=0, dtype=None, count=0):
        self.index, self.offset, self.row_bytes = index, offset, row_bytes
        self.dtype, self.count = dtype, count

    def __getitem__(self, row):
        """Row ``row`` of a 2-D workspace (``ws[0]``, ``part[1]`` below)."""
        count = self.row_bytes // np.dtype(self.dtype).itemsize
        return Slot(self.index, self.offset + row * self.row_bytes, 0, self.dtype, count)

    def __repr__(self):
        return f"Slot({self.index}, +{self.offset})"


class Step:
    """One kernel launch: which instantiation (``name``, ``dtype``, ``items``), its launch
    configuration, its argument ``template`` (None where a slot puts a pointer) and
    ``slots``: ``(position, Slot)`` pairs."""

    __slots__ = ("name", "dtype", "items", "grid", "block", "smem", "template", "slots")

    def __init__(self, name, dtype, items, grid, block, smem, template, slots):
        self.name, self.dtype, self.items, self.grid, self.block = name, dtype, items, grid, block
        self.smem, self.template, self.slots = smem, template, slots

    def __repr__(self):
        return f"Step({self.name}, grid={self.grid}, block={self.block}, smem={self.smem})"


class Schedule:
    """The launches of one call signature, as data (no compiled code, no device needed)."""

    __slots__ = ("steps", "scratch_bytes")

    def __init__(self, steps, scratch_bytes):
        self.steps, self.scratch_bytes = tuple(steps), scratch_bytes

    @property
    def names(self) -> tuple:
        return tuple(step.name for step in self.steps)


class _Builder:
    """The steps and workspaces of the schedule being built, and the device it is for."""

    def __init__(self, scratch_index, device):
        self.scratch_index, self.device = scratch_index, device
        self.scratch_bytes = 0
        self.steps = []


_building = threading.local()  # .builder: the _Builder of this thread's schedule


def _workspace(shape, dtype):
    """A part of the call's scratch buffer (``(n,)`` or ``(k, n)`` elements of ``dtype``)."""
    builder = _building.builder
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    itemsize = np.dtype(dtype).itemsize
    offset = builder.scratch_bytes
    builder.scratch_bytes += -(-math.prod(shape) * itemsize // ALIGN) * ALIGN
    row_bytes = shape[-1] * itemsize if len(shape) == 2 else 0
    return Slot(builder.scratch_index, offset, row_bytes, np.dtype(dtype), math.prod(shape))


def _step(kernel, dtype, grid, block, args, items=None, smem=0):
    """Note one launch of ``kernel`` (its ``dtype`` and ``items`` instantiation)."""
    template, slots = [], []
    for position, arg in enumerate(args):
        if type(arg) is Slot:
            slots.append((position, arg))
            template.append(None)
        else:
            template.append(arg)
    _building.builder.steps.append(Step(kernel, dtype, items, tuple(grid), tuple(block), smem,
                                        template, tuple(slots)))


def _device() -> DeviceInfo:
    return _building.builder.device


def _target_blocks() -> int:
    """Enough blocks to fill the device a few times over."""
    return _BLOCKS_PER_SM * _device().sm_count


def _ceil(a, b):
    return -(-a // b)


def _param_row_blocks(rows, dtype) -> int:
    """The most blocks a row backward that sums dweight/dbias runs ``rows`` rows on: each
    block's partial row (2 x count sums of the accumulation dtype, written, then read by
    param_grad_finish: 4 x count values) within ``_PARTIAL_TRAFFIC`` of the rows' own traffic
    (3 x count elements a row), in whole blocks per SM (an SM with one block more than the
    others would set the pace), at least one. Fewer blocks than the resident ones leave each
    SM few warps to hide a row's latencies with: the 16-bit backward of ConvNeXt-T's last
    stage in channels_last memory (3136 rows of 768) on 132 blocks, 8 warps an SM, ran at 0.26
    of a copy's bandwidth (an H100; 1.17x torch's time), where the same kernel on the blocks
    resident reached 0.64-0.66 for rows of 512-1024."""
    item, acc = 16 // _VECTOR[dtype], np.dtype(acc_dtype(dtype)).itemsize
    sms = _target_blocks() // _BLOCKS_PER_SM
    return sms * max(1, int(_PARTIAL_TRAFFIC * 3 * rows * item / (4 * acc)) // sms)


def _grid_1d(n, per_block, cap=None):
    blocks = max(1, _ceil(n, per_block))
    return min(blocks, cap or 64 * _target_blocks(), _MAX_X)


def _two_vector_rows(layout, dtype):
    """(kernel, grid, block, ITEMS) of rows_fwd_block at two 16-byte vectors a thread (ITEMS
    16 in 16-bit types, 8 in float32; 16 past 8192 float32 elements), or None: rows of 16-bit
    or float32 types of at least 64 vectors (a warp's worth) that it holds. The row kernels
    are bound by the instructions they issue, not by memory: per row a team sums twice and
    converts and scales every element, so a thread that holds two vectors spends half as
    many instructions per byte on the sums. Forward kernel-only time on an H200
    (asv_bench/gpu_row_variants.py, fraction of a copy's bandwidth, bfloat16 / float32
    layer norm): rows of 512-4096 at 0.53-0.69 / 0.82-0.93 this way, against 0.34-0.42 /
    0.32-0.45 for rows_fwd_multi (one vector a thread, several rows a block) and 0.42-0.49
    for the block kernel at one vector a thread; torch 0.30-0.61 / 0.45-0.74."""
    count = layout.reduced
    if not layout.rows or dtype not in ("float16", "bfloat16", "float32") or count < 64 * _VECTOR[dtype]:
        return None
    return _block_row("rows_fwd", layout.outer, count, dtype, 2 * _VECTOR[dtype])


def _block_row(prefix, rows, count, dtype, min_items=1, items_from=None):
    """(kernel, grid, block, ITEMS) of the block-per-row kernel with the smallest ITEMS of at
    least ``min_items`` (of those ``items_from``, a kernel of the family, is built for) and a
    power of two of threads holding the row, or None. The forward runs on a persistent grid
    (the blocks resident at 64 registers), each block reading its next rows while it sums the
    current one (:func:`_block_fwd_stage`)."""
    kernel = f"{prefix}_block"
    for items in items_of(items_from or kernel, dtype):
        threads = 1 << max(5, (_ceil(count, items) - 1).bit_length())
        if items >= min_items and threads <= block_threads_max(kernel, dtype):
            if prefix == "rows_fwd":
                return kernel, (min(rows, _device().sm_count * (_SMEM_ROW_THREADS // threads)),), (threads,), items
            return kernel, (_grid_1d(rows, 1),), (threads,), items
    return None


_FWD_STAGES = 4  # rows.cu: FWD_STAGES
# 16-bit rows take 2 slots: on an H100 (2026-11-26, one process) layer norm's bfloat16 rows of
# 512-16384 reached 0.78-0.83 of a copy with 2 slots, 0.75-0.79 with 3 and 0.73-0.77 with 4;
# rms_norm's 2 >= 4 too. float32 ran level but for rms_norm 16384 (0.95 with 3-4, 0.88 with 2).
_FWD_STAGES_16BIT = 2
_SM_BLOCKS_MAX = 32  # resident blocks an SM holds at most (sm_80, sm_90)


def fwd_slot_bytes(dtype, items, threads, residual) -> int:
    """rows.cu's fwd_slot_bytes: one row of rows_fwd_block's stage, x (and the residual) at
    ``items`` elements a thread."""
    return (2 if residual else 1) * items * threads * (16 // _VECTOR[dtype])


def _block_fwd_stage(count, dtype, items, threads, residual, p_div, p_len, reserve=0) -> int:
    """Dynamic shared memory of rows_fwd_block: a ring of row slots (``fwd_slot_bytes``), as
    many as the share of an SM's shared memory of its resident blocks (at 64 registers 1024 /
    threads, at most 32) holds, at most ``_FWD_STAGES``; each block keeps all but one of them
    in flight ahead of the row it sums. 0 (rows read as they go) where fewer than 2 fit, the
    rows are not whole 16-byte vectors, or the instantiation does not stage (float64, 16-bit
    ITEMS=8: rows.cu's FwdStaged), and for rows whose parameter changes within a 16-byte vector
    (``p_div``, not plain, not a multiple of the vector: NCHW group norm of HW = 49, say; the
    kernel reads those as they go). 16-bit types take at most ``_FWD_STAGES_16BIT``: an H100
    gets 2 slots for every row of 512-16384 elements in 16-bit types (one row ahead), 4 in
    float32 (3 rows ahead: 96 KiB of reads in flight an SM), float32 16384 3. ``reserve``: bytes
    of each block's share kept for other uses (rows_fwd_lean's stash of float32 parameters)."""
    vector = _VECTOR[dtype]
    plain = p_div == 1 and p_len == count  # rows.cu: p = the position in the row
    if dtype == "float64" or count % vector or (vector == 8 and items == 8) or not (plain or p_div % vector == 0):
        return 0
    slot = fwd_slot_bytes(dtype, items, threads, residual)
    share = _smem_share(min(_SMEM_ROW_THREADS // threads, _SM_BLOCKS_MAX), _ROW_STATIC_SMEM) - reserve
    most = min(_FWD_STAGES, _FWD_STAGES_16BIT) if vector == 8 else _FWD_STAGES
    return _ring(share, slot, most) * slot


def _lean_rows(plain, dtype, items, smem, w, b, param_in_t) -> bool:
    """True where rows_fwd_block's rows go to rows_fwd_lean instead: staged (``smem``: room for
    2 or more row slots), ``plain`` (the parameter of an element is its position in the row), at
    most two 16-byte vectors a thread (the ``items`` rows_fwd_lean is built for), weight and
    bias each None or held in x's own dtype (``param_in_t``'s bits; float32 rows: float32),
    which each thread then keeps in registers across its rows (rows.cu's lean_fwd_rows). A
    float32 weight beside 16-bit rows (twice the registers) takes :func:`_lean_stash`."""
    in_x_dtype = all(p is None or dtype == "float32" or param_in_t >> k & 1 for k, p in enumerate((w, b)))
    return smem > 0 and plain and items in items_of("rows_fwd_lean", dtype) and in_x_dtype


def lean_stash_bytes(dtype, items, threads) -> int:
    """rows.cu's stash_bytes: a thread's weight and bias in float32, ``items`` of each."""
    return 2 * items * 4 * threads if _VECTOR[dtype] == 8 else 0


def _lean_stash(count, dtype, items, threads, residual, plain, smem) -> int:
    """rows_fwd_lean's shared memory for 16-bit plain rows whose parameters are not all in x's
    dtype (a float32 weight, as under autocast with a model kept in float32): each thread keeps
    its weight and bias vectors in float32 in its own words past the ring (lean_stash_bytes),
    read back every row instead of loaded from global memory and tested (the launch sets bit 2
    of ``param_in_t`` for it; 16-bit parameters may take it too, which the SASS makes shorter:
    gpu_row_variants.py's ``stash16``); 0 where the ring then no longer gets 2 slots of the SM's
    share (rows_fwd_block stays)."""
    if not (smem > 0 and plain and _VECTOR[dtype] == 8 and items in items_of("rows_fwd_lean", dtype)):
        return 0
    stash = lean_stash_bytes(dtype, items, threads)
    ring = _block_fwd_stage(count, dtype, items, threads, residual, 1, count, reserve=stash)
    return ring + stash if ring else 0


def _row_kernel(prefix, rows, count, dtype):
    """(kernel, grid, block, ITEMS) of the register-resident row kernels for ``count``, or
    None when the row is longer than they hold in ``dtype``: the warp kernel with the
    smallest ITEMS that holds the row, else the block kernel with the smallest ITEMS and a
    power of two of threads holding it (powers of two keep the SM's warps whole: 64
    registers x any of them is 32 warps, 50%; :func:`_block_row`)."""
    for items in items_of(f"{prefix}_warp", dtype):
        if 32 * items >= count:
            return f"{prefix}_warp", (_grid_1d(rows, _ROWS_BLOCK // 32),), (_ROWS_BLOCK,), items
    return _block_row(prefix, rows, count, dtype)


_MULTI_BLOCK = 256  # rows_fwd_multi's block (rows.cu: MULTI_BLOCK)


def _multi_rows(layout, dtype, has_params, backward=False):
    """(kernel, grid, block, ITEMS) of rows_fwd_multi (rows_bwd_multi with ``backward``), or
    None: rows whose team (ITEMS = one 16-byte vector per thread, a power of two of threads)
    fits its block, plain (p = position in the row) where there are parameters. A persistent
    grid: at most the blocks resident at once (4 per SM: 32 warps at 64 registers; the 16-bit
    backward 3: 24 warps at 80), each taking groups of ``256 / team`` rows in turn, its
    weight and bias loaded once. The backward's blocks each write a row of dweight/dbias
    partials: at most ``_param_row_blocks``."""
    count = layout.reduced
    if not layout.rows or (has_params and (layout.p_div != 1 or layout.p_len != count)):
        return None
    items = MULTI_ITEMS[dtype]
    team = 1 << (_ceil(count, items) - 1).bit_length()
    if team > _MULTI_BLOCK:
        return None
    teams = _MULTI_BLOCK // team
    groups = _ceil(layout.outer, teams)
    if not backward:
        return "rows_fwd_multi", (min(groups, _target_blocks()),), (_MULTI_BLOCK,), items
    sms = _target_blocks() // _BLOCKS_PER_SM
    resident = (3 if _VECTOR[dtype] == 8 else 4) * sms  # rows.cu: MultiBwdBlocks
    blocks = min(groups, resident, _param_row_blocks(layout.outer, dtype))
    return "rows_bwd_multi", (blocks,), (_MULTI_BLOCK,), items


def multi_bwd_static_smem(dtype) -> int:
    """rows_bwd_multi's static shared memory: the teams' sums (2 x ITEMS x 256 values of A)
    and the team sums' 2 x 8."""
    acc = np.dtype(acc_dtype(dtype)).itemsize
    return (2 * MULTI_ITEMS[dtype] * _MULTI_BLOCK + 2 * _MULTI_BLOCK // 32) * acc


# rows_bwd_multi's ring slot: a group's x and dy (2 x 256 16-byte vectors), then each thread's
# row's rstd and first value (a 4-byte word each a thread)
MULTI_BWD_SLOT = (2 * _MULTI_BLOCK + _MULTI_BLOCK // 2) * 16


def _multi_bwd_stage(count, dtype) -> int:
    """Dynamic shared memory of rows_bwd_multi: a ring of slots of one group's rows
    (``MULTI_BWD_SLOT``), as many as the share of an SM of its resident blocks (3 in 16-bit
    types, 4 otherwise: rows.cu's MultiBwdBlocks) holds past its static sums, at most
    ``_BWD_STAGES`` (3 groups in flight ahead of the one summed: 96 KiB an SM in 16-bit
    types, where one group ahead kept 24 KiB); 0 (read as they go) for float64, rows not of
    whole vectors, or fewer than 2 slots."""
    vector = _VECTOR[dtype]
    if dtype == "float64" or count % vector:
        return 0
    slot = MULTI_BWD_SLOT
    per_sm = 3 if vector == 8 else 4  # rows.cu: MultiBwdBlocks
    return _ring(_smem_share(per_sm, multi_bwd_static_smem(dtype)), slot, _BWD_STAGES) * slot


def _smem_row(layout, dtype, copies=1):
    """(grid, block, dynamic smem bytes) of rows_fwd_smem (``copies`` 1: x) or rows_bwd_smem
    (2: x and dy), or None: rows too long for the register kernels whose ``copies`` arrays (in
    x's dtype, each a 16-byte multiple) fit one block's opt-in shared memory, at least one
    row per SM (fewer rows take the split path, which cuts them into chunks over every SM).
    Blocks of 512 threads where two rows fit an SM (one loads while the other sums), else
    1024; at most the blocks resident at once (registers allow one block of 1024 or two of
    512 per SM), each taking rows in turn."""
    itemsize = 16 // _VECTOR[dtype]
    smem = copies * _ceil(layout.reduced * itemsize, 16) * 16
    static = _ROW_STATIC_SMEM if copies == 1 else _ROW_BWD_STATIC_SMEM
    limit = _smem_limit()
    sms = max(1, _target_blocks() // _BLOCKS_PER_SM)
    if smem > limit - static or layout.outer < sms:
        return None
    per_sm, threads = _held_row_blocks(smem, static)
    return (min(layout.outer, per_sm * sms),), (threads,), smem


_SMEM_ROW_THREADS = 1024  # rows_fwd_smem's launch bound (rows.cu: ROW_BLOCK_MAX)


def _smem_blocks_per_sm(smem, static) -> int:
    """Blocks of ``smem`` dynamic and ``static`` static bytes of shared memory an SM holds."""
    return (_smem_limit() + _SMEM_RESERVED) // (smem + static + _SMEM_RESERVED)


def _smem_share(blocks, static) -> int:
    """Dynamic shared memory each of ``blocks`` blocks of ``static`` static bytes may take
    for all of them to fit one SM (the opt-in limit plus one block's reservation)."""
    return (_smem_limit() + _SMEM_RESERVED) // blocks - _SMEM_RESERVED - static


def _ring(room, slot, most) -> int:
    """The slots of ``slot`` bytes a ring of rows read ahead takes in ``room`` bytes: as many
    as fit, at most ``most``, none where fewer than 2 fit (a ring of one reads nothing ahead)."""
    depth = min(most, max(0, room) // slot)
    return depth if depth >= 2 else 0


def _held_row_blocks(smem, static):
    """(blocks per SM, threads) of the kernels that hold rows in shared memory: 512 threads
    where two blocks fit an SM (one loads while the other sums), else 1024 (registers allow
    one block of 1024 or two of 512)."""
    if _smem_blocks_per_sm(smem, static) >= 2:
        return 2, _SMEM_ROW_THREADS // 2
    return 1, _SMEM_ROW_THREADS


def _cluster_row(layout, dtype, copies=1):
    """(C, grid, block, dynamic smem bytes) of rows_fwd_cluster (``copies`` 1: x) or
    rows_bwd_cluster (2: x and dy), or None: rows that rows_fwd_smem/rows_bwd_smem do not
    take (too long for one block's shared memory, or fewer rows than SMs) split over a
    thread-block cluster of C blocks (of CLUSTER_SIZES the device allows) whose parts
    (cluster_segment: ceil(count / C) rounded up to 16 bytes, ``copies`` of them, plus 72
    values of A for the block sums and cluster slots, all dynamic) fit one block's opt-in
    shared memory, with at least a block per SM (C x rows >= SMs); else the split path.

    C: the smallest at which two blocks fit an SM (512 threads each: one loads its part while
    the other sums, as _held_row_blocks), else the smallest that fits (1024 threads, an SM
    each: load, sums and store in turn). A cluster a row, not a persistent grid of ``SMs x
    blocks per SM / C``: a cluster takes C free block slots of one GPC, and a GPC whose slots
    are not a multiple of C leaves some idle (an H100 GPC of 18 SMs holds 4 clusters of 4 at
    one block an SM), so such a grid may not be resident at once, and a cluster left over
    runs all its rows after the others. Unmeasured: the H100 (2026-11-26) ran bfloat16 rows
    of 262144 (C = 4, an SM a block, 33 persistent clusters) at 0.39 of a copy's bandwidth,
    float32 rows of 65536 (C = 2) at 0.72."""
    if not layout.rows:
        return None
    vector = _VECTOR[dtype]
    itemsize, acc = 16 // vector, np.dtype(acc_dtype(dtype)).itemsize
    limit = _smem_limit() - _CLUSTER_STATIC_SMEM
    sms = max(1, _target_blocks() // _BLOCKS_PER_SM)
    fits = []
    for c in CLUSTER_SIZES:
        if c > _device().cluster_max:
            break
        seg = _ceil(_ceil(layout.reduced, c), vector) * vector
        smem = copies * _ceil(seg * itemsize, 16) * 16 + 72 * acc
        if smem <= limit and layout.outer * c >= sms:
            fits.append((c, smem, _held_row_blocks(smem, _CLUSTER_STATIC_SMEM)))
    if not fits:
        return None
    c, smem, (_, threads) = next((fit for fit in fits if fit[2][0] == 2), fits[0])
    return c, (min(layout.outer, _MAX_X // c) * c,), (threads,), smem


_CLUSTER_STATIC_SMEM = 128  # rows_*_cluster: the IndexMap (everything else is dynamic)


def _split(length, parallel, target, min_chunk, align=1):
    """(chunk, nchunk): cut ``length`` into at most 65535 chunks so that ``parallel`` blocks
    per chunk make about ``target`` blocks, chunks of at least ``min_chunk`` elements."""
    want = max(1, min(_ceil(target, max(parallel, 1)), _ceil(length, min_chunk), _MAX_Y))
    chunk = _ceil(_ceil(length, want), align) * align
    return chunk, _ceil(length, chunk)


def _smem_limit() -> int:
    """Shared memory (static + dynamic) one block may opt in to on the device."""
    return _device().smem_optin



def _tile_static_smem(dtype) -> int:
    """tiles.cu's static shared memory: two (2, 256) arrays of A and the IndexMap."""
    return 4 * _TILE_THREADS * np.dtype(acc_dtype(dtype)).itemsize + 128


_ROW_STATIC_SMEM = 64 * 8 + 128  # rows_bwd_block_params, rows_fwd_smem: block sums and IndexMap
_ROW_BWD_STATIC_SMEM = 128 * 8 + 128  # rows_bwd_smem: block sums, segment pieces (64 A each), IndexMap


def _tile_budgets(dtype) -> tuple:
    """Dynamic shared memory one tile block may take on the current device, per tier of
    ``_TILE_SMEM_CAPS``. An SM holds the opt-in limit plus one block's reservation (228 KiB
    on H100, 164 KiB on A100), so ``_SMShare(4)`` is 52 KiB on an H100."""
    static = _tile_static_smem(dtype)
    limit = _smem_limit() - static
    budgets = []
    for cap in _TILE_SMEM_CAPS:
        if isinstance(cap, _SMShare):
            cap = _smem_share(cap.blocks, static)
        budgets.append(limit if cap is None else max(0, min(cap, limit)))
    return tuple(budgets)


def tile_params_fit(layout) -> bool:
    """Whether tiles.cu finds the parameter index ``p = (e / p_div) % p_len`` of its
    elements: from the column alone (``p_div * p_len`` divides inner: NHWC instance and
    group norm, or no parameters) or as the row (``p = r``: channels-first layer norm)."""
    return (layout.inner % (layout.p_div * layout.p_len) == 0
            or (layout.p_div == layout.inner and layout.p_len == layout.reduced))


# Columns a thread of the tile kernels' vector forms holds in one shared-memory vector (tiles.cu: TileCpt)
_TILE_CPT = {2: 4, 4: 4, 8: 2}  # by itemsize


def tile_vector_compute(width, itemsize) -> bool:
    """Whether the tile kernels work on a tile ``width`` columns wide in vectors of
    ``_TILE_CPT`` columns (tiles.cu: tile_vec_compute; cols_fwd_tile within, the backward as
    cols_bwd_tile_vec): a power of two, at most 64, of them a row."""
    cpt = _TILE_CPT[itemsize]
    per_row = width // cpt
    return width % cpt == 0 and per_row <= 64 and per_row & (per_row - 1) == 0


def tile_bwd_vector(layout, width, itemsize, param_grads, param_rows) -> bool:
    """Whether the backward takes cols_bwd_tile_vec (tiles.cu: tile_bwd_vector): the vector
    geometry, a parameter period under 2^31 where the parameter is the column's, per-column
    dweight/dbias (``param_grads`` without ``param_rows``) only there."""
    if not tile_vector_compute(width, itemsize):
        return False
    period = layout.p_div * layout.p_len
    if layout.inner % period:  # the parameter is the tile's row
        return not (param_grads and not param_rows)
    return period < 2**31


def tile_width(outer, reduced, inner, group, itemsize, copies, budget, target, row_extra=0, vector_compute=False):
    """Inner positions per block of tiles.cu (a multiple of ``group``), or None: the tile
    (``copies`` arrays of ``reduced x width`` elements, and ``row_extra`` bytes per row of
    ``reduced``: the backward's dweight/dbias accumulators) must fit ``budget`` bytes with rows
    of at least one sector (or all of ``inner``). Of the widths that fit, the widest that
    still makes ``target`` blocks, else the narrowest (small grids wait on load latency).
    Narrower than those come widths in whole 16-byte vectors (multiples of
    ``lcm(group, 16 / itemsize)``, at least 16 bytes) that are not whole sectors, for small
    spatial extents with many channels (ConvNeXt's 64x768x7x7 makes 256 tiles of 16
    bfloat16 columns, 448 of 8): the neighbouring tile, which reads the rest of a sector,
    runs at the same time (adjacent blockIdx.x) and finds it in L2. With
    ``vector_compute`` (forward and backward) only the widths that
    :func:`tile_vector_compute` takes are tried where there are any: the vector forms issue
    a third to a half of the scalar forms' instructions per element, which buys more than the
    widest tile."""
    fit = min(max(0, budget - reduced * row_extra) // (copies * reduced * itemsize), _TILE_THREADS)
    sector = max(1, _SECTOR // itemsize)
    step = math.lcm(group, sector)
    step = step if step <= fit else group
    widths = [w for w in range(fit - fit % step, 0, -step) if w < inner and w * itemsize >= _SECTOR]
    if inner <= fit:
        widths.insert(0, inner)
    vector = math.lcm(group, max(1, 16 // itemsize))
    below = min(widths[-1] if widths else fit + 1, fit + 1, inner)
    widths += [w for w in range((below - 1) // vector * vector, 0, -vector) if w * itemsize >= 16]
    if vector_compute:
        widths = [w for w in widths if tile_vector_compute(w, itemsize)] or widths
    for width in widths:
        if outer * _ceil(inner, width) >= target:
            return width
    return widths[-1] if widths else None


def _tile(layout, dtype, copies, row_extra=0, vector_compute=False):
    """(width, grid, dynamic smem bytes) of the tile kernels, or None when no tile fits:
    the first budget of ``_tile_budgets`` that holds one wins, a later one only with at
    least a block per SM. ``row_extra``: bytes of shared memory per row of ``reduced`` past
    the tiles (the backward's accumulators). The grid is the forward's, a block per tile."""
    if layout.rows or not tile_params_fit(layout):
        return None
    itemsize = 16 // _VECTOR[dtype]
    target = _target_blocks()
    for tier, budget in enumerate(_tile_budgets(dtype)):
        width = tile_width(layout.outer, layout.reduced, layout.inner, layout.group, itemsize, copies,
                           budget, target, row_extra, vector_compute)
        if width is not None:
            break
    else:
        return None
    tiles = _ceil(layout.inner, width)
    if tier and layout.outer * tiles < target // _BLOCKS_PER_SM:
        return None
    grid = (tiles, min(layout.outer, _MAX_Y))
    return width, grid, layout.reduced * (copies * width * itemsize + row_extra)


# Columns of at most this many inner positions (8x8 spatial extents) take a cluster a sample
# where the device has clusters (samples.cu): a tile's rows would be pieces of a few elements
# (ConvNeXt's 7x7 stage: 98-byte rows cut into 16-byte pieces read element by element, a
# tile's reductions for every 8 columns, and 448 tiles on 396 resident backward blocks).
SAMPLE_INNER_MAX = 64
_SAMPLE_THREADS = 256  # samples.cu's block (SAMPLE_THREADS)
_SAMPLE_BLOCKS_PER_SM = {"float64": 2}  # its launch bound: 4 blocks of 256 (64 registers), float64 2


def sample_part_rows(reduced, inner, itemsize, c) -> int:
    """samples.cu's sample_part_rows: the rows each of a cluster's ``c`` blocks holds,
    ceil(reduced / c) rounded up to whole 16-byte vectors of elements."""
    align = 1
    while (align * inner * itemsize) % 16:
        align *= 2
    return _ceil(_ceil(reduced, c), align) * align


def sample_smem(reduced, inner, dtype, c, copies, per_col) -> int:
    """Dynamic shared memory of cols_fwd_cluster (``copies`` 1) / cols_bwd_cluster (2): the
    parts (16-byte multiples), then samples.cu's SampleSmem (7 values of A per column, the
    parameters per column or per row of the part, 2 x 256 partials, 2 x 2 slots per column)."""
    itemsize, acc = 16 // _VECTOR[dtype], np.dtype(acc_dtype(dtype)).itemsize
    rows = sample_part_rows(reduced, inner, itemsize, c)
    npar = inner if per_col else rows
    return copies * _ceil(rows * inner * itemsize, 16) * 16 + (11 * inner + 2 * npar + 2 * _SAMPLE_THREADS) * acc


def _sample_cluster(layout, dtype, copies, param_grads=None):
    """(C, grid, dynamic smem bytes) of cols_fwd_cluster (``copies`` 1) or cols_bwd_cluster
    (2; ``param_grads`` not None: with dweight), or None: columns of one statistic each
    (group 1) and at most SAMPLE_INNER_MAX inner positions, parameters per column or per row
    (dweight per column only where p = i), on a device with clusters, whose parts fit the
    share of an SM's shared memory that keeps the blocks its registers allow (4, float64 2:
    56 KiB on an H100; larger samples, e.g. NHWC 32x56x56x64 float32, keep the tiles, which
    spread them wider). The smallest C of CLUSTER_SIZES whose C x outer blocks make
    ``_target_blocks`` (else the largest that fits); a persistent grid of whole clusters, at
    most the blocks resident at once."""
    if layout.rows or layout.group != 1 or layout.inner > SAMPLE_INNER_MAX or _device().cluster_max < 2:
        return None
    if not tile_params_fit(layout):
        return None
    per_col = layout.inner % (layout.p_div * layout.p_len) == 0
    if param_grads is not None and per_col and not (layout.p_div == 1 and layout.p_len == layout.inner):
        return None
    sizes = [c for c in CLUSTER_SIZES if c <= _device().cluster_max]
    per_sm = _SAMPLE_BLOCKS_PER_SM.get(dtype, 4)
    budget = _smem_share(per_sm, _SAMPLE_STATIC_SMEM)
    fits = [c for c in sizes
            if sample_smem(layout.reduced, layout.inner, dtype, c, copies, per_col) <= budget]
    if not fits:
        return None
    c = next((c for c in fits if layout.outer * c >= _target_blocks()), fits[-1])
    smem = sample_smem(layout.reduced, layout.inner, dtype, c, copies, per_col)
    sms = max(1, _target_blocks() // _BLOCKS_PER_SM)
    clusters = min(layout.outer, max(1, per_sm * sms // c))
    return c, (clusters * c,), smem


_SAMPLE_STATIC_SMEM = 0  # samples.cu: everything is dynamic


# Tile backward blocks an SM holds at once: its registers (tiles.cu: TILE_MIN_BLOCKS_BWD,
# 80 a thread) allow 3 of 256 threads (37.5%), float64's (122) 2.
_TILE_BWD_BLOCKS = {"float64": 2}


def _tile_bwd_grid(layout, dtype, width, smem):
    """cols_bwd_tile's persistent grid: the blocks resident at once (registers, and the
    shared memory of ``smem`` dynamic bytes, per SM, times the SMs), at most one per
    (o, tile) item; each block takes items in turn, so its dweight/dbias partial row (p = r)
    covers several tiles. Not _TILE_BLOCKS_PER_SM per SM: a 4th block would not be resident
    and would start only when a whole persistent block ends (a second wave)."""
    items = layout.outer * _ceil(layout.inner, width)
    sms = max(1, _target_blocks() // _BLOCKS_PER_SM)
    fit = _smem_blocks_per_sm(smem, _tile_static_smem(dtype))
    per_sm = max(1, min(_TILE_BWD_BLOCKS.get(dtype, 3), fit))
    return (min(items, per_sm * sms, _MAX_X),)


# ---- statistics --------------------------------------------------------------------------

def _stats(plan, layout, dtype, src, res, h, y, w, b, mean, rstd, param_in_t=0):
    """Fill ``mean``/``rstd`` (and ``h``, ``y`` unless None) from the buffer ``src``;
    ``rstd`` None (with ``mean``): no statistics are written, only ``y``. ``param_in_t``:
    bit 0 when ``w``, bit 1 when ``b`` hold x's dtype rather than the accumulation dtype."""
    acc = acc_dtype(dtype)
    center, eps, pin = i32(plan.center), f64(plan.eps), i32(param_in_t)
    outer, reduced, inner, group = layout.outer, layout.reduced, layout.inner, layout.group
    row = _two_vector_rows(layout, dtype)
    multi = None if row is not None else _multi_rows(layout, dtype, w is not None or b is not None)
    if multi is not None:
        kernel, grid, block, items = multi
        _step(kernel, dtype, grid, block,
                (src, _ptr(res), _ptr(h), _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer),
                 i64(reduced), center, eps, pin), items=items)
        return
    if row is None and layout.rows:
        row = _row_kernel("rows_fwd", outer, reduced, dtype)
    if row is not None:
        kernel, grid, block, items = row
        smem = 0
        if kernel == "rows_fwd_block":
            # rows without parameters are plain rows whatever their layout's parameter map says
            # (p_len 1): staged as those are (rows.cu treats them so)
            p_div, p_len = (1, reduced) if w is None and b is None else (layout.p_div, layout.p_len)
            smem = _block_fwd_stage(reduced, dtype, items, block[0], res is not None, p_div, p_len)
            plain = p_div == 1 and p_len == reduced
            if _lean_rows(plain, dtype, items, smem, w, b, param_in_t):
                kernel = "rows_fwd_lean"
            else:
                stashed = _lean_stash(reduced, dtype, items, block[0], res is not None, plain, smem)
                if stashed:  # param_in_t's bit 2 tells rows_fwd_lean to take its stash
                    kernel, smem, pin = "rows_fwd_lean", stashed, i32(param_in_t | 4)
        _step(kernel, dtype, grid, block,
                (src, _ptr(res), _ptr(h), _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer),
                 i64(reduced), i64(layout.p_div), i64(layout.p_len), center, eps, pin), items=items, smem=smem)
        return
    smem_row = _smem_row(layout, dtype) if layout.rows else None
    if smem_row is not None:
        grid, block, smem = smem_row
        _step("rows_fwd_smem", dtype, grid, block,
              (src, _ptr(res), _ptr(h), _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer),
               i64(reduced), i64(layout.p_div), i64(layout.p_len), center, eps, pin), smem=smem)
        return
    cluster = _cluster_row(layout, dtype)
    if cluster is not None:
        c, grid, block, smem = cluster
        _step("rows_fwd_cluster", dtype, grid, block,
              (src, _ptr(res), _ptr(h), _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer),
               i64(reduced), i64(layout.p_div), i64(layout.p_len), center, eps, pin), items=c, smem=smem)
        return
    sample = None if res is not None else _sample_cluster(layout, dtype, 1)
    if sample is not None:
        c, grid, smem = sample
        _step("cols_fwd_cluster", dtype, grid, (_SAMPLE_THREADS,),
              (src, _ptr(y), _ptr(w), _ptr(b), _ptr(mean), _ptr(rstd), i64(outer), i64(reduced), i64(inner),
               i64(layout.p_div), i64(layout.p_len), center, eps, pin), items=c, smem=smem)
        return
    tile = _tile(layout, dtype, 1, vector_compute=True)
    if tile is not None:
        width, grid, smem = tile
        _step("cols_fwd_tile", dtype, grid, (_TILE_THREADS,),
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
    _step("rows_stats_partial", dtype, (nchunk, min(outer, _MAX_Y)), (_BLOCK,),
            (src, _ptr(res), _ptr(h), ws[0], ws[1], ws[2], i64(outer), i64(reduced), i64(chunk)))
    lo = _workspace(outer, dtype=acc) if plan.center and y is not None else None
    _step("rows_stats_finalize", dtype, (_grid_1d(outer, _BLOCK, _MAX_Y),), (_BLOCK,),
            (h if res is not None else src, ws[0], ws[1], ws[2], _ptr(mean), rstd, _ptr(lo), i64(outer),
             i64(reduced), i64(nchunk), center, eps))
    if y is not None:
        _step("rows_apply_fwd", dtype, (_grid_1d(_ceil(layout.total, _VECTOR[dtype]), _BLOCK),), (_BLOCK,),
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
    _step("cols_stats_partial", dtype, grid, (32, 8),
            (src, _ptr(res), _ptr(h), ws[0], ws[1], ws[2], i64(outer), i64(reduced), i64(inner),
             i64(chunk), i64(group), center))
    slices = layout.slices
    shifted = _workspace((1, slices), dtype=acc)[0] if plan.center else None
    _step("stats_finalize", dtype, (_grid_1d(slices, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], ws[2], _ptr(shifted), rstd, i64(outer), i64(nchunk), i64(inner),
             i64(group), center, eps))
    if y is None and mean is None:
        return
    _step("cols_apply_fwd", dtype, grid, (32, 8),
            (h if res is not None else src, _ptr(y), _ptr(w), _ptr(b), _ptr(shifted), rstd, _ptr(mean),
             i64(outer), i64(reduced), i64(inner), i64(group), i64(chunk), i64(layout.p_div),
             i64(layout.p_len), center, pin))


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
    per position and block for plain rows past rows_bwd_multi's (a block a row, the sums in
    shared memory, which must fit the device), per row where p is the row's own (p = row %
    p_len: NCHW instance norm)."""
    if layout.p_div == layout.reduced:  # part[row] = part[(row // p_len) * p_len + p]
        fused = f"{kernel}_row_params"
        if items not in items_of(fused, dtype):
            return None
        smem = 0
        if kernel == "rows_bwd_block":
            grid, smem = _block_bwd(layout.outer, dtype, block[0], items)
        return fused, grid, smem, layout.a_len, (i64(layout.p_len),)
    fused = f"{kernel}_params"
    if layout.p_div != 1 or layout.p_len != layout.reduced or items not in items_of(fused, dtype):
        return None
    sums = 2 * items * block[0] * np.dtype(acc_dtype(dtype)).itemsize  # a slot per (item, thread)
    if sums > _smem_limit() - _ROW_STATIC_SMEM:
        return None
    target = _target_blocks()
    wanted = _param_row_blocks(layout.outer, dtype)
    if dtype == "float64":  # rows read as they go
        blocks = min(grid[0], target, wanted)
        return fused, (blocks,), sums, blocks, ()
    (blocks,), smem = _block_bwd(layout.outer, dtype, block[0], items, sums)
    blocks = min(blocks, wanted)
    return fused, (blocks,), smem, blocks, ()


def block_stage_bytes(dtype, items, threads) -> int:
    """rows.cu's block_stage_bytes: one slot of the block backwards' stage, a row's x and dy
    at ``items`` elements a thread each, and in a ring (``_bwd_ring``) the row's rstd and
    first value, a 4-byte word each a thread."""
    return 2 * items * threads * (16 // _VECTOR[dtype]) + (8 * threads if _bwd_ring(dtype, items) else 0)


_BWD_STAGES = 4  # rows.cu: BWD_STAGES


def _bwd_ring(dtype, items) -> bool:
    """Whether the block backward at ``items`` reads ahead through a ring of slots (16-bit
    ITEMS=8: one vector a thread) rather than one slot (rows.cu's BwdOneSlot)."""
    return _VECTOR[dtype] == 8 and items == 8


def _block_bwd(rows, dtype, threads, items, sums=0):
    """(grid, dynamic smem bytes) of the block backward row kernels (rows_bwd_block,
    _row_params, _params; ``sums`` bytes of the latter's dweight/dbias slots first): room for
    the stage each block copies rows ahead into (cp.async) while it sums one, on a persistent
    grid of the blocks resident at once (at 64 registers 1024 / threads an SM, fewer where
    shared memory holds fewer; a block past those would start only when a whole one ends).
    Kernels of two vectors a thread get one slot (the next row: 64 KiB of x and dy in flight
    an SM at any block size); 16-bit rows at one vector a thread (ITEMS=8) as many as the
    share of an SM of its resident blocks holds past the sums, at most ``_BWD_STAGES`` (3
    rows in flight: 96 KiB an SM), or none where fewer than 2 fit. float64 rows are read as
    they go, a block a row. The forward's block kernel gained 0.27 -> 0.40 (bfloat16) and
    0.44 -> 0.78 (float32) of a copy's bandwidth from reading one row ahead on an H200 (rows
    of 4096)."""
    if dtype == "float64":
        return (_grid_1d(rows, 1),), sums
    stage = block_stage_bytes(dtype, items, threads)
    per_sm = _SMEM_ROW_THREADS // threads
    depth = 1
    if _bwd_ring(dtype, items):
        depth = _ring(_smem_share(per_sm, _ROW_STATIC_SMEM) - sums, stage, _BWD_STAGES)
    smem = sums + depth * stage
    if smem > _smem_limit() - _ROW_STATIC_SMEM:  # no room for the stage: rows read as they go
        smem = sums
    per_sm = min(per_sm, _smem_blocks_per_sm(smem, _ROW_STATIC_SMEM))
    return (min(rows, max(1, per_sm) * _device().sm_count),), smem


def _dx(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_grads=None, param_in_t=0):
    """dx into ``dxb``. ``param_grads`` (bool: with dbias) asks the row and tile kernels to add
    up the parameter gradients' partial sums too: returns (part, nchunk) when they did, else None.
    ``param_in_t``: 1 when ``w`` holds x's dtype rather than the accumulation dtype."""
    center, pin = i32(plan.center), i32(param_in_t)
    acc = acc_dtype(dtype)
    outer, reduced, inner, group = layout.outer, layout.reduced, layout.inner, layout.group
    pdiv, plen = i64(layout.p_div), i64(layout.p_len)
    multi = _multi_rows(layout, dtype, w is not None or param_grads is not None, backward=True)
    if multi is not None:  # dweight/dbias partials per block: (part, blocks)
        kernel, grid, block, items = multi
        part = None if param_grads is None else _workspace((2, grid[0] * reduced), dtype=acc)
        _step(kernel, dtype, grid, block,
              (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, _ptr(None if part is None else part[0]),
               _ptr(part[1] if param_grads else None), i64(outer), i64(reduced), center, pin),
              items=items, smem=_multi_bwd_stage(reduced, dtype))
        return None if part is None else (part, grid[0])
    row = _row_kernel("rows_bwd", outer, reduced, dtype) if layout.rows else None
    if (row is None and param_grads is not None and layout.rows and layout.p_div == 1 and layout.p_len == reduced
            and outer >= _target_blocks() // _BLOCKS_PER_SM):
        # float32 rows of 8193-16384 with dweight, a row an SM at least: rows_bwd_block_params
        # holds them at ITEMS=16 (3 transfers, where rows_bwd_smem and param_grad_cols move 5;
        # fewer rows take a cluster a row, which spreads them over every SM)
        row = _block_row("rows_bwd", outer, reduced, dtype, items_from="rows_bwd_block_params")
    if row is not None:
        kernel, grid, block, items = row
        fused = None if param_grads is None else _row_params(layout, dtype, kernel, grid, block, items)
        if fused is not None:
            kernel, grid, smem, nchunk, extra = fused
            part = _workspace((2, nchunk * layout.p_len), dtype=acc)
            _step(kernel, dtype, grid, block,
                    (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, part[0], _ptr(part[1] if param_grads else None),
                     i64(outer), i64(reduced)) + extra + (center, pin), items=items, smem=smem)
            return part, nchunk
        smem = 0
        if kernel == "rows_bwd_block":
            grid, smem = _block_bwd(outer, dtype, block[0], items)
        _step(kernel, dtype, grid, block,
                (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, i64(outer), i64(reduced), pdiv, plen,
                 center, pin), items=items, smem=smem)
        return None
    sample = _sample_cluster(layout, dtype, 2, param_grads)
    if sample is not None:  # dweight/dbias partials per sample: (part, outer)
        c, grid, smem = sample
        part = None if param_grads is None else _workspace((2, outer * layout.p_len), dtype=acc)
        _step("cols_bwd_cluster", dtype, grid, (_SAMPLE_THREADS,),
              (dyb, xb, _ptr(w), rstd, dxb, _ptr(None if part is None else part[0]),
               _ptr(part[1] if param_grads else None), i64(outer), i64(reduced), i64(inner), pdiv, plen,
               center, pin), items=c, smem=smem)
        return None if part is None else (part, outer)
    mode = None if param_grads is None or layout.rows else _tile_param_mode(layout)
    # p = r: the block's dweight/dbias sums per row, 2 x reduced A, in shared memory
    tile = _tile(layout, dtype, 2, 2 * np.dtype(acc).itemsize if mode == 1 else 0, vector_compute=True)
    if tile is not None:
        width, _, smem = tile
        vector = tile_bwd_vector(layout, width, 16 // _VECTOR[dtype], mode is not None, mode == 1)
        grid = _tile_bwd_grid(layout, dtype, width, smem)
        part, part_w, part_b, nchunk = None, None, None, 0
        if mode is not None:  # partial sums per o (p = i) or per block (p = r)
            nchunk = outer if mode == 0 else grid[0]
            part = _workspace((2, nchunk * layout.p_len), dtype=acc)
            part_w, part_b = part[0], (part[1] if param_grads else None)
        _step("cols_bwd_tile_vec" if vector else "cols_bwd_tile", dtype, grid, (_TILE_THREADS,),
                (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, _ptr(part_w), _ptr(part_b), i64(outer),
                 i64(reduced), i64(inner), i64(group), i64(width), pdiv, plen, i32(mode or 0),
                 center, pin), smem=smem)
        return None if part is None else (part, nchunk)
    if not layout.rows:
        return _split_columns_dx(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_grads, param_in_t)
    segments = param_grads is not None and _segmented(layout)
    smem_row = _smem_row(layout, dtype, 2)
    if smem_row is not None:
        # rows of parameter segments with dweight/dbias: the kernel also sums them per (row,
        # segment), as _dx_by_segments's part (3 transfers where that path moves 5); other
        # rows' dweight/dbias then from param_grad_cols/rows
        grid, block, smem = smem_row
        part, part_w, part_b = None, None, None
        if segments:  # part[k][row * per_row + s], rows = batch * p_len / per_row
            part = _workspace((2, outer * (reduced // layout.p_div)), dtype=acc)
            part_w, part_b = part[0], (part[1] if param_grads else None)
        _step("rows_bwd_smem", dtype, grid, block,
              (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, _ptr(part_w), _ptr(part_b), i64(outer),
               i64(reduced), pdiv, plen, center, pin), smem=smem)
        return None if part is None else (part, layout.a_len)
    if segments:
        return _dx_by_segments(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, param_grads,
                               param_in_t)
    cluster = _cluster_row(layout, dtype, 2)
    if cluster is not None:  # dx (3 transfers where _split_row_dx moves 5); dweight/dbias after
        c, grid, block, smem = cluster
        _step("rows_bwd_cluster", dtype, grid, block,
              (dyb, xb, _ptr(w), _ptr(mean), rstd, dxb, i64(outer), i64(reduced), pdiv, plen, center, pin),
              items=c, smem=smem)
        return None
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
    _step("cols_grad_partial", dtype, (tiles, nchunk, zdim), (32, 8),
            (dyb, xb, NULL if by_column else _ptr(w), _ptr(mean), rstd, ws[0], ws[1], _ptr(ws_x), i64(outer),
             i64(reduced), i64(inner), i64(group), i64(chunk), i64(layout.p_div), i64(layout.p_len), center,
             pin))
    slices = layout.slices
    means = _workspace((2, slices), dtype=acc)
    part = _workspace((2, outer * inner), dtype=acc) if by_column else None
    lo = _workspace((1, slices), dtype=acc)[0] if by_row and plan.center else None
    _step("cols_grad_finalize", dtype, (_grid_1d(slices, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], _ptr(ws_x), _ptr(w) if by_column else NULL, _ptr(mean), rstd, means[0], means[1],
             _ptr(lo), part[0] if by_column else NULL, part[1] if by_column and param_grads else NULL,
             i64(outer), i64(nchunk), i64(inner), i64(group), f64(plan.count), center, pin))
    _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t)
    if by_row:
        part = _workspace((2, outer * tiles * reduced), dtype=acc)
        _step("cols_param_grad_rows", dtype, (tiles, nchunk, zdim), (32, 8),
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
    _step("rows_grad_partial", dtype, (nchunk, min(outer, _MAX_Y)), (_BLOCK,),
            (dyb, xb, _ptr(w), _ptr(mean), rstd, ws[0], ws[1], ws[2] if plan.center else NULL, i64(outer),
             i64(reduced), i64(chunk), i64(layout.p_div), i64(layout.p_len), i64(1), i32(plan.center),
             i32(param_in_t)))
    means = _workspace((2, outer), dtype=acc)
    _step("rows_grad_finalize", dtype, (_grid_1d(outer, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], ws[2] if plan.center else NULL, _ptr(mean), rstd, means[0], means[1],
             i64(outer), i64(nchunk), f64(plan.count)))
    _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t)
    return None


def _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t=0):
    """dx elementwise from the per-slice means of g = dy * w and g * xhat (``means[0]``, ``[1]``)."""
    _step("apply_bwd", dtype, (_grid_1d(_ceil(layout.total, _VECTOR[dtype]), _BLOCK),), (_BLOCK,),
            (dyb, xb, _ptr(w), _ptr(mean), rstd, means[0], means[1], dxb, i64(layout.total),
             i64(layout.reduced), i64(layout.inner), i64(layout.group), i64(layout.p_div),
             i64(layout.p_len), i32(plan.center), i32(param_in_t)))


def _segmented(layout) -> bool:
    """Rows made of whole segments of ``p_div`` elements with one parameter each (NCHW group
    norm: C/G channels of HW; NCHW instance norm: one channel), segments long enough to give
    a block of rows_grad_partial a full pass of its threads."""
    return layout.p_div >= _BLOCK and layout.reduced % layout.p_div == 0


def _dx_by_segments(plan, layout, dtype, dyb, xb, w, mean, rstd, dxb, with_bias, param_in_t=0):
    """Split rows of parameter segments, with dweight/dbias: rows_grad_partial sums dy,
    dy*xhat and, centred, x - mean per (segment, chunk), unweighted; segment_grad_finalize
    takes the saved mean's rounding out and makes of them both the slices' means of g and
    g*xhat (the weight applied per segment) and per-segment dweight/dbias partials; apply_bwd writes dx. dy and x are read twice in all (5 transfers
    of x's size; the split path followed by param_grad_rows: 7). Returns (part, batch)."""
    acc = acc_dtype(dtype)
    seg, per_row = layout.p_div, layout.reduced // layout.p_div
    segs = layout.outer * per_row
    chunk, nchunk = _split(seg, min(segs, _MAX_Y), _target_blocks(), 4096, align=256)
    ws = _workspace((3 if plan.center else 2, segs * nchunk), dtype=acc)
    ws_x = ws[2] if plan.center else NULL
    _step("rows_grad_partial", dtype, (nchunk, min(segs, _MAX_Y)), (_BLOCK,),
            (dyb, xb, NULL, _ptr(mean), rstd, ws[0], ws[1], ws_x, i64(segs), i64(seg), i64(chunk),
             i64(1), i64(1), i64(per_row), i32(plan.center), i32(0)))
    slices = layout.slices
    means = _workspace((2, slices), dtype=acc)
    part = _workspace((2, segs), dtype=acc)
    _step("segment_grad_finalize", dtype, (_grid_1d(slices, _BLOCK, _MAX_Y),), (_BLOCK,),
            (ws[0], ws[1], ws_x, _ptr(w), _ptr(mean), rstd, means[0], means[1], part[0],
             _ptr(part[1] if with_bias else None), i64(slices), i64(per_row), i64(nchunk),
             i64(layout.p_len), f64(plan.count), i32(param_in_t)))
    _apply_bwd(plan, layout, dtype, dyb, xb, w, mean, rstd, means, dxb, param_in_t)
    return part, layout.a_len


def _finish_param_grads(part, nchunk, p_len, dtype, dweight, dbias, grad_in_t=0):
    """dweight/dbias from per-chunk partial sums ``part[k][c * p_len + p]``; ``grad_in_t``:
    bit 0 / bit 1 when dweight / dbias hold x's dtype (else the accumulation dtype)."""
    _step("param_grad_finish", dtype, (_grid_1d(p_len, _FINISH_BLOCK[0], _MAX_Y),), _FINISH_BLOCK,
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
        _step("param_grad_cols", dtype, (tiles, nchunk), (32, 8),
                (dyb, xb, _ptr(mean), rstd, part[0], _ptr(part[1] if dbias is not None else None),
                 i64(a_len), i64(p_len)) + geometry + (i64(chunk), center))
    else:
        chunk, nchunk = _split(a_len, p_len, target, 1)
        part = _workspace((2, nchunk * p_len), dtype=acc)
        _step("param_grad_rows", dtype, (p_len, nchunk), (_BLOCK,),
                (dyb, xb, _ptr(mean), rstd, part[0], _ptr(part[1] if dbias is not None else None),
                 i64(a_len), i64(p_len), i64(b_len)) + geometry + (i64(chunk), center))
    _finish_param_grads(part, nchunk, p_len, dtype, dweight, dbias, grad_in_t)


# ---- schedules ---------------------------------------------------------------------------

def _build(scratch_index, device, schedule) -> Schedule:
    if not isinstance(device, DeviceInfo):
        raise TypeError(f"a schedule is computed for a DeviceInfo, got {device!r}")
    builder = _Builder(scratch_index, device)
    _building.builder = builder
    try:
        schedule()
    finally:
        _building.builder = None
    return Schedule(builder.steps, builder.scratch_bytes)


def _slots(names, present):
    """A Slot per name in ``present``, None for the others."""
    return [Slot(i) if name in present else None for i, name in enumerate(names)]


def schedule_forward(plan, dtype, layout, present, param_in_t=0, device=None) -> Schedule:
    """The forward of ``plan`` on dense buffers in ``layout``'s order: ``y = (v - mean) * rstd
    * weight + bias`` with ``v = x`` (``+ residual -> h``). ``present``: the forward slot
    names the call has (``mean``/``rstd`` absent: statistics not written); ``param_in_t``:
    bit 0 / bit 1 when weight / bias hold x's dtype; ``device``: the :class:`DeviceInfo`."""
    x, res, h, y, w, b, mean, rstd, _ = _slots(FORWARD_SLOTS, set(present) | {"x", "y"})
    return _build(FORWARD_SLOTS.index("scratch"), device, lambda: _stats(
        plan, layout, dtype, x, res, h, y, w, b, mean, rstd, param_in_t))


def schedule_backward(plan, dtype, layout, present, param_in_t=0, device=None,
                      grad_in_t=0) -> Schedule:
    """The backward of ``plan``: dx, and dweight/dbias where ``present`` has ``dw``/``db``;
    without ``rstd`` in ``present`` the statistics are recomputed first. ``param_in_t`` 1
    when the weight holds x's dtype; ``grad_in_t`` bit 0 / bit 1 when dweight / dbias are
    written in x's dtype; ``device`` as in :func:`schedule_forward`."""
    dy, x, w, mean, rstd, dx, dw, db, _ = _slots(BACKWARD_SLOTS, set(present) | {"dy", "x", "dx"})

    def schedule():
        nonlocal mean, rstd
        if rstd is None:
            acc = acc_dtype(dtype)
            mean = _workspace(layout.slices, acc) if plan.center else None
            rstd = _workspace(layout.slices, acc)
            _stats(plan, layout, dtype, x, None, None, None, None, None, mean, rstd)
        fused = _dx(plan, layout, dtype, dy, x, w, mean, rstd, dx,
                    None if dw is None else db is not None, param_in_t)
        if fused is not None:
            _finish_param_grads(*fused, layout.p_len, dtype, dw, db, grad_in_t)
        elif dw is not None:
            _param_grads(plan, layout, dtype, dy, x, mean, rstd, dw, db, grad_in_t)

    return _build(BACKWARD_SLOTS.index("scratch"), device, schedule)
