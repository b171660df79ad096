"""``anynorm._cuda._schedule`` and ``_launcher`` end to end on the CPU: the launch
schedules (layouts, chunk sizes, grids, workspaces, argument order), bound and launched,
drive the real kernels compiled by the emulation harness (``tests/emulation/emu_harness.py``),
against the reference executor.

CuPy's allocator and kernel lookup are swapped for the harness's emulated device memory
and modules; the device is pretended small (few blocks) so grid-stride loops, several
chunks per row and several partial chunks per column all run. Layout copies
(``_launcher.input_buffer``) need real CuPy arrays and are left to the GPU suite: the buffers here are given in memory
order with the strides the layout reads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cupy", exc_type=ImportError)  # anynorm._cuda imports CuPy (no GPU needed)
_launcher = pytest.importorskip("anynorm._cuda._launcher", exc_type=ImportError)

from anynorm import _reference  # noqa: E402
from anynorm._cuda import _compile, _layout, _schedule  # noqa: E402
from anynorm._plan import make_plan  # noqa: E402

_HERE = Path(__file__).resolve().parent
_NAME = "anynorm_emu_harness"
if _NAME in sys.modules:
    emu = sys.modules[_NAME]
else:
    _spec = importlib.util.spec_from_file_location(_NAME, _HERE / "emulation" / "emu_harness.py")
    emu = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = emu
    _spec.loader.exec_module(emu)

pytestmark = pytest.mark.skipif(emu.compiler() is None or not hasattr(os, "fork"),
                                reason="the CUDA emulation needs g++ and fork()")

SOURCES = [str(_HERE.parent / "kernels" / f) for f in _compile.KERNELS]
# Shared memory for a tile of the columns kernels: small, so that the columns cases below
# take tiles narrower than inner (several per row of tiles) and some fall back to the split path.
TILE_BUDGET = 6 * 1024
SMEM_LIMIT = 227 * 1024  # an H100's, for the row backward's shared-memory parameter sums
# Largest errors seen over these cases, relative to max(1, |reference|): float64 8e-16,
# float32 9e-7, float16 4.4e-4 (y and dx: the last rounding to float16), bfloat16 3.7e-3;
# each tolerance is a few times that, so that a wrong weight or partial sum fails it.
TOL = {"float64": 1e-14, "float32": 3e-6, "float16": 2e-3, "bfloat16": 1.5e-2}
_modules: dict = {}


def _module(dtype):
    if dtype not in _modules:
        names = [e for f in _compile.KERNELS for e in _compile.name_expressions(f, dtype)]
        _modules[dtype] = emu.Module(emu.build(SOURCES, names, f"anynorm-launch-{dtype}"), names)
    return _modules[dtype]


def _row_view(parent, start, n):
    """Elements [start, start + n) of an emulated buffer, as a DeviceArray."""
    v = emu.DeviceArray.__new__(emu.DeviceArray)
    v.shape, v.dtype, v.size = (n,), parent.dtype, n
    v.array = parent.array.reshape(-1)[start:start + n]
    v.nbytes = n * v.array.itemsize
    v.ptr = parent.ptr + start * v.array.itemsize
    v.guard_damage = parent.guard_damage
    return v


def _typed_view(parent, offset, dtype, count):
    """``count`` elements of ``dtype`` at byte ``offset`` of an emulated scratch buffer."""
    v = emu.DeviceArray.__new__(emu.DeviceArray)
    name = np.dtype(dtype).name
    v.shape, v.dtype, v.size = (count,), name, count
    v.array = parent.array.reshape(-1)[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)
    v.nbytes = count * np.dtype(dtype).itemsize
    v.ptr = parent.ptr + offset
    v.guard_damage = parent.guard_damage
    return v


def _emulated_arg(buf, slot):
    """A slot's kernel argument on the emulated device: the DeviceArray itself (the emulator
    checks its dtype and canaries), a typed view of the scratch for a workspace."""
    if buf is None:
        return None
    if slot.dtype is None:
        assert slot.offset == 0
        return buf
    return _typed_view(buf, slot.offset, slot.dtype, slot.count)


def _launch_on_emulator(monkeypatch):
    """``_launcher`` on the emulated kernels: a small device (6 blocks target, a tile budget
    of TILE_BUDGET), scratch in emulated memory, nothing bound kept between calls (the
    tests patch the schedule's decisions)."""
    monkeypatch.setattr(_launcher, "get_kernel",
                        lambda k, dtype, items=None: _module(dtype).get_function(
                            _compile.name_expression(k, dtype, items)).as_cupy(
                                items if k in CLUSTER_KERNELS else 1))
    monkeypatch.setattr(_launcher, "device_info", lambda device: _schedule.DeviceInfo(132, SMEM_LIMIT, 8))
    monkeypatch.setattr(_launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(_launcher, "_device_context", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(_launcher, "_current_stream", lambda: None)
    monkeypatch.setattr(_launcher, "_scratch", lambda n: emu.empty(n, "uint8") if n else None)
    monkeypatch.setattr(_launcher, "_memo", lambda plan: {})
    monkeypatch.setattr(_launcher, "buffer_arg", _emulated_arg)
    monkeypatch.setattr(_schedule, "_target_blocks", lambda: 6)
    monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (TILE_BUDGET,))
    monkeypatch.setattr(_schedule, "_smem_limit", lambda: SMEM_LIMIT)
    # long rows take the split path here (its cases below); test_launch_rows_in_shared_memory
    # puts rows_fwd_smem back
    monkeypatch.setattr(_schedule, "_smem_row", lambda layout, dtype, copies=1: None)
    monkeypatch.setattr(_schedule, "_cluster_row", lambda layout, dtype, copies=1: None)  # as _smem_row
    # columns of small inner extent take the tiles here (their cases: use_sample_clusters)
    monkeypatch.setattr(_schedule, "_sample_cluster", lambda layout, dtype, copies, param_grads=None: None)


_SMEM_ROW = _schedule._smem_row
_CLUSTER_ROW = _schedule._cluster_row
_SAMPLE_CLUSTER = _schedule._sample_cluster
CLUSTER_KERNELS = ("rows_fwd_cluster", "rows_bwd_cluster", "cols_fwd_cluster", "cols_bwd_cluster")  # their ITEMS: the cluster size (blocks along x)


@pytest.fixture
def emulated(monkeypatch):
    _launch_on_emulator(monkeypatch)
    monkeypatch.setattr(_launcher, "element_strides", lambda a: a.elem_strides)
    monkeypatch.setattr(_launcher, "input_buffer", lambda p, l, a: a)
    monkeypatch.setattr(_launcher, "output_buffer", lambda p, l, a: a)
    monkeypatch.setattr(_launcher, "store", lambda p, l, b, o: None)


def _rounded(a, dtype):
    if dtype == "bfloat16":
        return emu.bf16_to_float(emu.bf16_bits(a)).astype(np.float64)
    return a.astype(dtype).astype(np.float64)


def _device(x, order, dtype, offset):
    """x's elements in memory ``order`` on the emulated device, tagged with x's strides."""
    mem = np.ascontiguousarray(np.transpose(x, order))
    logical = np.transpose(mem, np.argsort(order))
    d = emu.to_device(mem.reshape(-1), dtype, offset)
    d.elem_strides = tuple(s // mem.itemsize for s in logical.strides)
    return d


def _host(d, shape, order):
    return np.transpose(d.get_float().reshape([shape[a] for a in order]), np.argsort(order))


def _assert_scaled(got, want, rtol, what):
    err = float(np.abs(got - want).max(initial=0))
    assert err <= rtol * max(1.0, float(np.abs(want).max(initial=0))), (what, err)


def _replay(schedule, plan, dtype, layout, names, buffers, pin, *extra):
    """Compute a schedule for the buffers given (``names`` -> DeviceArray or None), bind it
    (``_launcher``) and launch it with their addresses, as the hot path does."""
    present = {name for name, d in zip(names, buffers) if d is not None}
    bound = _launcher.bind(schedule(plan, dtype, layout, present, pin, *extra))
    scratch = emu.empty(max(1, bound.scratch_bytes), "uint8") if bound.scratch_bytes else None
    ptrs = [0 if d is None else d.ptr for d in buffers] + [0 if scratch is None else scratch.ptr]
    bound.run(ptrs, None)
    return bound


def _schedule_forward(plan, dtype, layout, present, pin):
    return _schedule.schedule_forward(plan, dtype, layout, present, pin, _launcher.device_info(0))


def _schedule_backward(plan, dtype, layout, present, pin, gin):
    return _schedule.schedule_backward(plan, dtype, layout, present, pin, _launcher.device_info(0), gin)


def _forward(bound, plan, dtype, xd, wd, bd, rd, yd, hd, md, sd, pin=0):
    if not bound:
        _launcher.forward(plan, dtype, xd, wd, bd, rd, yd, hd, md, sd, pin)
        return
    layout = _layout.plan_layout(plan, xd.elem_strides)
    _replay(_schedule_forward, plan, dtype, layout, _schedule.FORWARD_SLOTS[:-1],
            (xd, rd, hd, yd, wd, bd, md, sd), pin)


def _backward(bound, plan, dtype, dyd, xd, wd, md, sd, dxd, dwd, dbd, pin=0, gin=0):
    if not bound:
        _launcher.backward(plan, dtype, dyd, xd, wd, md, sd, dxd, dwd, dbd, pin & 1, gin)
        return
    layout = _layout.plan_layout(plan, xd.elem_strides, plan.has_weight or dwd is not None)
    _replay(_schedule_backward, plan, dtype, layout, _schedule.BACKWARD_SLOTS[:-1],
            (dyd, xd, wd, md, sd, dxd, dwd, dbd), pin & 1, gin)



def forward_float32(op, x, kw):
    """``(plan, xd, md, sd, y)``: ``_launcher.forward`` of the C-contiguous float32 ``x`` without
    parameters, its device buffers (mean ``md`` None for RMS norm) and ``y`` on the host."""
    plan = make_plan(op, x, **kw)
    xd = _device(x, tuple(range(x.ndim)), "float32", 0)
    yd = emu.empty(x.size, "float32")
    n = math.prod(plan.stats_shape)
    md = emu.empty(n, "float32") if plan.center else None
    sd = emu.empty(n, "float32")
    _launcher.forward(plan, "float32", xd, None, None, None, yd, None, md, sd)
    return plan, xd, md, sd, yd.get_float().reshape(x.shape)


# ANYNORM_EMU_SEED=k reruns every case on other data
SEED = int(os.environ.get("ANYNORM_EMU_SEED", "0"))


def _check(op, shape, kw, dtype, order=None, residual=False, offset=0, with_params=True,
           bound=False, stats=True, params_in_x=False):
    """Run forward and backward through ``_launcher`` against the reference; with ``bound``,
    the schedules are bound once and launched on the buffers' addresses (``_launcher.bind``),
    the forward without statistics unless ``stats``; with ``params_in_x`` the weight and bias
    are stored in x's dtype (``param_in_t``), not the accumulation dtype, and take their
    gradients in it (``grad_in_t``)."""
    # a seed of the case itself (str hashes change per process: PYTHONHASHSEED)
    rng = np.random.default_rng(zlib.crc32(repr((op, shape, dtype, residual, SEED)).encode()))
    order = order or tuple(range(len(shape)))
    acc = "float64" if dtype == "float64" else "float32"
    x = _rounded(rng.standard_normal(shape) * 3 + 1, dtype)
    res = _rounded(rng.standard_normal(shape), dtype) if residual else None
    pshape = make_plan(op, x, **kw).param_shape
    pdtype = dtype if params_in_x else acc
    w = _rounded(rng.standard_normal(pshape) * 0.5 + 1, pdtype) if with_params else None
    b = _rounded(rng.standard_normal(pshape) * 0.5, pdtype) if with_params and op != "rms_norm" else None
    pin = (int(w is not None) | 2 * int(b is not None)) if params_in_x else 0
    gin = 3 if params_in_x and dtype != acc else 0  # dweight/dbias written in x's dtype
    plan = make_plan(op, x, w, b, res, **kw)
    xd = _device(x, order, dtype, offset)
    assert not _layout.plan_layout(plan, xd.elem_strides).copy
    rd = _device(res, order, dtype, offset) if residual else None
    yd = emu.empty(x.size, dtype, offset)
    hd = emu.empty(x.size, dtype, offset) if residual else None
    nstats = math.prod(plan.stats_shape)
    md = emu.empty(nstats, acc) if plan.center else None
    sd = emu.empty(nstats, acc)
    wd = None if w is None else emu.to_device(w.reshape(-1), pdtype)
    bd = None if b is None else emu.to_device(b.reshape(-1), pdtype)
    y_alone = None
    if not stats:  # inference: y (and h) alone, no statistics written
        _forward(bound, plan, dtype, xd, wd, bd, rd, yd, hd, None, None, pin)
        y_alone = _host(yd, shape, order).copy()
    _forward(bound, plan, dtype, xd, wd, bd, rd, yd, hd, md, sd, pin)

    h = _rounded(x + res, dtype) if residual else x
    ry, _, rmean, rrstd = _reference.forward(make_plan(op, h, w, b, **kw), h, w, b)
    _assert_scaled(_host(yd, shape, order), ry, TOL[dtype], "y")
    if y_alone is not None:
        np.testing.assert_array_equal(y_alone, _host(yd, shape, order))
    # float32 means of ~1e4 values of scale 3 (|mean| ~ 1): rounding relative to the data,
    # not to the mean (2.2e-6 seen)
    stat_tol = 1e-14 if acc == "float64" else 4e-6
    _assert_scaled(sd.get_float().reshape(plan.stats_shape), rrstd, stat_tol, "rstd")
    if plan.center:
        _assert_scaled(md.get_float().reshape(plan.stats_shape), rmean, stat_tol, "mean")
    if residual:
        np.testing.assert_array_equal(_host(hd, shape, order), h)

    dy = _rounded(rng.standard_normal(shape) + 0.5, dtype)  # off zero: mean(g) matters in dx
    bplan = make_plan(op, h, w, **kw)
    rdx, rdw, rdb = _reference.backward(bplan, dy, h, w)
    hdev, dydev = _device(h, order, dtype, offset), _device(dy, order, dtype, offset)
    for given_stats in (False, True):
        dxd = emu.empty(x.size, dtype, offset)
        plen = math.prod(pshape)
        gdtype = dtype if gin else acc
        dwd = emu.empty(plen, gdtype) if w is not None else None
        dbd = emu.empty(plen, gdtype) if w is not None else None
        mean, rstd = ((md if plan.center else None), sd) if given_stats else (None, None)
        _backward(bound, bplan, dtype, dydev, hdev, wd, mean, rstd, dxd, dwd, dbd, pin, gin)
        _assert_scaled(_host(dxd, shape, order), rdx, 1.5 * TOL[dtype], "dx")
        if w is not None:
            # float32 sums of ~1e4 terms of either sign: the error is relative to their
            # magnitudes' sum (~1e4 here), not to the result (~50): 2.2e-5 of it seen
            grad_tol = 1e-13 if acc == "float64" else 5e-5
            if gin:  # and one rounding to x's dtype
                grad_tol += TOL[dtype]
            _assert_scaled(dwd.get_float().reshape(pshape), rdw, grad_tol, "dweight")
            _assert_scaled(dbd.get_float().reshape(pshape), rdb, grad_tol, "dbias")


CASES = [
    ("layer_norm", (5, 1), {}, None),  # warp, ITEMS=1
    ("layer_norm", (7, 3), {}, None),
    ("layer_norm", (6, 1000), {}, None),  # block of 128 per row, ITEMS=8
    ("layer_norm", (3, 1025), {}, None),  # block of 256 per row, ITEMS=8
    ("layer_norm", (2, 8192), {}, None),  # block of 1024 per row, ITEMS=8
    ("layer_norm", (2, 9000), {}, None),  # block of 1024 per row, ITEMS=16 (float32: with dweight too)
    ("layer_norm", (2, 17000), {}, None),  # chunked rows, several chunks
    ("layer_norm", (2, 3, 4, 5), {"axis": 1}, None),  # columns (channels-first), one tile per o
    ("layer_norm", (3, 70, 33), {"axis": 1}, None),  # columns, tiles 16 wide (8 backward)
    ("layer_norm", (2, 400, 9), {"axis": 1}, None),  # no tile fits: columns split path
    ("rms_norm", (2, 3000), {"axis": -1, "eps": 1e-6}, None),
    ("rms_norm", (2, 17000), {"axis": -1, "eps": 1e-6}, None),
    ("rms_norm", (2, 6, 5, 3), {"axis": 1, "eps": 1e-6}, None),
    ("instance_norm", (2, 3, 40, 50), {"channel_axis": 1}, None),  # block per row, p per row
    ("instance_norm", (2, 3, 90, 100), {"channel_axis": 1}, None),  # block per row (ITEMS=16), p per row
    ("instance_norm", (2, 4, 5, 3), {"channel_axis": -1}, None),  # NHWC columns
    ("instance_norm", (2, 3, 4, 5), {"channel_axis": 1}, (0, 2, 3, 1)),  # channels-last memory
    ("group_norm", (2, 6, 4, 5), {"channel_axis": 1, "num_groups": 3}, None),
    ("group_norm", (2, 4, 5, 6), {"channel_axis": -1, "num_groups": 3}, None),  # columns, group 2
    ("group_norm", (2, 8, 20, 20), {"channel_axis": 1, "num_groups": 2}, None),  # block per row
    ("group_norm", (1, 8, 50, 50), {"channel_axis": 1, "num_groups": 2}, None),  # block per row
    ("group_norm", (2, 6, 90, 70), {"channel_axis": 1, "num_groups": 2}, None),  # chunked rows of segments
    ("instance_norm", (2, 2, 130, 131), {"channel_axis": 1}, None),  # chunked rows of one segment
]


# Every case in float32 and float16; one per kernel path in bfloat16 and float64.
_SHORT = [CASES[i] for i in (1, 3, 5, 7, 9, 13, 17, 21)]
MATRIX = ([(c, d) for d in ("float32", "float16") for c in CASES]
          + [(c, d) for d in ("bfloat16", "float64") for c in _SHORT])


@pytest.mark.parametrize("case, dtype", MATRIX,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}-{d}" for c, d in MATRIX])
def test_launch_sequences(emulated, case, dtype):
    op, shape, kw, order = case
    _check(op, shape, kw, dtype, order)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_launch_without_parameters(emulated, dtype):
    _check("layer_norm", (3, 1025), {}, dtype, with_params=False)
    _check("group_norm", (2, 4, 5, 6), {"channel_axis": -1, "num_groups": 3}, dtype, with_params=False)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("shape", [(5, 40), (3, 2000), (2, 9000), (2, 17000)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_fused_residual(emulated, dtype, shape, offset):
    _check("layer_norm", shape, {}, dtype, residual=True, offset=offset)
    _check("rms_norm", shape, {"axis": -1, "eps": 1e-6}, dtype, residual=True, offset=offset)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_columns_split_path(emulated, monkeypatch, dtype):
    """Columns through cols.cu + finish.cu, as when no tile fits in shared memory."""
    monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (0,))
    names = _record_launches(monkeypatch)
    _check("layer_norm", (3, 70, 33), {"axis": 1}, dtype)
    _check("rms_norm", (2, 6, 5, 3), {"axis": 1, "eps": 1e-6}, dtype, residual=True)
    # the parameter is the reduced index (p = r): dweight/dbias read dy and x again
    assert {"cols_stats_partial", "cols_grad_partial", "cols_grad_finalize", "cols_param_grad_rows"} <= names
    assert not {"cols_fwd_tile", "cols_bwd_tile", "cols_bwd_tile_vec", "param_grad_cols", "param_grad_rows"} & names
    # the parameter is the column (p = i, NHWC): cols_grad_finalize hands the columns' unweighted
    # sums on as dweight/dbias partials
    for op, shape, kw in [("group_norm", (2, 4, 5, 6), {"channel_axis": -1, "num_groups": 3}),
                          ("instance_norm", (3, 7, 9, 5), {"channel_axis": -1})]:
        names.clear()
        _check(op, shape, kw, dtype)
        assert {"cols_grad_partial", "cols_grad_finalize", "param_grad_finish"} <= names, names
        assert not {"param_grad_cols", "param_grad_rows", "cols_bwd_tile", "cols_bwd_tile_vec"} & names, names


# the tile backward: cols_bwd_tile, or cols_bwd_tile_vec where the width holds its vectors
TILE_BACKWARDS = {"cols_bwd_tile", "cols_bwd_tile_vec"}


def test_launch_tile_past_default_shared_memory(emulated, monkeypatch):
    """A 62.5 KiB tile: the kernel is opted in before the launch (the emulator, like a GPU,
    refuses more than 48 KiB of dynamic shared memory otherwise)."""
    monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (64 * 1024,))
    monkeypatch.setattr(_schedule, "_target_blocks", lambda: 2)  # 2 blocks of all 16 columns suffice
    forward = _launcher.get_kernel("cols_fwd_tile", "float32")
    forward.max_dynamic_shared_size_bytes = 48 * 1024  # as a freshly loaded function
    names = _record_launches(monkeypatch)
    _check("layer_norm", (2, 1000, 4, 4), {"axis": 1}, "float32")
    assert {"cols_fwd_tile", "cols_bwd_tile_vec", "param_grad_finish"} <= names  # 16 columns: 4 vectors
    assert not {"cols_stats_partial", "cols_grad_partial", "param_grad_rows", "param_grad_cols"} & names
    assert forward.max_dynamic_shared_size_bytes == 1000 * 16 * 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_large_tile_tier(emulated, monkeypatch, dtype):
    """A reduced axis too long for the first budget takes a tile of the second (the device's
    whole opt-in limit on a GPU) when that gives a block per SM, else the split path."""
    # 600 rows of one 32-byte sector: 19 KiB a tile, past the first budget
    monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (6 * 1024, 80 * 1024))
    names = _record_launches(monkeypatch)
    _check("instance_norm", (4, 30, 20, 16), {"channel_axis": -1}, dtype)
    assert {"cols_fwd_tile", "param_grad_finish"} <= names and TILE_BACKWARDS & names
    assert not {"cols_stats_partial", "cols_grad_partial"} & names

    # a "device" of 32 SMs: 4 samples x 4 tiles of 16 bytes (2 for bfloat16) are too few blocks
    monkeypatch.setattr(_schedule, "_target_blocks", lambda: 32 * _schedule._BLOCKS_PER_SM)
    names.clear()
    _check("instance_norm", (4, 30, 20, 16), {"channel_axis": -1}, dtype)
    assert {"cols_stats_partial", "cols_grad_partial"} <= names
    assert not ({"cols_fwd_tile"} | TILE_BACKWARDS) & names


# (op, shape, kwargs): tiles whose backward runs on fewer blocks than (o, tile) items
_PERSISTENT_TILES = [
    ("layer_norm", (3, 12, 7, 7), {"axis": 1}),  # p = r, HW = 49: 7 tiles of 8 (odd inner)
    ("layer_norm", (2, 13, 5, 9), {"axis": 1}),  # p = r, C = 13 (not a multiple of 8), inner 45
    ("rms_norm", (3, 20, 4, 6), {"axis": 1, "eps": 1e-6}),  # p = r, no bias, no centring
    ("instance_norm", (3, 6, 7, 13), {"channel_axis": -1}),  # p = i (per-o partials), C = 13
    ("group_norm", (2, 3, 5, 12), {"channel_axis": -1, "num_groups": 3}),  # p = i, group 4, C = 12
    # (HW = 1 is a rows layout here; the kernel itself with one row: test_kernels_emulated)
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("op, shape, kw", _PERSISTENT_TILES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in _PERSISTENT_TILES])
def test_launch_tile_backward_persistent_grid(emulated, monkeypatch, dtype, op, shape, kw):
    """cols_bwd_tile on its persistent grid: the blocks resident at once (here a "device" of
    one SM: 3), each taking several (o, tile) items in turn; with p = r each block adds its
    items' dweight/dbias sums into one partial row, so param_grad_finish adds gridDim.x rows
    (not outer x tiles). dx, dweight and dbias against the float64 reference (``_check``)."""
    monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (2048,))  # narrow tiles: many items
    names = _record_launches(monkeypatch)
    _check(op, shape, kw, dtype)
    assert {"cols_fwd_tile", "param_grad_finish"} <= names and TILE_BACKWARDS & names, names
    x = np.zeros(shape, np.float32)
    w = np.ones(make_plan(op, x, **kw).param_shape, np.float32)
    plan = make_plan(op, x, w, None if op == "rms_norm" else w, **kw)
    layout = _layout.plan_layout(plan, tuple(s // x.itemsize for s in x.strides), True)
    present = {"w", "mean", "rstd", "dw"} | (set() if op == "rms_norm" else {"db"})
    steps = {st.name: st for st in _schedule_backward(plan, dtype, layout, present, 0, 0).steps}
    tile = next(steps[k] for k in TILE_BACKWARDS if k in steps)
    finish = steps["param_grad_finish"]
    width = int(tile.template[12])
    items = layout.outer * -(-layout.inner // width)
    assert tile.grid == (3,) and items > 3, (tile.grid, items)
    param_rows = int(tile.template[15])
    assert int(finish.template[5]) == (3 if param_rows else layout.outer)  # nchunk


@pytest.mark.parametrize("dtype, shape, fused", [
    ("float32", (70, 100), "rows_bwd_multi"),  # 70 rows: teams of 32, 8 rows a block at a time
    ("bfloat16", (40, 3000), "rows_bwd_block_params"),
    ("float64", (6, 1000), "rows_bwd_block_params"),  # past the warp sums' 256: a block, sums in smem
])
def test_launch_row_backward_sums_params_on_the_way(emulated, monkeypatch, dtype, shape, fused):
    """Layer/RMS norm rows: the row backward writes dweight/dbias partial sums per position
    itself, so dy and x are not read again; NCHW instance norm rows (p = the row's channel)
    per row; NCHW group norm rows (p changes within a row) leave them to params.cu."""
    names = _record_launches(monkeypatch)
    _check("layer_norm", shape, {}, dtype)
    _check("rms_norm", shape, {"axis": -1, "eps": 1e-6}, dtype)
    if fused:
        assert fused in names and "param_grad_finish" in names
        assert not {"param_grad_cols", "param_grad_rows"} & names
    else:
        assert "param_grad_cols" in names and not {n for n in names if n.endswith("_params")}
    names.clear()
    _check("instance_norm", (2, 3, 40, 50), {"channel_axis": 1}, dtype)  # p = channel of the row
    assert "rows_bwd_block_row_params" in names and not {"param_grad_cols", "param_grad_rows"} & names
    names.clear()
    _check("group_norm", (2, 8, 20, 20), {"channel_axis": 1, "num_groups": 2}, dtype)  # p varies in a row
    assert "param_grad_rows" in names and not {n for n in names if n.endswith("_params")}


def _multi_team(count, dtype):
    """rows_bwd_multi's team for ``count`` (one 16-byte vector a thread), or None past its block."""
    team = 1 << (-(-count // _schedule._VECTOR[dtype]) - 1).bit_length()
    return team if team <= _schedule._MULTI_BLOCK else None


def _forward_multi(count, dtype):
    """rows_fwd_multi takes the rows of its team, but rows of 64 vectors or more (16-bit and
    float32) go to rows_fwd_block at two vectors a thread."""
    return _multi_team(count, dtype) is not None and (dtype == "float64" or count < 64 * _schedule._VECTOR[dtype])


# (rows, count): one row (M=1); fewer rows than a block's teams; odd and not whole vectors
# (scalar items); grid-stride over more groups than the (6-block) grid; teams of one warp,
# of 2-8 warps (their sums meet in shared memory), of the whole block
MULTI_SHAPES = [(1, 8), (1, 200), (3, 24), (50, 5), (900, 12), (7, 100), (5, 777), (6, 1024), (3, 2000)]


@pytest.mark.parametrize("shape", MULTI_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_several_rows_per_block(emulated, monkeypatch, dtype, shape):
    """Short plain rows (or rows without parameters): rows_fwd_multi and rows_bwd_multi,
    weight and bias loaded once per thread for all its rows, dweight/dbias partials per block;
    with a residual, without parameters, parameters in x's dtype."""
    names = _record_launches(monkeypatch)
    _check("layer_norm", shape, {}, dtype)
    multi = _multi_team(shape[1], dtype) is not None
    assert ("rows_fwd_multi" in names) == _forward_multi(shape[1], dtype), names
    assert ("rows_bwd_multi" in names) == multi, names
    _check("rms_norm", shape, {"axis": -1, "eps": 1e-6}, dtype, residual=True, params_in_x=True)
    _check("layer_norm", shape, {}, dtype, with_params=False, offset=1)


@pytest.mark.parametrize("dtype, shape", [("float16", (5, 777)), ("float16", (900, 12)), ("float64", (3, 64)),
                                          ("float64", (7, 511))])
def test_launch_several_rows_per_block_dtypes(emulated, monkeypatch, dtype, shape):
    names = _record_launches(monkeypatch)
    _check("layer_norm", shape, {}, dtype)
    _check("layer_norm", shape, {}, dtype, residual=True, params_in_x=True)
    assert "rows_bwd_multi" in names, names
    assert ("rows_fwd_multi" in names) == _forward_multi(shape[1], dtype), names


def test_launch_rows_with_a_parameter_per_row_skip_the_multi_kernel(emulated, monkeypatch):
    """NCHW instance norm rows with weights (p = the row's channel): the warp kernel (the
    backward's statistics pass, without parameters, may take rows_fwd_multi)."""
    names = _record_launches(monkeypatch)
    plan = make_plan("instance_norm", np.zeros((2, 3, 4, 5)), np.ones(3), np.zeros(3), channel_axis=1)
    layout = _layout.plan_layout(plan, (60, 20, 5, 1))
    assert _schedule._multi_rows(layout, "float32", True) is None
    assert _schedule._multi_rows(layout, "float32", False) is not None
    _check("instance_norm", (2, 3, 4, 5), {"channel_axis": 1}, "float32")
    assert "rows_fwd_warp" in names


@pytest.mark.parametrize("dtype, one_pass", [("float32", True), ("bfloat16", True), ("float64", False)])
def test_launch_row_backward_up_to_16384_in_registers(emulated, monkeypatch, dtype, one_pass):
    """Rows of 8193-16384 with dweight: rows_bwd_block_params holds them in a block's
    registers (1024 threads, ITEMS=16, 64 registers), its dweight/dbias sums in shared memory
    (float32 too, where there is a row an SM at least: the emulated device's target makes one
    SM); float64 takes the chunked path."""
    names = _record_launches(monkeypatch)
    _check("layer_norm", (3, 12000), {}, dtype)
    chunked = {"rows_grad_partial", "rows_grad_finalize", "apply_bwd"}
    if one_pass:
        assert "rows_bwd_block_params" in names and not chunked & names
        assert not {"param_grad_cols", "param_grad_rows"} & names
    else:
        assert chunked <= names and not {"rows_bwd_block", "rows_bwd_block_params"} & names


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_long_rows_of_segments(emulated, monkeypatch, dtype):
    """NCHW group and instance norm rows past 16384 elements: one pass of per-segment (per
    channel) sums serves dx and dweight/dbias (5 transfers); without weight, or with segments
    shorter than a block, the plain split path (and param_grad_rows)."""
    names = _record_launches(monkeypatch)
    segmented = {"rows_grad_partial", "segment_grad_finalize", "apply_bwd", "param_grad_finish"}
    for op, shape, kw in [("group_norm", (2, 6, 90, 70), {"channel_axis": 1, "num_groups": 2}),
                          ("instance_norm", (2, 2, 130, 131), {"channel_axis": 1})]:
        names.clear()
        _check(op, shape, kw, dtype)
        assert segmented <= names and not {"param_grad_rows", "rows_grad_finalize"} & names, names
    names.clear()
    _check("group_norm", (2, 6, 90, 70), {"channel_axis": 1, "num_groups": 2}, dtype, with_params=False)
    assert "rows_grad_finalize" in names and "segment_grad_finalize" not in names
    names.clear()
    _check("group_norm", (1, 4096, 4, 4), {"channel_axis": 1, "num_groups": 2}, dtype)  # segments of 16
    assert {"rows_grad_finalize", "param_grad_rows"} <= names and "segment_grad_finalize" not in names


def _record_launches(monkeypatch):
    """The set of kernel names the launcher fetches from now on."""
    names, fetch = set(), _launcher.get_kernel
    monkeypatch.setattr(_launcher, "get_kernel", lambda k, dtype, items=None: names.add(k) or fetch(k, dtype, items))
    return names


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bound_schedules_replay(emulated, case, dtype):
    """The hot path: each schedule computed and bound once (``_launcher.bind``), then
    launched with the buffers' addresses and one scratch allocation; the forward also without
    statistics (inference writes y only, whichever kernel path the shape takes)."""
    op, shape, kw, order = case
    _check(op, shape, kw, dtype, order, bound=True, stats=False)
    if op in ("layer_norm", "rms_norm") and order is None:
        _check(op, shape, kw, dtype, order, residual=True, bound=True, stats=False)


def test_bound_schedule_matches_eager_launches(emulated, monkeypatch):
    """A recorded schedule holds the same kernels, grids, blocks and shared memory as the
    eager launcher, and its workspaces fit in its scratch at 256-byte boundaries."""
    calls = []
    fetch = _launcher.get_kernel

    class Spy:
        """The kernel, noting each launch as the GPU would see it."""

        def __init__(self, name, function):
            self.name, self.function = name, function

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            calls.append((self.name, tuple(grid), tuple(block), shared_mem))
            return self.function(grid, block, args, shared_mem=shared_mem)

        @property
        def max_dynamic_shared_size_bytes(self):
            return self.function.max_dynamic_shared_size_bytes

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, n):
            self.function.max_dynamic_shared_size_bytes = n

    monkeypatch.setattr(_launcher, "get_kernel", lambda k, dtype, items=None: Spy(k, fetch(k, dtype, items)))
    for op, shape, kw, _ in CASES:
        calls.clear()
        _check(op, shape, kw, "float32")
        eager = list(calls)
        calls.clear()
        _check(op, shape, kw, "float32", bound=True)
        assert calls == eager, (op, shape)
    x = np.zeros((2, 17000), np.float32)
    plan = make_plan("layer_norm", x)
    layout = _layout.plan_layout(plan, (17000, 1))
    bound = _schedule_forward(plan, "float32", layout, {"rstd", "mean"}, 0)
    assert bound.names == ("rows_stats_partial", "rows_stats_finalize", "rows_apply_fwd")
    # one workspace of partial sums (3 rows), 256-byte aligned
    assert bound.scratch_bytes % _schedule.ALIGN == 0 and bound.scratch_bytes >= _schedule.ALIGN
    offsets = [slot.offset for step in bound.steps for _, slot in step.slots if slot.index == 8]
    assert offsets and max(offsets) < bound.scratch_bytes
    inference = _schedule_forward(plan, "float32", layout, set(), 0)  # stats in scratch then
    assert inference.scratch_bytes == bound.scratch_bytes + 2 * _schedule.ALIGN


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_parameters_in_the_input_dtype(emulated, case, dtype):
    """A half-precision model's own weight and bias (x's dtype, not float32) read and widened
    by every kernel path, eager and replayed: no conversion before the launch."""
    op, shape, kw, order = case
    _check(op, shape, kw, dtype, order, params_in_x=True)
    _check(op, shape, kw, dtype, order, params_in_x=True, bound=True, stats=False)


def test_one_bound_launch_per_signature(emulated, monkeypatch):
    """``_launcher.dense_forward``/``dense_backward`` bind once per signature (as shipped:
    kept in ``plan.memo``) and never hand a launch bound for other strides, statistics,
    parameter dtypes or device to a call; memory in another order gets its own kernels, a
    layout that needs copies gets None."""
    monkeypatch.setattr(_launcher, "_memo", lambda plan: plan.memo)
    binds = []
    bind = _launcher.bind
    monkeypatch.setattr(_launcher, "bind", lambda schedule: binds.append(schedule.names) or bind(schedule))
    x = np.zeros((6, 1000), np.float32)
    plan = make_plan("layer_norm", x, np.ones(1000, np.float32), np.ones(1000, np.float32), cache=False)
    stats = {"w", "b", "rstd", "mean"}
    first = _launcher.dense_forward(plan, "float32", (1000, 1), None, stats, 0, 0)
    assert _launcher.dense_forward(plan, "float32", (1000, 1), None, set(stats), 0, 0) is first
    assert len(binds) == 1
    others = [_launcher.dense_forward(plan, "float32", (1000, 1), None, {"w", "b"}, 0, 0),
              _launcher.dense_forward(plan, "float32", (1000, 1), None, stats, 3, 0),
              _launcher.dense_forward(plan, "float32", (1000, 1), None, stats, 0, 1)]
    assert all(o is not None and o is not first for o in others) and len(binds) == 4
    # the same strides' schedule on another device is bound again, not shared
    assert len({id(o) for o in others}) == 3
    transposed = _launcher.dense_forward(plan, "float32", (1, 6), None, stats, 0, 0)  # columns in memory
    assert transposed.names != first.names and not transposed.names[0].startswith("rows_")
    assert _launcher.dense_forward(plan, "float32", (2000, 1), None, stats, 0, 0) is None  # every other row
    backward = _launcher.dense_backward(plan, "float32", (1000, 1), (1000, 1), {"w", "rstd", "mean", "dw", "db"}, 0, 0, 0)
    assert backward is _launcher.dense_backward(plan, "float32", (1000, 1), (1000, 1),
                                                {"w", "rstd", "mean", "dw", "db"}, 0, 0, 0)
    assert backward is not _launcher.dense_backward(plan, "float32", (1000, 1), (1000, 1),
                                                    {"w", "rstd", "mean", "dw", "db"}, 0, 3, 0)
    assert _launcher.dense_backward(plan, "float32", (1000, 1), (1, 6), {"w", "dw", "db"}, 0, 0, 0) is None


SMEM_CASES = [
    ("layer_norm", (3, 17000), {}, None),  # 16-byte vectors, 1 row per block of a 6-block "device"
    ("layer_norm", (7, 16392), {}, None),  # several rows per block (grid 2: one SM, two blocks)
    ("layer_norm", (2, 17001), {}, None),  # odd length: element by element
    ("rms_norm", (3, 20000), {"axis": -1, "eps": 1e-6}, None),
    ("group_norm", (2, 6, 90, 70), {"channel_axis": 1, "num_groups": 2}, None),  # segments of 6300
    ("group_norm", (2, 4, 96, 96), {"channel_axis": 1, "num_groups": 2}, None),  # segments of whole vectors
    ("instance_norm", (2, 2, 130, 131), {"channel_axis": 1}, None),  # one parameter a row
]


@pytest.mark.parametrize("case", SMEM_CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_launch_rows_in_shared_memory(emulated, monkeypatch, case, dtype):
    """Rows past the register kernels held in a block's shared memory (rows_fwd_smem, and
    rows_bwd_smem with x and dy): one read of x (and dy); with and without statistics,
    residual, parameters in x's dtype; the backward's recomputed statistics come from the
    forward kernel too."""
    monkeypatch.setattr(_schedule, "_smem_row", _SMEM_ROW)
    op, shape, kw, order = case
    names = _record_launches(monkeypatch)
    _check(op, shape, kw, dtype, order, stats=False)
    assert "rows_fwd_smem" in names and not {"rows_stats_partial", "rows_apply_fwd"} & names, names
    if dtype != "float64":  # float64 rows past 13.6K need 2 arrays past 227 KiB: the split path
        assert "rows_bwd_smem" in names and not {"rows_grad_partial", "apply_bwd"} & names, names
    if op in ("group_norm", "instance_norm"):  # with weights (their partials by rows_bwd_smem) and without
        names.clear()
        _check(op, shape, kw, dtype, order, with_params=False)
    if dtype != "float64":
        assert "rows_bwd_smem" in names and not {"rows_grad_partial", "apply_bwd"} & names, names
    if op in ("layer_norm", "rms_norm"):
        _check(op, shape, kw, dtype, order, residual=True, params_in_x=True, bound=True)


# NCHW rows of parameter segments held in shared memory with dy: rows_bwd_smem also writes
# the dweight/dbias partials per (row, segment), param_grad_finish adds them over the batch
SMEM_SEGMENT_CASES = [
    ("group_norm", (2, 6, 91, 71), {"channel_axis": 1, "num_groups": 2}),  # 3 odd segments of 6461: several warps each, element by element
    ("group_norm", (2, 4, 96, 96), {"channel_axis": 1, "num_groups": 2}),  # 2 segments of 9216: 16-byte vectors
    ("group_norm", (1, 80, 16, 32), {"channel_axis": 1, "num_groups": 2}),  # 40 segments of 512: warps take several
    ("group_norm", (1, 128, 257, 1), {"channel_axis": 1, "num_groups": 2}),  # 64 odd segments of 257
    ("instance_norm", (2, 3, 129, 131), {"channel_axis": 1}),  # one odd segment a row: the whole block on it
    ("instance_norm", (2, 2, 128, 136), {"channel_axis": 1}),  # one segment of whole vectors
]
_SEGMENT_PATH = {"rows_grad_partial", "segment_grad_finalize", "apply_bwd", "param_grad_rows", "param_grad_cols"}


def _check_without_bias(op, shape, kw, dtype):
    """dx and dweight with no dbias asked for (part_b null), statistics recomputed."""
    rng = np.random.default_rng(zlib.crc32(repr((op, shape, dtype, "no bias", SEED)).encode()))
    order = tuple(range(len(shape)))
    x = _rounded(rng.standard_normal(shape) * 3 + 1, dtype)
    dy = _rounded(rng.standard_normal(shape) + 0.5, dtype)
    pshape = make_plan(op, x, **kw).param_shape
    w = _rounded(rng.standard_normal(pshape) * 0.5 + 1, "float32")
    plan = make_plan(op, x, w, **kw)
    dxd, dwd = emu.empty(x.size, dtype), emu.empty(w.size, "float32")
    _launcher.backward(plan, dtype, _device(dy, order, dtype, 0), _device(x, order, dtype, 0),
                       emu.to_device(w.reshape(-1), "float32"), None, None, dxd, dwd, None)
    rdx, rdw, _ = _reference.backward(plan, dy, x, w)
    _assert_scaled(_host(dxd, shape, order), rdx, 1.5 * TOL[dtype], "dx")
    _assert_scaled(dwd.get_float().reshape(pshape), rdw, 5e-5, "dweight")


@pytest.mark.parametrize("case", SMEM_SEGMENT_CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_launch_segment_rows_in_shared_memory_with_param_grads(emulated, monkeypatch, case, dtype):
    """NCHW group and instance norm rows past the register kernels, held in shared memory with
    dy: dx and the dweight/dbias partials in one kernel (rows_bwd_smem), then param_grad_finish
    (3 transfers of x's size); with dbias, without it, and with parameters (and their
    gradients) in x's dtype; against the float64 reference."""
    monkeypatch.setattr(_schedule, "_smem_row", _SMEM_ROW)
    op, shape, kw = case
    names = _record_launches(monkeypatch)
    _check(op, shape, kw, dtype)
    assert {"rows_bwd_smem", "param_grad_finish"} <= names and not _SEGMENT_PATH & names, names
    names.clear()
    _check_without_bias(op, shape, kw, dtype)
    assert {"rows_bwd_smem", "param_grad_finish"} <= names and not _SEGMENT_PATH & names, names
    if dtype != "float32":
        _check(op, shape, kw, dtype, params_in_x=True, bound=True)


def test_shared_memory_rows_need_a_row_per_sm_and_room(emulated, monkeypatch):
    """The rule (``_schedule._smem_row``): a row per SM at least, a row that fits the opt-in
    shared memory; blocks of 512 where two rows fit an SM, else 1024."""
    monkeypatch.setattr(_schedule, "_smem_row", _SMEM_ROW)
    monkeypatch.setattr(_schedule, "_target_blocks", lambda: 4 * 132)
    monkeypatch.setattr(_schedule, "_smem_limit", lambda: 227 * 1024)

    def rule(rows, n, dtype):
        plan = make_plan("layer_norm", np.zeros((rows, n), np.float32))
        return _schedule._smem_row(_layout.plan_layout(plan, (n, 1)), dtype)

    assert rule(512, 65536, "bfloat16") == ((132,), (1024,), 131072)
    assert rule(256, 40960, "bfloat16") == ((256,), (512,), 81920)  # two 80 KiB rows an SM
    assert rule(512, 65536, "float32") is None  # 256 KiB
    assert rule(64, 65536, "bfloat16") is None  # fewer rows than SMs: the split path
    assert rule(132, 16392, "float64") == ((132,), (1024,), 131136)  # 128 KiB: one an SM


def use_clusters(monkeypatch, smem_limit=24 * 1024):
    """Rows past one block's shared memory (a ``smem_limit`` small enough for short rows to
    be long) split over thread-block clusters: rows_fwd_cluster and rows_bwd_cluster back in
    the schedule."""
    monkeypatch.setattr(_schedule, "_cluster_row", _CLUSTER_ROW)
    monkeypatch.setattr(_schedule, "_smem_row", _SMEM_ROW)
    monkeypatch.setattr(_schedule, "_smem_limit", lambda: smem_limit)


def use_sample_clusters(monkeypatch):
    """Columns of small inner extent over a cluster a sample (samples.cu) back in the schedule."""
    monkeypatch.setattr(_schedule, "_sample_cluster", _SAMPLE_CLUSTER)


# (op, shape, kwargs): ConvNeXt's 7x7 stage in small (p = the row), an 8x8 extent, NHWC
# instance norm (p = the column), RMS norm over the channels; 6 target blocks here: clusters
# of 2 (3 samples) and 4 (2 samples)
SAMPLE_CASES = [
    ("layer_norm", (3, 40, 7, 7), {"axis": 1}),
    ("layer_norm", (2, 9, 8, 8), {"axis": 1}),
    ("instance_norm", (3, 7, 7, 8), {"channel_axis": -1}),
    ("rms_norm", (2, 30, 5, 5), {"axis": 1}),
]


@pytest.mark.parametrize("case", SAMPLE_CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_launch_small_inner_columns_across_a_cluster(emulated, monkeypatch, case, dtype):
    """cols_fwd_cluster and cols_bwd_cluster through the launcher: y and the statistics, dx,
    dweight and dbias (partials per sample, then param_grad_finish), bound and not, with
    parameters in x's dtype and without dbias; a residual keeps the tiles forward."""
    use_sample_clusters(monkeypatch)
    op, shape, kw = case
    names = _record_launches(monkeypatch)
    _check(op, shape, kw, dtype, stats=False)
    assert {"cols_fwd_cluster", "cols_bwd_cluster", "param_grad_finish"} <= names, names
    assert not {"cols_fwd_tile", "cols_bwd_tile", "cols_bwd_tile_vec", "cols_stats_partial"} & names, names
    _check(op, shape, kw, dtype, params_in_x=True, bound=True)
    if op != "rms_norm" and dtype != "float64":  # (the helper's dweight is float32)
        _check_without_bias(op, shape, kw, dtype)
    names.clear()
    _check(op, shape, kw, dtype, residual=True)
    assert "cols_fwd_tile" in names and "cols_bwd_cluster" in names, names


# (op, shape, kwargs): rows of 20000 float32 (80 KB: 4 blocks of 20 KB; 16-bit: 2 of 20 KB),
# odd rows (the scalar path; the last block's part shorter), NCHW group norm rows of parameter
# segments, one row (fewer rows than clusters), several rows a cluster (grid-stride)
CLUSTER_CASES = [
    ("layer_norm", (3, 20000), {}),
    ("layer_norm", (1, 20001), {}),
    ("rms_norm", (5, 20000), {"axis": -1, "eps": 1e-6}),
    ("group_norm", (2, 6, 90, 70), {"channel_axis": 1, "num_groups": 2}),
    ("group_norm", (2, 6, 91, 71), {"channel_axis": 1, "num_groups": 2}),
]


@pytest.mark.parametrize("case", CLUSTER_CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_rows_across_a_cluster(emulated, monkeypatch, case, dtype):
    """rows_fwd_cluster (and rows_bwd_cluster for x and dy): each of C blocks holds a part of
    the row, the sums added up through distributed shared memory; with and without
    statistics, residual, parameters in x's dtype. NCHW rows of parameter segments with
    dweight keep the segments path backward (it sums them on the way)."""
    use_clusters(monkeypatch, 24 * 1024 if dtype == "bfloat16" else 48 * 1024)  # x and dy fit 4 blocks
    op, shape, kw = case
    names = _record_launches(monkeypatch)
    _check(op, shape, kw, dtype, stats=False)
    assert "rows_fwd_cluster" in names and not {"rows_stats_partial", "rows_apply_fwd", "rows_fwd_smem"} & names
    assert ("rows_bwd_cluster" in names) == (op != "group_norm"), names
    assert not {"rows_grad_partial", "apply_bwd"} & names or op == "group_norm", names
    if op != "group_norm":
        _check(op, shape, kw, dtype, residual=True, params_in_x=True, bound=True)


@pytest.mark.parametrize("schedule", ["1", "5"])
@pytest.mark.parametrize("dtype, c, threads, limit, cluster_max", [
    ("float32", 4, 1024, 20, 8), ("float16", 2, 1024, 24, 2), ("float16", 4, 512, 24, 8),
    ("float64", 8, 1024, 32, 8), ("float32", 8, 512, 24, 8)])
def test_launch_rows_across_a_cluster_any_order(emulated, monkeypatch, dtype, c, threads, limit, cluster_max,
                                                schedule):
    """Threads of the cluster's blocks run in reverse and random orders (a missing cluster
    barrier would read a slot before its block wrote it); 2, 4 and 8 blocks a cluster, of
    1024 threads (an SM a block) and of 512 (two an SM: the first C at which they fit)."""
    monkeypatch.setenv("ANYNORM_EMU_SCHEDULE", schedule)
    use_clusters(monkeypatch, limit * 1024)
    device = _schedule.DeviceInfo(132, _schedule._smem_limit(), cluster_max)
    monkeypatch.setattr(_launcher, "device_info", lambda _: device)
    names = _record_launches(monkeypatch)
    shape = (4, 20000)
    plan = make_plan("layer_norm", np.zeros(shape))
    step, = _schedule.schedule_forward(plan, dtype, _layout.plan_layout(plan, (shape[1], 1)), set(),
                                       device=device).steps
    assert (step.name, step.items, step.block) == ("rows_fwd_cluster", c, (threads,)), step
    _check("layer_norm", shape, {}, dtype)
    assert "rows_fwd_cluster" in names, names



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_launch_rows_across_several_clusters(emulated, monkeypatch, dtype):
    """Clusters taking rows in turn (the kernels' grid-stride loop, which the schedule's
    cluster a row leaves to grids past the launch limit: here cut to 2 clusters for 7 rows on
    a "device" of 8 SMs), both ways."""
    monkeypatch.setattr(_schedule, "_target_blocks", lambda: 8 * _schedule._BLOCKS_PER_SM)
    use_clusters(monkeypatch, 48 * 1024)
    plan = make_plan("layer_norm", np.zeros((7, 40000)))
    step, = _schedule.schedule_forward(plan, dtype, _layout.plan_layout(plan, (40000, 1)), set(),
                                       device=_schedule.DeviceInfo(8, 48 * 1024, 8)).steps
    assert step.name == "rows_fwd_cluster" and step.grid[0] == 7 * step.items, step  # a cluster a row
    monkeypatch.setattr(_schedule, "_MAX_X", 2 * step.items)
    step, = _schedule.schedule_forward(plan, dtype, _layout.plan_layout(plan, (40000, 1)), set(),
                                       device=_schedule.DeviceInfo(8, 48 * 1024, 8)).steps
    assert step.grid[0] == 2 * step.items, step
    names = _record_launches(monkeypatch)
    _check("layer_norm", (7, 40000), {}, dtype)
    assert {"rows_fwd_cluster", "rows_bwd_cluster"} <= names, names
