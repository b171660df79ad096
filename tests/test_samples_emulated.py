"""The sample-cluster kernels (``kernels/samples.cu``, issue 15) on the CPU emulator.

Columns of small inner extent (ConvNeXt's 7x7 stage: 768 channels x 49 positions a sample)
run a cluster of C blocks a sample: block k holds rows [k * part, ...) of the sample's
contiguous (reduced, inner) block as one flat range (16-byte copies where samples start
aligned), and the blocks add their columns' sums from each other's shared memory. Cases:
every cluster size, inner 49 (rows 98 bytes apart: parts of 8 rows' multiples in 16-bit
types), 64, 3 and 8, parts of unequal length and empty ones (reduced 5 over 8 blocks),
parameters per row (channels-first layer norm) and per column (NHWC instance norm), fewer
clusters than samples (each cluster walks several), buffers off alignment (element by
element), RMS norm, statistics alone, parameters stored in x's dtype; the backward's
dweight/dbias partials per sample through param_grad_finish.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import test_kernels_emulated as K
emu = K.emu  # the harness instance whose DeviceArrays K.run_* make
from anynorm._cuda import _layout, _schedule
from anynorm._plan import make_plan

pytestmark = pytest.mark.skipif(emu.compiler() is None or not hasattr(os, "fork"),
                                reason="the CUDA emulation needs g++ and fork()")

DTYPES = ("float16", "bfloat16", "float32", "float64")


@pytest.fixture(scope="module")
def samples():
    """samples.cu (every cluster size) and param_grad_finish alone."""
    return K.kernel_set(("samples.cu", "params.cu"), ("cols_fwd_cluster", "cols_bwd_cluster", "param_grad_finish"),
                        "samples")


# (id, case, cluster size, clusters: None one per sample, else fewer)
CASES = [
    ("ln_cf_7x7_c4", lambda: K.layer_norm_channels_first(3, 40, 7, 7), 4, None),
    ("ln_cf_7x7_c8_walk", lambda: K.layer_norm_channels_first(3, 40, 7, 7), 8, 1),  # one cluster, 3 samples
    ("ln_cf_8x8_c2", lambda: K.layer_norm_channels_first(2, 33, 8, 8), 2, None),  # inner 64: 256 threads, 4 lanes
    ("ln_cf_empty_parts", lambda: K.layer_norm_channels_first(2, 5, 7, 7), 8, None),  # 5 rows: one part holds all
    ("ln_cf_inner3", lambda: K.layer_norm_channels_first(2, 50, 1, 3), 4, 1),  # 6-byte rows (16-bit)
    ("in_nhwc_c8", lambda: K.instance_norm_nhwc(3, 7, 7, 8), 4, 2),  # p = column, 49 rows
    ("in_nhwc_c49", lambda: K.instance_norm_nhwc(2, 6, 6, 49), 2, None),  # odd inner, p = column
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,c,grid", CASES, ids=[c[0] for c in CASES])
def test_sample_forward(samples, name, make, c, grid, dtype):
    """y, mean and rstd against the float64 reference: with weight and bias (in A and in x's
    dtype), without, as RMS norm, statistics alone, and on buffers off alignment."""
    case = make()
    kw = dict(path="sample", items=c, grid=grid)
    K.check_forward(samples, case, dtype, **kw)
    K.check_forward(samples, case, dtype, params_in_t=True, **kw)
    K.check_forward(samples, case, dtype, weight=False, bias=False, **kw)
    K.check_forward(samples, case, dtype, center=0, bias=False, **kw)
    K.check_forward(samples, case, dtype, want_y=False, **kw)
    K.check_forward(samples, case, dtype, offset=1, schedule=5, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,c,grid", CASES, ids=[c[0] for c in CASES])
def test_sample_backward(samples, name, make, c, grid, dtype):
    """dx against the float64 reference (weight in A and in x's dtype, none, RMS, buffers off
    alignment), then dweight/dbias from the per-sample partials through param_grad_finish."""
    case = make()
    kw = dict(path="sample", items=c, grid=grid)
    K.check_backward(samples, case, dtype, **kw)
    K.check_backward(samples, case, dtype, params_in_t=True, **kw)
    K.check_backward(samples, case, dtype, weight=False, **kw)
    K.check_backward(samples, case, dtype, center=0, **kw)
    K.check_backward(samples, case, dtype, offset=1, schedule=5, **kw)
    for with_bias in (True, False):
        check_sample_param_grads(samples, case, dtype, c, grid, with_bias)


def check_sample_param_grads(samples, case, dtype, c, grid, with_bias):
    """cols_bwd_cluster's dweight/dbias partials per sample (part[o * p_len + p]), summed by
    param_grad_finish over the samples, against the float64 reference."""
    A = K.ACC[dtype]
    x, w, _ = K._data(case, dtype, 5)
    dy = np.random.default_rng(6).standard_normal(case.shape)
    xr, dyr = K._rounded(x, dtype), K._rounded(dy, dtype)
    _, _, rstd = K.ref_forward(case, xr, None, None, 1, 1e-5)
    parts = [K._acc_buf(case.outer * case.p_len, dtype) for _ in range(2)]
    part_b = parts[1] if with_bias else None
    function, smem = K.sample_kernel(samples, "cols_bwd_cluster", case, dtype, c, 2)
    dxd = emu.empty(case.total, dtype)
    function(((grid or case.outer) * c,), (K.SAMPLE_BLOCK,),
             (emu.to_device(dy.reshape(-1), dtype), emu.to_device(x.reshape(-1), dtype), emu.to_device(w, A),
              emu.to_device(rstd.astype(A), A), dxd, parts[0], part_b, case.outer, case.reduced, case.inner,
              case.p_div, case.p_len, 1, 0), shared_mem=smem, cluster=c)
    dw, db = emu.empty(case.p_len, A), (emu.empty(case.p_len, A) if with_bias else None)
    samples("param_grad_finish", dtype)((K._ceil(case.p_len, 32),), K.FINISH_BLOCK,
                                        (parts[0], part_b, dw, db, case.p_len, case.outer, 0))
    dx_ref, dw_ref, db_ref = K.ref_backward(case, dyr, xr, w, 1, 1e-5)
    K._close(dxd.get_float().reshape(case.shape), dx_ref, K.TOL[dtype] * 4, f"dx of {case} {dtype}",
             scale=max(1.0, float(np.abs(dx_ref).max())))
    n_terms = case.total // case.p_len
    K._close(dw.get_float(), dw_ref, K.STAT_TOL[dtype] * 4, f"dweight of {case} {dtype}", scale=max(1.0, n_terms))
    if with_bias:
        K._close(db.get_float(), db_ref, K.STAT_TOL[dtype] * 4, f"dbias of {case} {dtype}", scale=max(1.0, n_terms))


def _layout_of(op, shape, **kw):
    x = np.zeros(shape, np.float32)
    w = np.ones(make_plan(op, x, **kw).param_shape, np.float32)
    plan = make_plan(op, x, w, w, **kw)
    strides = tuple(int(np.prod(shape[k + 1:])) for k in range(len(shape)))
    return _layout.plan_layout(plan, strides, True)


def test_the_launcher_takes_a_cluster_a_sample_for_small_inner():
    """ConvNeXt's 7x7 stage (and 8x8 extents) on an H100: clusters of 8 (64 x 8 blocks: 4 an
    SM), forward and backward; 14x14 stays on the tiles; no clusters on an A100, nor for
    group norm (statistics of several columns) or a residual."""
    from test_schedules import SMALL, STATS, _backward, _forward, _plan

    grads = {"w", "rstd", "mean", "dw", "db"}
    plan = _plan("layer_norm", (64, 768, 7, 7), axis=1)
    fwd, bwd = _forward(plan, {"w", "b"} | STATS), _backward(plan, grads)
    assert (fwd.steps[0].name, fwd.steps[0].items, fwd.steps[0].grid) == ("cols_fwd_cluster", 8, (512,))
    assert bwd.names == ("cols_bwd_cluster", "param_grad_finish") and bwd.steps[0].items == 8
    assert _forward(_plan("layer_norm", (64, 384, 14, 14), axis=1), {"w", "b"}).names == ("cols_fwd_tile",)
    assert _forward(plan, {"w", "b"}, device=SMALL).names != ("cols_fwd_cluster",)  # no clusters there
    nhwc_in = _plan("instance_norm", (32, 7, 7, 8), channel_axis=-1)
    assert _backward(nhwc_in, grads).names == ("cols_bwd_cluster", "param_grad_finish")
    gn = _plan("group_norm", (32, 7, 7, 64), channel_axis=-1, num_groups=32)
    assert "cols_fwd_cluster" not in _forward(gn, {"w", "b"}).names
    # the shared memory the launcher gives is what the kernel lays out
    layout = _layout_of("layer_norm", (64, 768, 7, 7), axis=1)
    rows = _schedule.sample_part_rows(768, 49, 2, 8)
    assert rows == 96 and rows * 49 * 2 % 16 == 0
    assert fwd.steps[0].smem == _schedule.sample_smem(layout.reduced, layout.inner, "bfloat16", 8, 1, False)


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_sample_columns_far_from_zero(samples, offset):
    """float32 columns offset by 1e4 and 1e6 (channels-first layer norm, 4 x 96 x 7 x 7): y at
    float32 rounding, at most half the error of the best kernel that subtracts a float32 mean
    ((x - fl32(mean)) * rstd from the exact statistics: torch's kernels are no better), the
    written mean the true mean rounded once; dx from the saved statistics at the tolerance
    of data near zero."""
    case = K.layer_norm_channels_first(4, 96, 7, 7)
    rng = np.random.default_rng(7)
    x = (offset + rng.standard_normal(case.shape)).astype(np.float32).astype(np.float64)
    y, _, mean, rstd = K.run_forward(samples, case, "float32", x, None, None, path="sample", items=4)
    y_ref, mean_ref, rstd_ref = K.ref_forward(case, x, None, None, 1, 1e-5)
    stat_shape = (case.outer, 1) + case.shape[2:]
    mean32 = mean_ref.astype(np.float32).astype(np.float64).reshape(stat_shape)
    comparator = float(np.abs((x - mean32) * rstd_ref.reshape(stat_shape) - y_ref).max())
    ours = float(np.abs(y.reshape(case.shape) - y_ref).max())
    assert ours <= max(0.5 * comparator, 8 * float(np.finfo(np.float32).eps)), (ours, comparator)
    np.testing.assert_allclose(mean, mean_ref, rtol=2.0**-23, atol=0)
    np.testing.assert_allclose(rstd, rstd_ref, rtol=2e-6)
    dy = rng.standard_normal(case.shape).astype(np.float32).astype(np.float64)
    dx = K.run_backward(samples, case, "float32", dy, x, None, mean.astype(np.float32), rstd.astype(np.float32),
                        path="sample", items=4)
    dx_ref, _, _ = K.ref_backward(case, dy, x, None, 1, 1e-5)
    K._close(dx.reshape(case.shape), dx_ref, K.TOL["float32"] * 4, f"dx at {offset:g}",
             scale=max(1.0, float(np.abs(dx_ref).max())))
