"""Row kernels on rows far from zero (offset 1e4, 1e6 in float32), run on the CPU emulator
through ``anynorm._cuda._launcher``: y (and dx) within half of torch's error on the same data.

A float32 mean near 1e6 is rounded to 1/16; forming ``x - mean`` from it puts that rounding
into every output (torch's CPU and GPU kernels do). The row kernels take ``d = x - shift``
with ``shift`` the row's first element (exact near it), ``mean(d)`` and the deviations
``d - mean(d)`` from those small numbers; the split path hands ``apply`` the rounding of the
written mean (``mean_lo``) with it, and the backward recomputes ``mean(d)`` from the row it
holds rather than trusting the rounded saved mean.
"""

from __future__ import annotations


import numpy as np
import pytest

import test_kernels_launch_emulated as L
from test_kernels_launch_emulated import emulated  # noqa: F401  (fixture)

from anynorm import _reference
from anynorm._cuda import _launcher, _schedule
from anynorm._plan import make_plan

torch = pytest.importorskip("torch")
F = torch.nn.functional

# (op, shape, kwargs, forward kernel, backward kernel)
CASES = [
    ("layer_norm", (256, 4096), {}, "rows_fwd_lean", "rows_bwd_block"),
    ("layer_norm", (64, 768), {}, "rows_fwd_lean", "rows_bwd_multi"),  # two vectors a thread forward
    ("layer_norm", (64, 100), {}, "rows_fwd_multi", "rows_bwd_multi"),
    ("layer_norm", (64, 250), {}, "rows_fwd_multi", "rows_bwd_multi"),  # teams of 2 warps
    ("layer_norm", (64, 500), {}, "rows_fwd_lean", "rows_bwd_multi"),
    ("layer_norm", (3, 20000), {}, "rows_stats_partial", "rows_grad_finalize"),
    ("instance_norm", (4, 8, 64), {"channel_axis": 1}, "rows_fwd_multi", "rows_bwd_multi"),
    ("instance_norm", (2, 3, 40, 50), {"channel_axis": 1}, "rows_fwd_lean", "rows_bwd_block"),
    ("rms_norm", (64, 768), {"axis": -1, "eps": 1e-6}, "rows_fwd_lean", "rows_bwd_multi"),
    ("layer_norm", (5, 40000), {}, "rows_stats_partial", "rows_grad_finalize"),  # 2+ chunks a row
    ("layer_norm", (3, 20000), {}, "rows_fwd_smem", "rows_bwd_smem"),  # the row in shared memory
    ("layer_norm", (3, 20001), {}, "rows_fwd_smem", "rows_bwd_smem"),  # element by element
    ("layer_norm", (3, 20000), {}, "rows_fwd_cluster", "rows_bwd_cluster"),  # blocks of a cluster
    ("layer_norm", (3, 20001), {}, "rows_fwd_cluster", "rows_bwd_cluster"),
]
# Where torch is itself at float32 rounding (RMS norm has no cancellation), a few ulps of y.
FLOOR = 1e-6
IDS = [f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in CASES]


def _torch_forward(op, t, kw):
    """torch.nn.functional's answer for the tensor ``t``."""
    if op == "layer_norm":
        return F.layer_norm(t, t.shape[-1:], eps=1e-5)
    if op == "instance_norm":
        return F.instance_norm(t, eps=1e-5)
    return F.rms_norm(t, t.shape[-1:], eps=kw["eps"])


def _data(shape, offset, seed=11):
    return (offset + np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _ours_forward(op, x, kw):
    plan, _, md, sd, y = L.forward_float32(op, x, kw)
    return plan, y, (None if md is None else md.get_float()), sd.get_float()


def forward_errors(op, shape, kw, offset):
    """(ours, torch's) max |y - exact| (exact: float64 from the float32 input)."""
    x = _data(shape, offset)
    plan, y, _, _ = _ours_forward(op, x, kw)
    x64 = x.astype(np.float64)
    ref = _reference.forward(make_plan(op, x64, **kw), x64, None, None)[0]
    theirs = _torch_forward(op, torch.from_numpy(x), kw).numpy().astype(np.float64)
    return float(np.abs(y - ref).max()), float(np.abs(theirs - ref).max())


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_offset_rows_forward_half_of_torchs_error(emulated, monkeypatch, case, offset):  # noqa: F811
    op, shape, kw, path, _ = case
    if path == "rows_fwd_smem":
        monkeypatch.setattr(_schedule, "_smem_row", L._SMEM_ROW)
    if path == "rows_fwd_cluster":
        L.use_clusters(monkeypatch)
    names = L._record_launches(monkeypatch)
    ours, theirs = forward_errors(op, shape, kw, offset)
    assert path in names, names
    print(f"{op}{shape} at {offset:g}: y error {ours:.3g}, torch's {theirs:.3g}")
    assert ours <= max(0.5 * theirs, FLOOR), f"{op}{shape} at {offset:g}: error {ours:.3g}, torch's {theirs:.3g}"


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 2, 4, 5)], ids=[IDS[i] for i in (0, 2, 4, 5)])
def test_offset_rows_mean_is_the_true_mean(emulated, case, offset):  # noqa: F811
    """The written mean is shift + mean(d): the exact mean rounded once (within 1 ulp)."""
    op, shape, kw = case[:3]
    x = _data(shape, offset)
    plan, _, mean, rstd = _ours_forward(op, x, kw)
    x64 = x.astype(np.float64)
    _, _, rmean, rrstd = _reference.forward(make_plan(op, x64, **kw), x64, None, None)
    np.testing.assert_allclose(mean, rmean.reshape(-1), rtol=2.0**-23, atol=0)
    np.testing.assert_allclose(rstd, rrstd.reshape(-1), rtol=2e-6)


def _torch_backward(op, x, dy, kw):
    t = torch.from_numpy(x).requires_grad_(True)
    _torch_forward(op, t, kw).backward(torch.from_numpy(dy))
    return t.grad.numpy().astype(np.float64)


def backward_errors(op, shape, kw, offset):
    """(ours, torch's) max |dx - exact| with the statistics of our own forward, dy off zero
    (mean(g) != 0, which a rounded mean would feed into dx)."""
    x = _data(shape, offset)
    dy = (np.random.default_rng(12).standard_normal(shape) + 0.5).astype(np.float32)
    plan, _, mean, rstd = _ours_forward(op, x, kw)
    md = None if mean is None else L.emu.to_device(mean.astype(np.float32), "float32")
    sd = L.emu.to_device(rstd.astype(np.float32), "float32")
    dxd = L.emu.empty(x.size, "float32")
    order = tuple(range(x.ndim))
    _launcher.backward(plan, "float32", L._device(dy, order, "float32", 0), L._device(x, order, "float32", 0),
                     None, md, sd, dxd, None, None)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    ref = _reference.backward(make_plan(op, x64, **kw), dy64, x64, None)[0]
    dx = dxd.get_float().reshape(shape)
    return float(np.abs(dx - ref).max()), float(np.abs(_torch_backward(op, x, dy, kw) - ref).max())


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_offset_rows_backward_half_of_torchs_error(emulated, monkeypatch, case, offset):  # noqa: F811
    """dx about the exact mean: the register kernels take mean(d) again from the row they hold;
    the split path takes the saved mean's rounding, mean(x - mean), out (rows_grad_finalize)."""
    op, shape, kw, _, path = case
    if path == "rows_bwd_smem":
        monkeypatch.setattr(_schedule, "_smem_row", L._SMEM_ROW)
    if path == "rows_bwd_cluster":  # x and dy of 20000 float32 in 4 blocks of 48 KiB
        L.use_clusters(monkeypatch, 48 * 1024)
    names = L._record_launches(monkeypatch)
    ours, theirs = backward_errors(op, shape, kw, offset)
    print(f"{op}{shape} at {offset:g}: dx error {ours:.3g}, torch's {theirs:.3g}")
    assert path in names, names
    assert ours <= max(0.5 * theirs, FLOOR), f"{op}{shape} at {offset:g}: dx error {ours:.3g}, torch's {theirs:.3g}"


# NCHW rows past 16384 elements made of per-channel segments: rows_grad_partial per segment
# -> segment_grad_finalize (dx's means and the dweight/dbias partials) -> apply_bwd, or where
# the row and dy fit a block's shared memory rows_bwd_smem (dx and the partials)
SEGMENT_CASES = [("group_norm", (2, 6, 90, 70), {"channel_axis": 1, "num_groups": 2}),
                 ("group_norm", (2, 6, 91, 71), {"channel_axis": 1, "num_groups": 2}),  # odd HW
                 ("instance_norm", (2, 2, 130, 131), {"channel_axis": 1})]


def _torch_param_backward(op, x, w, b, dy, kw):
    t, tw, tb = (torch.from_numpy(a).requires_grad_(True) for a in (x, w, b))
    if op == "group_norm":
        y = F.group_norm(t, kw["num_groups"], tw, tb, eps=1e-5)
    else:
        y = F.instance_norm(t, weight=tw, bias=tb, eps=1e-5)
    y.backward(torch.from_numpy(dy))
    return t.grad.numpy().astype(np.float64), tw.grad.numpy().astype(np.float64)


@pytest.mark.parametrize("path", ["segment_grad_finalize", "rows_bwd_smem"])
@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("case", SEGMENT_CASES, ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in SEGMENT_CASES])
def test_offset_segments_backward_half_of_torchs_error(emulated, monkeypatch, case, offset, path):  # noqa: F811
    """dx and dweight of the segmented backward about the exact mean: the split path takes the
    saved mean's rounding, mean(x - mean) over the slice's segments, out (segment_grad_finalize);
    rows_bwd_smem (the row in shared memory) takes mean(d) of d = x - x[0] again and sums the
    segments' dweight/dbias partials with that xhat."""
    op, shape, kw = case
    if path == "rows_bwd_smem":
        monkeypatch.setattr(_schedule, "_smem_row", L._SMEM_ROW)
    names = L._record_launches(monkeypatch)
    x = _data(shape, offset)
    rng = np.random.default_rng(13)
    dy = (rng.standard_normal(shape) + 0.5).astype(np.float32)
    w = (1.0 + 0.5 * rng.standard_normal(shape[1])).astype(np.float32)
    b = (0.5 * rng.standard_normal(shape[1])).astype(np.float32)
    _, _, mean, rstd = _ours_forward(op, x, kw)
    md, sd = (L.emu.to_device(a.astype(np.float32), "float32") for a in (mean, rstd))
    dxd, dwd, dbd = L.emu.empty(x.size, "float32"), L.emu.empty(w.size, "float32"), L.emu.empty(w.size, "float32")
    order = tuple(range(x.ndim))
    _launcher.backward(make_plan(op, x, w, **kw), "float32", L._device(dy, order, "float32", 0),
                       L._device(x, order, "float32", 0), L.emu.to_device(w, "float32"), md, sd, dxd, dwd, dbd)
    assert path in names and ({"segment_grad_finalize", "rows_bwd_smem"} - {path}).isdisjoint(names), names
    x64, dy64, w64 = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64)
    rdx, rdw, rdb = _reference.backward(make_plan(op, x64, w64, **kw), dy64, x64, w64)
    tdx, tdw = _torch_param_backward(op, x, w, b, dy, kw)
    ours_dx = float(np.abs(dxd.get_float().reshape(shape) - rdx).max())
    ours_dw = float(np.abs(dwd.get_float() - rdw).max())
    theirs_dx, theirs_dw = float(np.abs(tdx - rdx).max()), float(np.abs(tdw - rdw).max())
    print(f"{path}: {op}{shape} at {offset:g}: dx {ours_dx:.3g} (torch {theirs_dx:.3g}), "
          f"dweight {ours_dw:.3g} (torch {theirs_dw:.3g})")
    assert ours_dx <= max(0.5 * theirs_dx, FLOOR), (ours_dx, theirs_dx)
    # dweight sums ~1e4 float32 terms per channel: a few ulps of their magnitudes' sum
    assert ours_dw <= max(0.5 * theirs_dw, 1e-4 * float(np.abs(rdw).max() + 1)), (ours_dw, theirs_dw)
    np.testing.assert_allclose(dbd.get_float(), rdb, rtol=1e-5, atol=1e-3)
