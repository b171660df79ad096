"""Dask arrays with unknown chunk sizes (NaN: after boolean indexing, from a DataFrame's
``to_dask_array()``): every op whose normalized axes have known sizes runs lazily, block by
block, and gives what the same call on the computed array gives, forward (statistics and a
fused residual included) and backward; an unknown size where the norm needs it is the
ValueError that names ``compute_chunk_sizes``."""

from __future__ import annotations

import numpy as np
import pytest

import anynorm
from support import assert_close

da = pytest.importorskip("dask.array")

# (op, shape, keywords): normalized axes, parameter axes and channels all away from axis 0
CASES = [
    ("layer_norm", (9, 6, 5), dict(axis=-1)),
    ("layer_norm", (9, 6, 5), dict(axis=(1, 2))),
    ("layer_norm", (9, 6, 4, 3), dict(axis=1)),  # ConvNeXt's channels-first
    ("rms_norm", (9, 6, 5), dict(axis=-1)),
    ("rms_norm", (9, 6, 5), dict(axis=(1, 2))),
    ("instance_norm", (9, 6, 4, 3), dict(channel_axis=1)),
    ("instance_norm", (9, 4, 3, 6), dict(channel_axis=-1)),
    ("group_norm", (9, 6, 4, 3), dict(num_groups=3, channel_axis=1)),
    ("group_norm", (9, 4, 3, 6), dict(num_groups=2, channel_axis=-1)),
]
IDS = [f"{op}{shape}{sorted(kw.items())}" for op, shape, kw in CASES]
KEEP = np.array([1, 0, 1, 1, 1, 0, 1, 1, 1], bool)  # rows a boolean mask keeps


def _unknown(a, chunks=2):
    """``a[KEEP]`` as Dask makes it from a mask: every chunk size on axis 0 unknown."""
    x = da.from_array(a, chunks=chunks)
    out = x[da.from_array(KEEP[: a.shape[0]], chunks=chunks)]
    assert all(s != s for s in out.chunks[0])
    return out


def _param_shape(op, shape, kw):
    if op in ("layer_norm", "rms_norm"):
        axes = kw["axis"] if isinstance(kw["axis"], tuple) else (kw["axis"],)
        return tuple(shape[a] for a in sorted(a % len(shape) for a in axes))
    return (shape[kw["channel_axis"]],)


def _call(op, x, w, b, **kw):
    kw = dict(kw)
    if op == "rms_norm":
        return anynorm.rms_norm(x, w, **kw)
    if op == "group_norm":
        return anynorm.group_norm(x, kw.pop("num_groups"), w, b, **kw)
    return getattr(anynorm, op)(x, w, b, **kw)


def _backward(op, dy, x, w, **kw):
    kw = dict(kw)
    fn = getattr(anynorm, op + "_backward")
    if op == "group_norm":
        return fn(dy, x, kw.pop("num_groups"), w, **kw)
    return fn(dy, x, w, **kw)


def _as_list(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("dtype,offset", [("float64", 0.0), ("float32", 1e4), ("float16", 0.0)])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("op,shape,kw", CASES, ids=IDS)
def test_forward_matches_the_computed_array(op, shape, kw, affine, dtype, offset):
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 2 + offset).astype(dtype)
    pshape = _param_shape(op, shape, kw)
    w = (rng.random(pshape) + 0.5).astype(dtype) if affine else None
    b = (rng.random(pshape) - 0.5).astype(dtype) if affine and op != "rms_norm" else None
    x = _unknown(a)
    as_dask = [None if p is None else da.from_array(p) for p in (w, b)]
    for stats in (False, True):
        got = _as_list(_call(op, x, *as_dask, return_stats=stats, **kw))
        want = _as_list(_call(op, a[KEEP], w, b, return_stats=stats, **kw))
        assert len(got) == len(want)
        for g, e in zip(got, want):
            assert isinstance(g, da.Array) and g.dtype == e.dtype
            assert g.ndim == e.ndim and np.isnan(g.shape[0])
            assert_close(g.compute(), e, dtype)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_fused_residual(op):
    rng = np.random.default_rng(1)
    a, r = rng.standard_normal((9, 6, 5)) + 100, rng.standard_normal((9, 6, 5))
    got = _call(op, _unknown(a), None, None, residual=_unknown(r), return_stats=True)
    want = _call(op, a[KEEP], None, None, residual=r[KEEP], return_stats=True)
    for g, e in zip(got, want):
        assert_close(g.compute(), e, "float64")


@pytest.mark.parametrize("given", [False, True], ids=["recomputed", "stats_given"])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("op,shape,kw", CASES, ids=IDS)
def test_backward_matches_the_computed_array(op, shape, kw, affine, given):
    rng = np.random.default_rng(2)
    a = rng.standard_normal(shape) * 2 + 1e3
    dy = rng.standard_normal(shape)
    w = rng.random(_param_shape(op, shape, kw)) + 0.5 if affine else None
    x = _unknown(a)
    extra = dict(kw)
    want_extra = dict(kw)
    if given:
        for target, arr in ((extra, x), (want_extra, a[KEEP])):
            target["stats"] = tuple(_as_list(_call(op, arr, None, None, return_stats=True, **kw))[1:])
    got = _backward(op, _unknown(dy), x, None if w is None else da.from_array(w), **extra)
    want = _backward(op, dy[KEEP], a[KEEP], w, **want_extra)
    assert len(got) == len(want)
    for g, e in zip(got, want):
        assert (g is None) == (e is None)
        if e is not None:
            assert isinstance(g, da.Array) and g.dtype == e.dtype
            assert_close(g.compute(), e, "float64")


def test_unknown_sizes_where_the_norm_needs_them_ask_for_chunk_sizes():
    a = np.random.default_rng(3).standard_normal((9, 6, 5))
    x = _unknown(a)
    for call in (lambda: anynorm.layer_norm(x, axis=0),
                 lambda: anynorm.layer_norm(x, da.ones((9, 5)), axis=(0, 2)),  # not a weight error
                 lambda: anynorm.rms_norm(x, axis=(0, 1)),
                 lambda: anynorm.layer_norm_backward(x, x, axis=0)):
        with pytest.raises(ValueError, match=r"known sizes.*compute_chunk_sizes"):
            call()
    # a known normalized axis with the batch unknown: the usual checks, names as ever
    with pytest.raises(ValueError, match=r"weight must have shape \(5,\)"):
        anynorm.layer_norm(x, da.ones(4))
    with pytest.raises(TypeError, match="weight must be an array of the same library"):
        anynorm.layer_norm(x, np.ones(5))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        anynorm.layer_norm(x, residual=da.from_array(a))
    with pytest.raises(ValueError, match="dy must have x's shape"):
        anynorm.layer_norm_backward(da.from_array(a), x)
    with pytest.raises(ValueError, match="num_groups"):
        anynorm.group_norm(x, 4)
