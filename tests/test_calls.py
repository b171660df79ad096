"""The call-signature cache (``anynorm._calls``): one validation and plan per signature, a
new one for every change of library, shape, strides, dtype, device, keyword or parameter,
never a stale hit, and safe under threads."""

from __future__ import annotations


import numpy as np
import pytest

import anynorm
from anynorm import _calls
from reference import forward as reference_forward
from support import run_in_threads


@pytest.fixture
def planned(monkeypatch):
    """Counts the calls that were validated and planned (cache misses)."""
    _calls.clear()
    count = {"n": 0}
    make_plan = _calls.make_plan

    def counting(*args, **kwargs):
        count["n"] += 1
        return make_plan(*args, **kwargs)

    monkeypatch.setattr(_calls, "make_plan", counting)
    yield count
    _calls.clear()


def _close(y, x, **kw):
    want = reference_forward("layer_norm", np.asarray(x, dtype=np.float64), **kw)[0]
    np.testing.assert_allclose(np.asarray(y, dtype=np.float64), want, rtol=2e-5, atol=2e-5)


def test_repeat_calls_hit(planned):
    x = np.random.default_rng(0).standard_normal((6, 10)).astype(np.float32)
    w = np.ones(10, np.float32)
    for _ in range(5):
        _close(anynorm.layer_norm(x, w), x)
    assert planned["n"] == 1


def test_every_signature_component_misses(planned):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    w, b = np.ones(10, np.float32), np.zeros(10, np.float32)
    calls = [
        lambda: anynorm.layer_norm(x, w),
        lambda: anynorm.layer_norm(x.astype(np.float64), w),  # dtype
        lambda: anynorm.layer_norm(np.asfortranarray(x), w),  # strides
        lambda: anynorm.layer_norm(x[:3], w),  # shape
        lambda: anynorm.layer_norm(x, w.astype(np.float64)),  # parameter dtype
        lambda: anynorm.layer_norm(x, w, b),  # bias present
        lambda: anynorm.layer_norm(x, w, eps=1e-3),  # eps
        lambda: anynorm.layer_norm(x, w, return_stats=True),  # statistics wanted
        lambda: anynorm.layer_norm(x, w, residual=x),  # residual
        lambda: anynorm.layer_norm(x, axis=(0, 1)),  # axes
        lambda: anynorm.rms_norm(x, w),  # op
    ]
    for i, call in enumerate(calls):
        call()
        call()
        assert planned["n"] == i + 1, i
    with anynorm.use_backend("reference"):  # backend
        anynorm.layer_norm(x, w)
    assert planned["n"] == len(calls) + 1


def test_no_stale_reuse_across_strides_and_libraries(planned):
    """The same shape with other strides or another library gets its own, correct result."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    base = rng.standard_normal((8, 12)).astype(np.float32) * 3 + 1
    x = base[:, :6]  # (8, 6), rows 12 apart
    xc = np.ascontiguousarray(base[:, 6:])
    xt = np.ascontiguousarray(base[:6, :8]).T  # (8, 6), transposed memory
    for arr in (x, xc, xt, x, xc):
        _close(anynorm.layer_norm(arr), arr)
    for arr in (torch.from_numpy(xc), torch.from_numpy(xt), torch.from_numpy(xc).to(torch.float64)):
        y = anynorm.layer_norm(arr)
        assert isinstance(y, torch.Tensor) and y.dtype == arr.dtype and y.shape == arr.shape
        _close(y.numpy(), arr.numpy())
    assert planned["n"] == 6


def test_validation_is_not_skipped_by_a_hit(planned):
    x = np.ones((4, 8), np.float32)
    anynorm.layer_norm(x, np.ones(8, np.float32), eps=1)
    with pytest.raises(ValueError, match="weight must have shape"):
        anynorm.layer_norm(x, np.ones(7, np.float32), eps=1)
    with pytest.raises(TypeError, match="eps must be a float"):
        anynorm.layer_norm(x, np.ones(8, np.float32), eps=True)  # True == 1, but no float
    anynorm.layer_norm(x, axis=(0, 1))
    with pytest.raises(TypeError, match="axis must be an int"):
        anynorm.layer_norm(x, axis=(0, True))
    with pytest.raises(TypeError, match="same library"):
        anynorm.layer_norm(x, [1.0] * 8)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="same library"):
        anynorm.layer_norm(x, torch.ones(8))


def test_backward_calls_hit_and_check(planned):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    dy = rng.standard_normal((5, 7)).astype(np.float32)
    w = np.ones(7, np.float32)
    _, mean, rstd = anynorm.layer_norm(x, w, return_stats=True)
    first = anynorm.layer_norm_backward(dy, x, w, stats=(mean, rstd))
    again = anynorm.layer_norm_backward(dy, x, w, stats=(mean, rstd))
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert planned["n"] == 2
    with pytest.raises(ValueError, match="dy must have"):
        anynorm.layer_norm_backward(dy[:4], x, w, stats=(mean, rstd))
    with pytest.raises(ValueError, match=r"stats\[1\] must have shape"):
        anynorm.layer_norm_backward(dy, x, w, stats=(mean, rstd[:2]))


def test_signature_keys_device_and_library():
    torch = pytest.importorskip("torch")
    t = torch.ones(3, 4)
    (kind, sig), = _calls.signature(t)
    assert kind is torch.Tensor and sig == (t.shape, t.stride(), t.dtype, torch.device("cpu"))
    assert _calls.signature(t) == _calls.signature(t)  # the inlined key once the type is known
    (kind, sig), = _calls.signature(np.ones((3, 4), np.float32))
    assert kind is np.ndarray and sig[1] == (16, 4)
    assert _calls.signature([1.0, 2.0]) is None  # not an array: the uncached path reports it


def test_threads_share_the_cache(planned):
    """8 threads calling at once, on shapes some of them share: every result right."""
    rng = np.random.default_rng(4)
    inputs = [rng.standard_normal((4 + i % 3, 16)).astype(np.float32) * (i + 1) for i in range(8)]
    wants = [reference_forward("layer_norm", x.astype(np.float64))[0] for x in inputs]

    def work(i):
        for _ in range(50):
            got = anynorm.layer_norm(inputs[i])
            np.testing.assert_allclose(got, wants[i], rtol=2e-5, atol=2e-5)

    run_in_threads(work, 8)
    assert 3 <= planned["n"] <= 8  # three shapes; threads that missed together may each plan
