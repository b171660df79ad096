"""``torch.compile(fullgraph=True)`` of modules built from anynorm's layers and functions on
CPU tensors: one graph, the eager results, and no warning that torch.nn's own layers do not
also give. (CUDA tensors trace through the ``anynorm::`` custom ops: tests/gpu.)"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

import anynorm  # noqa: E402
import anynorm.nn  # noqa: E402


class Norms(torch.nn.Module):
    """Every op and layout, through anynorm.nn modules and the functions."""

    def __init__(self, c=8):
        super().__init__()
        self.lin = torch.nn.Linear(c, c)
        self.ln = anynorm.nn.LayerNorm(c)
        self.ln_cf = anynorm.nn.LayerNorm(c, axis=1)  # ConvNeXt's channels-first
        self.rms = anynorm.nn.RMSNorm(c)
        self.gn = anynorm.nn.GroupNorm(2, c)
        self.gn_last = anynorm.nn.GroupNorm(4, c, channel_axis=-1)
        self.inorm = anynorm.nn.InstanceNorm(c, affine=True)

    def forward(self, x):  # x: (N, C, H, W)
        t = self.lin(x.permute(0, 2, 3, 1))  # NHWC
        y = self.ln(t) + self.rms(t) + self.gn_last(t)
        y = y.permute(0, 3, 1, 2)
        y = y + self.ln_cf(x) + self.gn(x) + self.inorm(x)
        z, h = anynorm.layer_norm(t, self.ln.weight, self.ln.bias, residual=t)
        return y.sum() + z.sum() + h.sum() + anynorm.group_norm(x, 4).sum()


class Native(torch.nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.lin = torch.nn.Linear(c, c)
        self.ln = torch.nn.LayerNorm(c)
        self.gn = torch.nn.GroupNorm(2, c)

    def forward(self, x):
        return self.ln(self.lin(x.permute(0, 2, 3, 1))).sum() + self.gn(x).sum()


def _warm_caches():
    """Calls of every kind first, as earlier tests in a suite make them: the per-type and
    per-dtype caches are then full when Dynamo traces through them."""
    import numpy as np

    arrays = [np.ones((2, 3), np.float32), np.ones((2, 3)), torch.ones(2, 3), torch.ones(2, 3).double()]
    try:
        import array_api_strict

        arrays.append(array_api_strict.ones((2, 3)))
    except ImportError:
        pass
    for arr in arrays:
        anynorm.layer_norm(arr, arr[0, ...])
        anynorm.group_norm(arr[None, :, :, None], 1)


def _compiled_warnings(module, x):
    _warm_caches()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(module, fullgraph=True)(x)
    return out, {str(w.message) for w in caught}


def test_fullgraph_on_cpu_matches_eager_and_warns_like_torch_nn():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 5) * 3 + 100  # off zero: the paths must stay exact there too
    # torch.nn's layers first: warnings torch gives once per process (its own imports on a
    # first compile) are then seen there
    _, native_warnings = _compiled_warnings(Native(), x)
    ours = Norms()
    want = ours(x)
    got, our_warnings = _compiled_warnings(ours, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2)
    assert our_warnings <= native_warnings, our_warnings - native_warnings


def test_cuda_executor_checks_trace_without_warnings():
    """The CUDA executor's checks that torch.compile traces on CUDA tensors (which library,
    a usable runtime, a fake tensor) trace on CPU tensors too, without CuPy calls (the runtime's
    answer is kept from its first call) and with no warning: array_api_compat.is_torch_array's
    lru_cache made Dynamo warn (seen on an H200 under torch 2.11)."""
    pytest.importorskip("cupy")
    from anynorm._cuda import _executor
    from anynorm._plan import make_plan

    _executor._runtime_problem()  # a CUDA process answers it on its first eager call
    x = torch.randn(4, 8)
    plan = make_plan("layer_norm", x)
    want = _executor.unsupported(plan, x)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(lambda t: t + (1.0 if _executor.unsupported(plan, t) is None else 2.0),
                            fullgraph=True)(x)
    torch.testing.assert_close(got, x + (1.0 if want is None else 2.0))
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]


def run_first_call_compiled(*args):
    """tests/first_call_compiled.py in a fresh process (anynorm imported before torch)."""
    script = pathlib.Path(__file__).with_name("first_call_compiled.py")
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_fullgraph_first_call_of_a_process_imported_before_torch():
    """Was: Dynamo could not trace ContextVar.get (the backend in force), and traced
    array_api_compat's lru_cache-wrapped checks, when the process' first anynorm call on a
    tensor was compiled and anynorm had been imported before torch."""
    run_first_call_compiled("cpu")


def test_cuda_executor_checks_trace_in_a_fresh_process():
    """The CUDA executor's check of the runtime (CuPy's device count), first asked inside a
    trace: Dynamo cannot trace CuPy's runtime call (failed on an H200: a process whose first
    call on CUDA tensors was compiled)."""
    pytest.importorskip("cupy")
    code = """
import torch
from anynorm._cuda import _executor
from anynorm._plan import make_plan
x = torch.randn(4, 8)
plan = make_plan("layer_norm", x)
out = torch.compile(lambda t: t + (1.0 if _executor.unsupported(plan, t) is None else 2.0),
                    fullgraph=True)(x)
want = x + (1.0 if _executor._runtime_problem() is None else 2.0)
torch.testing.assert_close(out, want)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_fullgraph_gradients_on_cpu():
    torch.manual_seed(1)
    x = torch.randn(3, 8, 4, 4, requires_grad=True)
    model = Norms()
    model(x).backward()
    want = x.grad.clone(), model.ln.weight.grad.clone()
    x.grad = None
    model.zero_grad()
    _warm_caches()
    torch._dynamo.reset()
    torch.compile(model, fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.ln.weight.grad, want[1], rtol=1e-4, atol=1e-4)


HALF_CASES = [
    ("layer_norm", (8, 64), dict(axis=-1)),
    ("rms_norm", (8, 64), dict(axis=-1)),
    ("group_norm", (2, 16, 4, 4), dict(num_groups=4, channel_axis=1)),
    ("instance_norm", (2, 8, 4, 4), dict(channel_axis=1)),
]


def _half_call(op, kw):
    kw = dict(kw)
    groups = kw.pop("num_groups", None)

    def f(x, w, b):
        if op == "rms_norm":
            return anynorm.rms_norm(x, w, return_stats=True, **kw)
        if op == "group_norm":
            return anynorm.group_norm(x, groups, w, b, return_stats=True, **kw)
        return getattr(anynorm, op)(x, w, b, return_stats=True, **kw)
    return f


def _grads(fn, x, w, b, dy):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    fn(x, w, b)[0].backward(dy)
    return x.grad.double(), w.grad.double()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("op,shape,kw", HALF_CASES, ids=[c[0] for c in HALF_CASES])
def test_fullgraph_half_dtypes_keep_float32_statistics_and_digits(op, shape, kw, dtype):
    """float16/bfloat16 under torch.compile: the statistics in float32 and exact to float32
    rounding (inductor's decompositions of torch's mixed-dtype kernels return them in x's
    dtype, and ``x - shift`` rounded to x's dtype loses the digits of slices near zero: rstd
    off by 4e-3 in bfloat16), gradients as exact as the eager path's."""
    import numpy as np

    import reference

    tdtype = getattr(torch, dtype)
    f = _half_call(op, kw)
    _warm_caches()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    eps = float(torch.finfo(tdtype).eps) if op == "rms_norm" else 1e-5
    for offset in (0.0, 100.0):
        g = torch.Generator().manual_seed(0)
        x = (offset + torch.randn(shape, generator=g)).to(tdtype)
        c = shape[-1] if op in ("layer_norm", "rms_norm") else shape[1]
        w = (torch.rand(c, generator=g) + 0.5).to(tdtype)
        b = None if op == "rms_norm" else (torch.rand(c, generator=g) - 0.5).to(tdtype)
        dy = torch.randn(shape, generator=g).to(tdtype)
        _, mean_ref, rstd_ref = reference.forward(op, x.double().numpy(), eps=eps, **kw)
        with torch.no_grad():
            out = compiled(x, w, b)
            eager = f(x, w, b)
        assert out[0].dtype == tdtype
        assert [s.dtype for s in out[1:]] == [torch.float32] * (len(out) - 1), (offset, out[1:])
        torch.testing.assert_close(out[0], eager[0], rtol=0, atol=2 * float(torch.finfo(tdtype).eps) * 8)
        np.testing.assert_allclose(out[-1].double().numpy(), rstd_ref, rtol=2e-6)
        if mean_ref is not None:
            err = np.max(np.abs(out[1].double().numpy() - mean_ref) * rstd_ref)
            assert err <= 2e-6 * max(1.0, offset), (offset, err)
        # gradients against float64 autograd: no worse than the eager path's (1.25x, plus a
        # quarter of the dtype's rounding)
        x64, w64 = x.double(), w.double()
        b64 = None if b is None else b.double()
        want = _grads(f, x64, w64, b64, dy.double())
        got, base = _grads(compiled, x, w, b, dy), _grads(f, x, w, b, dy)
        for name, g_got, g_eager, g_ref in zip(("dx", "dweight"), got, base, want):
            scale = float(g_ref.abs().max())
            e_got = float((g_got - g_ref).abs().max()) / scale
            e_eager = float((g_eager - g_ref).abs().max()) / scale
            assert e_got <= 1.25 * e_eager + 0.25 * float(torch.finfo(tdtype).eps), (name, offset, e_got, e_eager)


# (op, shape, keywords, parameter shape): every op and layout, the parameters' axes fixed
SYMBOLIC_CASES = [
    ("layer_norm", (4, 6, 8), dict(axis=-1), (8,)),
    ("layer_norm", (4, 6, 5, 5), dict(axis=1), (6,)),  # ConvNeXt's channels-first
    ("layer_norm", (4, 6, 8), dict(axis=(0, 2)), (4, 8)),
    ("rms_norm", (4, 6, 8), dict(axis=-1), (8,)),
    ("group_norm", (4, 6, 5, 5), dict(num_groups=3, channel_axis=1), (6,)),
    ("group_norm", (4, 5, 5, 6), dict(num_groups=3, channel_axis=-1), (6,)),
    ("group_norm", (4, 5, 6), dict(num_groups=3, channel_axis=-1), (6,)),
    ("instance_norm", (4, 6, 5, 5), dict(channel_axis=1), (6,)),
]
SYMBOLIC_IDS = [f"{op}{shape}{sorted(kw.items())}" for op, shape, kw, _ in SYMBOLIC_CASES]


def _free_axes(op, shape, kw):
    """The axes whose size a call may change: not those the parameters are shaped by."""
    if op in ("layer_norm", "rms_norm"):
        axes = kw["axis"] if isinstance(kw["axis"], tuple) else (kw["axis"],)
    else:
        axes = (kw["channel_axis"],)
    fixed = {a % len(shape) for a in axes}
    return [a for a in range(len(shape)) if a not in fixed]


def _grown(shape, free, by):
    return tuple(s + by if a in free else s for a, s in enumerate(shape))


def _symbolic_call(op, kw, weight, bias):
    kw = dict(kw)
    groups = kw.pop("num_groups", None)
    if op == "rms_norm":
        return lambda x: anynorm.rms_norm(x, weight, **kw)
    if op == "group_norm":
        return lambda x: anynorm.group_norm(x, groups, weight, bias, **kw)
    return lambda x: getattr(anynorm, op)(x, weight, bias, **kw)


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
@pytest.mark.parametrize("op,shape,kw,pshape", SYMBOLIC_CASES, ids=SYMBOLIC_IDS)
def test_fullgraph_with_dynamic_shapes(op, shape, kw, pshape, dynamic):
    """``torch.compile(dynamic=True)``, and the automatic dynamic shapes a second shape
    brings (``dynamic=None``, the default): one fullgraph compile serves growing shapes, with
    eager's outputs and gradients on data at 1e4 (sizes stay symbolic through the plan,
    eps may be a SymFloat, no size test guards a dynamic axis)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.rand(pshape, generator=g) + 0.5).requires_grad_(True)
    b = torch.rand(pshape, generator=g) - 0.5
    f = _symbolic_call(op, kw, w, b)
    _warm_caches()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    free = _free_axes(op, shape, kw)
    for by in (0, 2, 5):
        x = (torch.randn(_grown(shape, free, by), generator=g) * 2 + 1e4).requires_grad_(True)
        got, want = compiled(x), f(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        dy = torch.randn(got.shape, generator=g)
        pairs = zip(torch.autograd.grad(got, (x, w), dy), torch.autograd.grad(want, (x, w), dy))
        for gg, gw in pairs:
            torch.testing.assert_close(gg, gw, rtol=1e-4, atol=1e-4 * float(gw.abs().max()))


@pytest.mark.parametrize("op,shape,kw,pshape", SYMBOLIC_CASES, ids=SYMBOLIC_IDS)
def test_export_with_dynamic_dims(op, shape, kw, pshape):
    """``torch.export`` with ``Dim`` on every axis the parameters do not fix (a serving
    model's batch, a sequence, an image's height and width): no guard specializes them, and
    the exported program gives eager's result on other shapes, at 1e4 as near zero."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.rand(pshape, generator=g) + 0.5, torch.rand(pshape, generator=g) - 0.5
    f = _symbolic_call(op, kw, w, b)

    class Wrapped(torch.nn.Module):
        def forward(self, x):
            return f(x)

    free = _free_axes(op, shape, kw)
    dims = {a: torch.export.Dim(f"d{a}") for a in free}
    program = torch.export.export(Wrapped(), (torch.randn(shape, generator=g),),
                                  dynamic_shapes={"x": dims})
    for by, offset in ((3, 0.0), (7, 1e4)):
        x = torch.randn(_grown(shape, free, by), generator=g) + offset
        torch.testing.assert_close(program.module()(x), f(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,shape,kw,pshape", SYMBOLIC_CASES, ids=SYMBOLIC_IDS)
def test_jit_trace_records_the_exact_path(op, shape, kw, pshape):
    """``torch.jit.trace`` (and the legacy ``torch.onnx.export``, which traces) replays the
    ops recorded while tracing: the call must record the shifted path, not the eager
    check-then-rerun, whose branch a trace would freeze (traced on data near zero, a
    LayerNorm replayed at 1e4 gave torch's 1.2e-3 where eager gives 3.5e-7). The trace's
    own re-trace check passes, also on a first call of its signature."""
    g = torch.Generator().manual_seed(6)
    w, b = torch.rand(pshape, generator=g) + 0.5, torch.rand(pshape, generator=g) - 0.5
    f = _symbolic_call(op, kw, w, b)
    anynorm._calls.clear()  # a first call of the signature inside the trace
    traced = torch.jit.trace(f, torch.randn(shape, generator=g))
    x = torch.randn(shape, generator=g) * 2 + 1e4
    f64 = _symbolic_call(op, kw, w.double(), b.double())
    want = f64(x.double())  # float64 of the same float32 input
    for got in (traced(x), f(x)):
        err = float((got.double() - want).abs().max())
        assert err <= 1e-6 * float(want.abs().max()), err
