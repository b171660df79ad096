"""Hypothesis sweep: ranks 1-5, random axis sets (any order, negatives, int/tuple/list), channel axes,
group counts, dtypes and affine parameters, against the reference; plus identities between the ops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import anynorm
import reference
from support import Case, assert_close, call, call_backward, default_eps, get_backend, has_bias, make_inputs

FAST = ["numpy", "numpy-readonly", "torch"]
SLOW = ["array-api-strict", "dask", "jax"]  # graph building / per-shape compilation


@st.composite
def axis_sets(draw, rank):
    """An int or a tuple/list of distinct axes, in any order, each possibly negative."""
    axes = draw(st.permutations(range(rank)).map(lambda p: p[: draw(st.integers(1, rank))]))
    axes = [a - rank if draw(st.booleans()) else a for a in axes]
    form = draw(st.sampled_from(["int", "tuple", "list"] if len(axes) == 1 else ["tuple", "list"]))
    return axes[0] if form == "int" else (tuple(axes) if form == "tuple" else list(axes))


@st.composite
def problems(draw, dtypes=("float32", "float64"), max_size=4):
    """(Case, dtype, affine, seed) for any of the four operations, axes of 1 to ``max_size``."""
    op = draw(st.sampled_from(reference.OPS))
    min_rank = {"layer_norm": 1, "rms_norm": 1, "instance_norm": 3, "group_norm": 2}[op]
    rank = draw(st.integers(min_rank, 5))
    shape = draw(st.lists(st.integers(1, max_size), min_size=rank, max_size=rank))
    if op in ("layer_norm", "rms_norm"):
        where = {"axis": draw(axis_sets(rank))}
    else:
        c = draw(st.integers(1, rank - 1))
        where = {"channel_axis": c - rank if draw(st.booleans()) else c}
        if op == "group_norm":
            shape[c] = draw(st.integers(1, 6))
            where["num_groups"] = draw(st.sampled_from([g for g in range(1, shape[c] + 1) if shape[c] % g == 0]))
    dtype = draw(st.sampled_from(dtypes))
    return Case(op, tuple(shape), tuple(where.items())), dtype, draw(st.booleans()), draw(st.integers(0, 2**16))


def check_against_reference(backend, c, dtype, affine, seed):
    x64, w64, b64 = make_inputs(c, seed, affine=affine)
    x = backend.asarray(x64, dtype)
    w, b = (None if p is None else backend.asarray(p, dtype) for p in (w64, b64))
    out = call(c.op, x, w, b, return_stats=True, **c.kw)
    ref_y, _, ref_rstd = reference.forward(c.op, backend.to_numpy(x), backend.to_numpy(w), backend.to_numpy(b),
                                           eps=default_eps(c.op, dtype), **c.kw)
    backend.check(out[0], c.shape, dtype)
    assert_close(backend.to_numpy(out[0]), ref_y, dtype, scale=4, what=str(c))
    assert tuple(out[-1].shape) == ref_rstd.shape
    assert_close(backend.to_numpy(out[-1]), ref_rstd, dtype, scale=4, what=f"rstd of {c}")
    dy64 = np.random.default_rng(seed + 1).standard_normal(c.shape)
    grads = call_backward(c.op, backend.asarray(dy64, dtype), x, w, **c.kw)
    ref_grads = reference.backward(c.op, backend.to_numpy(backend.asarray(dy64, dtype)), backend.to_numpy(x),
                                   backend.to_numpy(w), eps=default_eps(c.op, dtype), **c.kw)
    for g, r in zip(grads, ref_grads):
        if r is not None and g is not None:
            assert_close(backend.to_numpy(g), r, dtype, scale=10 * np.prod(c.shape) ** 0.5, what=f"grad of {c}")


@pytest.mark.parametrize("lib", FAST)
@given(problem=problems(dtypes=("float16", "bfloat16", "float32", "float64")))
def test_sweep_fast_libraries(lib, problem):
    b = get_backend(lib)
    c, dtype, affine, seed = problem
    if dtype not in b.dtypes:
        dtype = "float32"
    check_against_reference(b, c, dtype, affine, seed)


@pytest.mark.parametrize("lib", SLOW)
@settings(max_examples=8)
@given(problem=problems())
def test_sweep_other_libraries(lib, problem):
    check_against_reference(get_backend(lib), *problem)


# --- identities between the operations (NumPy, float64) ---------------------------------------

@given(problem=problems(dtypes=("float64",)), data=st.data())
def test_transposing_x_transposes_y(problem, data):
    """Permuting x's axes (and the axis arguments with them) permutes the result."""
    c, _, affine, seed = problem
    x, w, b = make_inputs(c, seed, affine=affine)
    perm = data.draw(st.permutations(range(len(c.shape))))
    if c.op in ("instance_norm", "group_norm"):
        perm = [0] + [p for p in perm if p != 0]  # the batch axis stays first
    inverse = list(np.argsort(perm))
    kw = dict(c.kw)
    if "axis" in kw:
        axes = kw["axis"] if isinstance(kw["axis"], (tuple, list)) else (kw["axis"],)
        old_sorted = sorted(a % len(c.shape) for a in axes)
        new_sorted = sorted(inverse[a] for a in old_sorted)
        kw["axis"] = tuple(new_sorted)
        # weight dims follow the sorted axes: dim j of the new weight is old axis perm[new_sorted[j]]
        dims = [old_sorted.index(perm[a]) for a in new_sorted]
        w, b = (None if p is None else np.transpose(p, dims) for p in (w, b))
    else:
        kw["channel_axis"] = inverse[kw["channel_axis"] % len(c.shape)]
    y = call(c.op, x, *make_inputs(c, seed, affine=affine)[1:], **c.kw)
    y_moved = call(c.op, np.transpose(x, perm), w, b, **kw)
    assert_close(y_moved, np.transpose(y, perm), "float64")


@given(problem=problems(dtypes=("float64",)), scale=st.floats(1e-3, 1e3), shift=st.floats(-1e3, 1e3))
def test_layer_norm_ignores_scale_and_shift(problem, scale, shift):
    """With eps=0, normalizing a*x + c gives the same as normalizing x (a > 0), for the centring ops."""
    c, _, _, seed = problem
    if c.op == "rms_norm":
        c = Case("layer_norm", c.shape, c.where)
    x = make_inputs(c, seed, affine=False)[0]
    if reference.layout(c.op, c.shape, **c.kw).to_rows(x).shape[1] < 2:  # one element: 0/0
        return
    y = call(c.op, x, eps=0.0, **c.kw)
    assert_close(call(c.op, scale * x + shift, eps=0.0, **c.kw), y, "float64", scale=1e4)


@given(shape=st.lists(st.integers(1, 4), min_size=3, max_size=5), channels=st.integers(1, 6),
       seed=st.integers(0, 100))
def test_group_norm_extremes(shape, channels, seed):
    """num_groups == C is instance norm; num_groups == 1 is layer norm over all non-batch axes."""
    shape[1] = channels
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal(shape), rng.standard_normal(channels), rng.standard_normal(channels)
    assert_close(anynorm.group_norm(x, channels, w, b), anynorm.instance_norm(x, w, b), "float64")
    expand = (channels,) + (1,) * (len(shape) - 2)
    full = lambda p: np.broadcast_to(p.reshape(expand), shape[1:])  # noqa: E731
    want = anynorm.layer_norm(x, full(w), full(b), axis=tuple(range(1, len(shape))))
    assert_close(anynorm.group_norm(x, 1, w, b), want, "float64")


@given(problem=problems(dtypes=("float64",)))
def test_rms_norm_of_centred_rows_is_layer_norm(problem):
    c, _, _, seed = problem
    if c.op not in ("layer_norm", "rms_norm"):
        return
    x = make_inputs(c, seed, affine=False)[0]
    centred = x - reference.forward("layer_norm", x, **c.kw)[1]
    assert_close(anynorm.rms_norm(centred, eps=1e-5, **c.kw), anynorm.layer_norm(x, **c.kw), "float64", scale=10)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@given(problem=problems())
def test_stats_rebuild_y(lib, problem):
    """y == (x - mean) * rstd * weight + bias with the returned statistics broadcast back."""
    b_ = get_backend(lib)
    c, dtype, _, seed = problem
    x64, w64, b64 = make_inputs(c, seed)
    x = b_.asarray(x64, dtype)
    out = call(c.op, x, b_.asarray(w64, dtype), None if b64 is None else b_.asarray(b64, dtype),
               return_stats=True, **c.kw)
    y = b_.to_numpy(out[0])
    lay = reference.layout(c.op, c.shape, **c.kw)
    rows = lay.to_rows(b_.to_numpy(x))
    mean = 0.0 if c.op == "rms_norm" else b_.to_numpy(out[1]).reshape(-1, 1)
    xhat = lay.from_rows((rows - mean) * b_.to_numpy(out[-1]).reshape(-1, 1))
    rebuilt = xhat * lay.param_full(w64) + (lay.param_full(b64) if has_bias(c.op) else 0)
    assert_close(y, rebuilt, dtype, scale=10)
