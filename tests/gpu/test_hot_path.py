"""The GPU call path (anynorm._calls, _cuda/_launcher): CUDA graph capture and replay for every
op and layout, torch.compile(mode="reduce-overhead"), CuPy stream capture, no stale launcher
across strides, dtypes and devices, one kernel and one allocation per inference call, and
the custom ops in a fresh process (opcheck)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

import anynorm
from gpu_support import assert_close, assert_close_normwise

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device", allow_module_level=True)

CUDA = "cuda"
# op, x shape, keyword arguments, memory format: every kernel family and layout, and a row
# long enough for the split path (its workspaces live in the call's scratch allocation)
CASES = [
    ("layer_norm", (64, 768), {}, None),
    ("layer_norm", (4, 100_000), {}, None),
    ("rms_norm", (64, 1024), {}, None),
    ("layer_norm", (8, 96, 14, 14), {"axis": 1}, None),
    ("layer_norm", (8, 96, 14, 14), {"axis": 1}, torch.channels_last),
    ("group_norm", (4, 64, 16, 16), {"num_groups": 8}, None),
    ("group_norm", (2, 64, 128, 128), {"num_groups": 32}, None),
    ("group_norm", (4, 16, 16, 64), {"num_groups": 8, "channel_axis": -1}, None),
    ("instance_norm", (4, 32, 16, 16), {}, None),
    ("instance_norm", (4, 16, 16, 32), {"channel_axis": -1}, None),
]


def _ids(case):
    op, shape, kw, fmt = case
    return f"{op}-{'x'.join(map(str, shape))}-{kw}-{'cl' if fmt else 'c'}"


def _params(op, shape, kw, dtype):
    c = shape[kw.get("channel_axis", 1)] if op in ("group_norm", "instance_norm") else None
    pshape = (c,) if c else ((shape[1],) if kw.get("axis") == 1 else shape[-1:])
    w = torch.rand(pshape, device=CUDA, dtype=dtype) + 0.5
    b = None if op == "rms_norm" else torch.randn(pshape, device=CUDA, dtype=dtype)
    return w, b


def _call(op, x, w, b, kw):
    if op == "group_norm":
        kw = dict(kw)
        return anynorm.group_norm(x, kw.pop("num_groups"), w, b, **kw)
    if op == "rms_norm":
        return anynorm.rms_norm(x, w, **kw)
    return getattr(anynorm, op)(x, w, b, **kw)


def _input(shape, fmt, dtype=torch.float32, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=CUDA, dtype=dtype) * 2 + 1
    return x.contiguous(memory_format=fmt) if fmt else x


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_torch_cuda_graph_replays_on_new_data(case):
    op, shape, kw, fmt = case
    x = _input(shape, fmt)
    w, b = _params(op, shape, kw, torch.float32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():  # warm-up: compile, record the schedule
        for _ in range(2):
            _call(op, x, w, b, kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        y = _call(op, x, w, b, kw)
    for seed in (1, 2):
        x.copy_(_input(shape, fmt, seed=seed))
        graph.replay()
        with torch.no_grad():
            want = _call(op, x, w, b, kw)
        torch.cuda.synchronize()
        torch.testing.assert_close(y, want, rtol=0, atol=0)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]], ids=_ids)
def test_torch_cuda_graph_of_forward_and_backward(case):
    op, shape, kw, fmt = case
    x = _input(shape, fmt).requires_grad_()
    w, b = (p.requires_grad_() if p is not None else None for p in _params(op, shape, kw, torch.float32))
    dy = torch.randn_like(x)

    def step():
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        _call(op, x, w, b, kw).backward(dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in (x, w, b):  # the captured backward writes into these grads
        if t is not None:
            t.grad = None
    with torch.cuda.graph(graph):
        _call(op, x, w, b, kw).backward(dy)
    with torch.no_grad():
        x.copy_(_input(shape, fmt, seed=5))
    graph.replay()
    got = [t.grad.clone() for t in (x, w, b) if t is not None]
    x2 = x.detach().clone().requires_grad_()
    w2, b2 = (None if t is None else t.detach().clone().requires_grad_() for t in (w, b))
    _call(op, x2, w2, b2, kw).backward(dy)
    want = [t.grad for t in (x2, w2, b2) if t is not None]
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_compile_reduce_overhead():
    torch._dynamo.reset()
    w, b = _params("layer_norm", (64, 768), {}, torch.float32)

    def block(x):
        y, h = anynorm.layer_norm(x, w, b, residual=x)
        return anynorm.rms_norm(y, w) + h

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for seed in range(4):  # cudagraph trees record on a later call, then replay
        x = _input((64, 768), None, seed=seed)
        torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)


def test_cupy_stream_capture():
    cp = pytest.importorskip("cupy")
    x = cp.asarray(_input((64, 768), None).cpu().numpy())
    w = cp.ones(768, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        anynorm.layer_norm(x, w)  # warm-up: compile, record, fill the memory pool
        stream.synchronize()
        stream.begin_capture()
        y = anynorm.layer_norm(x, w)
        graph = stream.end_capture()
        x[...] = cp.asarray(_input((64, 768), None, seed=3).cpu().numpy())
        graph.launch()
        want = anynorm.layer_norm(x, w)
        stream.synchronize()
    cp.testing.assert_array_equal(y, want)


def test_cupy_repeat_calls_reuse_the_bound_launch(monkeypatch):
    """A CuPy call signature keeps the launch its first call bound: one schedule lookup for
    three calls; parameters that need a conversion (float64 weight on float32 x) are
    converted, and looked up, on every call."""
    cp = pytest.importorskip("cupy")
    from anynorm._cuda import _cupy_exec

    anynorm._calls.clear()  # a call of this signature earlier in the process bound it already
    looked_up = []
    find = _cupy_exec._bound_forward
    monkeypatch.setattr(_cupy_exec, "_bound_forward",
                        lambda *args: looked_up.append(1) or find(*args))
    x = cp.asarray(_input((64, 768), None).cpu().numpy())
    for w_dtype, lookups in ((cp.float32, 1), (cp.float64, 3)):
        looked_up.clear()
        w = cp.full(768, 2.0, w_dtype)
        ys = [anynorm.layer_norm(x, w) for _ in range(3)]
        assert len(looked_up) == lookups, w_dtype
        with anynorm.use_backend("reference"):
            want = anynorm.layer_norm(x, w.astype(cp.float32))
        for y in ys:
            assert_close(y, want, torch.float32)


def test_same_shape_other_strides_dtypes_devices_never_reuse_a_launcher():
    shape = (8, 96, 14, 14)
    for fmt in (None, torch.channels_last, None, torch.channels_last):
        for dtype in (torch.float32, torch.float16, torch.float32):
            x = _input(shape, fmt, dtype)
            w, b = _params("layer_norm", shape, {"axis": 1}, dtype)
            y = anynorm.layer_norm(x, w, b, axis=1)
            with anynorm.use_backend("reference"):
                want = anynorm.layer_norm(x, w, b, axis=1)
            assert_close(y, want, dtype)
    if torch.cuda.device_count() > 1:
        for device in ("cuda:1", "cuda:0", "cuda:1"):
            x = _input(shape, None).to(device)
            y = anynorm.layer_norm(x, axis=1)
            assert y.device == x.device
            with anynorm.use_backend("reference"):
                assert_close(y, anynorm.layer_norm(x, axis=1), torch.float32)


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float16)])
def test_inference_is_one_kernel_and_one_allocation(x_dtype, w_dtype):
    x = _input((64, 768), None, x_dtype)
    w, b = _params("layer_norm", (64, 768), {}, w_dtype)
    with torch.no_grad():
        anynorm.layer_norm(x, w, b)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        anynorm.layer_norm(x, w, b)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == 1  # y alone
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            anynorm.layer_norm(x, w, b)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "rows_fwd" in kernels[0], kernels


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float16)])
def test_training_step_runs_no_conversion_kernels(x_dtype, w_dtype):
    """Forward + backward launch anynorm's kernels and nothing else: weight and bias are read
    as they are stored, and dweight/dbias are written in the parameters' dtype by the finish
    kernel (no copy kernels converting them, no zeroing). Gradients match torch's."""
    x = _input((64, 768), None, x_dtype).requires_grad_()
    w, b = (t.requires_grad_() for t in _params("layer_norm", (64, 768), {}, w_dtype))
    dy = torch.randn_like(x)
    anynorm.layer_norm(x, w, b).backward(dy)
    torch.cuda.synchronize()
    x.grad = w.grad = b.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        anynorm.layer_norm(x, w, b).backward(dy)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert all(any(k in name for k in ("rows_", "param_grad")) for name in kernels), kernels
    assert w.grad.dtype == b.grad.dtype == w_dtype
    got = x.grad, w.grad, b.grad
    x.grad = w.grad = b.grad = None
    torch.nn.functional.layer_norm(x.float(), (768,), w.float(), b.float()).backward(dy.float())
    for mine, want, what in zip(got, (x.grad, w.grad, b.grad), ("dx", "dweight", "dbias")):
        assert_close_normwise(mine.float(), want, x_dtype, what)


def test_opcheck_in_a_fresh_process():
    code = """
import torch, anynorm
x = torch.randn(6, 40, device="cuda", requires_grad=True)
w = torch.randn(40, device="cuda", requires_grad=True)
b = torch.randn(40, device="cuda", requires_grad=True)
torch.library.opcheck(torch.ops.anynorm.forward.default,
                      (x, w, b, None, "layer_norm", [1], 1, 0, 1e-5))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_compile_first_call_of_a_process_imported_before_torch():
    """torch.compile(mode="reduce-overhead", fullgraph=True) of the process' first anynorm
    call on CUDA tensors, anynorm imported before torch (failed on torch 2.11: Dynamo cannot
    trace ContextVar.get, and the ops were not registered yet)."""
    script = pathlib.Path(__file__).parent.parent / "first_call_compiled.py"
    done = subprocess.run([sys.executable, str(script), "cuda", "reduce-overhead"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_stats_only_when_wanted_match_stats_path():
    x = _input((64, 768), None)
    w, b = _params("layer_norm", (64, 768), {}, torch.float32)
    with torch.no_grad():
        y = anynorm.layer_norm(x, w, b)
        y2, mean, rstd = anynorm.layer_norm(x, w, b, return_stats=True)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    want = x.double().mean(-1, keepdim=True)
    np.testing.assert_allclose(mean.cpu().numpy(), want.cpu().numpy(), rtol=1e-5, atol=1e-5)
