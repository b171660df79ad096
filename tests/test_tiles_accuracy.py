"""Columns far from zero (issue 15): the shared-memory tile kernels (``kernels/tiles.cu``) and
the split forward (``kernels/cols.cu`` + ``stats_finalize``) on float32 slices offset by 1e4
and 1e6, on the CPU emulator.

Cases: channels-first layer norm (NCHW 8x96x14x14: statistics over C, ``p = r``), NHWC
instance norm and NHWC group norm (``p = i``, group 1 and 8). The forward's ``y`` must come
out at float32 rounding level, and at most half the error of the comparator, which is the
best a kernel that subtracts a float32 mean can do: ``(x - fl32(mean)) * rstd`` computed
exactly from the true statistics (torch's CPU and CUDA kernels, which also subtract a
rounded mean, are at least this far off: 1.2e-3 at 1e4, 5.5e-2 at 1e6 on the H100,
``probe.txt``). The written mean must be the true mean to float32 rounding. The backward's
``xhat`` is checked through ``dx`` and ``dweight`` against float64 formulas.

Channels-first layer norm over channels_last memory is a rows layout (the channel axis is
innermost): ``rows.cu``, issue 14, and not here.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

from test_kernels_launch_emulated import emu  # the emulation harness, loaded once
from test_kernels_launch_emulated import emulated  # noqa: F401  (fixture)

from anynorm._cuda import _schedule  # noqa: E402  (pure: no CuPy needed)

_HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(emu.compiler() is None or not hasattr(os, "fork"),
                                reason="the CUDA emulation needs g++ and fork()")

KERNELS = Path(os.environ.get("ANYNORM_EMU_KERNEL_DIR", _HERE.parent / "kernels"))
F32_EPS = float(np.finfo(np.float32).eps)
OFFSETS = [1e4, 1e6]
BLOCK = 256


class Columns:
    """A columns-family problem: buffer (outer, reduced, inner), statistics per (o, i // group),
    parameter index ``p = (e // p_div) % p_len``."""

    def __init__(self, name, outer, reduced, inner, group, p_div, p_len, width):
        self.name, self.outer, self.reduced, self.inner, self.group = name, outer, reduced, inner, group
        self.p_div, self.p_len, self.width = p_div, p_len, width

    def __repr__(self):
        return self.name

    @property
    def shape(self):
        return (self.outer, self.reduced, self.inner)

    @property
    def grouped(self):
        """x as (outer, reduced, inner // group, group): the statistics reduce axes 1 and 3."""
        return (self.outer, self.reduced, self.inner // self.group, self.group)

    def param_index(self):
        e = np.arange(self.outer * self.reduced * self.inner).reshape(self.shape)
        return (e // self.p_div) % self.p_len

    @property
    def param_rows(self):
        return int(self.p_div == self.inner)


# (case, tile width): widths that split inner into several tiles, a partial last one included
CASES = [
    Columns("ln channels-first 8x96x14x14", 8, 96, 196, 1, 196, 96, 64),
    Columns("in nhwc 4x14x14x64", 4, 196, 64, 1, 1, 64, 16),
    Columns("gn nhwc 4x14x14x64 g8", 4, 196, 64, 8, 1, 64, 24),
]


@pytest.fixture(scope="module")
def tiles():
    names = ["cols_fwd_tile<float>", "cols_bwd_tile<float>", "cols_bwd_tile_vec<float>", "param_grad_finish<float>"]
    return emu.build_many([([KERNELS / "tiles.cu", KERNELS / "params.cu"], names, "tiles-accuracy")])[0]


@pytest.fixture(scope="module")
def split():
    names = ["cols_stats_partial<float>", "cols_apply_fwd<float>", "stats_finalize<float>"]
    return emu.build_many([([KERNELS / "cols.cu", KERNELS / "finish.cu"], names, "cols-accuracy")])[0]


def _ceil(a, b):
    return -(-a // b)


def _data(case, offset, seed=0):
    rng = np.random.default_rng(seed)
    x = (offset + rng.standard_normal(case.shape)).astype(np.float32)
    w = (1.0 + 0.5 * rng.standard_normal(case.p_len)).astype(np.float32)
    b = (0.5 * rng.standard_normal(case.p_len)).astype(np.float32)
    dy = rng.standard_normal(case.shape).astype(np.float32)
    return x, w, b, dy


def _stats64(case, x):
    """float64 (mean, rstd) per slice, broadcastable over ``case.grouped``."""
    v = x.astype(np.float64).reshape(case.grouped)
    mean = v.mean((1, 3), keepdims=True)
    rstd = 1.0 / np.sqrt(((v - mean) ** 2).mean((1, 3), keepdims=True) + 1e-5)
    return mean, rstd


def _smem(case, copies):
    return copies * case.reduced * case.width * 4


def run_tile_forward(tiles, case, x, w, b):
    xd, yd = emu.to_device(x.reshape(-1)), emu.empty(x.size, "float32")
    slices = case.outer * case.inner // case.group
    md, sd = emu.empty(slices, "float32"), emu.empty(slices, "float32")
    tiles.get_function("cols_fwd_tile<float>")(
        (_ceil(case.inner, case.width), case.outer), (BLOCK,),
        (xd, None, None, yd, emu.to_device(w), emu.to_device(b), md, sd, case.outer, case.reduced,
         case.inner, case.group, case.width, case.p_div, case.p_len, 1, 1e-5, 0),
        shared_mem=_smem(case, 1))
    return yd.get_float().reshape(case.shape), md.get_float(), sd.get_float()


def run_tile_backward(tiles, case, dy, x, w, mean, rstd, blocks=None):
    """cols_bwd_tile on a persistent grid of ``blocks`` (default: one per (o, tile) item; fewer:
    each block takes several tiles, and with p = r sums dweight/dbias over them in shared
    memory), then param_grad_finish: (dx, dweight)."""
    items = case.outer * _ceil(case.inner, case.width)
    blocks = blocks or items
    nchunk = blocks if case.param_rows else case.outer
    parts = [emu.empty(nchunk * case.p_len, "float32") for _ in range(2)]
    dxd = emu.empty(x.size, "float32")
    vector = _schedule.tile_bwd_vector(case, case.width, 4, True, case.param_rows)  # the launcher's choice
    kernel = tiles.get_function("cols_bwd_tile_vec<float>" if vector else "cols_bwd_tile<float>")
    smem = _smem(case, 2) + 8 * case.reduced * case.param_rows  # the tiles, the per-row sums
    kernel.max_dynamic_shared_size_bytes = max(smem, 48 * 1024)  # opted in, as the launcher does
    kernel(
        (blocks,), (BLOCK,),
        (emu.to_device(dy.reshape(-1)), emu.to_device(x.reshape(-1)), emu.to_device(w),
         emu.to_device(mean.astype(np.float32)), emu.to_device(rstd.astype(np.float32)), dxd, parts[0],
         parts[1], case.outer, case.reduced, case.inner, case.group, case.width, case.p_div, case.p_len,
         case.param_rows, 1, 0), shared_mem=smem)
    dw, db = emu.empty(case.p_len, "float32"), emu.empty(case.p_len, "float32")
    tiles.get_function("param_grad_finish<float>")((1,), (32, 16), (parts[0], parts[1], dw, db, case.p_len,
                                                                    nchunk, 0))
    return dxd.get_float().reshape(case.shape), dw.get_float()


CHUNK = 40  # rows per chunk of the split forward: 3 to 5 chunks per column here


def run_split_forward(split, case, x, w, b):
    """cols_stats_partial -> stats_finalize -> cols_apply_fwd, as _schedule._split_columns."""
    nchunk = _ceil(case.reduced, CHUNK)
    slices = case.outer * case.inner // case.group
    ws = [emu.empty(case.outer * nchunk * case.inner, "float32") for _ in range(3)]
    xd, yd = emu.to_device(x.reshape(-1)), emu.empty(x.size, "float32")
    shifted, md, sd = (emu.empty(slices, "float32") for _ in range(3))
    grid = (_ceil(case.inner, 32), nchunk, case.outer)
    split.get_function("cols_stats_partial<float>")(grid, (32, 8), (xd, None, None, *ws, case.outer, case.reduced,
                                                                   case.inner, CHUNK, case.group, 1))
    split.get_function("stats_finalize<float>")((1,), (BLOCK,), (*ws, shifted, sd, case.outer, nchunk, case.inner,
                                                                 case.group, 1, 1e-5))
    split.get_function("cols_apply_fwd<float>")(grid, (32, 8), (xd, yd, emu.to_device(w), emu.to_device(b), shifted,
                                                               sd, md, case.outer, case.reduced, case.inner,
                                                               case.group, CHUNK, case.p_div, case.p_len, 1, 0))
    return yd.get_float().reshape(case.shape), md.get_float(), sd.get_float()


def forward_errors(run, case, offset):
    """(kernel's max |y - y64|, comparator's, kernel's max |mean - mean64|) for one offset."""
    x, w, b, _ = _data(case, offset)
    mean, rstd = _stats64(case, x)
    p = case.param_index()
    xv = x.astype(np.float64).reshape(case.grouped)
    y64 = ((xv - mean) * rstd).reshape(case.shape) * w[p] + b[p]
    # the comparator: the true statistics, but the mean rounded to float32 before x - mean
    y_cmp = ((xv - mean.astype(np.float32).astype(np.float64)) * rstd).reshape(case.shape) * w[p] + b[p]
    y, m, s = run(case, x, w, b)
    np.testing.assert_allclose(s, rstd.reshape(-1), rtol=64 * F32_EPS)
    return (float(np.abs(y - y64).max()), float(np.abs(y_cmp - y64).max()),
            float(np.abs(m - mean.reshape(-1)).max()))


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tile_forward_far_from_zero(tiles, case, offset):
    check_forward(lambda *a: run_tile_forward(tiles, *a), case, offset)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_split_forward_far_from_zero(split, case, offset):
    """The columns' split path (long reduced axes): the partial states are of v - shift, the
    slice's first element, and y is formed from v - shift as in the tiles."""
    check_forward(lambda *a: run_split_forward(split, *a), case, offset)


def check_forward(run, case, offset):
    err, cmp_err, mean_err = forward_errors(run, case, offset)
    y_scale = 4.0  # |y| <~ |xhat| * |w| + |b|: a few units
    assert err <= 16 * F32_EPS * y_scale, f"{case} at {offset:g}: y error {err:.3g} (comparator {cmp_err:.3g})"
    assert err <= 0.5 * cmp_err, f"{case} at {offset:g}: y error {err:.3g} vs comparator {cmp_err:.3g}"
    assert mean_err <= 2 * F32_EPS * offset, f"{case} at {offset:g}: mean error {mean_err:.3g}"


@pytest.mark.parametrize("blocks", [None, 3], ids=["block_per_tile", "3_blocks"])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tile_backward_far_from_zero(tiles, case, offset, blocks):
    """dx and dweight from the saved (float32) statistics: xhat = (x - mean) * rstd formed
    with the saved mean alone is off by half an ulp of the offset times rstd. On a grid of a
    block per tile and on a persistent grid of 3 blocks, each taking several tiles (and with
    p = r adding their dweight/dbias into one partial row)."""
    x, w, _, dy = _data(case, offset, seed=1)
    mean, rstd = _stats64(case, x)
    xv, g = x.astype(np.float64).reshape(case.grouped), (dy * w[case.param_index()]).astype(np.float64)
    xhat = (xv - mean) * rstd
    gv = g.reshape(case.grouped)
    dx64 = (rstd * (gv - gv.mean((1, 3), keepdims=True) - xhat * (gv * xhat).mean((1, 3), keepdims=True)))
    dw64 = np.zeros(case.p_len)
    np.add.at(dw64, case.param_index().reshape(-1), (dy.astype(np.float64) * xhat.reshape(case.shape)).reshape(-1))
    dx, dw = run_tile_backward(tiles, case, dy, x, w, mean.reshape(-1), rstd.reshape(-1), blocks)
    dx_err = float(np.abs(dx - dx64.reshape(case.shape)).max())
    dw_err = float(np.abs(dw - dw64).max())
    terms = case.outer * case.reduced * case.inner // case.p_len
    assert dx_err <= 64 * F32_EPS * float(np.abs(dx64).max()), f"{case} at {offset:g}: dx error {dx_err:.3g}"
    assert dw_err <= 8 * F32_EPS * np.sqrt(terms) * 4, f"{case} at {offset:g}: dweight error {dw_err:.3g}"


# ---- the split backward (cols_grad_partial -> cols_grad_finalize -> apply_bwd) ---------------------

# (op, shape, kwargs): the columns' split path with the tiles turned off; odd sizes (C = 5, 12:
# not multiples of 8; HW = 49 and 3).
SPLIT_CASES = [
    ("instance_norm", (2, 9, 11, 5), {"channel_axis": -1}),  # NHWC, p = i
    ("group_norm", (2, 7, 7, 12), {"channel_axis": -1, "num_groups": 3}),  # NHWC, group 4, HW = 49
    ("layer_norm", (3, 200, 7, 7), {"axis": 1}),  # channels-first LN, p = r, inner 49
    ("group_norm", (2, 3, 1, 40), {"channel_axis": -1, "num_groups": 5}),  # NHWC, HW = 3, group 8
    # (HW = 1 is a rows layout: the channels are the reduced extent, contiguous)
]
SPLIT_IDS = [f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in SPLIT_CASES]


def _torch_grads(op, x, w, b, dy, kw):
    """torch's dx and dweight for the same float32 data (channels moved first where they are last)."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    t = torch.from_numpy(x).requires_grad_(True)
    tw = torch.from_numpy(w).requires_grad_(True)
    tb = torch.from_numpy(b).requires_grad_(True)
    if op == "layer_norm":  # over axis 1 (channels), NCHW
        y = F.layer_norm(t.movedim(1, -1), t.shape[1:2], tw, tb, eps=1e-5).movedim(-1, 1)
    elif op == "instance_norm":
        y = F.instance_norm(t.movedim(-1, 1), weight=tw, bias=tb, eps=1e-5).movedim(1, -1)
    else:
        y = F.group_norm(t.movedim(-1, 1), kw["num_groups"], tw, tb, eps=1e-5).movedim(1, -1)
    y.backward(torch.from_numpy(dy))
    return t.grad.numpy().astype(np.float64), tw.grad.numpy().astype(np.float64)


def split_backward_errors(monkeypatch, op, shape, kw, offset):
    """(ours, torch's) max |dx - exact| and max |dweight - exact| on float32 data offset by
    ``offset``, through ``_launcher`` with no tile (the split forward's statistics, then the
    split backward); exact: float64 from the same float32 data."""
    import test_kernels_launch_emulated as L
    from anynorm import _reference
    from anynorm._cuda import _launcher, _schedule
    from anynorm._plan import make_plan

    monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (0,))
    names = L._record_launches(monkeypatch)
    rng = np.random.default_rng(zlib.crc32(repr((op, shape, offset)).encode()))
    x = (offset + rng.standard_normal(shape)).astype(np.float32)
    dy = (rng.standard_normal(shape) + 0.5).astype(np.float32)
    pshape = make_plan(op, x, **kw).param_shape
    w = (1.0 + 0.5 * rng.standard_normal(pshape)).astype(np.float32)
    b = (0.5 * rng.standard_normal(pshape)).astype(np.float32)
    plan = make_plan(op, x, w, b, **kw)
    order = tuple(range(x.ndim))
    xd, dyd = L._device(x, order, "float32", 0), L._device(dy, order, "float32", 0)
    n = int(np.prod(plan.stats_shape))
    md, sd, yd = L.emu.empty(n, "float32"), L.emu.empty(n, "float32"), L.emu.empty(x.size, "float32")
    wd, bd = L.emu.to_device(w.reshape(-1), "float32"), L.emu.to_device(b.reshape(-1), "float32")
    _launcher.forward(plan, "float32", xd, wd, bd, None, yd, None, md, sd)
    dxd = L.emu.empty(x.size, "float32")
    dwd, dbd = L.emu.empty(w.size, "float32"), L.emu.empty(w.size, "float32")
    bplan = make_plan(op, x, w, **kw)
    _launcher.backward(bplan, "float32", dyd, xd, wd, md, sd, dxd, dwd, dbd)
    x64, dy64, w64 = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64)
    rdx, rdw, _ = _reference.backward(make_plan(op, x64, w64, **kw), dy64, x64, w64)
    tdx, tdw = _torch_grads(op, x, w, b, dy, kw)
    dx, dw = dxd.get_float().reshape(shape), dwd.get_float().reshape(pshape)
    errs = (float(np.abs(dx - rdx).max()), float(np.abs(tdx - rdx).max()),
            float(np.abs(dw - rdw.reshape(pshape)).max()), float(np.abs(tdw.reshape(pshape) - rdw.reshape(pshape)).max()))
    return errs, names, float(np.abs(rdx).max()), float(np.abs(rdw).max())


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=SPLIT_IDS)
def test_split_backward_far_from_zero(emulated, monkeypatch, case, offset):
    """dx and dweight within half of torch's error (or at float32 rounding, where torch's
    group norm is far worse): cols_grad_finalize takes the saved mean's rounding
    (c = mean(x - mean), summed by cols_grad_partial on the way) out of the slices' means of
    g and g * xhat and of the columns' dweight sums (p = i), and hands it to
    cols_param_grad_rows (p = r)."""
    op, shape, kw = case
    (dx_err, dx_torch, dw_err, dw_torch), names, dx_scale, dw_scale = split_backward_errors(
        monkeypatch, op, shape, kw, offset)
    assert {"cols_grad_partial", "cols_grad_finalize", "apply_bwd"} <= names, names
    assert dx_err <= max(0.5 * dx_torch, 16 * F32_EPS * dx_scale), f"dx error {dx_err:.3g}, torch's {dx_torch:.3g}"
    # p = i: cols_grad_finalize's column sums; p = r: cols_param_grad_rows with its mean_lo
    assert "param_grad_rows" not in names, names
    assert dw_err <= max(0.5 * dw_torch, 64 * F32_EPS * dw_scale), f"dweight error {dw_err:.3g}, torch's {dw_torch:.3g}"
