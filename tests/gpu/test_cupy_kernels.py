"""CUDA kernels on CuPy arrays against the reference executor on the same GPU.

Every op and shape class (rows: warp-per-row and chunked; columns; copied layouts), row
lengths 1 .. 2^20, more than 65535 rows and columns, misaligned and non-dense views,
fused residual, a tensor of more than 2^31 elements; outputs, statistics and gradients.
Columns layouts run through both of their paths (shared-memory tiles and the split path).
"""

from __future__ import annotations

import numpy as np
import pytest

import anynorm
from gpu_support import assert_close, assert_close_normwise, backward, forward, param_shape

pytestmark = pytest.mark.gpu

# (op, shape, kwargs). Comments name the kernel path the layout takes.
CASES = [
    ("layer_norm", (64, 1), {}),  # warp, ITEMS=1
    ("layer_norm", (64, 3), {}),
    ("layer_norm", (33, 1000), {}),  # warp, ITEMS=32
    ("layer_norm", (16, 4096), {}),  # block per row, ITEMS=16
    ("layer_norm", (8, 12000), {}),  # block ITEMS=64 (float64 backward: chunked)
    ("layer_norm", (4, 16385), {}),  # chunked rows
    ("layer_norm", (4, 65536), {}),
    ("layer_norm", (2, 2**20), {}),
    ("layer_norm", (1, 2**24), {}),  # the longest row issue 3 names: one row cut into 4 chunks per SM
    ("layer_norm", (70001, 8), {}),  # > 65535 rows, warp
    ("layer_norm", (70001, 1500), {}),  # > 65535 rows, block per row (grid-stride)
    ("layer_norm", (3, 5, 7), {"axis": (-2, -1)}),
    ("layer_norm", (4, 6, 8, 9), {"axis": 1}),  # channels-first (ConvNeXt): columns, one tile
    ("layer_norm", (2, 70000, 3), {"axis": 1}),  # columns, long reduced axis: split path
    ("layer_norm", (70001, 4, 2), {"axis": 1}),  # columns tile, > 65535 outer (gridDim.y loop)
    ("layer_norm", (4, 6, 8, 9), {"axis": (1, 3)}),  # copied to canonical rows
    ("rms_norm", (33, 1000), {}),
    ("rms_norm", (4, 65536), {}),
    ("rms_norm", (4, 6, 8, 9), {"axis": 1}),
    ("instance_norm", (4, 6, 8, 9), {"channel_axis": 1}),  # NCHW: rows, param per row
    ("instance_norm", (4, 8, 9, 6), {"channel_axis": -1}),  # NHWC: columns
    ("instance_norm", (2, 300, 300, 4), {"channel_axis": -1}),
    # NHWC, 3136 positions: no 64 KiB tile; on an H100 float32/float64 take 98 KiB ones, halves split
    ("instance_norm", (32, 56, 56, 64), {"channel_axis": -1}),
    ("instance_norm", (70001, 2, 5), {"channel_axis": 1}),
    ("instance_norm", (2, 3, 70000), {"channel_axis": 1}),
    ("group_norm", (4, 6, 8, 9), {"channel_axis": 1, "num_groups": 3}),
    ("group_norm", (2, 32, 128, 128), {"channel_axis": 1, "num_groups": 8}),  # chunked rows of segments
    ("group_norm", (4, 8, 9, 6), {"channel_axis": -1, "num_groups": 2}),  # NHWC: columns, group 3
    ("group_norm", (4, 8, 9, 6), {"channel_axis": -1, "num_groups": 6}),
    ("group_norm", (2, 32, 32, 64), {"channel_axis": -1, "num_groups": 32}),
]
DTYPES = ("float16", "float32", "float64")


def _ids(case):
    op, shape, kw = case
    return f"{op}-{'x'.join(map(str, shape))}-{'-'.join(f'{k}{v}' for k, v in kw.items())}"


def _data(cp, shape, dtype, seed=0, loc=1.0, scale=3.0):
    rng = cp.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=cp.float32) * scale + loc).astype(dtype)


def _params(cp, op, shape, kw, dtype, seed=1):
    ps = param_shape(op, shape, **kw)
    w = _data(cp, ps, dtype, seed, 1.0, 0.5)
    b = None if op == "rms_norm" else _data(cp, ps, dtype, seed + 1, 0.0, 0.5)
    return w, b


def _check_forward(op, x, w, b, residual=None, **kw):
    with anynorm.use_backend("kernels"):
        got = forward(op, x, w, b, residual, **kw)
    with anynorm.use_backend("reference"):
        want = forward(op, x, w, b, residual, **kw)
    for name, g, e in zip(("y", "h", "mean", "rstd"), got, want):
        if e is None:
            assert g is None, name
            continue
        assert type(g) is type(e) and g.dtype == e.dtype and g.shape == e.shape, name
        assert_close(g, e, x.dtype, "stats" if name in ("mean", "rstd") else "output", name)
    return got


def _check_backward(op, dy, x, w, with_stats, **kw):
    stats = None
    if with_stats:
        with anynorm.use_backend("reference"):
            _, _, mean, rstd = forward(op, x, w, **kw)
        stats = (rstd,) if op == "rms_norm" else (mean, rstd)
    with anynorm.use_backend("kernels"):
        got = backward(op, dy, x, w, stats, **kw)
    with anynorm.use_backend("reference"):
        want = backward(op, dy, x, w, stats, **kw)
    assert_close(got[0], want[0], x.dtype, what="dx")
    for name, g, e in zip(("dweight", "dbias"), got[1:], want[1:]):
        if e is None:
            assert g is None, name
            continue
        assert g.dtype == e.dtype and g.shape == e.shape, name
        # the sums are accumulated in x's precision (float32 for float32 x, whatever the
        # weight's dtype): the bound is the coarser of the two dtypes'
        coarse = x.dtype if x.dtype.itemsize < w.dtype.itemsize else w.dtype
        assert_close_normwise(g, e, coarse, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_matches_reference(cp, case, dtype):
    op, shape, kw = case
    x = _data(cp, shape, dtype)
    w, b = _params(cp, op, shape, kw, dtype)
    _check_forward(op, x, w, b, **kw)
    _check_forward(op, x, None, None, **kw)


@pytest.mark.parametrize("with_stats", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backward_matches_reference(cp, case, dtype, with_stats):
    op, shape, kw = case
    x = _data(cp, shape, dtype)
    dy = _data(cp, shape, dtype, seed=5, loc=0.0, scale=1.0)
    w, _ = _params(cp, op, shape, kw, dtype)
    _check_backward(op, dy, x, w, with_stats, **kw)
    _check_backward(op, dy, x, None, with_stats, **kw)


# Columns layouts small enough for a shared-memory tile (tiles.cu), run again with the tile
# budget set to nothing (cols.cu + finish.cu) and to the device's opt-in maximum with the
# widest tiles (past the default 48 KiB: 2 x 768 x 7 x 7 in float32 puts all 49 columns,
# 147 KiB, in one tile; 1600 rows of 16 columns take 100 KiB forward, 200 KiB backward).
TILE_CASES = [
    ("layer_norm", (2, 768, 7, 7), {"axis": 1}),  # ConvNeXt's last stage, channels-first
    ("layer_norm", (3, 96, 20, 20), {"axis": 1}),
    ("rms_norm", (4, 6, 8, 9), {"axis": 1}),
    ("instance_norm", (4, 8, 9, 6), {"channel_axis": -1}),
    ("group_norm", (2, 7, 7, 96), {"channel_axis": -1, "num_groups": 32}),  # group 3
    ("instance_norm", (2, 40, 40, 16), {"channel_axis": -1}),  # 1600 rows: tiles of 100-200 KiB
]


@pytest.mark.parametrize("cap", [0, 2**30], ids=["split", "largest-tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TILE_CASES, ids=_ids)
def test_columns_paths(cp, monkeypatch, case, dtype, cap):
    from anynorm._cuda import _launcher, _schedule

    monkeypatch.setattr(_schedule, "_TILE_SMEM_CAPS", (cap,))
    monkeypatch.setattr(_schedule, "_target_blocks", lambda: 1)  # widest tile that fits
    monkeypatch.setattr(_schedule, "_sample_cluster", lambda *a, **k: None)  # tiles, not a cluster a sample
    monkeypatch.setattr(_launcher, "_memo", lambda plan: {})  # nothing bound before the patch kept
    op, shape, kw = case
    x = _data(cp, shape, dtype)
    w, b = _params(cp, op, shape, kw, dtype)
    _check_forward(op, x, w, b, **kw)
    dy = _data(cp, shape, dtype, seed=5, loc=0.0, scale=1.0)
    _check_backward(op, dy, x, w, False, **kw)


# Columns of small inner extent: a cluster a sample (samples.cu) on sm_90, as the launcher
# schedules them (ConvNeXt's last stage at batch 8 and 64; an 8x8 extent; NHWC instance norm
# with 8 channels; a sample shorter than the cluster's parts; samples off 16-byte alignment).
SAMPLE_CASES = [
    ("layer_norm", (8, 768, 7, 7), {"axis": 1}),
    ("layer_norm", (64, 768, 7, 7), {"axis": 1}),
    ("layer_norm", (4, 33, 8, 8), {"axis": 1}),
    ("rms_norm", (3, 96, 7, 7), {"axis": 1}),
    ("instance_norm", (16, 7, 7, 8), {"channel_axis": -1}),
    ("layer_norm", (5, 3, 7, 7), {"axis": 1}),
    ("layer_norm", (6, 5, 3, 7), {"axis": 1}),  # 5 x 21 elements a sample: no 16-byte vectors
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SAMPLE_CASES, ids=_ids)
def test_sample_clusters(cp, case, dtype):
    from anynorm._cuda import _launcher, _layout, _schedule
    from anynorm._plan import make_plan

    op, shape, kw = case
    x = _data(cp, shape, dtype)
    w, b = _params(cp, op, shape, kw, dtype)
    plan = make_plan(op, x, w, b, **kw)
    layout = _layout.plan_layout(plan, tuple(s // x.itemsize for s in x.strides))
    device = _launcher.device_info(cp.cuda.Device().id)
    schedule = _schedule.schedule_forward(plan, dtype, layout, {"w", "b"}, device=device)
    if device.cluster_max >= 2:
        assert schedule.names == ("cols_fwd_cluster",), schedule.names
    _check_forward(op, x, w, b, **kw)
    dy = _data(cp, shape, dtype, seed=5, loc=0.0, scale=1.0)
    _check_backward(op, dy, x, w, False, **kw)
    _check_backward(op, dy, x, w, True, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_parameter_dtype(cp, dtype):
    """float32 weights on half inputs (and float64 on float32): the kernels cast them."""
    x = _data(cp, (40, 300), dtype)
    w, b = _params(cp, "layer_norm", (40, 300), {}, "float64" if dtype == "float32" else "float32")
    _check_forward("layer_norm", x, w, b)
    dy = _data(cp, (40, 300), dtype, seed=3, loc=0.0, scale=1.0)
    _check_backward("layer_norm", dy, x, w, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, axis", [((64, 3), -1), ((33, 1000), -1), ((8, 70000), -1),
                                         ((4, 6, 8, 9), 1)])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_fused_residual(cp, op, shape, axis, dtype):
    x = _data(cp, shape, dtype)
    residual = _data(cp, shape, dtype, seed=9)
    w, b = _params(cp, op, shape, {"axis": axis}, dtype)
    y, h, _, _ = _check_forward(op, x, w, b, residual, axis=axis)
    cp.testing.assert_array_equal(h, x + residual)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("length", [3, 8, 1000, 1024, 4096, 8192, 16384])
def test_misaligned_views(cp, length, dtype):
    """Views starting one element past a 16-byte boundary take the scalar paths."""
    rows = 37
    flat = _data(cp, (rows * length + 1,), dtype)
    x = flat[1:].reshape(rows, length)
    assert x.data.ptr % 16 != 0
    res = _data(cp, (rows * length + 3,), dtype, seed=4)[3:].reshape(rows, length)
    w, b = _params(cp, "layer_norm", (rows, length), {}, dtype)
    _check_forward("layer_norm", x, w, b)
    _check_forward("layer_norm", x, w, b, res)
    dy = _data(cp, (rows * length + 2,), dtype, seed=6)[2:].reshape(rows, length)
    _check_backward("layer_norm", dy, x, w, False)


@pytest.mark.parametrize("make", [
    lambda a: a[:, ::2],  # non-dense
    lambda a: a.T,  # transposed: kept axis order reversed
    lambda a: a[::-1],  # negative strides
], ids=["strided", "transposed", "reversed"])
def test_other_layouts_are_copied(cp, make):
    x = make(_data(cp, (64, 96), "float32"))
    w, b = _params(cp, "layer_norm", x.shape, {}, "float32")
    _check_forward("layer_norm", x, w, b)
    dy = make(_data(cp, (64, 96), "float32", seed=2))
    _check_backward("layer_norm", dy, x, w, True)


def test_outputs_keep_channels_last_layout(cp):
    x = cp.ascontiguousarray(_data(cp, (2, 5, 6, 3), "float32")).transpose(0, 3, 1, 2)  # NCHW view of NHWC
    y = anynorm.instance_norm(x, channel_axis=1)
    assert y.strides == x.strides
    _check_forward("instance_norm", x, None, None, channel_axis=1)


def test_empty_batch(cp):
    x = cp.zeros((0, 8), dtype=cp.float32)
    with anynorm.use_backend("kernels"):
        y, mean, rstd = anynorm.layer_norm(x, return_stats=True)
        dx, dw, db = anynorm.layer_norm_backward(x, x, cp.ones(8, cp.float32))
    assert y.shape == (0, 8) and mean.shape == (0, 1) and dx.shape == (0, 8)
    assert (dw == 0).all() and (db == 0).all()


def test_runs_on_current_stream(cp):
    x = _data(cp, (512, 1000), "float32")
    with anynorm.use_backend("reference"):
        want = anynorm.layer_norm(x)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()  # x was made on the null stream, which a non-blocking one does not wait for
    with stream, anynorm.use_backend("kernels"):
        y = anynorm.layer_norm(x)
    stream.synchronize()
    assert_close(y, want, x.dtype)


def test_inputs_are_not_modified(cp):
    x = _data(cp, (16, 100), "float16")
    res = _data(cp, (16, 100), "float16", seed=3)
    x0, r0 = x.copy(), res.copy()
    with anynorm.use_backend("kernels"):
        anynorm.layer_norm(x, residual=res)
    cp.testing.assert_array_equal(x, x0)
    cp.testing.assert_array_equal(res, r0)


def test_kernel_cache_reuses_compiled_functions(cp):
    from anynorm._cuda._compile import get_kernel

    assert get_kernel("apply_bwd", "float32") is get_kernel("apply_bwd", "float32")


def test_more_than_2_31_elements(cp):
    """64-bit indexing: a float16 tensor of 2^31 + 2048 elements (rows and columns paths)."""
    n_rows, length = 2**21 + 2, 1024
    need = n_rows * length * 2 * 4  # x, y, dy, dx in float16
    free, _ = cp.cuda.Device().mem_info
    if free < need + (4 << 30):
        pytest.skip(f"needs about {(need >> 30) + 4} GiB of free GPU memory, {free >> 30} free")
    x = _data(cp, (n_rows, length), "float16")
    assert x.size > 2**31
    w, b = _params(cp, "layer_norm", (n_rows, length), {}, "float16")
    with anynorm.use_backend("kernels"):
        y, mean, rstd = anynorm.layer_norm(x, w, b, return_stats=True)
    picks = np.r_[0:3, n_rows // 2, n_rows - 3:n_rows]
    with anynorm.use_backend("reference"):
        ry, rmean, rrstd = anynorm.layer_norm(x[picks], w, b, return_stats=True)
    assert_close(y[picks], ry, x.dtype)
    assert_close(rstd[picks], rrstd, x.dtype, "stats")
    dy = _data(cp, (n_rows, length), "float16", seed=7, loc=0.0, scale=1.0)
    with anynorm.use_backend("kernels"):
        dx, _, _ = anynorm.layer_norm_backward(dy, x, w, stats=(mean, rstd))
    with anynorm.use_backend("reference"):
        rdx, _, _ = anynorm.layer_norm_backward(dy[picks], x[picks], w)
    assert_close(dx[picks], rdx, x.dtype)
    del y, dx, dy
    # Columns: layer norm over axis 1 of (2^20 + 1, 1024, 2): inner = 2, > 2^31 elements.
    xc = x.reshape(-1)[: (2**20 + 1) * 2048].reshape(2**20 + 1, 1024, 2)
    with anynorm.use_backend("kernels"):
        yc = anynorm.layer_norm(xc, axis=1)
    with anynorm.use_backend("reference"):
        ryc = anynorm.layer_norm(xc[-2:], axis=1)
    assert_close(yc[-2:], ryc, x.dtype)



# Rows the sm_90 schedule splits over a thread-block cluster (rows_fwd_cluster): past one
# block's shared memory (262144 float16, 65536 float32) or too few for a block each (64 rows);
# NCHW group norm rows of parameter segments.
CLUSTER_CASES = [((128, 262144), "float16"), ((264, 65536), "float32"), ((64, 40960), "float16"),
                 ((66, 4, 129, 129), "float32")]


@pytest.mark.parametrize("shape, dtype", CLUSTER_CASES, ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_rows_across_a_cluster(cp, monkeypatch, shape, dtype):
    """The cluster kernels where the device has clusters (sm_90): output, statistics, dx and
    dweight/dbias as the reference's; the split path's kernels where it has none (and the
    segments path for the backward of NCHW group norm with weights)."""
    from anynorm._cuda import _launcher

    names, fetch = set(), _launcher.get_kernel
    monkeypatch.setattr(_launcher, "get_kernel", lambda k, d, items=None: names.add(k) or fetch(k, d, items))
    monkeypatch.setattr(_launcher, "_memo", lambda plan: {})
    op, kw = ("group_norm", {"num_groups": 1, "channel_axis": 1}) if len(shape) == 4 else ("layer_norm", {})
    x = _data(cp, shape, dtype)
    w, b = _params(cp, op, shape, kw, dtype)
    _check_forward(op, x, w, b, **kw)
    clusters = int(cp.cuda.Device().compute_capability) >= 90
    assert ("rows_fwd_cluster" in names) == clusters, names
    names.clear()
    _check_backward(op, _data(cp, shape, dtype, seed=5, loc=0.0, scale=1.0), x, w, True, **kw)
    assert ("rows_bwd_cluster" in names) == (clusters and op == "layer_norm"), names
