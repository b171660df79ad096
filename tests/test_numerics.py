"""Adversarial numerics: rows far from zero, float16 squares that overflow, constant rows, NaN/Inf."""

from __future__ import annotations

import numpy as np
import pytest

import anynorm
import reference
from support import TOLERANCE, call, call_backward, case, default_eps, get_backend, torch_functional

LAYOUTS = [
    case("layer_norm", (16, 256)),
    case("layer_norm", (256, 16), axis=0),
    case("instance_norm", (4, 8, 64)),
    case("instance_norm", (4, 64, 8), channel_axis=-1),
    case("group_norm", (4, 8, 32), num_groups=2, channel_axis=-1),
]


def max_error(backend, y, x, c, eps=1e-5):
    ref = reference.forward(c.op, backend.to_numpy(x), eps=eps, **c.kw)[0]
    return float(np.max(np.abs(backend.to_numpy(y) - ref)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("c", LAYOUTS, ids=str)
def test_offset_rows_no_worse_than_torch(backend, c, offset, dtype):
    """Rows offset by 1e4/1e6: the error against the exact answer is at most torch.nn.functional's
    on the same data (naive E[x^2]-E[x]^2 would lose every digit here)."""
    torch = pytest.importorskip("torch")
    x64 = offset + np.random.default_rng(11).standard_normal(c.shape)
    x = backend.asarray(x64, dtype)
    ours = max_error(backend, call(c.op, x, **c.kw), x, c)
    xt = torch.asarray(backend.to_numpy(x)).to(getattr(torch, dtype))
    theirs = max_error(get_backend("torch"), torch_functional(c.op, xt, **c.kw), xt, c)
    assert ours <= max(theirs, TOLERANCE[dtype]), f"error {ours:.3g}, torch's {theirs:.3g}"


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_offset_rows_statistics(backend, offset):
    """The mean is right to a few float32 ulps; rstd is no further off than torch.native_layer_norm's
    (cancellation would make it 1/sqrt(rounding noise), or NaN)."""
    torch = pytest.importorskip("torch")
    x64 = offset + np.random.default_rng(12).standard_normal((8, 128))
    x = backend.asarray(x64, "float32")
    _, mean, rstd = anynorm.layer_norm(x, return_stats=True)
    _, ref_mean, ref_rstd = reference.forward("layer_norm", backend.to_numpy(x))
    np.testing.assert_allclose(backend.to_numpy(mean), ref_mean, rtol=4 * 2.0**-24)
    _, _, torch_rstd = torch.native_layer_norm(torch.asarray(backend.to_numpy(x), dtype=torch.float32),
                                               [128], None, None, 1e-5)
    torch_error = np.max(np.abs(torch_rstd.double().numpy() / ref_rstd.ravel() - 1))
    ours_error = np.max(np.abs(backend.to_numpy(rstd) / ref_rstd - 1))
    assert ours_error <= max(torch_error, 1e-5), f"rstd error {ours_error:.3g}, torch's {torch_error:.3g}"


@pytest.mark.parametrize("c", [case("rms_norm", (4, 64)), case("layer_norm", (4, 64)),
                               case("layer_norm", (4, 64), axis=0), case("group_norm", (2, 4, 32), num_groups=2),
                               case("instance_norm", (2, 3, 40), channel_axis=-1)], ids=str)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_inputs_whose_squares_overflow(backend, c, dtype):
    """|x| up to ~5e4: x*x overflows float16 (max 65504), so statistics must be taken in float32."""
    x64 = np.random.default_rng(13).standard_normal(c.shape) * 8000.0 + 2000.0
    x = backend.asarray(np.clip(x64, -6e4, 6e4), dtype)
    out = call(c.op, x, return_stats=True, **c.kw)
    y, rstd = backend.to_numpy(out[0]), backend.to_numpy(out[-1])
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(rstd)) and np.all(rstd > 0)
    ref_y, _, ref_rstd = reference.forward(c.op, backend.to_numpy(x), eps=default_eps(c.op, dtype), **c.kw)
    np.testing.assert_allclose(y, ref_y, rtol=TOLERANCE[dtype], atol=2 * TOLERANCE[dtype])
    np.testing.assert_allclose(rstd, ref_rstd, rtol=TOLERANCE["float32"])


@pytest.mark.parametrize("value", [0.0, 0.1, -3.0, 1e4])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("c", [case("layer_norm", (3, 7)), case("layer_norm", (3, 4, 5), axis=(0, 2)),
                               case("instance_norm", (2, 3, 5)), case("group_norm", (2, 6, 3), num_groups=3)],
                         ids=str)
def test_constant_rows_give_the_bias(backend, c, value, dtype):
    """A slice whose values are all equal has variance 0: y is finite and equals the bias."""
    x64 = np.full(c.shape, value)
    bias64 = np.random.default_rng(14).standard_normal(c.param_shape)
    weight = backend.asarray(np.full(c.param_shape, 2.0), dtype)
    bias = backend.asarray(bias64, dtype)
    y = backend.to_numpy(call(c.op, backend.asarray(x64, dtype), weight, bias, **c.kw))
    want = reference.forward(c.op, x64, None, backend.to_numpy(bias), **c.kw)[0]  # the bias, broadcast
    assert np.all(np.isfinite(y))
    # one rounding of the mean (|value| * u) may survive, amplified by weight * rstd = 2 / sqrt(eps)
    acc_unit = 2.0**-24 if dtype != "float64" else 2.0**-53
    slack = 4 * abs(value) * acc_unit * 2.0 / np.sqrt(1e-5)
    np.testing.assert_allclose(y, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] + slack)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_zero_rows_rms_norm(backend, dtype):
    """RMS norm of an all-zero row is 0 (finite, since eps > 0), with rstd = 1/sqrt(eps)."""
    x = backend.asarray(np.zeros((2, 8)), dtype)
    y, rstd = anynorm.rms_norm(x, return_stats=True)
    assert np.all(backend.to_numpy(y) == 0)
    np.testing.assert_allclose(backend.to_numpy(rstd), 1 / np.sqrt(default_eps("rms_norm", dtype)), rtol=1e-6)


def _poisoned(c, bad, seed=15):
    x64 = np.random.default_rng(seed).standard_normal(c.shape)
    x64[(1,) * len(c.shape)] = bad
    return x64


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("c", [case("layer_norm", (4, 6)), case("layer_norm", (4, 6), axis=0),
                               case("rms_norm", (3, 4, 5), axis=(0, 2)), case("instance_norm", (3, 4, 5)),
                               case("group_norm", (3, 4, 5), num_groups=2)], ids=str)
def test_nan_stays_in_its_row(backend, c, bad):
    """A NaN (or Inf) poisons the slice it is in and nothing else; the other slices are exact."""
    x64 = _poisoned(c, bad)
    y = backend.to_numpy(call(c.op, backend.asarray(x64, "float32"), **c.kw))
    ref = reference.forward(c.op, x64, eps=default_eps(c.op, "float32"), **c.kw)[0]
    with np.errstate(invalid="ignore"):
        poisoned = ~np.isfinite(ref)  # the reference's own poisoned slice
    assert poisoned.any() and not poisoned.all()
    assert np.all(np.isnan(y[poisoned]))
    np.testing.assert_allclose(y[~poisoned], ref[~poisoned], rtol=TOLERANCE["float32"], atol=TOLERANCE["float32"])


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("c", [case("layer_norm", (4, 6)), case("group_norm", (3, 4, 5), num_groups=2)], ids=str)
def test_nan_stays_in_its_row_in_the_backward(backend, c):
    """dx of the other slices is finite and right when one slice holds a NaN."""
    x64 = _poisoned(c, np.nan)
    dy64 = np.random.default_rng(16).standard_normal(c.shape)

    dx = backend.to_numpy(call_backward(c.op, backend.asarray(dy64), backend.asarray(x64), **c.kw)[0])
    ref = reference.backward(c.op, dy64, x64, **c.kw)[0]
    with np.errstate(invalid="ignore"):
        poisoned = np.isnan(ref)
    assert poisoned.any() and not poisoned.all()
    assert np.all(np.isnan(dx[poisoned]))
    np.testing.assert_allclose(dx[~poisoned], ref[~poisoned], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_long_rows(backend, dtype):
    """2**16 elements per row, offset by 100: the summation does not drift."""
    x64 = 100.0 + np.random.default_rng(17).standard_normal((2, 2**16))
    x = backend.asarray(x64, dtype)
    y, mean, _ = anynorm.layer_norm(x, return_stats=True)
    ref_y, ref_mean, _ = reference.forward("layer_norm", backend.to_numpy(x))
    np.testing.assert_allclose(backend.to_numpy(mean), ref_mean, rtol=1e-6)
    np.testing.assert_allclose(backend.to_numpy(y), ref_y, rtol=TOLERANCE[dtype], atol=2 * TOLERANCE[dtype])
