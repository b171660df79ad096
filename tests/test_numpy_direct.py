"""NumPy calls straight onto anynorm's row kernel (``anynorm._numpy_direct``, issue 16).

A signature the packed row kernel takes (C-contiguous ndarray x, layer/RMS norm over
trailing axes or group/instance norm with channels on axis 1, parameters of the
accumulation dtype or of x's half dtype), below ``_numpy.DIRECT_MAX_ELEMENTS``, runs it from
a cached runner.  These tests check that such calls reach it, match the float64 reference
(far from zero too), leave their inputs alone, and that the signatures it declines still
get their results from the executor.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from support import PACKED_COLUMN_CASES, PACKED_SEGMENTED_CASES, call, count_packed_kernel_calls

import anynorm
from anynorm import _native, _numpy

pytestmark = pytest.mark.skipif(_native.rows_packed_kernel(np.float32) is None,
                                reason="anynorm's CPU kernels are not built here")

F32_EPS = float(np.finfo(np.float32).eps)
CASES = [
    ("layer_norm", (4, 8), {}, (8,)),
    ("layer_norm", (1000, 37), {}, (37,)),
    ("layer_norm", (2, 5, 6, 7), {"axis": (-2, -1)}, (6, 7)),
    ("rms_norm", (6, 100), {}, (100,)),
    ("group_norm", (3, 30, 7, 9), {"num_groups": 5}, (30,)),
    ("group_norm", (2, 8, 3, 4, 5), {"num_groups": 2}, (8,)),
    ("instance_norm", (4, 6, 7, 7), {}, (6,)),
] + PACKED_SEGMENTED_CASES + PACKED_COLUMN_CASES
IDS = [f"{op} {'x'.join(map(str, shape))}" for op, shape, _, _ in CASES]


def _eps(op, dtype):
    return 1e-5  # rms_norm too (_with_eps passes it: its default is x's dtype's epsilon)


def _with_eps(op, kw):
    return {**kw, "eps": 1e-5} if op == "rms_norm" else kw


@pytest.fixture
def kernel_calls(monkeypatch):
    """A list that grows by one for every packed-kernel call made from now on."""
    yield count_packed_kernel_calls(monkeypatch)
    anynorm._calls.clear()


def _dtypes():
    out = [(np.float32, np.float32), (np.float64, np.float64)]
    if _native.rows_packed_kernel(np.float16) is not None:
        out += [(np.float16, np.float16), (np.float16, np.float32)]
    try:
        import ml_dtypes
    except ImportError:
        return out
    return out + [(ml_dtypes.bfloat16, ml_dtypes.bfloat16), (ml_dtypes.bfloat16, np.float32)]


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("stats", [False, True], ids=["y", "stats"])
@pytest.mark.parametrize("dtype,pdtype", _dtypes(), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,shape,kw,pshape", CASES, ids=IDS)
def test_calls_reach_the_kernel_and_match_the_reference(op, shape, kw, pshape, dtype, pdtype, stats, offset,
                                                        kernel_calls):
    """Each call runs the packed kernel once, repeat calls too, with weight and bias, one of
    them or none; y matches the float64 reference of the rounded inputs to float32 rounding
    (half dtypes: one ulp), the statistics likewise, at offset 0 and (float32/float64) 1e4."""
    half = np.dtype(dtype).itemsize == 2
    if half and offset:
        pytest.skip("half dtypes hold no unit-scale detail at 1e4")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) + offset).astype(dtype)
    w = (rng.random(pshape) + 0.5).astype(pdtype)
    b = (rng.random(pshape) - 0.5).astype(pdtype)
    acc = np.float32 if half else np.dtype(dtype)
    for params in ((w, b), (w, None), (None, b), (None, None)):
        if op == "rms_norm" and params[1] is not None:
            continue
        args = params[:1] if op == "rms_norm" else params
        before = len(kernel_calls)
        outs = [call(op, x, *args, return_stats=stats, **_with_eps(op, kw)) for _ in range(2)]
        assert len(kernel_calls) == before + 2, "the direct path was not taken"
        y_ref, mean_ref, rstd_ref = reference.forward(
            op, x.astype(np.float64), *(None if p is None else p.astype(np.float64) for p in args),
            eps=_eps(op, np.float32 if half else dtype), **kw)
        for out in outs:
            y = out[0] if stats else out
            assert type(y) is np.ndarray and y.dtype == x.dtype and y.shape == shape and y.flags.c_contiguous
            scale = np.max(np.abs(y_ref))
            bound = (2.0**-8 if np.dtype(dtype).name == "bfloat16" else 2.0**-11) if half else (
                4e-15 if dtype == np.float64 else 8 * F32_EPS)
            assert np.max(np.abs(y.astype(np.float64) - y_ref)) <= bound * scale
            if stats:
                tol = 4e-15 if dtype == np.float64 else 8 * F32_EPS
                rstd = out[-1]
                assert rstd.dtype == acc and rstd.shape == rstd_ref.shape
                np.testing.assert_allclose(rstd, rstd_ref, rtol=tol)
                if mean_ref is not None:
                    assert out[1].dtype == acc and out[1].shape == mean_ref.shape
                    np.testing.assert_allclose(out[1], mean_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("op,shape,kw,pshape", CASES, ids=IDS)
def test_nan_stays_in_its_slice_and_inputs_are_kept(op, shape, kw, pshape, kernel_calls):
    """A NaN in one slice makes that slice NaN and no other; read-only inputs are read,
    never written; the outputs are new arrays."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[x.size // 2] = np.nan
    w = (rng.random(pshape) + 0.5).astype(np.float32)
    args = (w,) if op == "rms_norm" else (w, w - 1)
    for a in (x, *args):
        a.flags.writeable = False
    saved = [a.copy() for a in (x, *args)]
    y = call(op, x, *args, **_with_eps(op, kw))
    assert kernel_calls
    y_ref = reference.forward(op, x.astype(np.float64), *(a.astype(np.float64) for a in args),
                              eps=_eps(op, np.float32), **kw)[0]
    assert np.array_equal(np.isnan(y), np.isnan(y_ref)) and not np.isnan(y_ref).all()
    for a, s in zip((x, *args), saved):
        np.testing.assert_array_equal(a, s)
    assert not np.shares_memory(y, x)


def test_signatures_it_declines_still_get_their_results(kernel_calls):
    """F-ordered x, strided or mixed-dtype parameters, float64 parameters with float32 x, a
    residual, channels-last group norm on a transposed view: the executor's paths serve them,
    no packed-kernel call, results as the reference's."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    w = (rng.random(48) + 0.5).astype(np.float32)
    b = (rng.random(48) - 0.5).astype(np.float32)
    want = reference.forward("layer_norm", x.astype(np.float64), w.astype(np.float64), b.astype(np.float64),
                             eps=1e-5)[0]

    def check(y):
        np.testing.assert_allclose(y, want, atol=8 * F32_EPS * np.max(np.abs(want)))

    check(anynorm.layer_norm(np.asfortranarray(x), w, b))
    check(anynorm.layer_norm(x, np.repeat(w, 2)[::2], b))
    check(anynorm.layer_norm(x, w, b.astype(np.float64)))
    check(anynorm.layer_norm(x, w.astype(np.float64), b.astype(np.float64)))
    y, h = anynorm.layer_norm(x, w, b, residual=np.zeros_like(x))
    check(y)
    xs = rng.standard_normal((2, 8, 3, 3)).astype(np.float32).transpose(0, 2, 3, 1)  # NHWC view of NCHW
    np.testing.assert_allclose(anynorm.group_norm(xs, 4, channel_axis=-1),
                               reference.forward("group_norm", xs.astype(np.float64), num_groups=4,
                                                 channel_axis=-1, eps=1e-5)[0], atol=1e-5)
    assert kernel_calls == []


def test_subclasses_and_large_calls_take_the_executor(kernel_calls, monkeypatch, tmp_path):
    """A memory-mapped x (an ndarray subclass) and arrays from DIRECT_MAX_ELEMENTS on take the
    executor's path, with the same results."""
    x = np.random.default_rng(4).standard_normal((16, 64)).astype(np.float32)
    mapped = np.memmap(tmp_path / "x.bin", dtype=np.float32, mode="w+", shape=x.shape)
    mapped[...] = x
    direct = anynorm.layer_norm(x)
    assert len(kernel_calls) == 1
    tol = 4 * F32_EPS * np.max(np.abs(direct))
    np.testing.assert_allclose(anynorm.layer_norm(mapped), direct, atol=tol)
    monkeypatch.setattr(_numpy, "DIRECT_MAX_ELEMENTS", x.size)
    anynorm._calls.clear()
    np.testing.assert_allclose(anynorm.layer_norm(x), direct, atol=tol)
    assert len(kernel_calls) == 1


BACKWARD_CASES = [
    ("layer_norm", (4, 8), {}),
    ("layer_norm", (1000, 37), {}),  # short rows, four at a time
    ("layer_norm", (3, 5, 70), {"axis": (-2, -1)}),
    ("rms_norm", (6, 100), {}),
    ("layer_norm", (2, 3), {}),  # rows under a vector: the general path
    ("layer_norm", (7, 13, 33), {"axis": (0, 2)}),  # segmented rows
    ("rms_norm", (300, 4, 16), {"axis": (0, 2)}),  # float32 gradient sums flushed part-way
    ("layer_norm", (2, 3, 4, 1030), {"axis": (0, 1, 3)}),
]


@pytest.mark.parametrize("given", [True, False], ids=["stats", "recomputed"])
@pytest.mark.parametrize("dtype,pdtype", _dtypes(), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op,shape,kw", BACKWARD_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_backward_rows_straight_onto_the_kernel(op, shape, kw, dtype, pdtype, given, monkeypatch):
    """``*_backward`` over trailing axes (or leading and trailing ones: segmented rows) of
    C-contiguous arrays below the threading size: the row backward kernel in one call (no
    executor), dx and the parameter gradients against
    the float64 reference, with the statistics given or taken again, with and without a
    weight, at offset 1e4 (float32/float64); inputs left as they were."""
    from anynorm import _numpy_direct

    taken = []
    real = _numpy_direct.backward
    monkeypatch.setattr(_numpy_direct, "backward", lambda *a: taken.append(1) or real(*a))
    half = np.dtype(dtype).itemsize == 2
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(shape) + (0.0 if half else 1e4)).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    axes = kw.get("axis", -1)
    axes = sorted(a % len(shape) for a in (axes if isinstance(axes, tuple) else (axes,)))
    pshape = tuple(shape[a] for a in axes)
    w = (rng.random(pshape) + 0.5).astype(pdtype)
    before = (x.copy(), dy.copy(), w.copy())
    fwd = getattr(anynorm, op)
    bwd = getattr(anynorm, op + "_backward")
    kw = _with_eps(op, kw)
    for weight in (w, None):
        stats = fwd(x, weight, return_stats=True, **kw)[1:] if given else None
        n_taken = len(taken)
        dx, dw, *rest = bwd(dy, x, weight, stats=stats, **kw)
        assert len(taken) == n_taken + 1
        ref = reference.backward(op, dy.astype(np.float64), x.astype(np.float64),
                                 None if weight is None else weight.astype(np.float64),
                                 **{"eps": 1e-5, **kw})
        assert dx.dtype == x.dtype and dx.shape == x.shape
        tol = (2.0**-7 if np.dtype(dtype).name == "bfloat16" else 2.0**-10) if half else (
            1e-12 if dtype == np.float64 else 64 * F32_EPS)
        scale = lambda a: max(float(np.max(np.abs(a))), 1.0)  # noqa: E731
        assert np.max(np.abs(dx.astype(np.float64) - ref[0])) <= tol * scale(ref[0])
        if weight is None:
            assert dw is None
            continue
        assert dw.dtype == w.dtype and dw.shape == w.shape
        for got, want in zip((dw, *rest), ref[1:]):
            assert np.max(np.abs(got.astype(np.float64) - want)) <= max(tol, 64 * F32_EPS) * scale(want)
    for a, b in zip((x, dy, w), before):
        np.testing.assert_array_equal(a, b)


def test_segmented_backward_weight_gradients_over_many_rows():
    """Layer norm over axes (0, 2) of (2, 30000, 16), dy averaging 1: the float32 sums of the
    weight and bias gradients go to float64 every BWD_FLUSH_ROWS rows (summed in float32
    over all 30000 rows, dbias drifts to 2.5e-6, 20 float32 eps)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 30000, 16)).astype(np.float32)
    dy = (1 + rng.standard_normal(x.shape)).astype(np.float32)
    w = (rng.random((2, 16)) + 0.5).astype(np.float32)
    dx, dw, db = anynorm.layer_norm_backward(dy, x, w, axis=(0, 2))
    ref = reference.backward("layer_norm", dy.astype(np.float64), x.astype(np.float64), w.astype(np.float64),
                             eps=1e-5, axis=(0, 2))
    for got, want in zip((dx, dw, db), ref):  # in float32 throughout: 2.5e-6 of dbias
        assert np.max(np.abs(got - want)) <= 8 * F32_EPS * np.max(np.abs(want))
