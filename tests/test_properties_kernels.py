"""Hypothesis sweep through anynorm's compiled CPU kernels (``kernels/cpu.cpp``).

The plain sweep (``test_properties.py``) draws arrays of at most 1024 elements, which the
NumPy executor hands to plain NumPy (``_numpy.SMALL_ELEMENTS``, ``SMALL_BACKWARD_ELEMENTS``)
and torch to its own kernels, so it never reaches the row and column kernels. Here those
floors are 1 and torch's training route takes the kernels at every size, so random ranks,
axis sets, channel axes, groups, dtypes, parameters and offsets run the kernels wherever
their layouts take the call (and the NumPy passes elsewhere), forward and backward, against
the float64 reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import reference
from support import assert_close, call, call_backward, default_eps, get_backend, make_inputs, param_shape
from test_properties import check_against_reference, problems

from anynorm import _native, _numpy, _torch_cpu_grad
from anynorm._calls import clear

pytestmark = pytest.mark.skipif(_native._compiler() is None, reason="no C++ compiler on this host")

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _every_size(mp):
    """The kernels for arrays of any size: no small-call floor, torch's training rule off."""
    mp.setattr(_numpy, "SMALL_ELEMENTS", 1)
    mp.setattr(_numpy, "SMALL_BACKWARD_ELEMENTS", 1)
    mp.setattr(_torch_cpu_grad, "TRAINING_ROWS_MIN_ELEMENTS", 0)
    mp.setattr(_torch_cpu_grad, "TRAINING_CHANNELS_LAST_MIN_ELEMENTS", 0)


@given(problem=problems(dtypes=DTYPES, max_size=9), direct=st.booleans())
def test_sweep_numpy_through_the_kernels(problem, direct):
    """NumPy calls on the kernels: straight (``anynorm._numpy_direct``, a signature's runner)
    or through the executor's blocking (``direct`` False: that path off)."""
    b = get_backend("numpy")
    c, dtype, affine, seed = problem
    if dtype not in b.dtypes:
        dtype = "float32"
    with pytest.MonkeyPatch.context() as mp:
        _every_size(mp)
        if not direct:
            mp.setattr(_numpy, "DIRECT_MAX_ELEMENTS", 0)
        clear()
        check_against_reference(b, c, dtype, affine, seed)
    clear()


@given(problem=problems(dtypes=("float32", "float64"), max_size=9), offset=st.sampled_from([0.0, 1e4]))
def test_sweep_far_from_zero_through_the_kernels(problem, offset):
    """Slices offset by 1e4 keep float32 rounding in y and in every gradient (the kernels'
    shifted sums), where a one-pass variance would lose four digits."""
    c, dtype, affine, seed = problem
    x64, w64, b64 = make_inputs(c, seed, affine=affine, offset=offset, scale=1.0)
    x = x64.astype(dtype)
    w, bias = (None if p is None else p.astype(dtype) for p in (w64, b64))
    dy = np.random.default_rng(seed + 1).standard_normal(c.shape).astype(dtype)
    eps = default_eps(c.op, dtype)
    with pytest.MonkeyPatch.context() as mp:
        _every_size(mp)
        y = call(c.op, x, w, bias, **c.kw)
        grads = call_backward(c.op, dy, x, w, **c.kw)
    xr = x.astype(np.float64)
    ref_y = reference.forward(c.op, xr, w64 if w is None else w.astype(np.float64),
                              None if bias is None else bias.astype(np.float64), eps=eps, **c.kw)[0]
    assert_close(y.astype(np.float64), ref_y, dtype, scale=4, what=f"{c} at offset {offset}")
    ref_grads = reference.backward(c.op, dy.astype(np.float64), xr, None if w is None else w.astype(np.float64),
                                   eps=eps, **c.kw)
    n = float(np.prod(c.shape))
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, ref_grads):
        if r is not None and g is not None:
            assert_close(np.asarray(g, dtype=np.float64), r, dtype, scale=10 * n ** 0.5,
                         what=f"{name} of {c} at offset {offset}")


@given(problem=problems(dtypes=("bfloat16", "float32", "float64"), max_size=9))
def test_sweep_torch_autograd_through_the_kernels(problem):
    """torch CPU tensors that require grad: forward and autograd's backward on the kernels
    (``_torch_cpu_grad``) wherever their layouts take the call, against the reference."""
    torch = pytest.importorskip("torch")
    c, dtype, affine, seed = problem
    x64, w64, b64 = make_inputs(c, seed, affine=affine)
    tdtype = getattr(torch, dtype)
    x = torch.tensor(x64, dtype=tdtype, requires_grad=True)
    w, bias = (None if p is None else torch.tensor(p, dtype=tdtype, requires_grad=True) for p in (w64, b64))
    dy = torch.tensor(np.random.default_rng(seed + 1).standard_normal(c.shape), dtype=tdtype)
    with pytest.MonkeyPatch.context() as mp:
        _every_size(mp)
        y = call(c.op, x, w, bias, **c.kw)
        y.backward(dy)
    eps = default_eps(c.op, dtype)

    def f64(t):
        return None if t is None else t.detach().double().numpy()

    ref_y = reference.forward(c.op, f64(x), f64(w), f64(bias), eps=eps, **c.kw)[0]
    assert_close(f64(y), ref_y, dtype, scale=4, what=str(c))
    ref_grads = reference.backward(c.op, f64(dy), f64(x), f64(w), eps=eps, **c.kw)
    n = float(np.prod(c.shape))
    for name, t, r in zip(("dx", "dweight", "dbias"), (x, w, bias), ref_grads):
        if r is not None and t is not None:
            assert_close(f64(t.grad), r, dtype, scale=10 * n ** 0.5, what=f"{name} of {c}")


@pytest.mark.parametrize("op,shape,kw,kind", [
    ("layer_norm", (5, 9), {}, "rows"),
    ("layer_norm", (3, 7, 4, 4), {"axis": 1}, "cols"),
    ("group_norm", (2, 4, 3, 5), {"num_groups": 2}, "rows"),
    ("instance_norm", (2, 3, 5, 6), {"channel_axis": -1}, "cols"),
])
def test_the_sweep_reaches_the_kernels(op, shape, kw, kind, monkeypatch):
    """With the floors the sweep sets, small calls of each kernel layout do run the compiled
    forward and backward (so the sweep above is a test of them)."""
    called = []
    lookup = _native._kernel

    def counting(kernel_kind, dtype, *prefix):
        fn = lookup(kernel_kind, dtype, *prefix)
        if fn is None:
            return None

        def run(*args):
            called.append(kernel_kind)
            return fn(*args)
        return run

    _every_size(monkeypatch)
    monkeypatch.setattr(_native, "_kernel", counting)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w = np.ones(param_shape(op, shape, **kw), np.float32)
    call(op, x, w, w, **kw)
    call_backward(op, x, x, w, **kw)
    assert {kind, f"{kind}_packed"} & set(called) and f"{kind}_bwd" in called, called


@given(problem=problems(dtypes=DTYPES, max_size=9), far=st.booleans())
def test_sweep_backward_with_the_forwards_statistics(problem, far):
    """``*_backward(..., stats=...)`` with what ``return_stats`` gave, through the kernels
    (their given-statistics mode) and the NumPy passes, against the float64 reference; float32
    and float64 also at offset 1e4, where xhat about the rounded mean alone was 30x off."""
    c, dtype, affine, seed = problem
    b = get_backend("numpy")
    if dtype not in b.dtypes:
        dtype = "float32"
    offset = 1e4 if far and dtype in ("float32", "float64") else 0.0
    x64, w64, _ = make_inputs(c, seed, affine=affine, offset=offset, scale=1.0)
    x = b.asarray(x64, dtype)
    w = None if w64 is None else b.asarray(w64, dtype)
    dy = b.asarray(np.random.default_rng(seed + 1).standard_normal(c.shape), dtype)
    eps = default_eps(c.op, dtype)
    with pytest.MonkeyPatch.context() as mp:
        _every_size(mp)
        out = call(c.op, x, w, None, return_stats=True, **c.kw)
        stats = out[1:]
        grads = call_backward(c.op, dy, x, w, stats=stats, **c.kw)
    f64 = [None if a is None else b.to_numpy(a).astype(np.float64) for a in (dy, x, w)]
    ref = reference.backward(c.op, *f64, eps=eps, **c.kw)
    n = float(np.prod(c.shape))
    for name, g, r in zip(("dx", "dweight", "dbias"), grads, ref):
        if r is not None and g is not None:
            assert_close(b.to_numpy(g).astype(np.float64), r, dtype, scale=4 if name == "dx" else 10 * n ** 0.5,
                         what=f"{name} of {c} at offset {offset}, statistics given")
