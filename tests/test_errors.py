"""Every error of the contract, on every backend, with a message naming the argument and the value."""

from __future__ import annotations

import numpy as np
import pytest

import anynorm
from support import call, call_backward, get_backend

RNG = np.random.default_rng(7)
X64 = RNG.standard_normal((2, 6, 4))


def arr(backend, data, dtype="float32"):
    """``data`` in this backend, any dtype (integer, bool and complex included)."""
    return backend.make_raw(np.asarray(data), dtype)


def foreign(backend, data):
    """``data`` as an array of another library than ``backend``'s."""
    if backend.name.startswith("numpy"):
        return get_backend("array-api-strict").asarray(data, "float32")
    return np.asarray(data, dtype=np.float32)


# (id, builder(backend) -> thunk, exception, regex the message must match)
FORWARD_ERRORS = [
    # TypeError: not an array, not a real floating dtype, mixed libraries
    ("x-list", lambda b: lambda: anynorm.layer_norm([[1.0, 2.0]]), TypeError, r"x must be an array.*list"),
    ("x-float", lambda b: lambda: anynorm.rms_norm(3.0), TypeError, r"x must be an array.*float"),
    ("x-none", lambda b: lambda: anynorm.group_norm(None, 1), TypeError, r"x must be an array.*None"),
    ("x-int", lambda b: lambda: anynorm.layer_norm(arr(b, X64, "int32")), TypeError, r"x.*floating.*int32"),
    ("x-bool", lambda b: lambda: anynorm.instance_norm(arr(b, X64 > 0, "bool")), TypeError, r"x.*floating.*bool"),
    ("x-complex", lambda b: lambda: anynorm.rms_norm(arr(b, X64, "complex64")), TypeError, r"x.*floating.*complex"),
    ("weight-int", lambda b: lambda: anynorm.layer_norm(arr(b, X64), arr(b, np.ones(4), "int32")),
     TypeError, r"weight.*floating.*int32"),
    ("bias-bool", lambda b: lambda: anynorm.group_norm(arr(b, X64), 2, None, arr(b, np.ones(6), "bool")),
     TypeError, r"bias.*floating.*bool"),
    ("weight-foreign", lambda b: lambda: anynorm.layer_norm(arr(b, X64), foreign(b, np.ones(4))),
     TypeError, r"weight must be an array of the same library as x"),
    ("bias-foreign", lambda b: lambda: anynorm.instance_norm(arr(b, X64), None, foreign(b, np.ones(6))),
     TypeError, r"bias must be an array of the same library as x"),
    ("residual-foreign", lambda b: lambda: anynorm.rms_norm(arr(b, X64), residual=foreign(b, X64)),
     TypeError, r"residual must be an array of the same library as x"),
    ("weight-list", lambda b: lambda: anynorm.layer_norm(arr(b, X64), [1.0] * 4), TypeError, r"weight.*list"),
    ("axis-float", lambda b: lambda: anynorm.layer_norm(arr(b, X64), axis=1.0), TypeError, r"axis.*1\.0"),
    ("num-groups-float", lambda b: lambda: anynorm.group_norm(arr(b, X64), 2.0), TypeError, r"num_groups.*2\.0"),
    ("num-groups-bool", lambda b: lambda: anynorm.group_norm(arr(b, X64), True), TypeError, r"num_groups"),
    ("eps-string", lambda b: lambda: anynorm.layer_norm(arr(b, X64), eps="1e-5"), TypeError, r"eps.*1e-5"),
    # ValueError: axes
    ("axis-out-of-range", lambda b: lambda: anynorm.layer_norm(arr(b, X64), axis=3), ValueError, r"axis=3"),
    ("axis-negative-out-of-range", lambda b: lambda: anynorm.rms_norm(arr(b, X64), axis=(-4, -1)),
     ValueError, r"axis=-4"),
    ("axis-repeated", lambda b: lambda: anynorm.layer_norm(arr(b, X64), axis=(2, -1)), ValueError,
     r"axis=\(2, -1\) repeats"),
    ("axis-empty", lambda b: lambda: anynorm.layer_norm(arr(b, X64), axis=()), ValueError, r"axis"),
    ("channel-axis-out-of-range", lambda b: lambda: anynorm.instance_norm(arr(b, X64), channel_axis=3),
     ValueError, r"channel_axis=3"),
    ("channel-axis-batch", lambda b: lambda: anynorm.group_norm(arr(b, X64), 2, channel_axis=-3),
     ValueError, r"channel_axis"),
    ("instance-norm-2d", lambda b: lambda: anynorm.instance_norm(arr(b, X64[:, :, 0])), ValueError,
     r"x.*\(2, 6\)"),
    ("group-norm-1d", lambda b: lambda: anynorm.group_norm(arr(b, X64[0, 0]), 1), ValueError, r"x.*\(4,\)"),
    # ValueError: parameter shapes
    ("weight-shape", lambda b: lambda: anynorm.layer_norm(arr(b, X64), arr(b, np.ones(6))), ValueError,
     r"weight must have shape \(4,\), got shape \(6,\)"),
    ("bias-shape", lambda b: lambda: anynorm.layer_norm(arr(b, X64), None, arr(b, np.ones((1, 4)))),
     ValueError, r"bias must have shape \(4,\), got shape \(1, 4\)"),
    ("weight-shape-unsorted-axes", lambda b: lambda: anynorm.layer_norm(arr(b, X64), arr(b, np.ones((4, 6))),
                                                                        axis=(2, 1)),
     ValueError, r"weight must have shape \(6, 4\)"),
    ("weight-shape-group-norm", lambda b: lambda: anynorm.group_norm(arr(b, X64), 3, arr(b, np.ones(3))),
     ValueError, r"weight must have shape \(6,\)"),
    ("weight-shape-channels-last", lambda b: lambda: anynorm.instance_norm(
        arr(b, X64), arr(b, np.ones(6)), channel_axis=-1), ValueError, r"weight must have shape \(4,\)"),
    ("residual-shape", lambda b: lambda: anynorm.layer_norm(arr(b, X64), residual=arr(b, X64[:1])),
     ValueError, r"residual.*\(1, 6, 4\)"),
    ("residual-dtype", lambda b: lambda: anynorm.layer_norm(arr(b, X64), residual=arr(b, X64, "float64")),
     ValueError, r"residual.*float64"),
    # ValueError: groups
    ("num-groups-zero", lambda b: lambda: anynorm.group_norm(arr(b, X64), 0), ValueError, r"num_groups.*got 0"),
    ("num-groups-negative", lambda b: lambda: anynorm.group_norm(arr(b, X64), -2), ValueError,
     r"num_groups.*got -2"),
    ("num-groups-not-divisor", lambda b: lambda: anynorm.group_norm(arr(b, X64), 4), ValueError,
     r"num_groups.*divisor.*6.*got 4"),
    ("num-groups-too-many", lambda b: lambda: anynorm.group_norm(arr(b, X64), 12), ValueError,
     r"num_groups.*got 12"),
    # ValueError: eps
    ("eps-negative", lambda b: lambda: anynorm.layer_norm(arr(b, X64), eps=-1e-5), ValueError, r"eps.*-1e-05"),
    ("eps-nan", lambda b: lambda: anynorm.rms_norm(arr(b, X64), eps=float("nan")), ValueError, r"eps.*nan"),
    ("eps-inf", lambda b: lambda: anynorm.group_norm(arr(b, X64), 2, eps=float("inf")), ValueError, r"eps.*inf"),
    # ValueError: empty normalized extent, 0-d x
    ("empty-extent", lambda b: lambda: anynorm.layer_norm(arr(b, np.ones((3, 0)))), ValueError,
     r"normalized.*empty|empty.*normalized"),
    ("empty-extent-instance", lambda b: lambda: anynorm.instance_norm(arr(b, np.ones((2, 3, 0)))), ValueError,
     r"normalized.*empty|empty.*normalized"),
    ("empty-channels-group", lambda b: lambda: anynorm.group_norm(arr(b, np.ones((2, 0, 3))), 1), ValueError,
     r"num_groups|normalized"),
    ("x-0d", lambda b: lambda: anynorm.layer_norm(arr(b, np.float32(1.0))), ValueError, r"x.*0-d"),
]

BACKWARD_ERRORS = [
    ("dy-shape", lambda b: lambda: anynorm.layer_norm_backward(arr(b, X64[0]), arr(b, X64)), ValueError,
     r"dy must have x's shape \(2, 6, 4\), got shape \(6, 4\)"),
    ("dy-int", lambda b: lambda: anynorm.rms_norm_backward(arr(b, X64, "int32"), arr(b, X64)), TypeError,
     r"dy.*floating.*int32"),
    ("dy-foreign", lambda b: lambda: anynorm.group_norm_backward(foreign(b, X64), arr(b, X64), 2), TypeError,
     r"dy must be an array of the same library"),
    ("x-int-backward", lambda b: lambda: anynorm.instance_norm_backward(arr(b, X64), arr(b, X64, "int32")),
     TypeError, r"x.*floating"),
    ("axis-backward", lambda b: lambda: anynorm.layer_norm_backward(arr(b, X64), arr(b, X64), axis=5),
     ValueError, r"axis=5"),
    ("groups-backward", lambda b: lambda: anynorm.group_norm_backward(arr(b, X64), arr(b, X64), 5),
     ValueError, r"num_groups.*got 5"),
    ("stats-count", lambda b: lambda: anynorm.layer_norm_backward(
        arr(b, X64), arr(b, X64), stats=(arr(b, np.ones((2, 6, 1))),)), ValueError, r"stats.*\(mean, rstd\)"),
    ("stats-shape", lambda b: lambda: anynorm.rms_norm_backward(
        arr(b, X64), arr(b, X64), stats=(arr(b, np.ones((2, 6))),)), ValueError,
     r"stats\[0\] must have shape \(2, 6, 1\)"),
    ("stats-foreign", lambda b: lambda: anynorm.group_norm_backward(
        arr(b, X64), arr(b, X64), 2, stats=(foreign(b, np.ones((2, 2))), arr(b, np.ones((2, 2))))), TypeError,
     r"stats\[0\]"),
    ("weight-shape-backward", lambda b: lambda: anynorm.instance_norm_backward(
        arr(b, X64), arr(b, X64), arr(b, np.ones(4))), ValueError, r"weight must have shape \(6,\)"),
    ("eps-backward", lambda b: lambda: anynorm.layer_norm_backward(arr(b, X64), arr(b, X64), eps=-1.0),
     ValueError, r"eps"),
]


@pytest.mark.parametrize("build, error, message", [e[1:] for e in FORWARD_ERRORS + BACKWARD_ERRORS],
                         ids=[e[0] for e in FORWARD_ERRORS + BACKWARD_ERRORS])
def test_error(backend, build, error, message):
    with pytest.raises(error, match=message):
        build(backend)()


def _other_device(backend):
    """An array on another device than the default one, or skip where the library has none."""
    if backend.name.startswith("torch"):
        import torch

        return lambda data: torch.asarray(np.asarray(data, np.float32), device="meta")
    if backend.name == "array-api-strict":
        xs = backend.xp
        return lambda data: xs.asarray(np.asarray(data, np.float32), device=xs.Device("device1"))
    pytest.skip(f"{backend.name} has a single device on this machine")


@pytest.mark.parametrize("role", ["weight", "bias", "residual"])
def test_arrays_on_different_devices(backend, role):
    elsewhere = _other_device(backend)
    x = arr(backend, X64)
    kw = {"residual": elsewhere(X64)} if role == "residual" else {role: elsewhere(np.ones(4))}
    with pytest.raises(ValueError, match=rf"{role} must be on the same device as x"):
        anynorm.layer_norm(x, **kw)


@pytest.mark.parametrize("layout", ["sparse_coo", "mkldnn"])
@pytest.mark.parametrize("role", ["x", "weight"])
def test_torch_layouts_without_strided_memory(role, layout):
    """A sparse or MKL-DNN tensor is a TypeError naming the argument (torch's kernels failed
    inside with 'unsupported memory format option Contiguous')."""
    torch = pytest.importorskip("torch")
    x, w = torch.randn(3, 4), torch.ones(4)
    convert = {"sparse_coo": lambda t: t.to_sparse(), "mkldnn": lambda t: t.to_mkldnn()}[layout]
    kw = {"x": convert(x), "weight": w} if role == "x" else {"x": x, "weight": convert(w)}
    for _ in range(2):  # the second call of the same signature too
        with pytest.raises(TypeError, match=rf"{role} must be a dense \(strided\) tensor, got layout"):
            anynorm.layer_norm(kw["x"], kw["weight"])
    with pytest.raises(TypeError, match=rf"{role} must be a dense"):
        anynorm.layer_norm_backward(x, kw["x"], kw["weight"])


@pytest.mark.parametrize("role", ["x", "weight"])
def test_numpy_masked_arrays(role):
    """np.ma arrays passed for NumPy ones: the data under the mask entered the statistics
    and np.ma masked the whole slice of the result."""
    x = np.random.default_rng(0).standard_normal((3, 4))
    masked = np.ma.masked_array(x, mask=np.eye(3, 4, dtype=bool))
    w = np.ma.masked_array(np.ones(4), mask=[True, False, False, False])
    args = (masked, None) if role == "x" else (x, w)
    for _ in range(2):
        with pytest.raises(TypeError, match=rf"{role} must not be a numpy.ma.MaskedArray"):
            anynorm.layer_norm(*args)


def test_dask_unknown_shape_is_a_clear_error():
    """Boolean indexing leaves Dask dimensions unknown (NaN): normalizing over such an axis
    needs its size, so say so, and what to do about it (tests/test_dask_unknown.py: the
    other axes work)."""
    da = pytest.importorskip("dask.array")
    x = da.from_array(X64, chunks=(1, 3, 2))
    with pytest.raises(ValueError, match=r"x must have known sizes on the axes it is normalized "
                                         r"over.*compute_chunk_sizes"):
        anynorm.layer_norm(x[x[:, 0, 0] > 0], axis=0)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "instance_norm", "group_norm"])
def test_errors_precede_any_work_on_empty_batches(backend, op):
    """A batch of size 0 is fine, but a wrong weight shape is still an error on it."""
    x = arr(backend, np.ones((0, 6, 4)))
    wrong = arr(backend, np.ones(5))
    kw = {"num_groups": 2} if op == "group_norm" else {}
    with pytest.raises(ValueError, match="weight"):
        call(op, x, wrong, **kw)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "instance_norm", "group_norm"])
def test_backward_checks_like_forward(backend, op):
    """The *_backward functions validate x/weight exactly as the forward does."""
    kw = {"num_groups": 4} if op == "group_norm" else {}
    x = arr(backend, X64)
    with pytest.raises(ValueError):
        call_backward(op, x, x, arr(backend, np.ones(7)), **kw)


@pytest.mark.parametrize("bad, error", [(True, TypeError), ((True,), TypeError), (1.0, TypeError),
                                        (np.int64(5), ValueError)], ids=repr)
def test_plan_cache_never_skips_validation(bad, error):
    """Plans are cached per arguments; ``True == 1`` and ``1.0 == 1`` must not hit the entry a
    valid ``axis=1`` call left there, and a rejected call leaves nothing behind."""
    x = np.ones((2, 3, 4), np.float32)
    anynorm.layer_norm(x, axis=1)
    with pytest.raises(error, match="axis"):
        anynorm.layer_norm(x, axis=bad)
    with pytest.raises(error, match="axis"):
        anynorm.layer_norm(x, axis=bad)


def test_plan_cache_keys_on_parameter_shapes():
    """A cached plan for ``weight`` of shape (4,) does not accept a (3,) weight later."""
    x = np.ones((2, 3, 4), np.float32)
    anynorm.layer_norm(x, np.ones(4, np.float32))
    with pytest.raises(ValueError, match=r"weight must have shape \(4,\)"):
        anynorm.layer_norm(x, np.ones(3, np.float32))
    assert anynorm.layer_norm(x, axis=[1, 2]).shape == (2, 3, 4)  # a list axis: uncached, fine
