"""NumPy arrays of ml_dtypes' floats (``bfloat16``, as JAX's bfloat16 arrays arrive in NumPy):
computed in float32 per block like float16, ``y`` rounded once to the input's dtype, the
statistics in float32; NumPy's own ``isdtype``/``finfo`` refuse these dtypes, which made every
call a TypeError about NumPy dtypes."""

from __future__ import annotations

import numpy as np
import pytest

import anynorm
import reference

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
BF16_EPS = float(ml_dtypes.finfo(BF16).eps)  # 2**-7

CASES = [
    ("layer_norm", (8, 64), dict(axis=-1)),
    ("layer_norm", (4, 6, 5, 5), dict(axis=1)),
    ("layer_norm", (6, 8, 5), dict(axis=(0, 2))),
    ("rms_norm", (8, 64), dict(axis=-1)),
    ("instance_norm", (4, 6, 5, 5), dict(channel_axis=1)),
    ("instance_norm", (4, 5, 5, 6), dict(channel_axis=-1)),
    ("group_norm", (4, 6, 5, 5), dict(channel_axis=1, num_groups=3)),
    ("group_norm", (4, 5, 5, 6), dict(channel_axis=-1, num_groups=2)),
]


def _args(kw):
    kw = dict(kw)
    groups = kw.pop("num_groups", None)
    return ((groups,) if groups else ()), kw


IDS = [f"{op}{shape}{sorted(kw.items())}" for op, shape, kw in CASES]


@pytest.mark.parametrize("offset", [0.0, 100.0])
@pytest.mark.parametrize("op,shape,kw", CASES, ids=IDS)
def test_bfloat16_numpy_arrays(op, shape, kw, offset):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) + offset).astype(BF16)
    lead, rest = _args(kw)
    y, *stats = getattr(anynorm, op)(x, *lead, return_stats=True, **rest)
    assert y.dtype == BF16 and y.shape == x.shape
    assert [s.dtype for s in stats] == [np.float32] * len(stats)
    # the float64 formula on the same (bfloat16-valued) input, rms_norm's eps that of bfloat16
    eps = BF16_EPS if op == "rms_norm" else None
    y64, mean64, rstd64 = reference.forward(op, x.astype(np.float64), eps=eps, **kw)
    # y: rounded once to bfloat16 (half an ulp of its magnitude, plus float32 noise)
    assert np.all(np.abs(y.astype(np.float64) - y64) <= 0.5 * BF16_EPS * np.abs(y64) + 1e-6)
    np.testing.assert_allclose(stats[-1].astype(np.float64), rstd64, rtol=2e-6)
    if mean64 is not None:
        err = np.max(np.abs(stats[0].astype(np.float64) - mean64) * rstd64)
        assert err <= 2e-6 * max(1.0, offset)
    dy = rng.standard_normal(shape).astype(BF16)
    dx = getattr(anynorm, op + "_backward")(dy, x, *lead, **rest)[0]
    dx64 = reference.backward(op, dy.astype(np.float64), x.astype(np.float64), eps=eps, **kw)[0]
    assert dx.dtype == BF16
    scale = np.max(np.abs(dx64))
    assert np.max(np.abs(dx.astype(np.float64) - dx64)) <= BF16_EPS * scale


def test_other_extension_dtypes_are_a_clear_type_error_when_not_floats():
    x = np.ones((2, 4), dtype=ml_dtypes.int4)
    with pytest.raises(TypeError, match="x must have a real floating-point dtype"):
        anynorm.layer_norm(x)
