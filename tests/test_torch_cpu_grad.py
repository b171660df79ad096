"""torch CPU calls on anynorm's CPU kernels: the autograd route (``anynorm/_torch_cpu_grad.py``,
forward by the NumPy executor, backward by the row backward kernel), the explicit backward on
bfloat16 tensors, and a module's parameters reaching the kernels without autograd."""

from __future__ import annotations

import numpy as np
import pytest

import reference

torch = pytest.importorskip("torch")
import anynorm  # noqa: E402
import anynorm.nn  # noqa: E402
from anynorm import _native, _torch, _torch_cpu_grad  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
# (op, shape, keyword arguments): every layout the route takes
CASES = [
    ("layer_norm", (64, 300), {}),
    ("layer_norm", (8, 5, 60), {"axis": (1, 2)}),
    ("group_norm", (4, 12, 9, 7), {"num_groups": 3}),
    ("instance_norm", (3, 5, 50), {}),
]
IDS = [f"{op} {'x'.join(map(str, shape))}" for op, shape, _ in CASES]


@pytest.fixture
def kernel_route(monkeypatch):
    """Every call in the test sent to anynorm's kernels, as outputs of FAULTING_BYTES are."""
    if _native.rows_backward_kernel(np.float32) is None:
        pytest.skip("anynorm's CPU kernels are not built here")
    monkeypatch.setattr(_torch, "_prefers_native", lambda plan, x: False)
    monkeypatch.setattr(_torch_cpu_grad, "TRAINING_ROWS_MIN_ELEMENTS", 0)  # short rows too
    anynorm._calls.clear()
    yield
    anynorm._calls.clear()


def _inputs(op, shape, kw, dtype, affine=True, offset=2.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (offset + 3 * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    pshape = shape[1:2] if op in ("group_norm", "instance_norm") else tuple(shape[a] for a in np.atleast_1d(kw.get("axis", -1)))
    pdtype = torch.float64 if dtype is torch.float64 else torch.float32
    w = (torch.rand(pshape, generator=gen, dtype=pdtype) + 0.5) if affine else None
    b = torch.randn(pshape, generator=gen, dtype=pdtype) if affine else None
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, b, dy


def _call(op, x, w, b, kw, **extra):
    if op == "group_norm":
        rest = {k: v for k, v in kw.items() if k != "num_groups"}
        return anynorm.group_norm(x, kw["num_groups"], w, b, eps=1e-5, **rest, **extra)
    return getattr(anynorm, op)(x, w, b, eps=1e-5, **{**kw, **extra})


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1.0))


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("op,shape,kw", CASES, ids=IDS)
def test_gradients_match_float64(op, shape, kw, dtype, affine, kernel_route):
    """y, dx, dweight and dbias of the kernel route against float64 on the same inputs."""
    x, w, b, dy = _inputs(op, shape, kw, dtype, affine)
    leaves = [t for t in (x, w, b) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    y = _call(op, x, w, b, kw)
    assert type(y.grad_fn).__name__ == "_KernelNormBackward"
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    as64 = lambda t: None if t is None else t.detach().double().numpy()  # noqa: E731
    where = {"num_groups": kw.get("num_groups"), "axis": kw.get("axis", -1)}
    exact_y = reference.forward(op, as64(x), as64(w), as64(b), eps=1e-5, **where)[0]
    exact = reference.backward(op, as64(dy), as64(x), as64(w), eps=1e-5, **where)
    tol = {torch.float32: 64 * EPS32, torch.bfloat16: 2.0 ** -7, torch.float64: 1e-12}[dtype]
    assert _rel(y.detach().double(), exact_y) <= tol
    assert _rel(x.grad.double(), exact[0]) <= tol
    if affine:
        assert w.grad.dtype == w.dtype and b.grad.dtype == b.dtype
        # the parameters' gradients are float32 sums for 16-bit x, float64 for float64
        param_tol = 1e-12 if dtype is torch.float64 else max(tol, 64 * EPS32)
        assert _rel(w.grad, exact[1]) <= param_tol
        assert _rel(b.grad, exact[2]) <= param_tol


@pytest.mark.parametrize("op,shape,kw", CASES, ids=IDS)
def test_double_backward_and_gradcheck(op, shape, kw, kernel_route):
    """float64: gradcheck and gradgradcheck (a backward that builds a graph runs torch
    operations autograd differentiates)."""
    small = tuple(min(s, 6) for s in shape[:-1]) + (min(shape[-1], 10),)
    if op == "group_norm":
        small = (2, 6, 3, 4)
    x, w, b, _ = _inputs(op, small, kw, torch.float64)
    args = [t.requires_grad_(True) for t in (x, w, b)]
    fn = lambda x, w, b: _call(op, x, w, b, kw)  # noqa: E731
    assert type(fn(*args).grad_fn).__name__ == "_KernelNormBackward"
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


def test_statistics_are_not_differentiable_and_only_wanted_gradients_come(kernel_route):
    x, w, b, dy = _inputs("layer_norm", (64, 300), {}, torch.float32)
    w.requires_grad_(True)
    y, mean, rstd = anynorm.layer_norm(x, w, b, return_stats=True)
    assert y.requires_grad and not mean.requires_grad and not rstd.requires_grad
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (64, 1)
    y.backward(dy)
    assert x.grad is None and b.grad is None
    exact = reference.backward("layer_norm", dy.double().numpy(), x.double().numpy(), w.detach().double().numpy(),
                               eps=1e-5)
    assert _rel(w.grad, exact[1]) <= 64 * EPS32


def test_gradient_of_any_memory_layout_reaches_the_kernel(kernel_route):
    """dy as autograd hands it: expanded (``y.sum()``), strided (a slice of y), contiguous."""
    x, w, b, _ = _inputs("layer_norm", (64, 300), {}, torch.float32)
    x.requires_grad_(True)
    grads = []
    for loss in (lambda y: y.sum(), lambda y: y[:, ::2].sum(), lambda y: (y * y).sum()):
        x.grad = None
        y = anynorm.layer_norm(x, w, b)
        loss(y).backward()
        grads.append(x.grad.clone())
        xr = x.detach().clone().requires_grad_(True)
        loss(torch.nn.functional.layer_norm(xr, (300,), w, b, 1e-5)).backward()
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)


def test_route_takes_the_kernels_layouts_and_declines_the_rest():
    """Rows (short ones from TRAINING_ROWS_MIN_ELEMENTS), channels-first layer norm, NCHW and
    NHWC group norm (from TRAINING_CHANNELS_LAST_MIN_ELEMENTS) with a gradient to record are
    taken; smaller short-row and NHWC calls, channels-last memory (not C-contiguous), a residual, a bias without weight, RMS
    norm (its own blocked autograd), strided x and no gradient are not."""
    from anynorm._plan import make_plan

    if _native.rows_backward_kernel(np.float32) is None:
        pytest.skip("anynorm's CPU kernels are not built here")
    x = torch.randn(4, 8, 6, 6, requires_grad=True)
    w, b = torch.ones(8), torch.zeros(8)

    def takes(op, t, *args, residual=None, **kw):
        return _torch_cpu_grad.takes(make_plan(op, t, *args, **kw), t, *args, residual)

    assert takes("group_norm", x, w, b, num_groups=2)
    assert takes("layer_norm", x, w, b, axis=1)
    nhwc = x.detach().permute(0, 2, 3, 1).contiguous().requires_grad_(True)
    assert not takes("group_norm", nhwc, w, b, num_groups=2, channel_axis=-1)  # small: torch's graph
    c = _torch_cpu_grad.TRAINING_CHANNELS_LAST_MIN_ELEMENTS // (2 * 16 * 16)
    nhwc = torch.randn(2, 16, 16, c, requires_grad=True)
    assert takes("group_norm", nhwc, torch.ones(c), torch.zeros(c), num_groups=2, channel_axis=-1)
    assert not takes("group_norm", x.detach(), w, b, num_groups=2)
    channels_last = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    assert not takes("group_norm", channels_last, w, b, num_groups=2)
    rows = torch.randn(16, 8, requires_grad=True)
    assert not takes("layer_norm", rows, w, b)  # short rows, small: torch's graph
    rows = torch.randn(_torch_cpu_grad.TRAINING_ROWS_MIN_ELEMENTS // 8, 8, requires_grad=True)
    assert takes("layer_norm", rows, w, b)
    assert not takes("layer_norm", rows, w, b, residual=rows)
    assert not takes("layer_norm", rows, None, b)
    assert not takes("rms_norm", rows, w, None)
    assert not takes("layer_norm", rows.t().contiguous().t(), w, b)
    with torch.no_grad():
        assert not takes("layer_norm", rows, w, b)


def test_large_outputs_take_the_route_when_autograd_records():
    """Outputs of FAULTING_BYTES (where the executor's reuse makes the kernels the cheaper)."""
    if _native.rows_backward_kernel(np.float32) is None or not _torch._large_outputs_cheaper():
        pytest.skip("anynorm's CPU kernels are not built here, or large outputs are not cheaper")
    x = torch.randn(_torch.FAULTING_BYTES // 4096, 1024, requires_grad=True)
    w = torch.ones(1024, requires_grad=True)
    y = anynorm.layer_norm(x, w, torch.zeros(1024))
    assert type(y.grad_fn).__name__ == "_KernelNormBackward"
    small = anynorm.layer_norm(x[:64], w, torch.zeros(1024))
    assert type(small.grad_fn).__name__ != "_KernelNormBackward"


def test_bfloat16_explicit_backward_takes_the_kernel():
    """``layer_norm_backward`` on bfloat16 tensors: the NumPy executor's kernel on ml_dtypes
    arrays of the same memory, bit for bit."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if _native.rows_backward_kernel(ml_dtypes.bfloat16) is None:
        pytest.skip("anynorm's CPU kernels are not built here")
    x, w, _, dy = _inputs("layer_norm", (64, 300), {}, torch.bfloat16)
    dx, dw, db = anynorm.layer_norm_backward(dy, x, w)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    as_np = lambda t: t.view(torch.int16).numpy().view(bf16)  # noqa: E731
    want = anynorm.layer_norm_backward(as_np(dy), as_np(x), w.numpy())
    assert dx.dtype == torch.bfloat16
    assert np.array_equal(dx.view(torch.int16).numpy(), want[0].view(np.int16))
    np.testing.assert_array_equal(dw.numpy(), want[1])
    np.testing.assert_array_equal(db.numpy(), want[2])


def test_module_parameters_reach_the_kernels_without_autograd(kernel_route, monkeypatch):
    """``anynorm.nn`` modules hand ``nn.Parameter``s: under ``no_grad`` they take the kernels
    as plain tensors do (the NumPy executor's bits), through the executor or straight
    (``_torch_direct``, the packed row kernel)."""
    calls = []
    run = _torch._numpy_forward
    monkeypatch.setattr(_torch, "_numpy_forward", lambda *a: calls.append(1) or run(*a))
    packed = _native.rows_packed_kernel

    def counted(*args):
        kernel = packed(*args)
        return None if kernel is None else (lambda *a: calls.append(1) or kernel(*a))

    monkeypatch.setattr(_native, "rows_packed_kernel", counted)
    m = anynorm.nn.LayerNorm(300)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
        x = torch.randn(64, 300)
        y = m(x)
    assert calls
    np.testing.assert_array_equal(y.numpy(), anynorm.layer_norm(x.numpy(), m.weight.detach().numpy(),
                                                                m.bias.detach().numpy()))



def test_training_route_where_torchs_kernels_win_only_without_autograd():
    """Layer norm rows of TRAINING_ROWS_MIN_ELEMENTS and channels-last group/instance norm
    of TRAINING_CHANNELS_LAST_MIN_ELEMENTS keep torch's kernels without autograd but take
    the kernel route when autograd records, from a signature's first call and from its
    cached runner; smaller rows and NCHW group norm keep torch's either way."""
    if _native.rows_backward_kernel(np.float32) is None:
        pytest.skip("anynorm's CPU kernels are not built here")
    anynorm._calls.clear()
    gen = torch.Generator().manual_seed(0)
    n_rows = _torch_cpu_grad.TRAINING_ROWS_MIN_ELEMENTS // 512
    nhwc = (2, 16, 16, 64)
    assert np.prod(nhwc) == _torch_cpu_grad.TRAINING_CHANNELS_LAST_MIN_ELEMENTS
    cases = [("layer_norm", (n_rows, 512), {}, True),
             ("layer_norm", (n_rows - 1, 512), {}, False),
             ("group_norm", nhwc, {"num_groups": 8, "channel_axis": -1}, True),
             ("instance_norm", nhwc, {"channel_axis": -1}, True),
             ("group_norm", (2, 64, 16, 16), {"num_groups": 8}, False)]
    for op, shape, kw, kernels in cases:
        x = 1e3 + torch.randn(shape, generator=gen)
        c = shape[kw.get("channel_axis", 1)] if op != "layer_norm" else shape[-1]
        w = torch.rand(c, generator=gen) + 0.5
        dy = torch.randn(shape, generator=gen)
        where = {"num_groups": kw.get("num_groups"), "channel_axis": kw.get("channel_axis", 1)}
        exact = reference.backward(op, dy.double().numpy(), x.double().numpy(), w.double().numpy(), eps=1e-5,
                                   **where)[0]
        for _ in range(2):  # the signature's first call, then its cached runner
            with torch.no_grad():
                assert _call(op, x, w, None, kw).grad_fn is None
            xg = x.clone().requires_grad_(True)
            y = _call(op, xg, w, None, kw)
            assert (type(y.grad_fn).__name__ == "_KernelNormBackward") == kernels, (op, shape)
            y.backward(dy)
            assert _rel(xg.grad.double(), exact) <= 64 * EPS32
