"""Forward parity: every backend and dtype against the float64 reference and torch.nn.functional."""

from __future__ import annotations

import numpy as np
import pytest

import anynorm
import reference
from support import (CASES, FLOAT_DTYPES, TOLERANCE, assert_close, call, call_backward, case, default_eps,
                     get_backend, make_inputs, stats_dtype, torch_functional)


def run_and_compare(backend, c, dtype, *, affine=True, eps=None, weight_dtype=None, seed=0):
    """Run ``c`` on ``backend`` in ``dtype`` and check y and the statistics against the reference."""
    x64, w64, b64 = make_inputs(c, seed, affine=affine)
    x = backend.asarray(x64, dtype)
    pdtype = weight_dtype or dtype
    w = None if w64 is None else backend.asarray(w64, pdtype)
    b = None if b64 is None else backend.asarray(b64, pdtype)
    kw = {} if eps is None else {"eps": eps}
    out = call(c.op, x, w, b, return_stats=True, **c.kw, **kw)
    y, stats = out[0], out[1:]
    ref_eps = default_eps(c.op, dtype) if eps is None else eps
    ref_y, ref_mean, ref_rstd = reference.forward(
        c.op, backend.to_numpy(x), backend.to_numpy(w), backend.to_numpy(b), eps=ref_eps, **c.kw)
    ref_stats = (ref_rstd,) if c.op == "rms_norm" else (ref_mean, ref_rstd)

    backend.check(y, c.shape, dtype)
    assert_close(backend.to_numpy(y), ref_y, dtype, scale=4, what="y")
    assert len(stats) == len(ref_stats)
    for got, want in zip(stats, ref_stats):
        backend.check(got, want.shape, stats_dtype(dtype))
        # rstd is O(1/std): compare relatively; mean absolutely at the data's scale
        assert_close(backend.to_numpy(got), want, stats_dtype(dtype), scale=4, what="statistics")
    if backend.lazy:
        assert y.numblocks != (1,) * y.ndim or x.numblocks == (1,) * x.ndim, "dask result lost its chunks"
    return x, y


@pytest.mark.matrix
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("c", CASES, ids=str)
def test_forward_matches_reference(backend, c, dtype):
    run_and_compare(backend, c, dtype)


@pytest.mark.parametrize("c", CASES, ids=str)
@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_reference_executor_matches_reference(lib, c):
    """The array-API core (``use_backend("reference")``) gives the same answers on NumPy and torch."""
    with anynorm.use_backend("reference"):
        run_and_compare(get_backend(lib), c, "float32")


@pytest.mark.parametrize("affine", ["none", "weight_only"])
@pytest.mark.parametrize("c", CASES[::3], ids=str)
def test_without_affine_parameters(backend, c, affine):
    """``weight=None`` (and ``bias=None``) mean 1 and 0."""
    x64, w64, _ = make_inputs(c)
    x = backend.asarray(x64, "float64")
    w = backend.asarray(w64, "float64") if affine == "weight_only" else None
    y = call(c.op, x, w, None, **c.kw)
    ref = reference.forward(c.op, x64, w64 if affine == "weight_only" else None, **c.kw)[0]
    assert_close(backend.to_numpy(y), ref, "float64")


@pytest.mark.parametrize("x_dtype,w_dtype", [("float32", "float16"), ("float16", "float32"),
                                             ("float64", "float32"), ("float32", "float64")])
@pytest.mark.parametrize("c", [CASES[0], CASES[10], CASES[15]], ids=str)
def test_parameters_of_another_dtype(backend, c, x_dtype, w_dtype):
    """weight/bias of another float dtype are used as given; y keeps x's dtype (as torch's autocast does)."""
    run_and_compare(backend, c, x_dtype, weight_dtype=w_dtype)


@pytest.mark.parametrize("c", CASES[::2], ids=str)
def test_eps_zero_is_allowed(backend, c):
    run_and_compare(backend, c, "float64", eps=0.0)


@pytest.mark.parametrize("eps", [0.0, 1e-2, 3])
def test_eps_is_inside_the_square_root(backend, eps):
    """A large eps changes rstd to 1/sqrt(var + eps), not 1/(std + eps)."""
    run_and_compare(backend, case("layer_norm", (3, 4)), "float64", eps=eps)
    run_and_compare(backend, case("group_norm", (2, 4, 3), num_groups=2), "float64", eps=eps)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rms_norm_default_eps_is_machine_epsilon(backend, dtype):
    """``eps=None`` is finfo(x.dtype).eps: visible on rows whose mean square is ~1e-6."""
    c = case("rms_norm", (3, 16))
    x64 = 1e-3 * np.random.default_rng(1).standard_normal(c.shape)
    x = backend.asarray(x64, dtype)
    y, rstd = anynorm.rms_norm(x, return_stats=True)
    ref_y, _, ref_rstd = reference.forward("rms_norm", backend.to_numpy(x), eps=float(np.finfo(dtype).eps))
    assert_close(backend.to_numpy(rstd), ref_rstd, dtype)
    assert_close(backend.to_numpy(y), ref_y, dtype)
    # and with eps=1e-5 the answer is clearly different
    other = anynorm.rms_norm(x, eps=1e-5)
    assert np.max(np.abs(backend.to_numpy(other) - ref_y)) > 1e-2


@pytest.mark.parametrize("c", [
    case("layer_norm", (0, 5)),
    case("layer_norm", (2, 0, 5), axis=-1),
    case("rms_norm", (0, 3, 4), axis=(1, 2)),
    case("instance_norm", (0, 3, 4)),
    case("group_norm", (0, 6, 2), num_groups=3),
    case("group_norm", (0, 4, 2, 2), num_groups=2, channel_axis=-1),
], ids=str)
def test_empty_batch_gives_empty_result(backend, c):
    """A batch of size 0 is not an error: y (and the stats) are empty with the right shapes."""
    x64, w64, b64 = make_inputs(c)
    x = backend.asarray(x64, "float32")
    w, b = (None if p is None else backend.asarray(p, "float32") for p in (w64, b64))
    out = call(c.op, x, w, b, return_stats=True, **c.kw)
    _, ref_mean, ref_rstd = reference.forward(c.op, x64, **c.kw)
    backend.check(out[0], c.shape, "float32")
    assert backend.to_numpy(out[0]).size == 0
    assert tuple(out[-1].shape) == ref_rstd.shape
    # and the backward: empty dx, parameter gradients that sum over nothing
    dx, dw, db = call_backward(c.op, x, x, w, **c.kw)
    backend.check(dx, c.shape, "float32")
    assert np.all(backend.to_numpy(dw) == 0) and tuple(dw.shape) == c.param_shape
    assert db is None if c.op == "rms_norm" else np.all(backend.to_numpy(db) == 0)


@pytest.mark.parametrize("axis", [-1, (0, 1), [1], (-2,)])
def test_rank_two_and_list_axes(backend, axis):
    run_and_compare(backend, case("layer_norm", (5, 6), axis=axis), "float32")


@pytest.mark.parametrize("axis, eps", [(np.int64(-1), np.float32(1e-3)), ((np.int32(1),), 1), ([-1], np.float64(0.5))],
                         ids=["numpy-scalars", "int-eps", "list-axis"])
def test_numpy_scalars_and_ints_are_accepted(backend, axis, eps):
    """axis may hold NumPy integers, eps may be an int or a NumPy float, as NumPy users expect."""
    run_and_compare(backend, case("layer_norm", (3, 5), axis=axis), "float64", eps=float(eps))
    x = backend.asarray(np.arange(15.0).reshape(3, 5))
    y = anynorm.layer_norm(x, axis=axis, eps=eps)
    ref = reference.forward("layer_norm", np.arange(15.0).reshape(3, 5), eps=float(eps), axis=axis)[0]
    assert_close(backend.to_numpy(y), ref, "float64")


# --- strided and non-contiguous inputs: executors that look at strides must get them right ----

def _strided_views(b, base):
    """Views of ``base`` in backend ``b`` whose memory is not one C-contiguous block."""
    if b.name.startswith("numpy"):
        base = b.asarray(base, "float32")
        return {"transposed": base.T, "sliced": base[:, ::2], "reversed": base[::-1, :, ::-1],
                "fortran": np.asfortranarray(base), "broadcast": np.broadcast_to(base[:1], base.shape)}
    torch = b.xp
    t = b.asarray(base, "float32")
    return {"transposed": t.permute(2, 1, 0), "sliced": t[:, ::2], "reversed": t.flip(0),
            "expanded": t[:1].expand(3, -1, -1), "channels_last": t.unsqueeze(0).contiguous(
                memory_format=torch.channels_last).squeeze(0)}


@pytest.mark.parametrize("lib", ["numpy", "numpy-readonly", "torch", "torch-autograd"])
@pytest.mark.parametrize("op, where", [
    ("layer_norm", {}), ("layer_norm", {"axis": (1, 2)}), ("rms_norm", {"axis": (0, 2)}),
    ("instance_norm", {}), ("group_norm", {"num_groups": 2, "channel_axis": -1}),
], ids=str)
def test_non_contiguous_inputs(lib, op, where):
    """Transposed, sliced, reversed, broadcast and channels-last views give the reference's answer,
    forward and backward (executors that look at strides must get them right)."""
    b = get_backend(lib)
    base = np.random.default_rng(3).standard_normal((3, 4, 6))
    for name, x in _strided_views(b, base).items():
        if op == "group_norm" and x.shape[-1] % 2:
            continue
        x_np = b.to_numpy(x)
        y = call(op, x, **where)
        assert tuple(y.shape) == tuple(x.shape)
        assert_close(b.to_numpy(y), reference.forward(op, x_np, **where)[0], "float32", what=name)
        dy = x[..., ::-1] if lib.startswith("numpy") else x.flip(-1)  # a strided dy as well
        dx = call_backward(op, dy, x, **where)[0]
        want = reference.backward(op, b.to_numpy(dy), x_np, **where)[0]
        assert_close(b.to_numpy(dx), want, "float32", scale=10, what=f"dx, {name}")


# --- the second oracle: torch.nn.functional ---------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("c", CASES, ids=str)
def test_matches_torch_functional(c, dtype):
    """Same data through torch.nn.functional (axes moved where torch wants them)."""
    torch = pytest.importorskip("torch")
    tb = get_backend("torch")
    x64, w64, b64 = make_inputs(c)
    x, w = tb.asarray(x64, dtype), tb.asarray(w64, dtype)
    b = None if b64 is None else tb.asarray(b64, dtype)
    ours = call(c.op, x, w, b, **c.kw)
    theirs = torch_functional(c.op, x, w, b, **c.kw)
    assert ours.dtype == theirs.dtype == getattr(torch, dtype)
    # torch rounds its bfloat16 statistics; allow both results their own rounding
    assert_close(tb.to_numpy(ours), tb.to_numpy(theirs), dtype, scale=4)


@pytest.mark.parametrize("c", [c for c in CASES if c.op in ("layer_norm", "group_norm", "instance_norm")],
                         ids=str)
def test_statistics_match_torch_natives(c):
    """mean and rstd equal what torch.native_layer_norm / native_group_norm return."""
    torch = pytest.importorskip("torch")
    x64, _, _ = make_inputs(c)
    x = torch.asarray(x64)
    _, mean, rstd = call(c.op, x, return_stats=True, **c.kw)
    kw = c.kw
    if c.op == "layer_norm":
        axes = sorted(a % x.ndim for a in (kw["axis"] if isinstance(kw.get("axis", -1), (tuple, list))
                                             else (kw.get("axis", -1),)))
        kept = [a for a in range(x.ndim) if a not in axes]
        moved = x.permute(*kept, *axes)
        _, tmean, trstd = torch.native_layer_norm(moved, [x.shape[a] for a in axes], None, None, 1e-5)
    else:
        moved = torch.movedim(x, kw.get("channel_axis", 1), 1).contiguous()
        n, ch = moved.shape[:2]
        groups = kw.get("num_groups", ch)
        _, tmean, trstd = torch.native_group_norm(moved, None, None, n, ch, moved[0, 0].numel(), groups, 1e-5)
    np.testing.assert_allclose(mean.numpy().ravel(), tmean.numpy().ravel(), rtol=TOLERANCE["float64"])
    np.testing.assert_allclose(rstd.numpy().ravel(), trstd.numpy().ravel(), rtol=TOLERANCE["float64"])


# --- the caller's arrays are never modified ----------------------------------------------------

def _snapshot(backend, arrays):
    return [(backend.to_numpy(a), getattr(a, "_version", None)) for a in arrays]


@pytest.mark.parametrize("c", [CASES[0], CASES[2], CASES[8], CASES[12], CASES[16]], ids=str)
def test_inputs_are_never_modified(backend, c):
    """x, weight, bias, residual, dy and stats keep their values (and torch version counters)
    through the forward and the backward; NumPy outputs share no memory with the inputs."""
    x64, w64, b64 = make_inputs(c)
    x, w = backend.asarray(x64, "float32"), backend.asarray(w64, "float32")
    b = None if b64 is None else backend.asarray(b64, "float32")
    dy = backend.asarray(np.random.default_rng(4).standard_normal(c.shape), "float32")
    extra = {"residual": backend.asarray(-x64, "float32")} if c.op in ("layer_norm", "rms_norm") else {}
    given = [a for a in (x, w, b, dy, *extra.values()) if a is not None]
    before = _snapshot(backend, given)

    out = call(c.op, x, w, b, return_stats=True, **extra, **c.kw)
    stats = out[2:] if extra else out[1:]
    stats_before = _snapshot(backend, stats)
    grads = call_backward(c.op, dy, x, w, stats=stats, **c.kw)

    for (value, version), arr in zip(before + stats_before, given + list(stats)):
        np.testing.assert_array_equal(backend.to_numpy(arr), value)
        assert getattr(arr, "_version", None) == version
    if backend.name.startswith("numpy"):
        for result in (*out, *grads):
            if result is not None:
                assert not any(np.shares_memory(result, a) for a in given)


# --- large inputs: blocked and multi-threaded executors cut these into many pieces ------------

@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("c", [
    case("layer_norm", (1200, 1024)),
    case("layer_norm", (96, 100, 130), axis=0),
    case("rms_norm", (40, 300, 100), axis=1),
    case("layer_norm", (8, 96, 40, 41), axis=(1, 3)),
    case("instance_norm", (4, 50, 64, 96), channel_axis=-1),
    case("group_norm", (6, 64, 55, 60), num_groups=8),
], ids=str)
def test_large_inputs(lib, c):
    """~1.2M elements: more than one cache-sized block and enough for several threads."""
    b = get_backend(lib)
    x64, w64, b64 = make_inputs(c, 21)
    x, w = b.asarray(x64, "float32"), b.asarray(w64, "float32")
    bias = None if b64 is None else b.asarray(b64, "float32")
    x_np, w_np = b.to_numpy(x), b.to_numpy(w)
    y = call(c.op, x, w, bias, **c.kw)
    eps = default_eps(c.op, "float32")
    assert_close(b.to_numpy(y), reference.forward(c.op, x_np, w_np, b.to_numpy(bias), eps=eps, **c.kw)[0],
                 "float32", scale=4)
    dy = b.asarray(np.random.default_rng(22).standard_normal(c.shape), "float32")
    got = call_backward(c.op, dy, x, w, **c.kw)
    want = reference.backward(c.op, b.to_numpy(dy), x_np, w_np, eps=eps, **c.kw)
    for name, g, r in zip(("dx", "dweight", "dbias"), got, want):
        if g is not None:
            # dweight/dbias sum ~1e6/len(weight) products: float32 summation error grows with that count
            scale = 4 if name == "dx" else 4 * np.sqrt(np.prod(c.shape) / r.size)
            assert_close(b.to_numpy(g), r, "float32", scale=scale, what=name)
