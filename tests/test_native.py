"""The compiled CPU kernels (``kernels/cpu.cpp`` through ``anynorm._native``).

They build with the host's C++ compiler (CI has one: the CUDA emulator needs g++), take the
NumPy executor's rows (layer/RMS norm over trailing axes, NCHW instance/group norm) and
columns (channels-first layer norm, NHWC instance/group norm), match the float64 reference to
float32 rounding on every dtype, length and offset, keep a NaN in its slice, and where they
cannot be built the NumPy passes run instead.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import reference
import support

import anynorm
from anynorm import _native, _numpy, _numpy_columns, _outputs
from anynorm._numpy_columns import NativeColumns
from anynorm._numpy_rows import RowsForward
from anynorm._plan import make_plan

pytestmark = pytest.mark.skipif(_native._compiler() is None, reason="no C++ compiler on this host")

EPS32 = float(np.finfo(np.float32).eps)
# y's error bound in units of the largest |y| (float32 and float16 round y last)
Y_TOL = {np.float16: 2 * 2.0 ** -11, np.float32: 8 * EPS32, np.float64: 1e-13}
ROW_LENGTHS = [1, 7, 8, 9, 16, 33, 770, 4099]


def _f16_supported():
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return " f16c" in flags or platform.machine() in ("aarch64", "arm64")


def _forward(op, x, weight=None, bias=None, residual=None, kernel=True, **kw):
    """anynorm's NumPy executor on x, with or without the compiled kernel."""
    plan = make_plan(op, x, weight, bias, residual, **kw)
    saved = _native._library
    if not kernel:
        _native._library = False
    try:
        layout = _numpy._Layout(plan, [x] if residual is None else [x, residual])
        call = RowsForward.make(plan, layout, x, weight, bias, residual)
        assert call is not None and (call.kernel is not None) == kernel
        call.run(call.blocks(), call.buffers())
        return call.results()
    finally:
        _native._library = saved


def _max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))


def _assert_near_float64(y, tol, op, x, weight=None, bias=None, **kw):
    """``y`` (NumPy) within ``tol`` times its largest value of float64's result on the same
    NumPy inputs (torch tensors' ``.numpy()``, bfloat16 as ml_dtypes')."""
    as64 = (lambda a: None if a is None else np.asarray(a).astype(np.float64))
    exact = reference.forward(op, as64(x), as64(weight), as64(bias), **kw)[0]
    assert _max_err(y, exact) <= tol * float(np.max(np.abs(exact))), op


def _forward_columns(op, x, weight=None, bias=None, **kw):
    """anynorm's NumPy executor on x through the compiled column kernel."""
    plan = make_plan(op, x, weight, bias, **kw)
    call = NativeColumns.make(plan, _numpy._Layout(plan, [x]), x, weight, bias, None)
    assert call is not None
    call.run(call.blocks(), call.buffers())
    return call.results()


def test_kernels_build_with_the_hosts_compiler():
    for kernel in (_native.rows_kernel, _native.cols_kernel):
        for dtype in (np.float32, np.float64):
            assert kernel(dtype) is not None, _native.status
        assert (kernel(np.float16) is not None) == _f16_supported()
        assert kernel(np.int32) is None
    assert _native.status.startswith("loaded"), _native.status


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", ROW_LENGTHS)
@pytest.mark.parametrize("params", ["w b", "w", "b", "none"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_rows_match_float64_reference(op, params, n, dtype):
    """Every row length (vector loops and their tails) and parameter combination: y, mean and
    rstd against float64, and no worse than the NumPy passes."""
    if dtype == np.float16 and _native.rows_kernel(dtype) is None:
        pytest.skip("no float16 kernel on this CPU")
    if op == "rms_norm" and params in ("w b", "b"):
        pytest.skip("RMS norm has no bias")
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((5, n)) * 2 + 1.5).astype(dtype)
    w = rng.standard_normal(n).astype(dtype) if "w" in params else None
    b = rng.standard_normal(n).astype(dtype) if "b" in params else None
    x.flags.writeable = False
    eps = 1e-5
    y, _, mean, rstd = _forward(op, x, w, b, eps=eps)
    y_np = _forward(op, x, w, b, kernel=False, eps=eps)[0]
    exact = reference.forward(op, x.astype(np.float64), None if w is None else w.astype(np.float64),
                              None if b is None else b.astype(np.float64), eps=eps, axis=-1)
    scale = max(float(np.max(np.abs(exact[0]))), 1.0)
    assert y.dtype == dtype and y.shape == x.shape
    assert _max_err(y, exact[0]) <= Y_TOL[dtype] * scale
    assert _max_err(y, exact[0]) <= 1.5 * _max_err(y_np, exact[0]) + Y_TOL[dtype] * scale / 4
    acc = np.float64 if dtype == np.float64 else np.float32
    stats_tol = 1e-13 if dtype == np.float64 else 4 * EPS32
    if op == "layer_norm":
        np.testing.assert_allclose(mean.reshape(-1), exact[1].reshape(-1), rtol=stats_tol, atol=stats_tol)
    np.testing.assert_allclose(rstd.reshape(-1), exact[2].reshape(-1), rtol=stats_tol)
    assert rstd.dtype == acc


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("rows", [1, 4, 6, 11])
@pytest.mark.parametrize("n", [8, 13, 37, 64, 65])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_short_rows_four_at_a_time(op, n, rows, offset, dtype):
    """Rows of 8 to 64 held in registers, four at a time with the rest one by one (65: the
    general path): y, mean and rstd of every row against float64, each row its own."""
    if dtype == np.float16 and _native.rows_kernel(dtype) is None:
        pytest.skip("no float16 kernel on this CPU")
    if dtype == np.float16 and offset:
        pytest.skip("float16 holds no offset of 1e4 with a spread")
    rng = np.random.default_rng(rows * 100 + n)
    # each row its own scale and offset: a block mixing rows' sums would show
    x = (offset + rng.standard_normal((rows, n)) * rng.uniform(0.5, 4, (rows, 1))
         + rng.uniform(-3, 3, (rows, 1))).astype(dtype)
    w, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    bias = b if op == "layer_norm" else None
    y, _, mean, rstd = _forward(op, x, w, bias)
    y_ref, mean_ref, rstd_ref = reference.forward(op, x.astype(np.float64), w.astype(np.float64),
                                                  None if bias is None else bias.astype(np.float64),
                                                  eps=1e-5, axis=-1)
    scale = np.max(np.abs(y_ref), axis=-1, keepdims=True)
    assert np.all(np.abs(y.astype(np.float64) - y_ref) <= Y_TOL[dtype] * scale)
    if op == "layer_norm":
        assert np.all(np.abs(mean.reshape(-1) - mean_ref.reshape(-1)) <= 4 * EPS32 * (offset + 4))
    np.testing.assert_allclose(rstd.reshape(-1), rstd_ref.reshape(-1), rtol=4 * EPS32)


def test_short_rows_whose_float32_mean_misses():
    """Rows of 64 at 1e6 with a spread of 0.3: the float32 mean of the row misses by more
    than a quarter of the spread in some rows of a block of four, which are summed again
    about the full mean (else the variance cancels: errors of 1e-5)."""
    rng = np.random.default_rng(11)
    x = (1e6 + 0.3 * rng.standard_normal((64, 64))).astype(np.float32)
    y = _forward("layer_norm", x)[0]
    y_ref = reference.forward("layer_norm", x.astype(np.float64), eps=1e-5, axis=-1)[0]
    assert _max_err(y, y_ref) <= 8 * EPS32 * float(np.max(np.abs(y_ref)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(50, 2, 1000), (20, 2, 2500), (6, 10, 16), (40, 3, 8), (4000, 2, 16)])
def test_segmented_rows_whose_head_is_unlike_the_rest(shape, dtype, monkeypatch):
    """Layer norm over axes (0, 2) of rows 1e4 from zero whose head (the first mean's first
    64 elements) sits 100 std above the rest: the first mean misses by nearly 100 std, so
    q - c^2 would cancel all but a part in len / 64 of q; the row is summed again about the
    full mean and y keeps float32 (float64) rounding.  (2500: runs past SEG_VECTOR_MAX;
    4000 runs of 16: float32 lanes added into float64 part-way.)  A NaN makes its row NaN
    and no other."""
    rng = np.random.default_rng(2)
    x = 1e4 + rng.standard_normal(shape)
    x[0, :, :64] += 100.0
    x = x.astype(dtype)
    calls = support.count_packed_kernel_calls(monkeypatch)
    y = anynorm.layer_norm(x, axis=(0, 2))
    assert calls == [False]
    y_ref = reference.forward("layer_norm", x.astype(np.float64), eps=1e-5, axis=(0, 2))[0]
    tol = 1e-13 if dtype == np.float64 else 8 * EPS32
    assert _max_err(y, y_ref) <= tol * float(np.max(np.abs(y_ref)))
    x[-1, 1, -1] = np.nan
    y_nan = anynorm.layer_norm(x, axis=(0, 2))
    assert np.all(np.isnan(y_nan[:, 1])) and not np.any(np.isnan(np.delete(y_nan, 1, axis=1)))
    np.testing.assert_array_equal(np.delete(y_nan, 1, axis=1), np.delete(y, 1, axis=1))


@pytest.mark.parametrize("shape", [(3, 5, 4, 4), (2, 7, 3, 3), (1, 9, 8, 8)])
@pytest.mark.parametrize("route", ["executor", "packed"])
def test_short_channel_runs_take_their_channels_parameters(shape, route, monkeypatch):
    """NCHW instance norm whose spatial run is a short row (8 to 64 pixels): the row's weight
    and bias are its channel's, four rows at a time; through the executor (a weight a row)
    and the packed entry point (the row index modulo the channels)."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) * 2 + 1).astype(np.float32)
    w, b = rng.standard_normal(shape[1]).astype(np.float32), rng.standard_normal(shape[1]).astype(np.float32)
    if route == "executor":
        y = _forward("instance_norm", x, w, b, channel_axis=1)[0]
    else:
        calls = support.count_packed_kernel_calls(monkeypatch)
        y = anynorm.instance_norm(x, weight=w, bias=b, channel_axis=1)
        assert calls == [False]
    y_ref = reference.forward("instance_norm", x.astype(np.float64), w.astype(np.float64),
                              b.astype(np.float64), eps=1e-5, channel_axis=1)[0]
    assert _max_err(y, y_ref) <= Y_TOL[np.float32] * float(np.max(np.abs(y_ref)))


@pytest.mark.parametrize("offset", [1e4, 1e6, 1e7])
@pytest.mark.parametrize("n", [9, 4096, 70000])
def test_rows_far_from_zero_keep_float32_rounding(n, offset):
    """float32 rows offset far from their spread (std 1, and 0.05 at 1e7 where the offset's
    ulp exceeds a quarter of it and the centring is redone): y within a few ulps of the
    float64 result, the mean to the offset's rounding."""
    rng = np.random.default_rng(7)
    spread = 0.05 if offset >= 1e7 else 1.0
    x = (offset + spread * rng.standard_normal((4, n))).astype(np.float32)
    y, _, mean, rstd = _forward("layer_norm", x)
    y_ref, mean_ref, rstd_ref = reference.forward("layer_norm", x.astype(np.float64), eps=1e-5, axis=-1)
    assert _max_err(y, y_ref) <= 8 * EPS32 * float(np.max(np.abs(y_ref)))
    assert _max_err(mean.reshape(-1), mean_ref.reshape(-1)) <= EPS32 * offset
    np.testing.assert_allclose(rstd.reshape(-1), rstd_ref.reshape(-1), rtol=8 * EPS32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("head", ["step", "ramp", "outlier"])
def test_rows_whose_head_is_unlike_the_rest(head, dtype):
    """The first mean comes from a row's first 64 elements: a step after them, a sorted ramp
    or one far outlier among them make it miss, and the row is centred again on its mean."""
    if dtype == np.float16 and _native.rows_kernel(dtype) is None:
        pytest.skip("no float16 kernel on this CPU")
    rng = np.random.default_rng(11)
    n = 3000
    x = rng.standard_normal((3, n))
    if head == "step":
        x[:, :64] += 40.0
    elif head == "ramp":
        x = np.sort(x, axis=1) * 30 + 500
    else:
        x[:, 3] = 2e3
    x = x.astype(dtype)
    y, _, mean, rstd = _forward("layer_norm", x)
    y_ref, mean_ref, rstd_ref = reference.forward("layer_norm", x.astype(np.float64), eps=1e-5, axis=-1)
    assert _max_err(y, y_ref) <= Y_TOL[dtype] * float(np.max(np.abs(y_ref)))
    scale = float(np.max(np.abs(x.astype(np.float64))))
    np.testing.assert_allclose(mean.reshape(-1), mean_ref.reshape(-1), rtol=0, atol=4 * EPS32 * scale)
    np.testing.assert_allclose(rstd.reshape(-1), rstd_ref.reshape(-1), rtol=8 * EPS32)


@pytest.mark.parametrize("n", [100, 3000])  # 3000: rows in groups (ROW_GROUP), y by column chunks
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_residual_sum_is_written_and_normalized(op, dtype, n):
    rng = np.random.default_rng(2)
    x, res = (rng.standard_normal((6, n)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(n).astype(dtype)
    y, h, _, _ = _forward(op, x, w, residual=res)
    np.testing.assert_array_equal(h, x + res)
    y_ref = reference.forward(op, (x + res).astype(np.float64), w.astype(np.float64), eps=1e-5, axis=-1)[0]
    assert _max_err(y, y_ref) <= Y_TOL[dtype] * float(np.max(np.abs(y_ref)))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,shape,kw", [
    ("instance_norm", (2, 3, 8, 9), dict(channel_axis=1)),  # runs of 72: whole vectors
    ("instance_norm", (2, 5, 7, 7), dict(channel_axis=1)),  # runs of 49: vector tails
    ("group_norm", (2, 8, 9, 9), dict(channel_axis=1, num_groups=4)),  # 2 runs a row
    ("group_norm", (3, 6, 65), dict(channel_axis=1, num_groups=3)),
])
def test_channel_runs_take_their_own_parameters(op, shape, kw, dtype):
    """NCHW instance/group norm: a weight and bias constant on each channel's spatial run,
    indexed across rows (``w_run``)."""
    if dtype == np.float16 and _native.rows_kernel(dtype) is None:
        pytest.skip("no float16 kernel on this CPU")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 2).astype(dtype)
    c = shape[1]
    w, b = rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype)
    y, _, mean, rstd = _forward(op, x, w, b, **kw)
    y_ref = reference.forward(op, x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                              eps=1e-5, **kw)[0]
    assert _max_err(y, y_ref) <= Y_TOL[dtype] * float(np.max(np.abs(y_ref)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_non_finite_value_stays_in_its_row(op, bad):
    """A NaN or Inf makes its row NaN (layer norm; RMS norm: as the reference) and leaves the
    other rows as they were."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 37)).astype(np.float32)
    clean = _forward(op, x)[0]
    x[2, 5] = bad
    y = _forward(op, x)[0]
    np.testing.assert_array_equal(np.delete(y, 2, axis=0), np.delete(clean, 2, axis=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        y_ref = reference.forward(op, x.astype(np.float64), eps=1e-5, axis=-1)[0]
    np.testing.assert_array_equal(np.isnan(y[2]), np.isnan(y_ref[2]))


def _strip_bytes(monkeypatch, nbytes):
    """NativeColumns' strips (channels-first and NHWC) of ``nbytes`` of x."""
    for name in ("NATIVE_STRIP_BYTES", "NATIVE_CF_STRIP_BYTES", "NATIVE_CF_WHOLE_BYTES"):
        monkeypatch.setattr(_numpy_columns, name, nbytes)


COLUMN_CASES = [
    ("layer_norm", (2, 5, 30, 37), dict(axis=1)),  # channels-first, odd spatial size
    ("layer_norm", (2, 96, 7, 7), dict(axis=1)),  # ConvNeXt's last stage: 49 columns
    ("layer_norm", (2, 300, 6, 6), dict(axis=1)),  # more channels than a chunk of rows
    ("instance_norm", (2, 9, 9, 6), dict(channel_axis=-1)),  # fewer channels than a vector
    ("instance_norm", (2, 20, 20, 64), dict(channel_axis=-1)),
    ("instance_norm", (2, 3, 4, 5, 40), dict(channel_axis=-1)),  # NDHWC
    ("group_norm", (2, 8, 8, 32), dict(channel_axis=-1, num_groups=8)),
    ("group_norm", (2, 5, 7, 12), dict(channel_axis=-1, num_groups=3)),
    ("group_norm", (2, 30, 30, 20), dict(channel_axis=-1, num_groups=2)),
]


@pytest.mark.parametrize("strips", ["wide", "a vector", "a group"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("op,shape,kw", COLUMN_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_columns_match_float64_reference(op, shape, kw, affine, dtype, strips, monkeypatch):
    """Channels-first layer norm and NHWC instance/group norm: y, mean, rstd against float64,
    a sample's columns in one strip, in strips of whole 8-column vectors (and groups), or of
    one group (the scalar loops)."""
    if dtype == np.float16 and _native.cols_kernel(dtype) is None:
        pytest.skip("no float16 kernel on this CPU")
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 3 + 2).astype(dtype)
    x.flags.writeable = False
    plan = make_plan(op, x, **kw)
    if strips != "wide":
        call = NativeColumns.make(plan, _numpy._Layout(plan, [x]), x, None, None, None)
        unit = np.lcm(call.group, 8) if strips == "a vector" else 1
        _strip_bytes(monkeypatch, call.P * unit * x.itemsize)
        expected = min(call.Q, np.lcm(call.group, 8) if strips == "a vector" else call.group)
        assert NativeColumns.make(plan, _numpy._Layout(plan, [x]), x, None, None, None).strip == expected
    w = rng.standard_normal(plan.param_shape).astype(dtype) if affine else None
    b = rng.standard_normal(plan.param_shape).astype(dtype) if affine else None
    args = {k: v for k, v in kw.items() if k != "num_groups"}
    y, _, mean, rstd = _forward_columns(op, x, w, b, **kw)
    exact = reference.forward(op, x.astype(np.float64), None if w is None else w.astype(np.float64),
                              None if b is None else b.astype(np.float64), eps=1e-5,
                              num_groups=kw.get("num_groups"), **args)
    assert y.dtype == dtype and y.shape == x.shape
    assert _max_err(y, exact[0]) <= Y_TOL[dtype] * float(np.max(np.abs(exact[0])))
    stats_tol = 1e-13 if dtype == np.float64 else 4 * EPS32
    np.testing.assert_allclose(mean.reshape(-1), exact[1].reshape(-1), rtol=stats_tol, atol=stats_tol)
    np.testing.assert_allclose(rstd.reshape(-1), exact[2].reshape(-1), rtol=stats_tol)


@pytest.mark.parametrize("offset", [1e4, 1e6, 1e7])
@pytest.mark.parametrize("op,shape,kw", COLUMN_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_columns_far_from_zero_keep_float32_rounding(op, shape, kw, offset):
    """As for rows: std 1, and 0.05 at 1e7, where a chunk's float32 first mean can miss by
    more than a quarter of the spread and the chunk is centred again."""
    spread = 0.05 if offset >= 1e7 else 1.0
    x = (offset + spread * np.random.default_rng(8).standard_normal(shape)).astype(np.float32)
    args = {k: v for k, v in kw.items() if k != "num_groups"}
    y, _, mean, rstd = _forward_columns(op, x, **kw)
    y_ref, mean_ref, rstd_ref = reference.forward(op, x.astype(np.float64), eps=1e-5,
                                                  num_groups=kw.get("num_groups"), **args)
    assert _max_err(y, y_ref) <= 8 * EPS32 * float(np.max(np.abs(y_ref)))
    assert _max_err(mean.reshape(-1), mean_ref.reshape(-1)) <= EPS32 * offset
    np.testing.assert_allclose(rstd.reshape(-1), rstd_ref.reshape(-1), rtol=8 * EPS32)


# The column kernel's tails: statistics of a strip's last W % 8 columns as the vector of its
# last 8 (W >= 8), the scalar loops below 8 columns, y's last W % 8.  (P, Q, group), P past a
# chunk of rows
TAIL_SHAPES = [(300, 1, 1), (300, 7, 1), (300, 9, 1), (300, 49, 1), (300, 196, 1), (300, 1001, 1),
               (130, 36, 3), (130, 9, 9)]


def _tail_case(P, Q, group, dtype, offset, rng):
    """``(op, x, w, b, kw)``: channels-first layer norm over ``(2, P, Q)`` (group 1) or NHWC
    group norm over ``(2, P, 1, Q)`` (groups of ``group`` columns)."""
    if group == 1:
        op, shape, kw, pshape = "layer_norm", (2, P, Q), dict(axis=1), (P,)
    else:
        op, shape, kw, pshape = "group_norm", (2, P, 1, Q), dict(channel_axis=-1, num_groups=Q // group), (Q,)
    x = (offset + rng.standard_normal(shape) * 2).astype(dtype)
    w = (rng.random(pshape) + 0.5).astype(dtype)
    b = (rng.random(pshape) - 0.5).astype(dtype)
    return op, x, w, b, kw


@pytest.mark.parametrize("dtype,offset", [(np.float16, 0.0), (np.float32, 0.0), (np.float32, 1e4),
                                          (np.float32, 1e6), (np.float64, 0.0)],
                         ids=["float16", "float32", "float32-1e4", "float32-1e6", "float64"])
@pytest.mark.parametrize("strips", ["whole", "8"])
@pytest.mark.parametrize("P,Q,group", TAIL_SHAPES, ids=lambda v: str(v))
def test_column_tails_match_float64_reference(P, Q, group, strips, dtype, offset, monkeypatch):
    """Widths around a vector (1, 7, 9), ConvNeXt's 7x7 and 14x14, NHWC groups whose last strip
    is 12 columns: y, mean and rstd as the float64 reference, far from zero too (an overlapped
    column's first mean and sums from one pass or the mean is off by its rounding), and a NaN
    in the last column NaN-ing that column alone."""
    if dtype == np.float16 and _native.cols_kernel(dtype) is None:
        pytest.skip("no float16 kernel on this CPU")
    op, x, w, b, kw = _tail_case(P, Q, group, dtype, offset, np.random.default_rng(Q + P))
    if strips == "8":  # strips of one vector (group 1) or lcm(group, 8) columns
        _strip_bytes(monkeypatch, P * np.lcm(group, 8) * x.itemsize)
    args = {k: v for k, v in kw.items() if k != "num_groups"}
    y, _, mean, rstd = _forward_columns(op, x, w, b, **kw)
    y_ref, mean_ref, rstd_ref = reference.forward(op, x.astype(np.float64), w.astype(np.float64),
                                                  b.astype(np.float64), eps=1e-5,
                                                  num_groups=kw.get("num_groups"), **args)
    tol = Y_TOL[dtype] if offset == 0 else 8 * EPS32
    assert _max_err(y, y_ref) <= tol * float(np.max(np.abs(y_ref)))
    stats_tol = 1e-13 if dtype == np.float64 else 4 * EPS32
    assert _max_err(mean.reshape(-1), mean_ref.reshape(-1)) <= stats_tol * max(offset, 1.0)
    np.testing.assert_allclose(rstd.reshape(-1), rstd_ref.reshape(-1), rtol=8 * EPS32 if offset else stats_tol)

    x[1, 5, ..., Q - 1] = np.nan  # sample 1, the last column (its group)
    y_nan, _, mean_nan, _ = _forward_columns(op, x, w, b, **kw)
    nan = np.zeros(x.shape, bool)
    nan[1, ..., Q - group:] = True
    np.testing.assert_array_equal(np.isnan(y_nan), nan)
    np.testing.assert_array_equal(y_nan[~nan], y[~nan])
    assert np.isnan(mean_nan).sum() == 1


_GUARDED = """
    import ctypes, mmap, sys
    import numpy as np
    from anynorm import _native

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    maps = []

    def at_page_end(n, dtype):  # n elements just before a page that faults when touched
        nbytes = n * np.dtype(dtype).itemsize
        size = -(-nbytes // page) * page + page
        buf = mmap.mmap(-1, size)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert libc.mprotect(ctypes.c_void_p(addr + size - page), ctypes.c_size_t(page), 0) == 0
        maps.append(buf)
        return np.frombuffer(buf, dtype, n, size - page - nbytes)

    def call(kernel, x, w, b, P, Q, group, strip, param_rows, guarded):
        acc = w.dtype
        new = (lambda n, t: at_page_end(n, t)) if guarded else (lambda n, t: np.zeros(n, t))
        xs, y, mean, rstd = new(x.size, x.dtype), new(x.size, x.dtype), new(2 * Q // group, acc), new(2 * Q // group, acc)
        xs[:] = x.reshape(-1)
        assert kernel(xs.ctypes.data, y.ctypes.data, w.ctypes.data, b.ctypes.data, mean.ctypes.data,
                      rstd.ctypes.data, 2, P, Q, group, strip, param_rows, 1e-5) == 0
        return y, mean, rstd

    rng = np.random.default_rng(3)
    for dtype in (np.float16, np.float32, np.float64):
        kernel = _native.cols_kernel(dtype)
        if kernel is None:
            continue
        acc = np.float64 if dtype == np.float64 else np.float32
        for P, Q, group in ((300, 1, 1), (300, 7, 1), (300, 9, 1), (130, 49, 1), (130, 196, 1), (70, 1001, 1),
                            (130, 36, 3), (130, 9, 9)):
            x = rng.standard_normal(2 * P * Q).astype(dtype)
            for param_rows in ((1, 0) if group == 1 else (0,)):
                w = (rng.random(P if param_rows else Q) + 0.5).astype(acc)
                b = (rng.random(P if param_rows else Q) - 0.5).astype(acc)
                for strip in sorted({Q, min(Q, int(np.lcm(group, 8)))}):
                    args = (kernel, x, w, b, P, Q, group, strip, param_rows)
                    for got, want in zip(call(*args, True), call(*args, False)):
                        np.testing.assert_array_equal(got, want)
    print("ok")
"""


def test_columns_touch_nothing_past_x_or_y():
    """x, y, mean and rstd each end where a PROT_NONE page starts (a read or write past them
    faults): short and odd widths in whole and 8-column strips, every dtype; the results as
    from ordinary arrays."""
    if platform.system() != "Linux":
        pytest.skip("mprotect through ctypes: Linux")
    assert _python(_GUARDED) == ["ok"]


@pytest.mark.parametrize("P, Q, group, strip, param_rows", [
    (130, 196, 1, 196, 1), (130, 196, 1, 8, 1), (130, 196, 1, 1, 1), (50, 1100, 1, 1100, 1),
    (50, 1100, 1, 680, 1), (40, 98, 1, 98, 1), (200, 64, 1, 64, 0), (200, 64, 2, 16, 0),
    (200, 36, 3, 12, 0), (200, 36, 3, 3, 0)])
def test_columns_streamed_y_as_stored(P, Q, group, strip, param_rows):
    """float32 y by non-temporal stores (y 16-byte aligned, rows and strips in 16-byte pieces)
    equals y by ordinary stores (y 4 bytes past that): whole strips, 512-column blocks, widths
    of 4 mod 8, strips that start off a 16-byte boundary."""
    kernel = _native.cols_kernel(np.float32)
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, P, Q)) * 0.05 + 1e3).astype(np.float32)
    x[1, 3, Q // 2] = np.nan
    n = P if param_rows else Q
    w, b = (rng.random(n) + 0.5).astype(np.float32), (rng.random(n) - 0.5).astype(np.float32)
    outs = []
    for shift in (0, 1):
        buf = np.zeros(x.size + 8, np.float32)
        first = (-buf.ctypes.data % 16) // 4 + shift
        y = buf[first:first + x.size]
        mean, rstd = np.zeros(2 * Q // group, np.float32), np.zeros(2 * Q // group, np.float32)
        assert kernel(x.ctypes.data, y.ctypes.data, w.ctypes.data, b.ctypes.data, mean.ctypes.data,
                      rstd.ctypes.data, 2, P, Q, group, strip, param_rows, 1e-5) == 0
        outs.append((y.copy(), mean, rstd))
    for got, want in zip(*outs):
        np.testing.assert_array_equal(got, want)
    assert np.isnan(outs[0][0].reshape(2, P, Q)[1]).any() and not np.isnan(outs[0][0].reshape(2, P, Q)[0]).any()


@pytest.mark.parametrize("n, w_run, center", [(1024, 0, 1), (1027, 0, 1), (4096, 0, 1), (4096, 0, 0),
                                             (300, 100, 1), (1000, 0, 0)])
def test_rows_streamed_y_as_stored(n, w_run, center):
    """float32 rows whose y reaches ROWS_NT_BYTES (4 MiB a call) go by non-temporal stores
    where a row's part starts 16-byte aligned: the same bits as the same rows in calls of
    fewer rows (ordinary stores), y aligned or 4 bytes off, rows of odd lengths, rows in
    groups (4096 with parameters), runs of parameters (NCHW group norm), RMS norm."""
    kernel = _native.rows_kernel(np.float32)
    rows = (4 << 20) // (4 * n) + 3
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((rows, n)) * 0.5 + 1e3 * center).astype(np.float32)
    x[7, n // 2] = np.nan
    k = n // w_run if w_run else n
    w = (rng.random(rows * k if w_run else n) + 0.5).astype(np.float32)
    b = (rng.random(w.size) - 0.5).astype(np.float32) if center else None
    outs = []
    for shift, step in ((0, rows), (1, rows), (0, 97)):
        buf = np.zeros(x.size + 8, np.float32)
        first = (-buf.ctypes.data % 16) // 4 + shift
        y = buf[first:first + x.size].reshape(rows, n)
        mean, rstd = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            wp = w.ctypes.data + (r0 * k * 4 if w_run else 0)
            bp = 0 if b is None else b.ctypes.data + (r0 * k * 4 if w_run else 0)
            assert kernel(x[r0].ctypes.data, 0, 0, y[r0].ctypes.data, wp, bp, w_run, mean[r0:].ctypes.data,
                          rstd[r0:].ctypes.data, r1 - r0, n, center, 1e-5) == 0
        outs.append((y.copy(), mean, rstd))
    for other in outs[1:]:
        for got, want in zip(other, outs[0]):
            np.testing.assert_array_equal(got, want)
    y = outs[0][0]
    assert np.isnan(y[7]).all() and not np.isnan(np.delete(y, 7, axis=0)).any()


def test_column_nan_stays_in_its_slice():
    """A NaN in one (sample, group) of an NHWC group norm makes that slice NaN, no other."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 6, 6, 16)).astype(np.float32)
    clean = _forward_columns("group_norm", x, channel_axis=-1, num_groups=4)[0]
    x[1, 2, 3, 5] = np.nan  # sample 1, group 1 (channels 4-7)
    y = _forward_columns("group_norm", x, channel_axis=-1, num_groups=4)[0]
    nan = np.zeros(x.shape, bool)
    nan[1, :, :, 4:8] = True
    np.testing.assert_array_equal(np.isnan(y), nan)
    np.testing.assert_array_equal(y[~nan], clean[~nan])


def _python(code, **env):
    """Run ``code`` in a fresh interpreter with anynorm's repository on the path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = {**os.environ, "PYTHONPATH": root, **env}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


_PROBE = """
    import numpy as np, anynorm
    from anynorm import _native
    x = (1e4 + np.random.default_rng(0).standard_normal((64, 1000))).astype(np.float32)
    y = anynorm.layer_norm(x)
    d = x.astype(np.float64); d -= d.mean(-1, keepdims=True)
    exact = d / np.sqrt((d * d).mean(-1, keepdims=True) + 1e-5)
    print(_native.status)
    print(float(np.abs(y - exact).max() / np.abs(exact).max()))  # in units of max |y|
"""


def test_built_once_then_loaded_from_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    status, err = _python(_PROBE, ANYNORM_CACHE_DIR=cache)
    assert status.startswith("loaded " + cache), status
    built = [f for f in os.listdir(cache) if f.endswith(".so")]
    assert len(built) == 1, built
    stamp = os.stat(os.path.join(cache, built[0])).st_mtime_ns
    status2, err2 = _python(_PROBE, ANYNORM_CACHE_DIR=cache)
    assert status2 == status and os.listdir(cache) == built
    assert os.stat(os.path.join(cache, built[0])).st_mtime_ns == stamp
    assert float(err) <= 8 * EPS32 and float(err2) == float(err)


@pytest.mark.parametrize("env,expected", [
    (dict(ANYNORM_NATIVE="0"), "disabled by ANYNORM_NATIVE"),
    (dict(ANYNORM_CXX="false"), "build or load failed"),
])
def test_without_the_kernel_the_numpy_passes_run(tmp_path, env, expected):
    """Switched off, or with a compiler that fails: the NumPy executor's passes, as exact."""
    status, err = _python(_PROBE, ANYNORM_CACHE_DIR=str(tmp_path / "cache"), **env)
    assert status.startswith(expected), status
    assert float(err) <= 8 * EPS32


def test_torch_channels_first_runs_the_column_kernel():
    """Channels-first layer norm of a C-contiguous torch CPU tensor with runs of at least
    CF_KERNEL_MIN_RUN elements and CF_KERNEL_MIN_ELEMENTS in all takes the NumPy executor and
    its column kernel (ConvNeXt's late stages: 0.3-0.9x F's time, torch's kernel ~1.0-1.2x), the
    same bits as on the tensor's NumPy view, exact far from zero; channels-last memory, short
    runs and small arrays keep torch's kernel."""
    torch = pytest.importorskip("torch")
    import anynorm
    from anynorm import _torch

    if _native.cols_kernel(np.float32) is None:
        pytest.skip("anynorm's CPU kernels are not built here")
    gen = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(4, 64, 16, 16, generator=gen)  # 2^16 elements, runs of 256 < SHORT_RUN
    w, b = torch.rand(64, generator=gen), torch.rand(64, generator=gen)
    assert x.numel() == _torch.CF_KERNEL_MIN_ELEMENTS
    plan = make_plan("layer_norm", x, w, b, axis=1)
    assert not _torch._native_first(plan, True)
    assert _torch._native_first(plan, False)  # channels-last memory: rows of 256 for torch
    assert _torch._native_first(make_plan("layer_norm", x[:3], w, b, axis=1), True)
    short = torch.randn(80, 64, 3, 5, generator=gen)  # enough elements, runs of 15
    assert short.numel() >= _torch.CF_KERNEL_MIN_ELEMENTS and _torch.CF_KERNEL_MIN_RUN == 16
    assert _torch._native_first(make_plan("layer_norm", short, w, b, axis=1), True)
    assert not _torch._native_first(make_plan("layer_norm", short[..., :4].repeat(1, 1, 2, 1), w, b, axis=1), True)
    assert _torch._native_first(make_plan("layer_norm", x, w, b, axis=1, residual=x), True)
    with torch.no_grad():
        y = anynorm.layer_norm(x, w, b, axis=1)
        y_last = anynorm.layer_norm(x.contiguous(memory_format=torch.channels_last), w, b, axis=1)
    assert np.array_equal(y.numpy(), anynorm.layer_norm(x.numpy(), w.numpy(), b.numpy(), axis=1))
    for out in (y, y_last):
        _assert_near_float64(out.numpy(), Y_TOL[np.float32], "layer_norm", x.numpy(), w.numpy(), b.numpy(),
                             eps=1e-5, axis=1)


def test_torch_short_rows_take_the_row_kernel_unless_recorded(monkeypatch):
    """Layer/RMS norm rows of SHORT_ROW_MIN to SHORT_ROW_MAX take anynorm's row kernel where
    torch has at most SHORT_ROWS_THREADS threads, or from the executor's threading size on
    (float64, longer or shorter rows, strided x: torch's); a call autograd records keeps
    torch's graph (below TRAINING_ROWS_MIN_ELEMENTS)."""
    torch = pytest.importorskip("torch")
    from anynorm import _numpy, _torch

    if _native.rows_kernel(np.float32) is None:
        pytest.skip("anynorm's CPU kernels are not built here")

    def first(x, threads, op="layer_norm"):
        return _torch._native_first(make_plan(op, x), x.is_contiguous(), threads)

    rows = torch.randn(1000, 37)
    assert not first(rows, 2) and not first(rows, 3) and not first(rows, 2, "rms_norm")
    assert (not first(rows.to(torch.float16), 2)) == (_native.rows_kernel(np.float16) is not None)
    assert first(rows, 4)  # many threads: torch's kernel runs them all
    assert not first(torch.randn(_numpy.PARALLEL_MIN_ELEMENTS // 37 + 1, 37), 16)  # the executor threads it
    assert first(rows.double(), 2)
    assert first(torch.randn(1000, 65), 2) and first(torch.randn(1000, 7), 2)
    assert first(torch.randn(37, 1000).t(), 2)
    if _torch._numpy_dtype(torch.bfloat16) is not None:
        assert not first(rows.to(torch.bfloat16), 2)

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    calls = support.count_packed_kernel_calls(monkeypatch)
    w, b = torch.rand(37) + 0.5, torch.rand(37)
    x = (1e4 + rows).requires_grad_(True)
    y = anynorm.layer_norm(x.detach(), weight=w, bias=b)
    assert calls == [False]
    y_ref = reference.forward("layer_norm", x.detach().double().numpy(), w.double().numpy(), b.double().numpy(),
                              eps=1e-5)[0]
    assert _max_err(y, y_ref) <= 8 * EPS32 * float(np.max(np.abs(y_ref)))
    y_grad = anynorm.layer_norm(x, weight=w, bias=b)
    assert calls == [False] and type(y_grad.grad_fn).__name__ == "NativeLayerNormBackward0"
    assert _max_err(y_grad.detach(), y_ref) <= 8 * EPS32 * float(np.max(np.abs(y_ref)))


def test_torch_routes_to_the_kernels(monkeypatch):
    """Without autograd, C-contiguous torch CPU tensors take anynorm's CPU kernels where those
    measured faster than torch's (anynorm/_torch.py): RMS norm rows of RMS_KERNEL_MIN_ELEMENTS
    and up, float16 channels-first group norm of HALF_GROUPS_MIN_ELEMENTS and up, and outputs
    of FAULTING_BYTES and up, which the executor reuses (or, without that, gets huge pages for
    where torch's allocations fault 4 KiB ones); autograd-free small calls and other memory
    keep torch's kernels.  The
    results are the NumPy executor's bits on the tensors' memory, exact far from zero."""
    torch = pytest.importorskip("torch")
    import anynorm
    from anynorm import _torch

    if _native.rows_kernel(np.float32) is None or _native.rows_kernel(np.float16) is None:
        pytest.skip("anynorm's CPU kernels (with float16) are not built here")

    def first(op, x, *args, **kwargs):
        return _torch._native_first(make_plan(op, x, *args, **kwargs), x.is_contiguous())

    rms = torch.randn(1024, 512)
    assert rms.numel() == _torch.RMS_KERNEL_MIN_ELEMENTS
    assert not first("rms_norm", rms)
    assert first("rms_norm", rms[:512])
    assert first("layer_norm", rms)  # layer norm rows of 512 keep torch's kernel
    assert first("rms_norm", rms.to(torch.bfloat16)) == (_torch._numpy_dtype(torch.bfloat16) is None)
    assert _torch._native_first(make_plan("rms_norm", rms), False)
    half = torch.randn(4, 64, 32, 32).to(torch.float16)
    assert half.numel() == _torch.HALF_GROUPS_MIN_ELEMENTS
    assert not first("group_norm", half, num_groups=8)
    assert first("group_norm", half[:2], num_groups=8)
    assert first("group_norm", half.float(), num_groups=8)
    assert first("group_norm", half.contiguous(memory_format=torch.channels_last), num_groups=8)

    gen = np.random.default_rng(0)
    cases = [("rms_norm", 1e4 + torch.from_numpy(gen.standard_normal((1024, 512), np.float32)), {}),
             ("group_norm", (300 + torch.from_numpy(gen.standard_normal((4, 64, 32, 32), np.float32))).half(),
              {"num_groups": 8})]
    big = 1e4 + torch.from_numpy(gen.standard_normal((8192, 1024), np.float32))  # 32 MiB
    assert big.numel() * 4 == _torch.FAULTING_BYTES
    if _torch._large_outputs_cheaper():
        assert not first("layer_norm", big)
        assert not first("group_norm", big.reshape(8, 64, 128, 128), num_groups=32)
        assert not first("layer_norm", big.reshape(8, 64, 128, 128), axis=(1, 2))
        assert first("layer_norm", big.reshape(8, 64, 128, 128), axis=(1, 3))  # no kernel
        assert first("layer_norm", big, residual=big)
        assert first("layer_norm", big.to(torch.bfloat16))
        assert first("layer_norm", big[:, :1000])  # strided rows
        cases.append(("layer_norm", big, {}))
    for op, x, kwargs in cases:
        n = x.shape[1] if op == "group_norm" else x.shape[-1]
        w = torch.from_numpy(gen.random(n, np.float32) + 0.5).to(x.dtype)
        fn = getattr(anynorm, op)
        with torch.no_grad():
            y = fn(x, weight=w, eps=1e-5, **kwargs)
        assert y.dtype == x.dtype and y.shape == x.shape
        assert np.array_equal(y.numpy(), fn(x.numpy(), weight=w.numpy(), eps=1e-5, **kwargs)), op
        _assert_near_float64(y.numpy(), Y_TOL[np.dtype(x.numpy().dtype).type], op, x.numpy(), w.numpy(),
                             eps=1e-5, **kwargs)
    monkeypatch.setattr(_torch, "_THP", False)  # no huge pages for NumPy either
    assert not first("layer_norm", big)  # the output cache alone makes the kernels cheaper
    monkeypatch.setattr(_outputs, "ENABLED", False)
    assert first("layer_norm", big)


def test_torch_route_takes_at_most_torchs_threads(monkeypatch):
    """Torch CPU tensors that take the NumPy executor, forward or backward, run on at most
    ``torch.get_num_threads()`` threads: a caller who limits torch's threads (a DataLoader
    worker, ``torch.set_num_threads(1)``) gets no second thread from anynorm either."""
    torch = pytest.importorskip("torch")
    import anynorm
    from anynorm import _torch, _torch_direct, _torch_openmp

    monkeypatch.setattr(_numpy, "NUM_THREADS", 2)
    monkeypatch.setattr(_torch_direct, "DIRECT_MAX_THREADED_ELEMENTS", 0)  # the executor, not the packed call
    x = torch.randn(1536, 4096)  # 24 MiB of rows past NATIVE_MAX_ROW: the executor's
    assert x.numel() * 4 >= _torch.LONG_ROWS_KERNEL_MIN_BYTES
    assert x.numel() >= _numpy.PARALLEL_MIN_ELEMENTS
    threads = []  # (threads a part of the call may take, the team that runs them)
    real_run = _numpy._run
    monkeypatch.setattr(_numpy, "_run", lambda *args, **kw: threads.append((args[3], kw.get("team")))
                        or real_run(*args, **kw))
    saved = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            y1 = anynorm.layer_norm(x)
            dx1 = anynorm.layer_norm_backward(x, x)[0]
            assert threads and all(parallel == 1 for parallel, _ in threads)
            threads.clear()
            torch.set_num_threads(2)
            y2 = anynorm.layer_norm(x)
            dx2 = anynorm.layer_norm_backward(x, x)[0]
            assert len(threads) == 2 and all(parallel == 2 for parallel, _ in threads)
            # torch's own OpenMP team runs them where this host's torch has one to find
            assert all((team is None) == (_torch_openmp.team() is None) for _, team in threads)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(y1, y2)
    torch.testing.assert_close(dx1, dx2, rtol=0, atol=0)


def test_torch_float16_rows_run_the_kernel():
    """float16 torch CPU tensors of LONG_ROWS_KERNEL_MIN_BYTES with rows past NATIVE_MAX_ROW
    take the NumPy executor (and so the kernel) where it is built, as float32 ones do, exact
    far from zero; smaller ones and bfloat16 keep torch's kernel (asv_bench/README.md)."""
    torch = pytest.importorskip("torch")
    import anynorm
    from anynorm import _torch

    if _native.rows_kernel(np.float16) is None:
        pytest.skip("no float16 kernel on this CPU")
    n = 2 * _torch.NATIVE_MAX_ROW
    x = (300 + torch.randn(_torch.LONG_ROWS_KERNEL_MIN_BYTES // (2 * n), n)).to(torch.float16)
    w, b = torch.rand(n).to(torch.float16), torch.rand(n).to(torch.float16)
    assert not _torch._native_first(make_plan("layer_norm", x, w, b))
    assert _torch._native_first(make_plan("layer_norm", x[:-1], w, b))
    assert _torch._native_first(make_plan("layer_norm", x.to(torch.bfloat16), w.to(torch.bfloat16),
                                          b.to(torch.bfloat16)))
    with torch.no_grad():
        y = anynorm.layer_norm(x, w, b)
    assert y.dtype == torch.float16
    _assert_near_float64(y.numpy(), Y_TOL[np.float16], "layer_norm", x.numpy(), w.numpy(), b.numpy(), eps=1e-5)


def _bf16():
    """ml_dtypes' bfloat16, skipping where it or the kernels' bfloat16 entry points are missing."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if _native.rows_kernel(ml_dtypes.bfloat16) is None:
        pytest.skip("anynorm's CPU kernels are not built here")
    return np.dtype(ml_dtypes.bfloat16)


BF16_CASES = [  # (op, shape, kwargs, kernel): every kernel path a bfloat16 array takes
    ("layer_norm", (64, 770), {"axis": -1}, "rows"),
    ("layer_norm", (16, 4099), {"axis": -1}, "rows"),  # grouped rows (parameters past L1)
    ("rms_norm", (33, 1000), {"axis": -1}, "rows"),
    ("group_norm", (4, 12, 9, 8), {"num_groups": 3}, "rows"),  # runs of 72 a parameter
    ("layer_norm", (3, 24, 7, 9), {"axis": 1}, "cols"),  # channels first
    ("instance_norm", (3, 5, 7, 24), {"channel_axis": -1}, "cols"),
    ("group_norm", (3, 5, 7, 24), {"num_groups": 6, "channel_axis": -1}, "cols"),
]


@pytest.mark.parametrize("op,shape,kw,kind", BF16_CASES)
@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_bfloat16_is_float32s_result_rounded(op, shape, kw, kind, offset):
    """bfloat16 (ml_dtypes) arrays through the kernels: y is the float32 kernels' result on the
    same values, rounded to nearest even as ml_dtypes' cast rounds it, bit for bit (the
    statistics too), including subnormal outputs (AVX512-BF16's conversion would flush
    them), a NaN weight's NaN and infinities; within bfloat16's rounding of float64's."""
    bf16 = _bf16()
    gen = np.random.default_rng(1)
    x = (offset + gen.standard_normal(shape).astype(np.float32)).astype(bf16)
    n = shape[-1] if kw.get("axis") == -1 else shape[kw.get("axis", kw.get("channel_axis", 1))]
    w = (gen.random(n, np.float32) + 0.5)
    w[:4] = [1e-39, -3e-41, np.nan, 1e38]  # subnormal, NaN and overflowing outputs
    b = gen.standard_normal(n).astype(np.float32)
    b[:4] = 0.0
    args = (w,) if op == "rms_norm" else (w, b)
    kw = dict(kw, eps=1e-5)
    run = _forward if kind == "rows" else _forward_columns
    y, *_, rstd = run(op, x, *args, **kw)
    y32, *_, rstd32 = run(op, x.astype(np.float32), *args, **kw)
    assert y.dtype == bf16
    assert np.array_equal(y.view(np.uint16), y32.astype(bf16).view(np.uint16))
    assert np.array_equal(rstd, rstd32)
    exact = reference.forward(op, x.astype(np.float64), *(a.astype(np.float64) for a in args), **kw)[0]
    finite = np.isfinite(exact) & (np.abs(exact) < 1e30)
    assert np.isnan(y[np.isnan(exact)].astype(np.float32)).all()
    err = np.abs(y.astype(np.float64) - exact)[finite]
    assert np.all(err <= 2.0 ** -8 * np.abs(exact[finite]) + 1e-6 * np.abs(exact[finite]).max())


def test_bfloat16_rounding_of_every_halfway_case():
    """The kernels' float32 -> bfloat16 rounding on values that sit exactly half way, one ulp of
    float32 either side, subnormals, infinities and NaNs: ml_dtypes' cast bit for bit (NaN
    as any quiet NaN)."""
    bf16 = _bf16()
    hi = np.arange(0, 1 << 16, 7, dtype=np.uint32) << 16
    bits = np.concatenate([hi | low for low in (0x7FFF, 0x8000, 0x8001, 0x0001, 0xFFFF)])
    values = bits.view(np.float32)
    # RMS norm of a row of ones (rstd exactly 1, eps 0) with these values as its weight: the
    # kernel's float32 y is the weight itself, rounded to bfloat16 8 lanes at a time
    w = np.resize(values, 8 * ((values.size + 7) // 8)).reshape(-1, 8)
    ones = np.ones(8, bf16)
    for row in w:
        y = _forward("rms_norm", ones[None, :], row, eps=0.0)[0][0]
        with np.errstate(invalid="ignore"):  # signalling NaNs among the values
            expected = row.astype(bf16)
        nan = np.isnan(row)
        assert np.array_equal(y.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])
        assert np.isnan(y[nan].astype(np.float32)).all()


def test_torch_bfloat16_takes_the_kernels():
    """bfloat16 torch CPU tensors reach the kernels as ml_dtypes arrays on the same memory
    where those measured faster than torch's (RMS rows, channels-first layer norm, outputs of
    FAULTING_BYTES): the NumPy executor's bits, bfloat16 out; long rows under that keep
    torch's (faster) bfloat16 kernel, as does every call where ml_dtypes is missing."""
    torch = pytest.importorskip("torch")
    bf16 = _bf16()
    import anynorm
    from anynorm import _torch

    def first(op, x, *args, **kwargs):
        return _torch._native_first(make_plan(op, x, *args, **kwargs), x.is_contiguous())

    gen = torch.Generator().manual_seed(0)
    cases = [("rms_norm", torch.randn(1024, 512, generator=gen), {"axis": -1}),
             ("layer_norm", 300 + torch.randn(4, 64, 16, 16, generator=gen), {"axis": 1})]
    long_rows = torch.randn(_torch.LONG_ROWS_KERNEL_MIN_BYTES // 8192, 4096, generator=gen)
    assert first("layer_norm", long_rows.to(torch.bfloat16))
    assert not first("layer_norm", long_rows)
    if _torch._large_outputs_cheaper():
        big = torch.randn(_torch.FAULTING_BYTES // 4096, 2048, generator=gen)
        assert not first("layer_norm", big.to(torch.bfloat16))
        cases.append(("layer_norm", big, {"axis": -1}))
    for op, x, kw in cases:
        x = x.to(torch.bfloat16)
        n = x.shape[kw["axis"]]
        w = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16)
        assert not first(op, x, w, **kw), op
        with torch.no_grad():
            y = getattr(anynorm, op)(x, w, eps=1e-5, **kw)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        xn = x.view(torch.int16).numpy().view(bf16)
        wn = w.view(torch.int16).numpy().view(bf16)
        expected = getattr(anynorm, op)(xn, wn, eps=1e-5, **kw)
        assert np.array_equal(y.view(torch.int16).numpy(), expected.view(np.int16)), op
        _assert_near_float64(y.float().numpy(), 2.0 ** -8, op, xn, wn, eps=1e-5, **kw)
    saved = _torch._BF16[:]
    try:
        _torch._BF16[:] = [None]  # as without ml_dtypes
        assert first("rms_norm", cases[0][1].to(torch.bfloat16))
    finally:
        _torch._BF16[:] = saved


def test_address_is_the_first_elements():
    """``_native.address`` (ctypes' view of the buffer where it can take one) gives what
    ``a.ctypes.data`` gives for every array the executors pass: contiguous, row-offset views,
    read-only, Fortran-ordered, strided, empty, float16 and ml_dtypes' bfloat16."""
    base = np.arange(96, dtype=np.float32).reshape(8, 12)
    readonly = base.copy()
    readonly.flags.writeable = False
    arrays = [base, base[3:], base[3:5], readonly, np.asfortranarray(base), base[:, ::2],
              np.empty(0, np.float32), base.astype(np.float16), base.astype(np.float64)[1:]]
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        arrays.append(base.astype(ml_dtypes.bfloat16)[2:])
    for a in arrays:
        assert _native.address(a) == a.ctypes.data, (a.dtype, a.shape, a.strides)
