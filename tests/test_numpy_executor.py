"""The blocked NumPy executor gives the array-API reference's answers on every kind of plan."""

from __future__ import annotations

import numpy as np
import pytest

from anynorm import _native, _numpy, _numpy_columns, _numpy_rows, _reference
from anynorm._plan import make_plan

# (op, shape, keyword arguments of make_plan)
CASES = [
    ("layer_norm", (6, 64), dict(axis=-1)),
    ("layer_norm", (3, 40, 70), dict(axis=-1)),
    ("layer_norm", (3, 4, 5), dict(axis=(-2, -1))),
    ("layer_norm", (2, 8, 5, 5), dict(axis=1)),  # ConvNeXt channels-first (short rows: folded)
    ("layer_norm", (2, 6, 20, 20), dict(axis=1)),  # channels-first, rows of >= 384 ("cf")
    ("layer_norm", (1, 260, 1, 384), dict(axis=1)),  # "cf" with > REDUCE_RUN channels
    ("layer_norm", (4, 5, 3), dict(axis=(0, 2))),
    ("layer_norm", (4, 5, 3), dict(axis=(2, 0, 1))),
    ("layer_norm", (9, 7), dict(axis=0)),
    ("layer_norm", (11,), dict(axis=0)),
    ("layer_norm", (5, 1, 7), dict(axis=(1, 2))),
    ("rms_norm", (7, 33), dict(axis=-1)),
    ("rms_norm", (3, 6, 4), dict(axis=1)),
    ("instance_norm", (2, 6, 5, 5), dict(channel_axis=1)),
    ("instance_norm", (2, 5, 5, 6), dict(channel_axis=-1)),
    ("instance_norm", (3, 4, 7), dict(channel_axis=1)),
    ("instance_norm", (2, 3, 4, 5, 6), dict(channel_axis=2)),
    ("group_norm", (2, 8, 5, 5), dict(channel_axis=1, num_groups=4)),
    ("group_norm", (2, 5, 5, 8), dict(channel_axis=-1, num_groups=4)),
    ("group_norm", (2, 6, 4), dict(channel_axis=1, num_groups=3)),
    ("group_norm", (3, 6), dict(channel_axis=1, num_groups=2)),
    ("group_norm", (2, 4, 6, 3), dict(channel_axis=2, num_groups=6)),
    # runs of >= 64 elements per channel: the row path's per-run affine step
    ("instance_norm", (2, 3, 8, 9), dict(channel_axis=1)),
    ("group_norm", (2, 8, 9, 8), dict(channel_axis=1, num_groups=4)),
    ("group_norm", (2, 9, 8, 8), dict(channel_axis=-1, num_groups=4)),
]
DTYPES = [np.float32, np.float64, np.float16]
TOL = {np.float16: 2e-2, np.float32: 2e-5, np.float64: 1e-12}


@pytest.fixture(params=["one box", "many boxes", "one sample per box", "threads", "small ufunc buffer",
                        "numpy passes"])
def blocking(request, monkeypatch):
    """Run each case as one box (short tails after the reduced axes take several samples per
    box), as one sample per box (what longer tails get), as many tiny boxes, split across
    threads, with NumPy's ufunc buffer cut to the inner loop length (what inner loops of
    384 to 8191 elements get) in many boxes on two threads, and with the row and column
    paths' NumPy passes where the compiled CPU kernels (``anynorm._native``) would take them
    (what a host without a C++ compiler runs)."""
    monkeypatch.setattr(_numpy, "SMALL_ELEMENTS", 1)  # the test shapes are small
    if request.param == "numpy passes":
        monkeypatch.setattr(_native, "_library", False)
    if request.param == "small ufunc buffer":
        monkeypatch.setattr(_numpy_rows, "MIN_BUFSIZE_INNER", 1)
    if request.param in ("many boxes", "threads", "small ufunc buffer"):
        monkeypatch.setattr(_numpy, "BLOCK_BYTES", 64)
        monkeypatch.setattr(_numpy, "LARGE_BOX_BYTES", 256)
        monkeypatch.setattr(_numpy_rows, "ROW_BLOCK_BYTES", 64)
        monkeypatch.setattr(_numpy_columns, "SAMPLE_ELEMENTS", 1)
        monkeypatch.setattr(_numpy_columns, "SAMPLE_ELEMENTS_HALF", 1)
        monkeypatch.setattr(_numpy_columns, "CF_BLOCK_BYTES", 64)
    if request.param == "one sample per box":
        monkeypatch.setattr(_numpy, "SHORT_TAIL", 1)
    if request.param in ("threads", "small ufunc buffer"):
        monkeypatch.setattr(_numpy, "NUM_THREADS", 2)
        monkeypatch.setattr(_numpy, "PARALLEL_MIN_ELEMENTS", 1)
    return request.param


def _inputs(op, shape, dtype, kw, *, affine=True, residual=False, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3 + 2).astype(dtype)
    param_shape = make_plan(op, x, **kw).param_shape
    weight = rng.standard_normal(param_shape).astype(dtype) if affine else None
    bias = rng.standard_normal(param_shape).astype(dtype) if affine and op != "rms_norm" else None
    res = rng.standard_normal(shape).astype(dtype) if residual else None
    return x, weight, bias, res


def _assert_same(ours, ref, dtype):
    tol = TOL[dtype]
    for a, b in zip(ours, ref):
        if b is None:
            assert a is None
            continue
        assert isinstance(a, np.ndarray)
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol)


def _frozen(*arrays):
    for a in arrays:
        if a is not None:
            a.flags.writeable = False
    return arrays


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("op,shape,kw", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_forward_and_backward_match_reference(op, shape, kw, affine, dtype, blocking):
    x, weight, bias, _ = _frozen(*_inputs(op, shape, dtype, kw, affine=affine))
    plan = make_plan(op, x, weight, bias, **kw)
    ref = _reference.forward(plan, x, weight, bias)
    ours = _numpy.forward(plan, x, weight, bias)
    _assert_same(ours, ref, dtype)
    assert ours[2] is None or ours[2].shape == plan.stats_shape
    assert ours[3].dtype == np.dtype(plan.acc_dtype)

    (dy,) = _frozen((np.random.default_rng(1).standard_normal(shape)).astype(dtype))
    for mean, rstd in ((None, None), (ref[2], ref[3])):
        expected = _reference.backward(plan, dy, x, weight, mean, rstd)
        got = _numpy.backward(plan, dy, x, weight, mean, rstd)
        _assert_same(got, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,shape,kw", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_centered_inputs_take_the_one_pass_exactly(op, shape, kw, dtype, blocking):
    """Zero-mean inputs (|mean| <= std / 4 in most slices: the one-pass statistics and
    y = x * a + c; the other slices of a block send it to the two-pass) and inputs with one
    slice far from zero (that block two-pass, the rest one-pass) match the reference."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(dtype)
    plan = make_plan(op, x, **kw)
    weight = rng.standard_normal(plan.param_shape).astype(dtype)
    bias = rng.standard_normal(plan.param_shape).astype(dtype) if op != "rms_norm" else None
    shifted = x.copy()
    shifted.reshape(-1)[:plan.count] += 1000
    for data in (x, shifted):
        _frozen(data)
        _assert_same(_numpy.forward(plan, data, weight, bias),
                     _reference.forward(plan, data, weight, bias), dtype)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_residual(op, dtype, blocking):
    x, weight, bias, res = _frozen(*_inputs(op, (5, 3, 17), dtype, {}, residual=True))
    plan = make_plan(op, x, weight, bias, res)
    ours = _numpy.forward(plan, x, weight, bias, res)
    _assert_same(ours, _reference.forward(plan, x, weight, bias, res), dtype)
    np.testing.assert_array_equal(ours[1], x + res)


@pytest.mark.parametrize("op,shape,kw", [
    ("layer_norm", (0, 8), dict(axis=-1)),
    ("rms_norm", (0, 3, 8), dict(axis=(1, 2))),
    ("instance_norm", (0, 4, 5), dict(channel_axis=1)),
    ("group_norm", (0, 5, 4), dict(channel_axis=-1, num_groups=2)),
])
def test_empty_batch(op, shape, kw):
    x, weight, bias, _ = _inputs(op, shape, np.float32, kw)
    plan = make_plan(op, x, weight, bias, **kw)
    y, h, mean, rstd = _numpy.forward(plan, x, weight, bias)
    assert y.shape == shape and rstd.shape == plan.stats_shape and h is None
    dx, dw, db = _numpy.backward(plan, np.ones_like(x), x, weight)
    assert dx.shape == shape and dw.shape == plan.param_shape
    np.testing.assert_array_equal(dw, 0)


@pytest.mark.parametrize("layout", ["transposed", "strided", "negative"])
@pytest.mark.parametrize("op,shape,kw", [
    ("layer_norm", (6, 10, 12), dict(axis=-1)),
    ("layer_norm", (6, 10, 12), dict(axis=(0, 2))),
    ("instance_norm", (3, 4, 6, 5), dict(channel_axis=1)),
    ("group_norm", (3, 6, 5, 8), dict(channel_axis=-1, num_groups=2)),
])
def test_non_contiguous_inputs(op, shape, kw, layout, blocking):
    rng = np.random.default_rng(3)
    if layout == "transposed":
        base = rng.standard_normal(shape[::-1]).astype(np.float32)
        x = base.transpose(tuple(range(len(shape)))[::-1])
    elif layout == "strided":
        x = rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(np.float32)[..., ::2]
    else:
        x = rng.standard_normal(shape).astype(np.float32)[::-1, ..., ::-1]
    assert x.shape == shape and not x.flags.c_contiguous
    _, weight, bias, _ = _inputs(op, shape, np.float32, kw)
    dy = np.asfortranarray(rng.standard_normal(shape).astype(np.float32))
    before = x.copy()
    plan = make_plan(op, x, weight, bias, **kw)
    _assert_same(_numpy.forward(plan, x, weight, bias), _reference.forward(plan, x, weight, bias),
                 np.float32)
    _assert_same(_numpy.backward(plan, dy, x, weight), _reference.backward(plan, dy, x, weight),
                 np.float32)
    np.testing.assert_array_equal(x, before)


def test_mixed_parameter_and_gradient_dtypes(blocking):
    """float64 weight on float32 x, float64 dy: arithmetic in the accumulation dtype."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 9)).astype(np.float32)
    weight, bias = rng.standard_normal(9), rng.standard_normal(9)
    dy = rng.standard_normal((4, 9))
    plan = make_plan("layer_norm", x, weight, bias)
    _assert_same(_numpy.forward(plan, x, weight, bias), _reference.forward(plan, x, weight, bias),
                 np.float32)
    _assert_same(_numpy.backward(plan, dy, x, weight), _reference.backward(plan, dy, x, weight),
                 np.float32)


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_offset_rows_as_accurate_as_reference(offset, blocking):
    """Corrected two-pass: a mean far from zero does not swamp a small variance."""
    rng = np.random.default_rng(5)
    x = (offset + rng.standard_normal((8, 4096))).astype(np.float32)
    plan = make_plan("layer_norm", x)
    exact = x.astype(np.float64)
    exact = (exact - exact.mean(-1, keepdims=True)) / np.sqrt(exact.var(-1, keepdims=True) + 1e-5)
    ours = np.abs(_numpy.forward(plan, x)[0] - exact).max()
    ref = np.abs(_reference.forward(plan, x)[0] - exact).max()
    assert ours <= 1.5 * ref + 1e-6, (ours, ref)


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("op,shape,kw", [c for c in CASES if c[0] != "rms_norm"],
                         ids=lambda v: str(v).replace(" ", ""))
def test_offset_data_exact_in_every_layout(op, shape, kw, offset, blocking):
    """Every box layout (rows, columns, generic; one box, many, threads) keeps float32 data
    far from zero exact: y within a few float32 ulps of the float64 result, the mean to the
    rounding of the offset (issue 16)."""
    import reference

    rng = np.random.default_rng(6)
    x = (offset + rng.standard_normal(shape)).astype(np.float32)
    plan = make_plan(op, x, **kw)
    y, _, mean, rstd = _numpy.forward(plan, x)
    y_ref, mean_ref, rstd_ref = reference.forward(op, x.astype(np.float64), eps=1e-5, **kw)
    eps32 = float(np.finfo(np.float32).eps)
    assert np.max(np.abs(y - y_ref)) <= 32 * eps32 * np.max(np.abs(y_ref))
    assert np.max(np.abs(mean.reshape(mean_ref.shape) - mean_ref)) <= 4 * eps32 * offset
    np.testing.assert_allclose(rstd.reshape(rstd_ref.shape), rstd_ref, rtol=64 * eps32)


# long reduced extents: float32 sums cut into runs added in float64, the centring redone
# where the first mean missed (before: 2e-3 at offset 1e4 and 3.5 at 1e6 for (262144, 3))
LONG_CASES = [
    ("layer_norm", (262144, 3), dict(axis=0), "C"),
    ("layer_norm", (262144, 3), dict(axis=0), "F"),
    ("layer_norm", (3, 262144), dict(axis=1), "C"),
    ("layer_norm", (64, 4096, 3), dict(axis=1), "C"),
    ("layer_norm", (300, 5000), dict(axis=1), "F"),
    ("instance_norm", (2, 4, 256, 256), dict(channel_axis=1), "C"),
    ("instance_norm", (2, 256, 256, 4), dict(channel_axis=-1), "C"),
    ("group_norm", (2, 256, 256, 8), dict(channel_axis=-1, num_groups=2), "C"),
]


@pytest.mark.parametrize("offset", [0.0, 1e4, 1e6])
@pytest.mark.parametrize("op,shape,kw,order", LONG_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_long_reductions_exact(op, shape, kw, order, offset):
    """Slices of 10^5 float32 elements along any axis, near and far from zero: y within a
    few float32 ulps of the float64 result (issue 16)."""
    import reference

    rng = np.random.default_rng(8)
    x = np.asarray((offset + rng.standard_normal(shape)).astype(np.float32), order=order)
    y, _, mean, rstd = _numpy.forward(make_plan(op, x, **kw), x)
    y_ref, mean_ref, rstd_ref = reference.forward(op, x.astype(np.float64), eps=1e-5, **kw)
    eps32 = float(np.finfo(np.float32).eps)
    assert np.max(np.abs(y - y_ref)) <= 8 * eps32 * np.max(np.abs(y_ref))
    np.testing.assert_allclose(rstd.reshape(rstd_ref.shape), rstd_ref, rtol=8 * eps32)
    assert np.max(np.abs(mean.reshape(mean_ref.shape) - mean_ref)) <= 4 * eps32 * max(offset, 1.0)


@pytest.mark.parametrize("op,shape,kw", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_sums_in_runs_match_reference(op, shape, kw, monkeypatch):
    """With runs of 2 terms every sum goes through the float64 combination of partial sums
    (rows, columns, add.reduce): same answers as the reference, also far from zero."""
    import reference

    monkeypatch.setattr(_numpy, "SMALL_ELEMENTS", 1)
    for name in ("SUM_RUN", "COL_RUN", "REDUCE_RUN"):
        monkeypatch.setattr(_numpy_rows, name, 2)
    for dtype in DTYPES:
        x, weight, bias, _ = _frozen(*_inputs(op, shape, dtype, kw))
        plan = make_plan(op, x, weight, bias, **kw)
        _assert_same(_numpy.forward(plan, x, weight, bias), _reference.forward(plan, x, weight, bias), dtype)
    if op != "rms_norm":
        x = (1e6 + np.random.default_rng(9).standard_normal(shape)).astype(np.float32)
        y = _numpy.forward(make_plan(op, x, **kw), x)[0]
        y_ref = reference.forward(op, x.astype(np.float64), eps=1e-5, **kw)[0]
        assert np.max(np.abs(y - y_ref)) <= 32 * float(np.finfo(np.float32).eps) * np.max(np.abs(y_ref))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,shape,kw", [c for c in CASES if np.prod(c[1]) < _numpy.SMALL_ELEMENTS],
                         ids=lambda v: str(v).replace(" ", ""))
def test_small_arrays_take_plain_numpy_path(op, shape, kw, dtype):
    """Arrays under SMALL_ELEMENTS run the reference's arithmetic in plain NumPy calls: the
    same answers (with and without parameters), and exact on data far from zero."""
    for affine in (True, False):
        x, weight, bias, _ = _frozen(*_inputs(op, shape, dtype, kw, affine=affine))
        plan = make_plan(op, x, weight, bias, **kw)
        ours = _numpy.forward(plan, x, weight, bias)
        _assert_same(ours, _reference.forward(plan, x, weight, bias), dtype)
        assert ours[3].dtype == np.dtype(plan.acc_dtype) and ours[3].shape == plan.stats_shape
    if op in ("layer_norm", "rms_norm"):
        x, weight, bias, res = _frozen(*_inputs(op, shape, dtype, kw, residual=True))
        plan = make_plan(op, x, weight, bias, res, **kw)
        ours = _numpy.forward(plan, x, weight, bias, res)
        _assert_same(ours, _reference.forward(plan, x, weight, bias, res), dtype)
    if dtype == np.float32 and op != "rms_norm":
        import reference

        x = (1e6 + np.random.default_rng(7).standard_normal(shape)).astype(np.float32)
        plan = make_plan(op, x, **kw)
        y, _, mean, _ = _numpy.forward(plan, x)
        y_ref, mean_ref, _ = reference.forward(op, x.astype(np.float64), eps=1e-5, **kw)
        eps32 = float(np.finfo(np.float32).eps)
        assert np.max(np.abs(y - y_ref)) <= 32 * eps32 * max(1.0, np.max(np.abs(y_ref)))
        assert np.max(np.abs(mean.reshape(mean_ref.shape) - mean_ref)) <= 4 * eps32 * 1e6


def test_half_conversions_match_numpy_bit_for_bit():
    """The integer-pass float16 conversions give NumPy's casts exactly: every float16 value
    to float32, and float32 values of every float16 range (zeros, subnormals, ties to even,
    overflow, infinities, NaN) back, also into a strided output."""
    from anynorm._numpy_half import float_to_half, half_to_float

    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    out = np.empty(every.shape, np.float32)
    half_to_float(every, out)
    np.testing.assert_array_equal(out, every.astype(np.float32))
    finite = every[np.isfinite(every)]
    out = np.empty(finite.shape, np.float32)
    half_to_float(finite, out)
    assert np.array_equal(out.view(np.uint32), finite.astype(np.float32).view(np.uint32))

    rng = np.random.default_rng(0)
    lo = np.arange(0x0400, 0x7BFF, dtype=np.uint16).view(np.float16).astype(np.float64)
    hi = np.arange(0x0401, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    ties = ((lo + hi) / 2).astype(np.float32)
    cases = [ties, -ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(0)),
             np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 7e4, np.inf, -np.inf, np.nan], np.float32)]
    cases += [(rng.standard_normal(4099) * scale).astype(np.float32) for scale in (1e-7, 1e-5, 1, 3e4)]
    for src in cases:
        out = np.empty(src.shape, np.float16)
        tmp = [np.empty(src.shape, np.uint32) for _ in range(2)]
        with np.errstate(over="ignore"):
            float_to_half(src, out, *tmp)
            expected = src.astype(np.float16)
        assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))
    src = (rng.standard_normal((6, 40)) * 1e-4).astype(np.float32)
    strided = np.zeros((6, 80), np.float16)[:, ::2]
    float_to_half(src, strided, *(np.empty(src.shape, np.uint32) for _ in range(2)))
    assert np.array_equal(strided.view(np.uint16), src.astype(np.float16).view(np.uint16))


def test_ufunc_buffer_size_restored():
    """The executor sets NumPy's ufunc buffer size for its own loops only: the caller's
    setting (in its errstate context) is the same after a call, on the calling thread and
    with the work split across threads; the chosen size is a multiple of 16 no longer than
    the inner loop."""
    x = np.random.default_rng(0).standard_normal((512, 4096)).astype(np.float32)
    plan = make_plan("layer_norm", x, axis=-1)
    if _numpy_rows._CONTEXT_BUFSIZE:  # NumPy >= 2 (before, the size is process-wide: left alone)
        assert _numpy_rows.bufsize(4096) == 4096 and _numpy_rows.bufsize(1000) == 992
        assert _numpy_rows.bufsize(8192) is None and _numpy_rows.bufsize(64) is None
    else:
        assert _numpy_rows.bufsize(4096) is None
    want = _reference.forward(plan, x.astype(np.float64))[0]
    for size in (8192, 2048):
        with np.errstate():
            np.setbufsize(size)
            y = _numpy.forward(plan, x)[0]
            assert np.getbufsize() == size
        np.testing.assert_allclose(y, want, atol=2e-5)
    if _numpy.NUM_THREADS > 1:  # the pool's threads are back at NumPy's default too
        assert _numpy._pool().submit(np.getbufsize).result() == 8192


@pytest.mark.parametrize("memory, axis", [
    ((1, 0), 0),              # Fortran-ordered matrix normalized over axis 0 (its memory rows)
    ((2, 1, 0), (0, 1)),      # Fortran-ordered 3-d, two normalized axes
    ((2, 0, 1), (0, 1)),      # a transposed 3-d array: the normalized axes swap order in memory
    ((0, 2, 1), 1),           # (B, D, T) memory read as (B, T, D) normalized over T
])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_memory_rows_of_transposed_arrays(op, memory, axis, blocking):
    """A Fortran-ordered or transposed array normalized along its memory's rows takes the row
    path on the C-contiguous view (y in x's memory layout); statistics, residual and the
    backward (dy in the same layout; weight axes reordered where memory swaps them) match
    the reference."""
    rng = np.random.default_rng(8)
    shape = (6, 10, 12)[:len(memory)]
    base = (rng.standard_normal(tuple(shape[a] for a in memory)) * 3 + 2).astype(np.float32)
    x = base.transpose(np.argsort(memory))
    assert x.shape == shape and not x.flags.c_contiguous
    kw = dict(axis=axis)
    _, weight, bias, _ = _inputs(op, shape, np.float32, kw)
    res = np.ascontiguousarray(rng.standard_normal(base.shape).astype(np.float32)).transpose(np.argsort(memory))
    plan = make_plan(op, x, weight, bias, res, **kw)
    assert _numpy._memory_order(plan, x, res) == tuple(memory)
    ours = _numpy.forward(plan, x, weight, bias, res)
    _assert_same(ours, _reference.forward(plan, x, weight, bias, res), np.float32)
    assert ours[0].transpose(memory).flags.c_contiguous  # y laid out like x
    dy = np.ascontiguousarray(rng.standard_normal(base.shape).astype(np.float32)).transpose(np.argsort(memory))
    plan = make_plan(op, x, weight, **kw)
    _assert_same(_numpy.backward(plan, dy, x, weight), _reference.backward(plan, dy, x, weight), np.float32)
    stats = _reference.forward(plan, x, weight)[2:]
    _assert_same(_numpy.backward(plan, dy, x, weight, *stats),
                 _reference.backward(plan, dy, x, weight, *stats), np.float32)


def test_memory_columns_stay_on_the_general_path():
    """Normalized axes that are not memory's innermost: no reordering (the columns path
    measured slower there)."""
    x = np.asfortranarray(np.ones((64, 80), np.float32))
    assert _numpy._memory_order(make_plan("layer_norm", x, axis=-1), x) is None
    assert _numpy._memory_order(make_plan("layer_norm", x, axis=0), x) == (1, 0)


@pytest.mark.parametrize("n", [64, 4096 + 37])  # one BLAS dot a row; runs of SUM_RUN summed in float64
def test_row_dots_without_numpy_vecdot(monkeypatch, n):
    """NumPy < 2.0 has no ``np.vecdot``: the row path's dot products then come from stacked
    matmuls (``_matmul_vecdot``), with the same results (checked on NumPy 1.26 by hand)."""
    x = (np.random.default_rng(1).standard_normal((64, n)) * 3 + 1e4).astype(np.float32)
    plan = make_plan("layer_norm", x, axis=-1)
    want = _numpy.forward(plan, x)
    a = x[:8, :100]
    np.testing.assert_allclose(_numpy_rows._matmul_vecdot(a, a), np.einsum("ij,ij->i", a, a),
                               rtol=1e-6)
    monkeypatch.setattr(_numpy_rows, "_vecdot", _numpy_rows._matmul_vecdot)
    got = _numpy.forward(plan, x)
    for g, w in zip(got, want):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("view", ["rows", "strided", "columns"])
def test_layouts_are_kept_per_strides_without_arrays(view, monkeypatch):
    """The executor's merged layout is made once per plan and strides (``_numpy._layout``)
    and keeps no array alive: an input and the outputs of a call are freed with their last
    reference, forward and backward; a second call with other strides gets its own layout.
    (The calls the kernels take straight are sent through the executor.)"""
    import gc
    import weakref

    import anynorm

    monkeypatch.setattr(_numpy, "DIRECT_MAX_ELEMENTS", 0)
    anynorm._calls.clear()

    base = np.random.default_rng(2).standard_normal((16, 64, 96)).astype(np.float32)
    kw = {"axis": 1} if view == "columns" else {"axis": -1}
    x = base[:, :, ::2] if view == "strided" else base.copy()
    w = np.ones(x.shape[kw["axis"]], np.float32)
    y, mean, rstd = anynorm.layer_norm(x, w, return_stats=True, **kw)
    dx, dw, _ = anynorm.layer_norm_backward(np.ones_like(x), x, w, stats=(mean, rstd), **kw)
    plan = make_plan("layer_norm", x, w, **kw)
    layouts = [k for k in plan.memo if k[0] == "numpy layout"]
    assert layouts  # memoized
    refs = [weakref.ref(a) for a in (x, y, dx)]
    del x, y, mean, rstd, dx, dw
    gc.collect()
    assert all(r() is None for r in refs)
    anynorm._calls.clear()  # no runner of the executor's kept for later tests
