"""Launch schedules as data (``anynorm._cuda._schedule``), computed for a described device
(``DeviceInfo``) without a GPU: which kernels a call launches, with what grid and scratch,
and that nothing but the call's signature and the device goes into them."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading

import numpy as np

from anynorm._cuda import _layout, _schedule  # noqa: E402  (pure: no CuPy needed)
from anynorm._plan import make_plan  # noqa: E402

H100 = _schedule.DeviceInfo(sm_count=132, smem_optin=227 * 1024, cluster_max=8)
SMALL = _schedule.DeviceInfo(sm_count=16, smem_optin=48 * 1024)
STATS = {"mean", "rstd"}


def _plan(op, shape, **kw):
    x = np.zeros(shape, np.float32)
    w = np.ones(make_plan(op, x, **kw).param_shape, np.float32)
    b = None if op == "rms_norm" else w
    return make_plan(op, x, w, b, **kw)


def _forward(plan, present, dtype="bfloat16", device=H100):
    layout = _layout.plan_layout(plan, _strides(plan.shape))
    return _schedule.schedule_forward(plan, dtype, layout, present, device=device)


def _backward(plan, present, dtype="bfloat16", device=H100):
    layout = _layout.plan_layout(plan, _strides(plan.shape), True)
    return _schedule.schedule_backward(plan, dtype, layout, present, device=device)


def _strides(shape):
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def test_transformer_rows_are_one_kernel_each_way():
    """768 elements: forward a block of 64 threads a row, two 16-byte vectors each
    (rows_fwd_lean<16>, on the blocks resident: 16 an SM); backward teams of 128 threads (one
    vector each), two rows per block of 256 at a time (rows_bwd_multi) on a persistent grid
    whose blocks each keep dweight/dbias partials in registers, one partial row per block."""
    plan = _plan("layer_norm", (64, 768))
    for present in ({"w", "b"}, {"w", "b"} | STATS):  # inference, and with statistics
        schedule = _forward(plan, present)
        assert schedule.names == ("rows_fwd_lean",) and schedule.scratch_bytes == 0
        assert schedule.steps[0].block == (64,) and schedule.steps[0].items == 16
        assert schedule.steps[0].grid == (64,)  # a block a row: 64 rows, under 16 x 132 resident
    assert _forward(_plan("layer_norm", (32768, 768)), {"w", "b"}).steps[0].grid == (16 * 132,)
    f32 = _forward(_plan("layer_norm", (64, 768)), {"w", "b"}, dtype="float32").steps[0]
    assert (f32.name, f32.block, f32.items) == ("rows_fwd_lean", (128,), 8)  # float32 weight and bias
    inference, training = _forward(plan, {"w", "b"}), _forward(plan, {"w", "b"} | STATS)
    mean_slot, rstd_slot = _schedule.FORWARD_SLOTS.index("mean"), _schedule.FORWARD_SLOTS.index("rstd")
    assert not {slot.index for _, slot in inference.steps[0].slots} & {mean_slot, rstd_slot}
    assert {mean_slot, rstd_slot} <= {slot.index for _, slot in training.steps[0].slots}
    backward = _backward(plan, {"w", "rstd", "mean", "dw", "db"})
    assert backward.names == ("rows_bwd_multi", "param_grad_finish")
    # 32 groups of 2 rows on 132 SMs: a block each, no more (one partial row per block)
    assert backward.steps[0].grid == (32,) and backward.steps[0].items == 8
    short = _plan("layer_norm", (64, 256))
    assert _forward(short, {"w", "b"}).names == ("rows_fwd_multi",)
    assert _backward(short, {"w", "rstd", "mean", "dw", "db"}).names == ("rows_bwd_multi", "param_grad_finish")
    assert _backward(short, {"rstd", "mean"}).names == ("rows_bwd_multi",)  # dx alone: no partials
    # M = 32768 rows of 768: 16384 groups on a persistent grid of 3 blocks per SM (16-bit)
    many = _plan("layer_norm", (32768, 768))
    assert _backward(many, {"w", "rstd", "mean", "dw", "db"}).steps[0].grid == (3 * 132,)
    assert _backward(many, {"w", "rstd", "mean", "dw", "db"}, dtype="float32").steps[0].grid == (4 * 132,)
    # past the multi kernel's block (2048 16-bit elements): a block a row, sums in shared memory
    wide = _plan("layer_norm", (64, 4096))
    assert _backward(wide, {"w", "rstd", "mean", "dw", "db"}).names == ("rows_bwd_block_params", "param_grad_finish")


def test_block_forward_rows_read_ahead_through_a_ring():
    """rows_fwd_block gets room for 4 row slots (3 rows in flight ahead of the one summed) for
    float32 rows of 512-8192 elements on an H100, 3 past 8192 (64 KiB slots), and 2 (one row
    ahead, measured fastest there) for 16-bit rows of 512-16384; slots of twice the bytes with
    a residual, as many as the share of the SM holds (none where fewer than 2 fit); the slots
    of its resident blocks (1024 / threads an SM) fit the SM's shared memory. float64 and rows
    not of whole 16-byte vectors get none (rows read as they go)."""
    # (n, dtype, ITEMS, slots, slots with a residual, lean without / with a residual): plain
    # staged rows at two vectors a thread take rows_fwd_lean, 16-bit ones (float32 parameters
    # here) with their weight and bias in a stash past the ring where the ring keeps 2 slots
    # beside it (_lean_stash), else rows_fwd_block
    for n, dtype, items, slots, with_res, lean_plain, lean_res in [
            (512, "bfloat16", 16, 2, 2, False, False), (768, "float16", 16, 2, 2, True, False),
            (4096, "bfloat16", 16, 2, 2, True, False), (16384, "bfloat16", 16, 2, 2, True, False),
            (512, "float32", 8, 4, 3, True, True), (8192, "float32", 8, 4, 3, True, True),
            (16384, "float32", 16, 3, 0, False, False), (4096, "float64", 8, 0, 0, False, False),
            (1001, "float32", 8, 0, 0, False, False)]:
        plan = _plan("layer_norm", (2 ** 25 // n, n))
        for present, residual in (({"w", "b"} | STATS, False), ({"w", "b", "res", "h"}, True)):
            step = _forward(plan, present, dtype).steps[0]
            threads = step.block[0]
            lean = lean_res if residual else lean_plain
            assert (step.name, step.items) == ("rows_fwd_lean" if lean else "rows_fwd_block", items), (n, dtype)
            slot = _schedule.fwd_slot_bytes(dtype, items, threads, residual) if dtype != "float64" else 0
            stash = _schedule.lean_stash_bytes(dtype, items, threads) if lean else 0
            ring = (step.smem - stash) // slot if slot else 0
            if stash:  # the ring beside the stash: 2 slots (16-bit rows take at most 2)
                assert ring == 2 and step.smem == 2 * slot + stash, (n, dtype, residual, step.smem)
            else:
                assert step.smem == (with_res if residual else slots) * slot, (n, dtype, residual, step.smem, slot)
            per_sm = min(1024 // threads, 32)
            assert step.grid == (min(plan.shape[0], 132 * per_sm),)
            assert per_sm * (step.smem + _schedule._ROW_STATIC_SMEM + 1024) <= H100.smem_optin + 1024
    # rows of a weight and bias a channel: staged where HW is whole vectors (one parameter a
    # vector), not where a channel ends inside one (the kernel reads those as they go)
    for shape, groups, dtype, slots in [((4, 64, 16, 16), 8, "bfloat16", 2), ((4, 64, 15, 16), 8, "float32", 4),
                                        ((4, 64, 15, 15), 8, "float32", 0), ((4, 64, 6, 6), 2, "bfloat16", 0)]:
        plan = _plan("group_norm", shape, channel_axis=1, num_groups=groups)
        step = _forward(plan, {"w", "b"} | STATS, dtype).steps[0]
        assert step.name == "rows_fwd_block", (shape, step.name)
        slot = _schedule.fwd_slot_bytes(dtype, step.items, step.block[0], False)
        assert step.smem == slots * slot, (shape, dtype, step.smem, slot)


def test_plain_rows_take_the_lean_forward():
    """rows_fwd_block's staged plain rows at two vectors a thread go to rows_fwd_lean (a
    thread's weight and bias loaded once, not a row at a time), with or without a residual and
    statistics, parameters or not: in registers where they are in x's dtype (``param_in_t``;
    float32 rows: float32), else (16-bit rows, a float32 weight or bias) in float32 in a
    stash past the ring (lean_stash_bytes), where the ring keeps 2 slots of the SM's share
    beside it. Rows of a weight a channel (NCHW group norm), unstaged rows (float64, rows not
    of whole vectors) and four float32 vectors a thread (16384) keep rows_fwd_block. Grid,
    block and ITEMS are rows_fwd_block's either way."""
    def step(op, shape, dtype, pin, present, **kw):
        plan = _plan(op, shape, **kw)
        layout = _layout.plan_layout(plan, _strides(plan.shape))
        return _schedule.schedule_forward(plan, dtype, layout, set(present), param_in_t=pin, device=H100).steps[0]

    wb, res = {"w", "b"}, {"res", "h"}
    for n, dtype, pin, present, want in [
            (4096, "bfloat16", 3, wb, "registers"), (768, "float16", 3, wb | STATS, "registers"),
            (16384, "bfloat16", 3, wb | res, "registers"), (4096, "float32", 0, wb, "registers"),
            (4096, "bfloat16", 0, set(), "registers"), (4096, "bfloat16", 1, {"w"}, "registers"),
            (4096, "bfloat16", 0, wb, "stash"), (4096, "bfloat16", 1, wb, "stash"), (1024, "float16", 2, wb, "stash"),
            (4096, "bfloat16", 0, {"w"}, "stash"), (768, "bfloat16", 0, wb | STATS, "stash"),
            (512, "float16", 2, wb, None), (768, "bfloat16", 0, wb | res | STATS, None),  # no room for the stash
            (16384, "float32", 0, wb, None), (4096, "float64", 0, wb, None), (1001, "float32", 0, wb, None),
            (1001, "bfloat16", 3, wb, None)]:
        chosen = step("layer_norm", (64, n), dtype, pin, present)
        assert chosen.name == ("rows_fwd_lean" if want else "rows_fwd_block"), (n, dtype, pin, present)
        stash = _schedule.lean_stash_bytes(dtype, chosen.items, chosen.block[0]) if want == "stash" else 0
        # the kernel's last argument: param_in_t, bit 2 set for the stash
        assert int(chosen.template[-1]) == (pin | 4 if want == "stash" else pin), (n, dtype, chosen.template[-1])
        if want:  # a ring of 2 or more slots, and the stash past it
            slot = _schedule.fwd_slot_bytes(dtype, chosen.items, chosen.block[0], bool(present & res))
            assert (chosen.smem - stash) % slot == 0 and chosen.smem - stash >= 2 * slot, (n, dtype, present, chosen)
            resident = min(1024 // chosen.block[0], 32)
            assert resident * (chosen.smem + _schedule._ROW_STATIC_SMEM + 1024) <= H100.smem_optin + 1024
        other = step("layer_norm", (64, n), dtype, 3 - pin if dtype != "float32" else pin, present)
        assert (other.grid, other.block, other.items) == (chosen.grid, chosen.block, chosen.items)
    assert step("rms_norm", (64, 4096), "bfloat16", 1, {"w"}).name == "rows_fwd_lean"
    # 16-bit parameters in the stash too where the registers rule is off (gpu_row_variants.py's
    # stash16): the same kernel, the stash's room and flag
    saved = _schedule._lean_rows
    _schedule._lean_rows = lambda plain, dtype, *a: dtype == "float32" and saved(plain, dtype, *a)
    try:
        stashed = step("layer_norm", (64, 4096), "bfloat16", 3, wb)
    finally:
        _schedule._lean_rows = saved
    held = step("layer_norm", (64, 4096), "bfloat16", 3, wb)
    assert stashed.name == held.name == "rows_fwd_lean" and int(stashed.template[-1]) == 7 == int(held.template[-1]) + 4
    assert stashed.smem == held.smem + _schedule.lean_stash_bytes("bfloat16", 16, held.block[0])
    assert step("group_norm", (4, 64, 16, 16), "bfloat16", 3, wb, channel_axis=1, num_groups=8).name == "rows_fwd_block"
    # no parameters at all (p_len 1 in the layout): plain rows, staged, whatever the layout
    for op, shape, kw, dtype in [("layer_norm", (256, 4096), {}, "float32"), ("rms_norm", (64, 4096), {}, "bfloat16"),
                                 ("instance_norm", (2, 3, 40, 48), {"channel_axis": 1}, "bfloat16"),
                                 ("group_norm", (2, 8, 16, 16), {"channel_axis": 1, "num_groups": 2}, "float32")]:
        plan = make_plan(op, np.zeros(shape, np.float32), **kw)
        layout = _layout.plan_layout(plan, _strides(plan.shape))
        bare = _schedule.schedule_forward(plan, dtype, layout, STATS, device=H100).steps[0]
        assert bare.name == "rows_fwd_lean" and bare.smem > 0, (op, shape, bare)


def test_multi_row_backward_reads_groups_ahead_through_a_ring():
    """rows_bwd_multi gets room for 4 slots of a group's x and dy (2 x 256 16-byte vectors: 3
    groups in flight ahead) past its static sums, within the share of an SM of its resident
    blocks (3 in 16-bit types, 4 in float32); float64 and rows not of whole vectors none."""
    grads = {"w", "rstd", "mean", "dw", "db"}
    for shape, dtype, slots in [((32768, 768), "bfloat16", 4), ((65536, 96), "float16", 4),
                                ((32768, 1024), "float32", 4), ((4096, 512), "float64", 0),
                                ((4096, 101), "float32", 0), ((4096, 100), "bfloat16", 0)]:
        step = _backward(_plan("layer_norm", shape), grads, dtype=dtype).steps[0]
        assert (step.name, step.smem) == ("rows_bwd_multi", slots * _schedule.MULTI_BWD_SLOT), (shape, dtype, step)
        per_sm = 3 if dtype in ("float16", "bfloat16") else 4
        need = step.smem + _schedule.multi_bwd_static_smem(dtype) + 1024
        assert per_sm * need <= H100.smem_optin + 1024


def test_param_partials_fill_the_sms_within_a_quarter_of_the_traffic():
    """The row backwards that sum dweight/dbias run on as many blocks as keep their partial
    rows (2 x count float32 sums a block, written and read back) within a quarter of the
    backward's traffic (x, dy, dx), in whole blocks per SM, at least one each, at most the
    resident ones. ConvNeXt-T's last stage in channels_last memory (3136 rows of 768) took
    132 blocks (8 warps an SM) and was slower than torch on an H100; now 2 (16-bit) and 4
    (float32) an SM."""
    grads = {"w", "rstd", "mean", "dw", "db"}
    last_stage = _plan("layer_norm", (3136, 768))
    # 16-bit: 3 resident an SM, but 3 x 132 partial rows would be 34% of the traffic
    assert _backward(last_stage, grads).steps[0].grid == (2 * 132,)
    assert _backward(last_stage, grads, dtype="float32").steps[0].grid == (4 * 132,)
    assert _backward(_plan("layer_norm", (1024, 768)), grads).steps[0].grid == (132,)  # 34%: one an SM
    for rows, count in [(3136, 768), (1024, 768), (12544, 384), (8192, 1024), (2048, 4096),
                        (20000, 2048), (600, 4096), (8192, 4096), (2048, 16384)]:
        for dtype, item in [("bfloat16", 2), ("float16", 2), ("float32", 4)]:
            step = _backward(_plan("layer_norm", (rows, count)), grads, dtype=dtype).steps[0]
            blocks = step.grid[0]
            assert step.name in ("rows_bwd_multi", "rows_bwd_block_params"), step
            assert blocks % 132 == 0, (rows, count, dtype, step)
            partial, traffic = 2 * 2 * blocks * count * 4, 3 * rows * count * item
            assert blocks == 132 or partial <= traffic / 4, (rows, count, dtype, blocks)


def test_block_backward_rows_read_ahead_on_the_resident_blocks():
    """Rows past rows_bwd_multi's: the block backwards run on the blocks resident at once (64
    registers: 1024 / threads an SM), with room past the dweight/dbias slots for a stage of
    rows' x and dy (slots of 2 * ITEMS * threads elements of x's dtype): one slot at two
    vectors a thread, 4 (3 rows ahead) for 16-bit rows at one vector a thread, whose slots
    also carry each row's rstd and first value (8 bytes a thread), their shared memory within
    the share of an SM of the resident blocks; float64 reads as it goes, a block a row."""
    grads, dx_only = {"w", "rstd", "mean", "dw", "db"}, {"rstd", "mean"}
    for shape, dtype, name, grid, block, items, slots in [
            ((8192, 4096), "bfloat16", "rows_bwd_block_params", 264, 512, 8, 4),
            ((4096, 8192), "float16", "rows_bwd_block_params", 132, 1024, 8, 4),
            ((2048, 16384), "bfloat16", "rows_bwd_block_params", 132, 1024, 16, 1),
            ((4096, 8192), "float32", "rows_bwd_block_params", 132, 1024, 8, 1),
            ((16384, 2048), "float32", "rows_bwd_block_params", 528, 256, 8, 1)]:
        itemsize = np.dtype(np.float32).itemsize if dtype == "float32" else 2
        plan = _plan("layer_norm", shape)
        step = _backward(plan, grads, dtype=dtype).steps[0]
        ring = itemsize == 2 and items == 8
        sums, slot = 2 * items * block * 4, 2 * items * block * itemsize + (8 * block if ring else 0)
        assert (step.name, step.grid, step.block, step.items) == (name, (grid,), (block,), items)
        assert step.smem == sums + slots * slot  # the sums, then the stage
        per_sm = grid // 132
        assert per_sm * (step.smem + _schedule._ROW_STATIC_SMEM + 1024) <= H100.smem_optin + 1024
        step = _backward(plan, dx_only, dtype=dtype).steps[0]
        assert (step.name, step.grid, step.smem) == ("rows_bwd_block", (grid,), slots * slot)
    # few rows: a block each
    assert _backward(_plan("layer_norm", (64, 4096)), grads).steps[0].grid == (64,)
    # NCHW instance norm rows with dweight: a partial per row, any grid
    step = _backward(_plan("instance_norm", (8, 64, 128, 128), channel_axis=1), grads).steps[0]
    assert (step.name, step.grid, step.smem) == ("rows_bwd_block_row_params", (132,), 2 * 16 * 1024 * 2)
    # float32 rows of 8193-16384 with dweight: rows_bwd_block_params at ITEMS=16, its sums
    # filling the room (no stage), one pass; without dweight, or fewer rows than SMs, as before
    wide = _plan("layer_norm", (2048, 16384))
    step = _backward(wide, grads, dtype="float32").steps[0]
    assert (step.name, step.grid, step.block, step.items, step.smem) == (
        "rows_bwd_block_params", (132,), (1024,), 16, 2 * 16 * 1024 * 4)
    assert _backward(wide, dx_only, dtype="float32").names == ("rows_bwd_smem",)
    assert "rows_bwd_block_params" not in _backward(_plan("layer_norm", (64, 16384)), grads, dtype="float32").names
    f64 = _backward(_plan("layer_norm", (8192, 4096)), dx_only, dtype="float64").steps[0]
    assert (f64.name, f64.grid, f64.smem) == ("rows_bwd_block", (8192,), 0)


def test_convnext_channels_first_is_one_tile_kernel():
    plan = _plan("layer_norm", (64, 96, 56, 56), axis=1)
    assert _forward(plan, {"w", "b"}).names == ("cols_fwd_tile",)
    # 128 columns, 32 vectors of 4: the backward's arithmetic in vectors too
    assert _backward(plan, {"w", "rstd", "mean", "dw", "db"}).names == ("cols_bwd_tile_vec", "param_grad_finish")


def _tile_backward(plan, dtype, present=frozenset({"w", "rstd", "mean", "dw", "db"})):
    """(grid, width, smem, items, nchunk or None) of the tile backward of ``plan`` (cols_bwd_tile
    or, where the width holds its vectors, cols_bwd_tile_vec: the same arguments)."""
    steps = _backward(plan, set(present), dtype).steps
    tile = steps[0]
    assert tile.name in ("cols_bwd_tile", "cols_bwd_tile_vec")
    outer, inner, width = (int(tile.template[k]) for k in (8, 10, 12))
    nchunk = int(steps[1].template[5]) if len(steps) > 1 else None
    return tile.grid, width, tile.smem, outer * -(-inner // width), nchunk


# ConvNeXt's channels-first layer norms (p = r), H100: (shape, dtype, tile width, (o, tile) items);
# the 7x7 stage takes a cluster a sample (test_samples_emulated.py)
CONVNEXT = [((64, 96, 56, 56), "bfloat16", 128, 64 * 25), ((64, 192, 28, 28), "bfloat16", 64, 64 * 13),
            ((64, 384, 14, 14), "bfloat16", 16, 64 * 13), ((64, 96, 56, 56), "float32", 64, 64 * 49),
            ((64, 384, 14, 14), "float32", 16, 64 * 13)]


def test_convnext_tile_backward_is_a_persistent_grid():
    """cols_bwd_tile runs the blocks resident at once (3 of 256 threads per SM by its 80
    registers: 396 on an H100), each taking (o, tile) items in turn and keeping dweight/dbias
    per channel in shared memory (2 x C float32 past the tiles): param_grad_finish adds 396
    partial rows, not outer x tiles (stage 1 bfloat16: 1600 before; stage 4: 448)."""
    for shape, dtype, width, items in CONVNEXT:
        grid, got_width, smem, got_items, nchunk = _tile_backward(_plan("layer_norm", shape, axis=1), dtype)
        c, itemsize = shape[1], 2 if dtype == "bfloat16" else 4
        assert (got_width, got_items) == (width, items), (shape, dtype, got_width, got_items)
        assert grid == (3 * 132,) and nchunk == 3 * 132, (shape, dtype, grid, nchunk)
        assert smem == 2 * c * width * itemsize + 2 * c * 4
    # dx alone: the same persistent grid, no accumulators
    grid, width, smem, _, nchunk = _tile_backward(_plan("layer_norm", (64, 96, 56, 56), axis=1), "bfloat16",
                                                  {"w", "rstd", "mean"})
    assert grid == (396,) and nchunk is None and smem == 2 * 96 * width * 2
    # fewer items than resident blocks: a block each
    grid, _, _, items, nchunk = _tile_backward(_plan("layer_norm", (4, 384, 14, 14), axis=1), "bfloat16")
    assert grid == (items,) == (nchunk,) == (100,)


def test_nhwc_tile_backward_keeps_partials_per_sample():
    """NHWC instance/group norm (p = i, the column): the persistent grid too, but the
    dweight/dbias partials stay one row of C per sample (nchunk = N): a row per block would be
    396 rows of C, more than N of them."""
    # (op, shape, kwargs, items, grid): 32x56x56x128's 98 KiB tiles leave room for 2 blocks per
    # SM (C <= 64 takes a cluster a sample)
    cases = [("instance_norm", (32, 56, 56, 128), {}, 32 * 16, 264),
             ("group_norm", (32, 28, 28, 256), {"num_groups": 32}, 32 * 32, 396),
             # 64 columns (16 vectors of 4: cols_bwd_tile_vec), not the 112 that fit (19 tiles)
             ("instance_norm", (32, 7, 7, 2048), {}, 32 * 32, 396)]
    for op, shape, kw, items, blocks in cases:
        grid, _, smem, got_items, nchunk = _tile_backward(_plan(op, shape, channel_axis=-1, **kw), "bfloat16")
        assert (grid, got_items, nchunk) == ((blocks,), items, 32), (op, shape, grid, got_items, nchunk)


def test_long_rows_split_with_workspaces_in_scratch():
    plan = _plan("layer_norm", (4, 100_000))
    with_stats = _forward(plan, {"w", "b"} | STATS)
    assert with_stats.names == ("rows_stats_partial", "rows_stats_finalize", "rows_apply_fwd")
    inference = _forward(plan, {"w", "b"})
    # the statistics rows_apply_fwd reads live in scratch when the caller wants none
    assert inference.scratch_bytes == with_stats.scratch_bytes + 2 * _schedule.ALIGN
    scratch = _schedule.FORWARD_SLOTS.index("scratch")
    for step in inference.steps:
        for _, slot in step.slots:
            assert slot.index != scratch or slot.offset < inference.scratch_bytes


def test_rows_past_one_block_span_a_cluster():
    """Rows past one block's shared memory, or too few to give rows_fwd_smem an SM each,
    split over a thread-block cluster whose blocks each hold a part (x read once), at the
    smallest C whose parts let two blocks of 512 share an SM (one loads while the other sums),
    else the smallest that fits: bfloat16 rows of 262144 (512 KiB) on clusters of 8 (64 KiB a
    block, where 4 gave an SM a block), float32 rows of 65536 on clusters of 4, 64 bfloat16
    rows of 40960 on clusters of 4 (clusters of 2 would leave SMs without a block). A cluster
    a row: a persistent grid of SMs x blocks / C clusters need not all be resident (a GPC
    whose slots are not a multiple of C leaves some idle), and the one left over would run
    its rows after the others. The split path before sm_90 and past 4 blocks' memory."""
    long = _plan("layer_norm", (128, 262144))
    step, = _forward(long, {"w", "b"}).steps
    assert (step.name, step.items, step.grid, step.block, step.smem) == (
        "rows_fwd_cluster", 8, (128 * 8,), (512,), 262144 // 8 * 2 + 72 * 4)
    step, = _forward(_plan("layer_norm", (512, 65536)), {"w", "b"}, "float32").steps
    assert (step.name, step.items, step.grid, step.block, step.smem) == (
        "rows_fwd_cluster", 4, (512 * 4,), (512,), 65536 // 4 * 4 + 72 * 4)
    step, = _forward(_plan("layer_norm", (64, 40960)), {"w", "b"}).steps
    assert (step.name, step.items, step.grid, step.block) == ("rows_fwd_cluster", 4, (256,), (512,))
    split = ("rows_stats_partial", "rows_stats_finalize", "rows_apply_fwd")
    assert _forward(long, {"w", "b"} | STATS, device=_schedule.DeviceInfo(132, 227 * 1024)).names == split
    # a device whose clusters stop at 4: bfloat16 rows of 262144 an SM a block
    four = _schedule.DeviceInfo(132, 227 * 1024, 4)
    step, = _forward(long, {"w", "b"}, device=four).steps
    assert (step.items, step.grid, step.block) == (4, (128 * 4,), (1024,))
    # backward: x and dy of float32 rows of 65536 on clusters of 8 (2 x 32 KiB a block, two an
    # SM), dx in one kernel (3 transfers where the split path moves 5), dweight/dbias after it
    full = _backward(_plan("layer_norm", (512, 65536)), {"w", "mean", "rstd", "dw", "db"}, "float32")
    assert full.names == ("rows_bwd_cluster", "param_grad_cols", "param_grad_finish")
    assert (full.steps[0].items, full.steps[0].block, full.steps[0].smem) == (8, (512,), 2 * 65536 // 8 * 4 + 72 * 4)
    # bfloat16 rows of 262144 with dy (1 MiB): clusters of 8, 2 x 64 KiB a block, an SM each
    step, = _backward(long, {"w", "mean", "rstd"}).steps
    assert (step.name, step.items, step.grid, step.block, step.smem) == (
        "rows_bwd_cluster", 8, (128 * 8,), (1024,), 2 * 262144 // 8 * 2 + 72 * 4)
    assert _forward(_plan("layer_norm", (128, 1 << 20)), {"w", "b"} | STATS).names == split


def test_group_norm_rows_in_shared_memory_sum_their_parameter_gradients():
    """NCHW rows of parameter segments that fit shared memory with dy (Stable Diffusion's
    64x64 GroupNorm(32, 320) in bfloat16: rows of 10 segments of 4096, 160 KiB with dy):
    rows_bwd_smem writes dx and the per-(row, segment) dweight/dbias partials in the layout of
    the segments path, param_grad_finish adds them over the batch (3 transfers of x's size
    where the segments path moves 5). Without dbias its partial is null; without dweight
    the kernel sums nothing. Where the rows do not fit (float32: 320 KiB) or are too few to
    fill the SMs, the segments path as before."""
    sd = _plan("group_norm", (8, 320, 64, 64), num_groups=32)
    full = _backward(sd, {"w", "mean", "rstd", "dw", "db"})
    assert full.names == ("rows_bwd_smem", "param_grad_finish"), full.names
    smem, finish = full.steps
    assert (smem.grid, smem.block, smem.smem) == ((132,), (1024,), 2 * 40960 * 2)
    slotted = {position for position, _ in smem.slots}
    assert {6, 7} <= slotted  # part_w, part_b: in the scratch buffer
    parts = {position: slot for position, slot in smem.slots if position in (6, 7)}
    assert parts[6].count == parts[7].count == 8 * 320 and parts[6].offset != parts[7].offset
    assert [int(a) for a in finish.template[4:6]] == [320, 8]  # p_len, nchunk = batch
    assert {position: slot.offset for position, slot in finish.slots}[0] == parts[6].offset
    no_bias = _backward(sd, {"w", "mean", "rstd", "dw"})
    assert no_bias.names == ("rows_bwd_smem", "param_grad_finish")
    assert 7 not in {p for p, _ in no_bias.steps[0].slots} and no_bias.steps[0].template[7] is None
    dx_only = _backward(sd, {"w", "mean", "rstd"})
    assert dx_only.names == ("rows_bwd_smem",) and dx_only.scratch_bytes == 0
    assert not {6, 7} & {p for p, _ in dx_only.steps[0].slots} and dx_only.steps[0].template[6:8] == [None, None]
    instance = _plan("instance_norm", (2, 160, 160, 160))  # one segment a row, 320 rows of 25600
    assert _backward(instance, {"w", "mean", "rstd", "dw", "db"}).names == ("rows_bwd_smem", "param_grad_finish")
    segments = ("rows_grad_partial", "segment_grad_finalize", "apply_bwd", "param_grad_finish")
    assert _backward(sd, {"w", "mean", "rstd", "dw", "db"}, "float32").names == segments
    few = _plan("group_norm", (2, 320, 64, 64), num_groups=32)  # 64 rows for 132 SMs
    assert _backward(few, {"w", "mean", "rstd", "dw", "db"}).names == segments


def test_the_device_decides_grids_and_kernels():
    """Rows too long for shared memory everywhere: the same split kernels, other grids; rows
    an H100 holds in shared memory (one block's, or a cluster's) and a 48 KiB device does
    not: other kernels."""
    plan = _plan("group_norm", (8, 320, 512, 512), num_groups=32)  # rows of 2621440: 5 MiB
    big, small = _forward(plan, {"w", "b"}, device=H100), _forward(plan, {"w", "b"}, device=SMALL)
    assert big.names == small.names
    assert [s.grid for s in big.steps] != [s.grid for s in small.steps]
    sd128 = _plan("group_norm", (8, 320, 128, 128), num_groups=32)  # rows of 163840: 320 KiB
    assert _forward(sd128, {"w", "b"}, device=H100).names == ("rows_fwd_cluster",)
    assert _forward(sd128, {"w", "b"}, device=SMALL).names[0] == "rows_stats_partial"
    sd = _plan("group_norm", (8, 320, 64, 64), num_groups=32)  # rows of 40960: 80 KiB in bfloat16
    assert _forward(sd, {"w", "b"}, device=H100).names == ("rows_fwd_smem",)
    assert _forward(sd, {"w", "b"}, device=SMALL).names[0] == "rows_stats_partial"


def test_parameter_dtype_flag_is_in_the_template():
    """param_in_t is the kernels' last argument: bits 0 and 1 as given (weight, bias in x's
    dtype), bit 2 where rows_fwd_lean takes float32 parameters from its stash."""
    plan = _plan("layer_norm", (64, 768))
    layout = _layout.plan_layout(plan, (768, 1))
    plain = _schedule.schedule_forward(plan, "bfloat16", layout, {"w", "b"}, 0, H100)
    in_x = _schedule.schedule_forward(plan, "bfloat16", layout, {"w", "b"}, 3, H100)
    unhold = lambda a: int(np.asarray(a.value if hasattr(a, "value") else a))  # noqa: E731
    assert unhold(plain.steps[0].template[-1]) == 4 and unhold(in_x.steps[0].template[-1]) == 3
    assert plain.steps[0].name == in_x.steps[0].name == "rows_fwd_lean"


def _as_data(schedule):
    return [(s.name, s.grid, s.block, s.smem, s.template,
             [(position, slot.index, slot.offset) for position, slot in s.slots]) for s in schedule.steps]


def test_schedules_are_the_same_from_8_threads():
    plan = _plan("layer_norm", (4, 100_000))
    want = _as_data(_forward(plan, {"w"}))
    got, barrier = [], threading.Barrier(8)

    def work():
        barrier.wait()
        for _ in range(20):
            got.append(_as_data(_forward(plan, {"w"})))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 160 and all(g == want for g in got)


def test_schedules_need_no_cupy():
    """``_layout`` and ``_schedule`` import and compute without CuPy (a process where
    ``import cupy`` fails), while the executor refuses to import."""
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import numpy as np\n"
            "from anynorm._cuda import _layout, _schedule\n"
            "from anynorm._plan import make_plan\n"
            "plan = make_plan('layer_norm', np.zeros((64, 768), np.float32))\n"
            "layout = _layout.plan_layout(plan, (768, 1))\n"
            "s = _schedule.schedule_forward(plan, 'bfloat16', layout, set(), 0, _schedule.DeviceInfo(132, 232448))\n"
            "print(s.names, 'cupy' in sys.modules and sys.modules['cupy'] is not None)\n"
            "try:\n    import anynorm._cuda._executor\nexcept ImportError:\n    print('executor: ImportError')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(pathlib.Path(__file__).resolve().parents[1]))
    assert run.stdout.splitlines() == ["('rows_fwd_lean',) False", "executor: ImportError"], run.stdout + run.stderr


def test_long_rows_that_fit_shared_memory_read_x_once():
    """Rows past the register kernels that fit a block's shared memory on an H100: one kernel
    forward (rows_fwd_smem), the backward's dx in one (rows_bwd_smem) and dweight/dbias
    after it; Stable Diffusion's 64x64 GroupNorm(32, 320) rows (40960) forward likewise;
    rows too long (float32 65536: 256 KiB) or too few to fill the SMs take a cluster of blocks
    (test_rows_past_one_block_span_a_cluster), or the split path where clusters do not exist."""
    plan = _plan("layer_norm", (1024, 32768))
    assert _forward(plan, {"w", "b"}).names == ("rows_fwd_smem",)
    assert _backward(plan, {"w", "mean", "rstd", "dw", "db"}).names == (
        "rows_bwd_smem", "param_grad_cols", "param_grad_finish")
    f32 = _plan("layer_norm", (1024, 16384))  # past rows_bwd_block's float32 (8192); with dweight
    assert _backward(f32, {"w", "mean", "rstd"}, "float32").names == ("rows_bwd_smem",)  # rows_bwd_block_params
    sd = _plan("group_norm", (8, 320, 64, 64), num_groups=32)
    step = _forward(sd, {"w", "b"}).steps
    assert [(s.name, s.block, s.smem) for s in step] == [("rows_fwd_smem", (512,), 40960 * 2)]
    no_clusters = _schedule.DeviceInfo(132, 227 * 1024)  # an A100-like device: none
    assert _forward(_plan("layer_norm", (512, 65536)), {"w"}, "float32", no_clusters).names[0] == "rows_stats_partial"
    assert _forward(_plan("layer_norm", (64, 32768)), {"w"}, device=no_clusters).names[0] == "rows_stats_partial"
    assert _forward(_plan("layer_norm", (64, 32768)), {"w"}).names == ("rows_fwd_cluster",)
