"""anynorm's CPU backward kernels (``anynorm_rows_bwd_*``, ``anynorm_cols_bwd_*`` in
kernels/cpu.cpp) through :class:`anynorm._numpy_rows_backward.RowsBackward` and
:class:`anynorm._numpy_columns_backward.ColumnsBackward`: dx, dweight and dbias against the
float64 reference for every row length's vector tails, rows one by one and in groups
(weights past L1), statistics given and taken again, runs of parameters (NCHW
instance/group norm), column strips of a sample, a vector and a group, slices far from zero,
NaN slices, dx by non-temporal stores, bfloat16 and the kernels' refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

import reference
from anynorm import _native, _numpy
from anynorm._numpy_rows_backward import RowsBackward
from anynorm._plan import make_plan

EPS32 = float(np.finfo(np.float32).eps)
DX_TOL = {np.float16: 4 * 2.0 ** -11, np.float32: 64 * EPS32, np.float64: 1e-12}
ROW_LENGTHS = [1, 7, 8, 9, 16, 33, 37, 64, 65, 770, 4099]  # 8-64: short rows; 4099: groups of 4 (weight past L1)


@pytest.fixture(autouse=True)
def _kernels_built():
    if _native.rows_backward_kernel(np.float32) is None:
        pytest.skip("anynorm's CPU kernels are not built here")


def _backward(op, dy, x, weight=None, stats=None, split=False, **kw):
    """``(dx, dweight, dbias)`` of the kernel path, in one call or one call per block."""
    plan = make_plan(op, x, weight, **kw)
    mean, rstd = stats if stats is not None else (None, None)
    call = RowsBackward.make(plan, _numpy._Layout(plan, [x, dy]), dy, x, weight, mean, rstd)
    assert call is not None
    blocks = call.blocks()
    parts = [call.run([b]) for b in blocks] if split else [call.run(blocks)]
    return call.results(parts)


def _stats(op, x, **kw):
    """The statistics as anynorm's forward returns them."""
    plan = make_plan(op, x, **kw)
    _, _, mean, rstd = _numpy.forward(plan, x)
    return mean, rstd


def _rel_err(got, want):
    want = np.asarray(want, np.float64)
    # relative to the largest value, or absolute where all are below 1 (rows of one: 0)
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(float(np.max(np.abs(want))), 1.0))


def _check(op, got, dy, x, weight, tol, **kw):
    want = reference.backward(op, dy, x, weight, **kw)
    assert _rel_err(got[0], want[0]) <= tol, "dx"
    if weight is None:
        assert got[1] is None and got[2] is None
        return
    assert got[1].shape == weight.shape and got[1].dtype == weight.dtype
    # float64 sums for float64 x; float32 sums added in float64 for the others
    param_tol = tol if tol < EPS32 else max(tol, 64 * EPS32)
    for g, w in zip(got[1:], want[1:]):
        assert _rel_err(g, w) <= param_tol, "dweight/dbias"


@pytest.mark.parametrize("stats", ["given", "recomputed"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("affine", [True, False], ids=["weight", "none"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_rows_backward_matches_float64_reference(op, affine, n, dtype, stats):
    """70 rows: a group of 4 and a tail, a flush of the float32 gradient sums at row 64."""
    if dtype == np.float16 and _native.rows_backward_kernel(np.float16) is None:
        pytest.skip("no float16 kernel on this CPU")
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((70, n)) * 2 + 1).astype(dtype)
    dy = rng.standard_normal((70, n)).astype(dtype)
    w = (rng.standard_normal(n) + 1).astype(np.float64 if dtype == np.float64 else np.float32) if affine else None
    eps = 1e-5
    given = _stats(op, x, eps=eps) if stats == "given" else None
    got = _backward(op, dy, x, w, given, eps=eps)
    assert got[0].dtype == dtype and got[0].shape == x.shape
    tol = DX_TOL[dtype] * (4 if n == 1 else 1)
    _check(op, got, dy, x, w, tol, eps=eps)


@pytest.mark.parametrize("n", [8, 37])
def test_weight_gradients_over_many_rows_keep_float32_rounding(n):
    """200000 rows whose dy averages 1: float32 sums of the weight and bias gradients go to
    float64 every BWD_FLUSH_ROWS rows (summed in float32 over all rows, dbias would be off
    by a part in 1e3)."""
    rng = np.random.default_rng(5)
    rows = 200000
    x = rng.standard_normal((rows, n)).astype(np.float32)
    dy = (1 + rng.standard_normal((rows, n))).astype(np.float32)
    w = (rng.standard_normal(n) + 1).astype(np.float32)
    got = _backward("layer_norm", dy, x, w, _stats("layer_norm", x, eps=1e-5), eps=1e-5)
    _check("layer_norm", got, dy, x, w, DX_TOL[np.float32], eps=1e-5)


@pytest.mark.parametrize("stats", ["given", "recomputed"])
@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("n", [9, 37, 4096])
def test_rows_backward_far_from_zero_keep_float32_rounding(n, offset, stats):
    """Statistics taken again as the forward takes them (the mean in two floats), or given
    (what the float32 mean's rounding left out taken back from the row's sums), so
    ``x - mean`` carries no rounding of the offset."""
    rng = np.random.default_rng(3)
    x = (offset + rng.standard_normal((40, n))).astype(np.float32)
    dy = rng.standard_normal((40, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    given = _stats("layer_norm", x, eps=1e-5) if stats == "given" else None
    _check("layer_norm", _backward("layer_norm", dy, x, w, given, eps=1e-5), dy, x, w, DX_TOL[np.float32], eps=1e-5)


@pytest.mark.parametrize("stats", ["given", "recomputed"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,shape,kw", [
    ("instance_norm", (3, 5, 7, 7), {}),  # runs of 49: vectors and a tail
    ("instance_norm", (2, 6, 8), {}),  # runs of 8: one vector
    ("group_norm", (4, 12, 9, 7), {"num_groups": 3}),  # 4 runs of 63 a row
    ("group_norm", (2, 6, 130), {"num_groups": 2}),
])
def test_runs_of_parameters_backward(op, shape, kw, dtype, stats):
    """NCHW instance/group norm: the weight constant on each channel's run, its gradients one
    a run, summed over the samples."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 3 - 2).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal(shape[1]) + 0.5).astype(dtype)
    given = _stats(op, x, **kw) if stats == "given" else None
    _check(op, _backward(op, dy, x, w, given, **kw), dy, x, w, DX_TOL[dtype], **kw)


def test_blocks_in_separate_calls_sum_their_gradients():
    """A thread's part returns its own weight and bias gradients; the call adds them."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 2000)).astype(np.float32)
    dy = rng.standard_normal((300, 2000)).astype(np.float32)
    w = rng.standard_normal(2000).astype(np.float32)
    whole = _backward("layer_norm", dy, x, w)
    split = _backward("layer_norm", dy, x, w, split=True)
    np.testing.assert_array_equal(split[0], whole[0])
    for a, b in zip(split[1:], whole[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.max(np.abs(b))))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_non_finite_value_makes_only_its_row_nan(op, bad):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, 300)).astype(np.float32)
    dy = rng.standard_normal((9, 300)).astype(np.float32)
    x[4, 17] = bad
    dx = _backward(op, dy, x, rng.standard_normal(300).astype(np.float32), eps=1e-5)[0]
    assert np.isnan(dx[4]).all()
    assert np.isfinite(np.delete(dx, 4, axis=0)).all()


@pytest.mark.parametrize("n, w_run, center", [(1024, 0, 1), (1027, 0, 1), (4096, 0, 1), (4096, 0, 0),
                                             (300, 100, 1)])
def test_streamed_dx_as_stored(n, w_run, center):
    """float32 dx of a call of 4 MiB and up goes by non-temporal stores where rows are whole
    16-byte pieces and dx is aligned: the same bits as the same rows in smaller calls, dx
    aligned or 4 bytes off, rows in groups (4096), runs of parameters, RMS norm."""
    kernel = _native.rows_backward_kernel(np.float32)
    rows = (4 << 20) // (4 * n) + 3
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((rows, n)) + 1e3 * center).astype(np.float32)
    dy = rng.standard_normal((rows, n)).astype(np.float32)
    k = n // w_run if w_run else n
    w = (rng.random(rows * k if w_run else n) + 0.5).astype(np.float32)
    outs = []
    for shift, step in ((0, rows), (1, rows), (0, 97)):
        buf = np.zeros(x.size + 8, np.float32)
        first = (-buf.ctypes.data % 16) // 4 + shift
        dx = buf[first:first + x.size].reshape(rows, n)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            wp = w.ctypes.data + (r0 * k * 4 if w_run else 0)
            assert kernel(x[r0].ctypes.data, dy[r0].ctypes.data, dx[r0].ctypes.data, wp, w_run, 0, 0, 0, 0,
                          r1 - r0, n, center, 1e-5) == 0
        outs.append(dx.copy())
    for other in outs[1:]:
        np.testing.assert_array_equal(other, outs[0])


def test_bfloat16_is_float32s_result_rounded():
    """bfloat16 (ml_dtypes) rows: dx is the float32 kernel's on the same values, rounded to
    bfloat16 (to within the float32 rounding of dx's cancelling terms, which the compiler may
    fuse differently in the two instantiations: 1 element in 54,000 then rounds the other way);
    the weight gradients are float32's."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(7)
    for shape in [(70, 770), (9, 4099)]:
        x = rng.standard_normal(shape).astype(np.float32).astype(bf16)
        dy = rng.standard_normal(shape).astype(np.float32).astype(bf16)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        got = _backward("layer_norm", dy, x, w, eps=1e-5)
        want = _backward("layer_norm", dy.astype(np.float32), x.astype(np.float32), w, eps=1e-5)
        assert got[0].dtype == bf16
        dx, dx32 = got[0].astype(np.float64), want[0].astype(np.float64)
        assert np.all(np.abs(dx - dx32) <= 2.0 ** -8 * np.abs(dx32) + 64 * EPS32 * np.abs(dx32).max())
        assert np.mean(got[0].view(np.uint16) == want[0].astype(bf16).view(np.uint16)) > 0.999
        for a, b in zip(got[1:], want[1:]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))


def test_kernel_refuses_bad_sizes():
    """Non-zero for rows of no elements, rows not whole runs, centred statistics without
    their mean."""
    kernel = _native.rows_backward_kernel(np.float32)
    a = np.ones((2, 8), np.float32)
    p = a.ctypes.data
    assert kernel(p, p, p, 0, 0, 0, 0, 0, 0, 2, 0, 1, 1e-5) == 1
    assert kernel(p, p, p, p, 3, 0, 0, 0, 0, 2, 8, 1, 1e-5) == 1
    assert kernel(p, p, p, 0, 0, 0, p, 0, 0, 2, 8, 1, 1e-5) == 1
    assert kernel(p, p, p, 0, 0, 0, p, 0, 0, 2, 8, 0, 1e-5) == 0  # RMS norm: no mean needed


def test_path_declines_what_it_does_not_take():
    """dy of another dtype, a strided x, reduced axes not trailing: the NumPy passes run."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((64, 80)).astype(np.float32)
    plan = make_plan("layer_norm", x)
    make = lambda dy, xx, p=plan: RowsBackward.make(p, _numpy._Layout(p, [xx, dy]), dy, xx, None, None, None)  # noqa: E731
    assert make(x, x) is not None
    assert make(x.astype(np.float64), x) is None
    strided = np.asfortranarray(x)
    assert make(x, strided) is None
    plan0 = make_plan("layer_norm", x, axis=0)
    assert RowsBackward.make(plan0, _numpy._Layout(plan0, [x, x]), x, x, None, None, None) is None


# ---- the column backward (anynorm_cols_bwd_*, ColumnsBackward) --------------------------------

COLUMN_CASES = [  # (op, shape, kwargs): channels-first layer norm, NHWC instance and group norm
    ("layer_norm", (3, 24, 7, 9), {"axis": 1}),  # Q = 63: vectors and a tail
    ("layer_norm", (2, 40, 1001), {"axis": 1}),
    ("instance_norm", (3, 5, 7, 24), {"channel_axis": -1}),
    ("instance_norm", (2, 130, 9), {"channel_axis": -1}),  # 9 channels: one vector and one
    ("group_norm", (3, 5, 7, 24), {"num_groups": 6, "channel_axis": -1}),
    ("group_norm", (2, 9, 9, 64), {"num_groups": 32, "channel_axis": -1}),
]
CIDS = [f"{op} {'x'.join(map(str, shape))}" for op, shape, _ in COLUMN_CASES]


def _backward_columns(op, dy, x, weight=None, stats=None, strip=None, dx_offset=0, **kw):
    """``(dx, dweight, dbias)`` of the column kernel path, optionally in strips of ``strip``
    columns and with dx 4 bytes past 16-byte alignment (``dx_offset=1``)."""
    from anynorm._numpy_columns_backward import ColumnsBackward

    plan = make_plan(op, x, weight, **kw)
    mean, rstd = stats if stats is not None else (None, None)
    call = ColumnsBackward.make(plan, _numpy._Layout(plan, [x, dy]), dy, x, weight, mean, rstd)
    assert call is not None
    if strip is not None:
        call.strip = strip
    if dx_offset:
        buf = np.zeros(x.size + 8, x.dtype)
        first = (-buf.ctypes.data % 16) // x.itemsize + dx_offset
        call.dx = buf[first:first + x.size].reshape(x.shape)
    return call.results([call.run(call.blocks())])


def _strip_choices(op, shape, kw):
    """Whole samples, one vector of columns, one group of columns."""
    group = 1
    if op == "group_norm":
        group = shape[-1] // kw["num_groups"]
    return [None, math.lcm(8, group), group]


@pytest.mark.parametrize("stats", ["given", "recomputed"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("affine", [True, False], ids=["weight", "none"])
@pytest.mark.parametrize("op,shape,kw", COLUMN_CASES, ids=CIDS)
def test_columns_backward_matches_float64_reference(op, shape, kw, affine, dtype, stats):
    if dtype == np.float16 and _native.cols_backward_kernel(np.float16) is None:
        pytest.skip("no float16 kernel on this CPU")
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 2 - 1).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    c = shape[kw.get("axis", kw.get("channel_axis", 1))]
    w = (rng.standard_normal(c) + 1).astype(np.float64 if dtype == np.float64 else np.float32) if affine else None
    given = _stats(op, x, **kw) if stats == "given" else None
    for strip in _strip_choices(op, shape, kw):
        got = _backward_columns(op, dy, x, w, given, strip, **kw)
        assert got[0].dtype == dtype and got[0].shape == x.shape
        _check(op, got, dy, x, w, DX_TOL[dtype], **kw)


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("op,shape,kw", COLUMN_CASES, ids=CIDS)
def test_columns_backward_far_from_zero_keep_float32_rounding(op, shape, kw, offset):
    """Statistics taken again: the mean in two floats, as the forward's kernel takes it."""
    rng = np.random.default_rng(3)
    x = (offset + rng.standard_normal(shape)).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[kw.get("axis", kw.get("channel_axis", 1))]).astype(np.float32)
    _check(op, _backward_columns(op, dy, x, w, **kw), dy, x, w, DX_TOL[np.float32], **kw)


def test_columns_backward_nan_stays_in_its_slice():
    """A NaN in one (sample, group) of an NHWC group norm makes that slice's dx NaN, no other."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 6, 6, 16)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    x[1, 2, 3, 5] = np.nan  # sample 1, group 1 (channels 4-7)
    dx = _backward_columns("group_norm", dy, x, np.ones(16, np.float32), channel_axis=-1, num_groups=4)[0]
    nan = np.zeros(x.shape, bool)
    nan[1, :, :, 4:8] = True
    np.testing.assert_array_equal(np.isnan(dx), nan)


@pytest.mark.parametrize("op,shape,kw", [("layer_norm", (2, 16, 64), {"axis": 1}),
                                         ("group_norm", (2, 16, 64), {"num_groups": 8, "channel_axis": -1})])
def test_columns_streamed_dx_as_stored(op, shape, kw):
    """float32 dx by non-temporal stores where dx is 16-byte aligned and a strip's rows are
    whole 16-byte pieces: the same bits as ordinary stores into dx 4 bytes off, whole and in
    strips of 8 and 4 columns (a last 4 as half a vector)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) + 3).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[1] if kw.get("axis") == 1 else shape[-1]).astype(np.float32)
    for strip in (None, 8, 12) if op == "layer_norm" else (None, 8, 16):
        streamed = _backward_columns(op, dy, x, w, None, strip, **kw)
        stored = _backward_columns(op, dy, x, w, None, strip, dx_offset=1, **kw)
        np.testing.assert_array_equal(streamed[0], stored[0])


def test_columns_bfloat16_is_float32s_result_rounded():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(7)
    for op, shape, kw in COLUMN_CASES:
        x = rng.standard_normal(shape).astype(np.float32).astype(bf16)
        dy = rng.standard_normal(shape).astype(np.float32).astype(bf16)
        w = rng.standard_normal(shape[kw.get("axis", kw.get("channel_axis", 1))]).astype(np.float32)
        got = _backward_columns(op, dy, x, w, **kw)
        want = _backward_columns(op, dy.astype(np.float32), x.astype(np.float32), w, **kw)
        assert got[0].dtype == bf16
        dx, dx32 = got[0].astype(np.float64), want[0].astype(np.float64)
        assert np.all(np.abs(dx - dx32) <= 2.0 ** -8 * np.abs(dx32) + 64 * EPS32 * np.abs(dx32).max())
        for a, b in zip(got[1:], want[1:]):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))


def test_column_kernel_refuses_bad_sizes():
    kernel = _native.cols_backward_kernel(np.float32)
    a = np.ones((2, 8, 8), np.float32)
    p = a.ctypes.data
    assert kernel(p, p, p, 0, 0, 0, 0, 0, 2, 0, 8, 1, 8, 1, 1e-5) == 1  # no rows
    assert kernel(p, p, p, 0, 0, 0, 0, 0, 2, 8, 8, 3, 6, 0, 1e-5) == 1  # groups not whole
    assert kernel(p, p, p, 0, 0, 0, 0, 0, 2, 8, 8, 2, 3, 0, 1e-5) == 1  # strip not whole groups
    assert kernel(p, p, p, 0, p, 0, 0, 0, 2, 8, 8, 1, 8, 1, 1e-5) == 1  # mean without rstd
    assert kernel(p, p, p, 0, 0, 0, 0, 0, 2, 8, 8, 1, 8, 1, 1e-5) == 0
