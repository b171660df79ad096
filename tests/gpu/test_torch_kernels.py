"""CUDA kernels on torch CUDA tensors: against torch's own functions and the reference
executor, through autograd, torch.compile, opcheck, streams and channels-last memory."""

from __future__ import annotations

import pytest

import anynorm
from gpu_support import assert_close, assert_close_normwise

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA device", allow_module_level=True)
F = torch.nn.functional
anynorm._register_torch_ops()  # torch.ops.anynorm: anynorm may have been imported before torch

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
CUDA = "cuda"


def _rand(shape, dtype, seed=0, loc=1.0, scale=3.0, requires_grad=True):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    t = (torch.randn(shape, generator=g, device=CUDA, dtype=torch.float32) * scale + loc).to(dtype)
    return t.requires_grad_(requires_grad)


def _grads(fn, inputs, seed=11):
    """Outputs of fn and gradients of sum(out * r) w.r.t. every input (None stays None)."""
    out = fn(*inputs)
    r = _rand(out.shape, out.dtype, seed, 0.0, 1.0, requires_grad=False)
    live = [t for t in inputs if t is not None and t.requires_grad]
    grads = torch.autograd.grad((out.float() * r.float()).sum(), live)
    return out, grads


def _compare(ours, theirs, inputs, dtype):
    y, g = _grads(ours, inputs)
    ry, rg = _grads(theirs, inputs)
    assert_close(y, ry, dtype, what="y")
    # torch rounds differently inside its backward (e.g. rows of length 1 give +-eps noise
    # times rstd where the exact answer is 0): compare gradients normwise.
    for name, a, b in zip(("dx", "dweight", "dbias"), g, rg):
        assert_close_normwise(a, b, dtype, name)


def _kernels(fn):
    def run(*args):
        with anynorm.use_backend("kernels"):
            return fn(*args)
    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 3), (33, 1000), (8, 4096), (2, 65536), (70001, 8),
                                   (4, 7, 96)])
def test_layer_norm_vs_torch(shape, dtype):
    x = _rand(shape, dtype)
    w = _rand(shape[-1:], dtype, 1, 1.0, 0.5)
    b = _rand(shape[-1:], dtype, 2, 0.0, 0.5)
    _compare(_kernels(lambda x, w, b: anynorm.layer_norm(x, w, b)),
             lambda x, w, b: F.layer_norm(x, shape[-1:], w, b, 1e-5), (x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 3), (33, 1000), (8, 4096)])
def test_rms_norm_vs_torch(shape, dtype):
    x = _rand(shape, dtype)
    w = _rand(shape[-1:], dtype, 1, 1.0, 0.5)
    _compare(_kernels(lambda x, w: anynorm.rms_norm(x, w, eps=1e-6)),
             lambda x, w: F.rms_norm(x, shape[-1:], w, 1e-6), (x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_channels_first_layer_norm_vs_torch(dtype):
    x = _rand((4, 48, 14, 14), dtype)
    w = _rand((48,), dtype, 1, 1.0, 0.5)
    b = _rand((48,), dtype, 2, 0.0, 0.5)
    _compare(_kernels(lambda x, w, b: anynorm.layer_norm(x, w, b, axis=1)),
             lambda x, w, b: F.layer_norm(x.permute(0, 2, 3, 1), (48,), w, b).permute(0, 3, 1, 2),
             (x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("groups", [1, 4, 32])
def test_group_norm_vs_torch(groups, channels_last, dtype):
    x = _rand((4, 64, 17, 19), dtype)
    if channels_last:
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    w = _rand((64,), dtype, 1, 1.0, 0.5)
    b = _rand((64,), dtype, 2, 0.0, 0.5)
    _compare(_kernels(lambda x, w, b: anynorm.group_norm(x, groups, w, b)),
             lambda x, w, b: F.group_norm(x.contiguous(), groups, w, b), (x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op, shape", [("group_norm", (2, 320, 64, 64)),
                                       ("instance_norm", (2, 3, 130, 131))])
def test_long_nchw_rows_vs_torch(op, shape, dtype):
    """Rows past 16384 elements (Stable Diffusion's 64x64 GroupNorm(32, 320): 40960): the
    backward's per-channel segment sums (segment_grad_finalize) against torch."""
    x = _rand(shape, dtype)
    w = _rand(shape[1:2], dtype, 1, 1.0, 0.5)
    b = _rand(shape[1:2], dtype, 2, 0.0, 0.5)
    if op == "group_norm":
        ours = lambda x, w, b: anynorm.group_norm(x, 32, w, b)  # noqa: E731
        theirs = lambda x, w, b: F.group_norm(x, 32, w, b)  # noqa: E731
    else:
        ours = lambda x, w, b: anynorm.instance_norm(x, w, b)  # noqa: E731
        theirs = lambda x, w, b: F.instance_norm(x, weight=w, bias=b)  # noqa: E731
    _compare(_kernels(ours), theirs, (x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nhwc_group_norm_vs_torch(dtype):
    x = _rand((2, 9, 11, 32), dtype)
    w = _rand((32,), dtype, 1, 1.0, 0.5)
    b = _rand((32,), dtype, 2, 0.0, 0.5)
    _compare(_kernels(lambda x, w, b: anynorm.group_norm(x, 8, w, b, channel_axis=-1)),
             lambda x, w, b: F.group_norm(x.permute(0, 3, 1, 2), 8, w, b).permute(0, 2, 3, 1),
             (x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_instance_norm_vs_torch(channel_axis, dtype):
    shape = (3, 16, 10, 12) if channel_axis == 1 else (3, 10, 12, 16)
    x = _rand(shape, dtype)
    w = _rand((16,), dtype, 1, 1.0, 0.5)
    b = _rand((16,), dtype, 2, 0.0, 0.5)
    if channel_axis == 1:
        theirs = lambda x, w, b: F.instance_norm(x, weight=w, bias=b)  # noqa: E731
    else:
        theirs = lambda x, w, b: F.instance_norm(x.permute(0, 3, 1, 2), weight=w, bias=b).permute(0, 2, 3, 1)  # noqa: E731
    _compare(_kernels(lambda x, w, b: anynorm.instance_norm(x, w, b, channel_axis=channel_axis)),
             theirs, (x, w, b), dtype)


def test_channels_last_output_keeps_memory_format():
    x = _rand((2, 8, 5, 6), torch.float32).detach().to(memory_format=torch.channels_last)
    with anynorm.use_backend("kernels"):
        y = anynorm.instance_norm(x)
    assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_fused_residual_autograd(op, dtype):
    """Gradients reach x, residual, weight and bias through y and h, as with the reference."""
    x, res = _rand((16, 1000), dtype), _rand((16, 1000), dtype, 3)
    w = _rand((1000,), dtype, 1, 1.0, 0.5)
    b = _rand((1000,), dtype, 2, 0.0, 0.5) if op == "layer_norm" else None
    fn = getattr(anynorm, op)

    def run(backend):
        with anynorm.use_backend(backend):
            args = (x, w, b) if op == "layer_norm" else (x, w)
            y, h = fn(*args, residual=res)
        r1 = _rand(y.shape, dtype, 7, 0.0, 1.0, False)
        r2 = _rand(h.shape, dtype, 8, 0.0, 1.0, False)
        loss = (y.float() * r1.float()).sum() + (h.float() * r2.float()).sum()
        live = [t for t in (x, res, w, b) if t is not None]
        return (y, h), torch.autograd.grad(loss, live)

    (y, h), grads = run("kernels")
    (ry, rh), rgrads = run("reference")
    assert_close(y, ry, dtype, what="y")
    assert torch.equal(h, rh)
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), grads, rgrads):
        if name in ("dx", "dresidual"):
            assert_close(a, e, dtype, what=name)
        else:
            assert_close_normwise(a, e, dtype, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transposed_inputs_go_by_torch_into_the_other_buffer(dtype, monkeypatch):
    """A pre-norm block on nn.MultiheadAttention(batch_first=True): its output (x) is a
    transposed view, the residual stream dense. torch adds x and the residual into the
    residual's layout and the kernels normalize h (no CuPy copy path), y and h come out
    dense, dy transposed in the backward is copied into x's layout; values and gradients as
    the reference's."""
    from anynorm._cuda import _launcher

    monkeypatch.setattr(_launcher, "forward", None)  # the CuPy copy path: not for torch
    monkeypatch.setattr(_launcher, "backward", None)
    x = _rand((1024, 8, 96), dtype, requires_grad=False).transpose(0, 1).requires_grad_()
    res = _rand((8, 1024, 96), dtype, 3)
    w, b = _rand((96,), dtype, 1, 1.0, 0.5), _rand((96,), dtype, 2, 0.0, 0.5)
    dy = _rand((1024, 8, 96), dtype, 7, 0.0, 1.0, False).transpose(0, 1)

    def run(backend):
        with anynorm.use_backend(backend):
            y, h = anynorm.layer_norm(x, w, b, residual=res)
        loss = (y.float() * dy.float()).sum() + h.float().square().sum()
        return (y, h), torch.autograd.grad(loss, (x, res, w, b))

    (y, h), grads = run("kernels")
    assert y.is_contiguous() and h.is_contiguous()
    (ry, rh), rgrads = run("reference")
    assert_close(y, ry, dtype, what="y")
    assert torch.equal(h, rh)
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), grads, rgrads):
        assert_close_normwise(a, e, dtype, name)
    with anynorm.use_backend("kernels"):
        y = anynorm.layer_norm(x.detach()[:, :, ::2])  # non-dense: the canonical order
    with anynorm.use_backend("reference"):
        assert_close(y, anynorm.layer_norm(x.detach()[:, :, ::2]), dtype, what="strided")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bias_without_weight_gets_gradient(dtype):
    x = _rand((8, 300), dtype)
    b = _rand((300,), dtype, 2, 0.0, 0.5)
    _compare(_kernels(lambda x, b: anynorm.layer_norm(x, None, b)),
             lambda x, b: F.layer_norm(x, (300,), None, b), (x, b), dtype)


def test_backward_functions_on_torch():
    x = _rand((8, 300), torch.float32, requires_grad=False)
    dy = _rand((8, 300), torch.float32, 4, 0.0, 1.0, requires_grad=False)
    w = _rand((300,), torch.float32, 1, requires_grad=False)
    with anynorm.use_backend("kernels"):
        got = anynorm.layer_norm_backward(dy, x, w)
    with anynorm.use_backend("reference"):
        want = anynorm.layer_norm_backward(dy, x, w)
    assert_close(got[0], want[0], torch.float32)
    assert_close_normwise(got[1], want[1], torch.float32, "dweight")
    assert_close_normwise(got[2], want[2], torch.float32, "dbias")


def test_modules_match_torch_modules():
    ours = anynorm.nn.LayerNorm(256).to(CUDA)
    theirs = torch.nn.LayerNorm(256).to(CUDA)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.2)
        theirs.bias.normal_(0.0, 0.2)
    ours.load_state_dict(theirs.state_dict())
    x = _rand((4, 10, 256), torch.float32)
    with anynorm.use_backend("kernels"):
        y = ours(x)
    assert_close(y, theirs(x), torch.float32)
    y.sum().backward()
    assert ours.weight.grad is not None and ours.bias.grad is not None


def test_runs_on_torch_current_stream():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = _rand((256, 4096), torch.float16, requires_grad=False)
        with anynorm.use_backend("kernels"):
            y = anynorm.layer_norm(x)
        ref = F.layer_norm(x, (4096,))
    side.synchronize()
    assert_close(y, ref, torch.float16)


def test_torch_compile():
    x = _rand((32, 512), torch.float32)
    w = _rand((512,), torch.float32, 1)
    b = _rand((512,), torch.float32, 2)

    def fn(x, w, b):
        return anynorm.layer_norm(x, w, b) * 2

    compiled = torch.compile(fn)
    with anynorm.use_backend("kernels"):
        y, g = _grads(compiled, (x, w, b))
        ry, rg = _grads(fn, (x, w, b))
    assert_close(y, ry, torch.float32)
    for a, e in zip(g, rg):
        assert_close_normwise(a, e, torch.float32)


def test_custom_op_compiles_fullgraph():
    x = _rand((32, 512), torch.bfloat16)
    w = _rand((512,), torch.bfloat16, 1)

    def fn(x, w):
        y, _, _, rstd = torch.ops.anynorm.forward(x, w, None, None, "rms_norm", [1], 1, 0, 1e-6)
        return y, rstd

    y, rstd = torch.compile(fn, fullgraph=True, dynamic=True)(x, w)
    assert_close(y, F.rms_norm(x, (512,), w, 1e-6), torch.bfloat16)
    assert rstd.shape == (32, 1) and rstd.dtype == torch.float32


OPCHECK_CASES = [
    ("layer_norm", (8, 100), [1], 1, 0, True, True, False),
    ("layer_norm", (8, 100), [1], 1, 0, True, True, True),
    ("rms_norm", (8, 100), [1], 1, 0, True, False, True),
    ("layer_norm", (2, 6, 5, 7), [1], 1, 0, True, True, False),
    ("instance_norm", (2, 6, 5, 7), [], 3, 0, True, True, False),
    ("group_norm", (2, 6, 5, 8), [], 3, 4, True, True, False),
    ("layer_norm", (4, 2000), [1], 1, 0, False, False, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(case, dtype):
    op, shape, axes, channel_axis, groups, has_w, has_b, has_res = case
    x = _rand(shape, dtype)
    pshape = tuple(shape[a] for a in axes) if axes else (shape[channel_axis],)
    w = _rand(pshape, dtype, 1) if has_w else None
    b = _rand(pshape, dtype, 2) if has_b else None
    res = _rand(shape, dtype, 3) if has_res else None
    torch.library.opcheck(torch.ops.anynorm.forward.default,
                          (x, w, b, res, op, axes, channel_axis, groups, 1e-5))
    plain = [t.detach() if t is not None else None for t in (x, w)]
    dy = _rand(shape, dtype, 4, requires_grad=False)
    torch.library.opcheck(torch.ops.anynorm.backward.default,
                          (dy, plain[0], plain[1], None, None, op, axes, channel_axis, groups, 1e-5,
                           True))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "group_norm"])
def test_torch_func_vmap_and_per_sample_grads(op):
    """vmap and vmap(grad) over CUDA tensors (the array-API core serves batched tensors):
    equal to a loop over the samples."""
    xs = _rand((3, 4, 8, 5), torch.float32, requires_grad=False)
    w = _rand((8,) if op == "group_norm" else (5,), torch.float32, seed=3, requires_grad=False)

    def call(w, x):
        if op == "group_norm":
            return anynorm.group_norm(x, 2, w)
        return getattr(anynorm, op)(x, w)

    torch.testing.assert_close(torch.func.vmap(call, in_dims=(None, 0))(w, xs),
                               torch.stack([call(w, s) for s in xs]))

    def loss(w, x):
        return (call(w, x) ** 3).sum()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, xs)
    want = torch.stack([torch.func.grad(loss)(w, s) for s in xs])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
