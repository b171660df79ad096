"""NaN/Inf semantics of the kernel paths, run on the CPU emulator through
``anynorm._cuda._schedule`` and ``_launcher``: a NaN or Inf in a slice makes that whole slice's y (and dx) NaN
and no other slice's. The first GPU run found RMS norm over axes (0, 2) of (3, 4, 5)
leaving the rest of the poisoned slice finite (``test_nan_stays_in_its_row[cupy-rms_norm
(3, 4, 5)[axis=(0, 2)]]``): that layout is columns with groups of 5, served by
``cols_fwd_tile``, whose ``var > 0 ? var : 0`` turned a NaN variance into 0.
"""

from __future__ import annotations


import numpy as np
import pytest

import test_kernels_launch_emulated as L
from test_kernels_launch_emulated import emulated  # noqa: F401  (fixture)

from anynorm import _reference
from anynorm._cuda import _launcher, _schedule
from anynorm._plan import make_plan

# (op, shape, kwargs, the kernel that must serve the forward, tile budget or None)
CASES = [
    ("layer_norm", (4, 6), {}, "rows_fwd_multi", None),
    ("rms_norm", (4, 6), {"axis": -1}, "rows_fwd_multi", None),
    ("layer_norm", (5, 160), {}, "rows_fwd_multi", None),  # teams of 64 threads: two warps meet in smem
    ("layer_norm", (3, 2000), {}, "rows_fwd_lean", None),
    ("rms_norm", (3, 2000), {"axis": -1}, "rows_fwd_lean", None),
    ("layer_norm", (3, 10000), {}, "rows_fwd_block", None),  # four float32 vectors a thread
    ("rms_norm", (3, 10000), {"axis": -1}, "rows_fwd_block", None),
    ("layer_norm", (2, 17000), {}, "rows_stats_partial", None),
    ("rms_norm", (2, 17000), {"axis": -1}, "rows_stats_partial", None),
    ("layer_norm", (2, 17000), {}, "rows_fwd_smem", None),
    ("rms_norm", (2, 17000), {"axis": -1}, "rows_fwd_smem", None),
    ("layer_norm", (2, 17000), {}, "rows_fwd_cluster", None),
    ("rms_norm", (2, 17000), {"axis": -1}, "rows_fwd_cluster", None),
    ("instance_norm", (3, 4, 5), {"channel_axis": 1}, "rows_fwd_multi", None),  # no parameters
    ("group_norm", (3, 4, 5), {"channel_axis": 1, "num_groups": 2}, "rows_fwd_multi", None),
    ("rms_norm", (3, 4, 5), {"axis": (0, 2)}, "cols_fwd_tile", L.TILE_BUDGET),
    ("rms_norm", (3, 4, 5), {"axis": (0, 2)}, "cols_stats_partial", 0),
    ("layer_norm", (4, 6), {"axis": 0}, "cols_fwd_tile", L.TILE_BUDGET),
    ("rms_norm", (3, 4, 5), {"axis": 1}, "cols_fwd_cluster", None),  # a cluster a sample
    ("layer_norm", (3, 9, 7, 7), {"axis": 1}, "cols_fwd_cluster", None),
]
IDS = [f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}" for c in CASES]


def _poisoned(shape, bad, seed=15):
    x = np.random.default_rng(seed).standard_normal(shape)
    x[(1,) * len(shape)] = bad
    return x.astype(np.float32)


def _check_poisoned(got, ref, slice_of_bad):
    """NaN wherever the reference is not finite; the rest of the poisoned slice
    (``slice_of_bad``) NaN or the reference's value (RMS norm of a row with an Inf: rstd = 0,
    y = 0 beside the Inf's NaN; the split paths' Welford states make it NaN); every other
    slice right."""
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(ref)
    assert bad.any() and slice_of_bad.any() and not slice_of_bad.all() and not (bad & ~slice_of_bad).any()
    assert np.all(np.isnan(got[bad])), got[bad]
    rest = slice_of_bad & ~bad
    assert np.all(np.isnan(got[rest]) | np.isclose(got[rest], ref[rest], rtol=3e-5, atol=3e-5))
    np.testing.assert_allclose(got[~slice_of_bad], ref[~slice_of_bad], rtol=3e-5, atol=3e-5)


def _slice_of_bad(op, shape, kw):
    """The elements of the slice that holds the poisoned element (where a NaN's reaches)."""
    x = _poisoned(shape, np.nan).astype(np.float64)
    with np.errstate(invalid="ignore"):
        return np.isnan(_reference.forward(make_plan(op, x, **kw), x, None, None)[0])


# cols_fwd_tile clamps a negative variance with `var < 0 ? 0 : var`, which keeps a NaN (the
# GPU run's rms_norm(3, 4, 5) over axes (0, 2): `var > 0 ? var : 0` made it 0)
MATRIX = [pytest.param(c, bad, id=f"{i}-{bad}") for c, i in zip(CASES, IDS) for bad in (np.nan, np.inf)]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("case, bad", MATRIX)
def test_nan_poisons_its_slice_only(emulated, monkeypatch, case, bad):  # noqa: F811
    op, shape, kw, path, budget = case
    if budget is not None:
        monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (budget,))
    if path == "rows_fwd_smem":
        monkeypatch.setattr(_schedule, "_smem_row", L._SMEM_ROW)
    if path == "rows_fwd_cluster":
        L.use_clusters(monkeypatch)
    if path == "cols_fwd_cluster":
        L.use_sample_clusters(monkeypatch)
    names = L._record_launches(monkeypatch)
    x = _poisoned(shape, bad)
    _, _, _, _, y = L.forward_float32(op, x, kw)
    assert path in names, names
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore"):
        ref = _reference.forward(make_plan(op, x64, **kw), x64, None, None)[0]
    _check_poisoned(y, ref, _slice_of_bad(op, shape, kw))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("case", [c for c in CASES if c[3] != "cols_fwd_tile"],
                         ids=[i for c, i in zip(CASES, IDS) if c[3] != "cols_fwd_tile"])
def test_nan_poisons_its_slice_only_in_the_backward(emulated, monkeypatch, case):  # noqa: F811
    op, shape, kw, path, budget = case
    if budget is not None:
        monkeypatch.setattr(_schedule, "_tile_budgets", lambda dtype: (budget,))
    if path == "rows_fwd_smem":  # and rows_bwd_smem
        monkeypatch.setattr(_schedule, "_smem_row", L._SMEM_ROW)
    if path == "cols_fwd_cluster":  # and cols_bwd_cluster
        L.use_sample_clusters(monkeypatch)
    x = _poisoned(shape, np.nan)
    dy = np.random.default_rng(16).standard_normal(shape).astype(np.float32)
    plan, xd, md, sd, _ = L.forward_float32(op, x, kw)
    dxd = L.emu.empty(x.size, "float32")
    _launcher.backward(plan, "float32", L._device(dy, tuple(range(x.ndim)), "float32", 0), xd, None, md, sd,
                       dxd, None, None)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    with np.errstate(invalid="ignore"):
        ref = _reference.backward(make_plan(op, x64, **kw), dy64, x64, None)[0]
    _check_poisoned(dxd.get_float().reshape(shape), ref, _slice_of_bad(op, shape, kw))
