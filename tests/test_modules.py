"""anynorm.nn (torch drop-ins) and the array-API module classes: outputs, parameters, state dicts."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import anynorm
import reference
from support import assert_close, get_backend

torch = pytest.importorskip("torch")
nn = anynorm.nn

# (our class, torch's class, constructor args, input shape)
PAIRS = [
    ("LayerNorm", torch.nn.LayerNorm, ((5,),), (2, 3, 5)),
    ("LayerNorm", torch.nn.LayerNorm, ((3, 5),), (2, 3, 5)),
    ("LayerNorm", torch.nn.LayerNorm, (5, 1e-3, True, False), (4, 5)),
    ("LayerNorm", torch.nn.LayerNorm, (5, 1e-5, False), (4, 5)),
    ("RMSNorm", torch.nn.RMSNorm, ((5,),), (2, 3, 5)),
    ("RMSNorm", torch.nn.RMSNorm, ((3, 5), 1e-4), (2, 3, 5)),
    ("RMSNorm", torch.nn.RMSNorm, (5, None, False), (4, 5)),
    ("GroupNorm", torch.nn.GroupNorm, (2, 6), (2, 6, 3, 3)),
    ("GroupNorm", torch.nn.GroupNorm, (3, 6, 1e-3, False), (2, 6, 4)),
    ("GroupNorm", torch.nn.GroupNorm, (1, 4), (3, 4)),
    ("InstanceNorm", torch.nn.InstanceNorm1d, (4,), (2, 4, 7)),
    ("InstanceNorm", torch.nn.InstanceNorm2d, (4, 1e-5, 0.1, True), (2, 4, 3, 5)),
    ("InstanceNorm", torch.nn.InstanceNorm3d, (3, 1e-4, 0.1, True), (2, 3, 2, 3, 4)),
]
PAIR_IDS = [f"{p[0]}{p[2]}" for p in PAIRS]


def randomize(module, seed):
    """Give every parameter random values, so that loading a state dict is visible."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


@pytest.mark.parametrize("name, theirs_cls, args, shape", PAIRS, ids=PAIR_IDS)
def test_nn_module_is_a_drop_in(name, theirs_cls, args, shape):
    """Same parameters and state_dict keys; loading works both ways; same outputs and gradients."""
    ours = randomize(getattr(nn, name)(*args).double(), 1)
    theirs = randomize(theirs_cls(*args).double(), 2)
    assert isinstance(ours, torch.nn.Module)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for p_ours, p_theirs in zip(ours.parameters(), theirs.parameters()):
        assert p_ours.shape == p_theirs.shape

    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(shape, dtype=torch.float64)
    for direction in ("theirs->ours", "ours->theirs"):
        x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
        assert_close(y_ours.detach().numpy(), y_theirs.detach().numpy(), "float64", what=direction)
        dy = torch.randn(shape, dtype=torch.float64)
        y_ours.backward(dy)
        y_theirs.backward(dy)
        assert_close(x_ours.grad.numpy(), x_theirs.grad.numpy(), "float64", scale=10)
        for p_ours, p_theirs in zip(ours.parameters(), theirs.parameters()):
            assert_close(p_ours.grad.numpy(), p_theirs.grad.numpy(), "float64", scale=10)
        randomize(ours, 3)
        theirs.load_state_dict(ours.state_dict())
        ours.zero_grad(), theirs.zero_grad()


@pytest.mark.parametrize("name, theirs_cls", [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm),
                                              ("GroupNorm", torch.nn.GroupNorm),
                                              ("InstanceNorm", torch.nn.InstanceNorm2d)])
def test_nn_constructor_matches_torch(name, theirs_cls):
    """Every constructor argument of the torch namesake, in order, with the same default."""
    ours = inspect.signature(getattr(nn, name)).parameters
    theirs = inspect.signature(theirs_cls).parameters
    positional = [p for p in theirs.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [p.name for p in ours.values()][:len(positional)]
    for p in theirs.values():
        assert p.name in ours and ours[p.name].default == p.default, p.name


def test_nn_default_parameters_and_axis():
    ln = nn.LayerNorm((3, 5))
    assert torch.equal(ln.weight, torch.ones(3, 5)) and torch.equal(ln.bias, torch.zeros(3, 5))
    assert ln.axis == (-2, -1)
    assert nn.RMSNorm(4).eps is None and nn.GroupNorm(2, 4).channel_axis == 1
    assert "axis" in repr(ln) and "channel_axis" in repr(nn.InstanceNorm(3))


def channels_last_pairs():
    """(ours, the torch computation it must equal) for channels-last / channels-first layouts."""
    ln = nn.LayerNorm(4, axis=1)  # ConvNeXt's channels-first LayerNorm on NCHW
    gn = nn.GroupNorm(2, 4, channel_axis=-1)  # NHWC group norm
    inorm = nn.InstanceNorm(4, affine=True, channel_axis=-1)  # NHWC instance norm
    tln, tgn, tin = torch.nn.LayerNorm(4), torch.nn.GroupNorm(2, 4), torch.nn.InstanceNorm2d(4, affine=True)
    for a, b in ((ln, tln), (gn, tgn), (inorm, tin)):
        randomize(b.double(), 4)
        a.double().load_state_dict(b.state_dict())
    return {
        "layer-norm-channels-first": (ln, lambda x: tln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2), (2, 4, 3, 5)),
        "group-norm-nhwc": (gn, lambda x: tgn(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1), (2, 3, 5, 4)),
        "instance-norm-nhwc": (inorm, lambda x: tin(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1), (2, 3, 5, 4)),
    }


@pytest.mark.parametrize("layout", ["layer-norm-channels-first", "group-norm-nhwc", "instance-norm-nhwc"])
@pytest.mark.parametrize("memory", ["contiguous", "channels_last"])
def test_nn_channels_last(layout, memory):
    ours, theirs, shape = channels_last_pairs()[layout]
    x = torch.randn(shape, dtype=torch.float64)
    if memory == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    assert_close(ours(x).detach().numpy(), theirs(x).detach().numpy(), "float64")


def test_nn_instance_norm_errors():
    with pytest.raises(NotImplementedError, match="track_running_stats"):
        nn.InstanceNorm(4, track_running_stats=True)
    with pytest.raises(ValueError, match="num_features=4"):
        nn.InstanceNorm(4)(torch.randn(2, 3, 5))


@pytest.mark.parametrize("channel_axis", [1, -1])
def test_nn_instance_norm_takes_an_unbatched_sample_as_instance_norm1d(channel_axis):
    """A 2-d input is one sample (C, L), as torch.nn.InstanceNorm1d takes it ((L, C) with
    channels last); gradients reach it and the parameters."""
    g = torch.Generator().manual_seed(0)
    theirs = torch.nn.InstanceNorm1d(4, affine=True).double()
    with torch.no_grad():
        theirs.weight.copy_(torch.rand(4, generator=g, dtype=torch.float64) + 0.5)
        theirs.bias.copy_(torch.rand(4, generator=g, dtype=torch.float64))
    ours = nn.InstanceNorm(4, affine=True, channel_axis=channel_axis).double()
    ours.load_state_dict(theirs.state_dict())
    x = (torch.randn(4, 10, generator=g, dtype=torch.float64) + 100).requires_grad_()
    want = theirs(x)
    got = ours(x if channel_axis == 1 else x.T)
    got = got if channel_axis == 1 else got.T
    assert got.shape == (4, 10)
    assert_close(got.detach().numpy(), want.detach().numpy(), "float64")
    dy = torch.randn(4, 10, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(got, (x, ours.weight), dy),
                    torch.autograd.grad(want, (x, theirs.weight), dy)):
        assert_close(a.numpy(), b.numpy(), "float64")


def test_nn_modules_follow_dtype_and_device_moves():
    """.half()/.double() and float16 inputs: parameters and output follow like torch's."""
    ln = nn.LayerNorm(8).half()
    x = torch.randn(2, 8).half()
    y = ln(x)
    assert y.dtype == torch.float16 and ln.weight.dtype == torch.float16
    want = reference.forward("layer_norm", x.double().numpy())[0]
    np.testing.assert_allclose(y.double().detach().numpy(), want, rtol=4e-3, atol=4e-3)


# --- array-API modules ------------------------------------------------------------------------

ARRAY_MODULES = [
    ("LayerNorm", torch.nn.LayerNorm, ((3, 5),), (2, 3, 5)),
    ("LayerNorm", torch.nn.LayerNorm, (5, 1e-5, True, False), (4, 5)),
    ("RMSNorm", torch.nn.RMSNorm, (5,), (4, 5)),
    ("GroupNorm", torch.nn.GroupNorm, (2, 6), (2, 6, 3)),
    ("InstanceNorm", torch.nn.InstanceNorm2d, (4, 1e-5, 0.1, True), (2, 4, 3, 3)),
]


@pytest.mark.parametrize("lib", ["numpy", "torch", "array-api-strict", "jax"])
@pytest.mark.parametrize("name, theirs_cls, args, shape", ARRAY_MODULES, ids=[f"{m[0]}{m[2]}" for m in ARRAY_MODULES])
def test_array_module_loads_torch_state_dict_both_ways(lib, name, theirs_cls, args, shape):
    b = get_backend(lib)
    ours = getattr(anynorm, name)(*args, xp=b.xp, dtype=b.dtype("float64"))
    theirs = randomize(theirs_cls(*args).double(), 5)
    want_keys = list(theirs.state_dict())
    assert list(ours.state_dict()) == want_keys
    # defaults: ones and zeros in the chosen library
    for key, value in ours.state_dict().items():
        assert b.is_own(value)
        assert np.all(b.to_numpy(value) == (1.0 if key == "weight" else 0.0))
        assert tuple(value.shape) == tuple(theirs.state_dict()[key].shape)

    ours.load_state_dict(theirs.state_dict())  # torch tensors (requires_grad) into any library
    x64 = np.random.default_rng(6).standard_normal(shape)
    y = ours(b.asarray(x64))
    assert b.is_own(y)
    assert_close(b.to_numpy(y), theirs(torch.asarray(x64)).detach().numpy(), "float64")

    ours.load_state_dict({k: np.full(tuple(v.shape), 0.5) for k, v in ours.state_dict().items()})
    theirs.load_state_dict({k: torch.asarray(b.to_numpy(v)) for k, v in ours.state_dict().items()})
    assert all(torch.all(v == 0.5) for v in theirs.state_dict().values())


def test_array_module_state_dict_errors():
    ln = anynorm.LayerNorm(4)
    with pytest.raises(ValueError, match="missing.*bias"):
        ln.load_state_dict({"weight": np.ones(4)})
    with pytest.raises(ValueError, match="unexpected.*running_mean"):
        ln.load_state_dict({"weight": np.ones(4), "bias": np.zeros(4), "running_mean": np.zeros(4)})
    with pytest.raises(ValueError, match=r"state_dict\['weight'\] must have shape \(4,\)"):
        ln.load_state_dict({"weight": np.ones(5), "bias": np.zeros(4)})
    with pytest.raises(NotImplementedError, match="track_running_stats"):
        anynorm.InstanceNorm(3, track_running_stats=True)
    with pytest.raises(ValueError, match="num_groups"):
        anynorm.GroupNorm(4, 6)


def test_array_module_without_affine_has_no_parameters():
    assert anynorm.LayerNorm(4, elementwise_affine=False).state_dict() == {}
    assert anynorm.InstanceNorm(3).state_dict() == {}
    assert list(anynorm.GroupNorm(1, 3, bias=False).state_dict()) == ["weight"]


@pytest.mark.parametrize("channel_axis", [1, -1])
def test_array_module_instance_norm_takes_an_unbatched_sample(backend, channel_axis):
    """anynorm.InstanceNorm on a 2-d input: one sample (C, L) ((L, C) channels-last), in the
    input's library, as torch.nn.InstanceNorm1d takes it."""
    x64 = np.random.default_rng(9).standard_normal((4, 10)) + 100
    x64 = x64 if channel_axis == 1 else x64.T
    x = backend.asarray(x64)
    module = anynorm.InstanceNorm(4, channel_axis=channel_axis, xp=backend.xp, dtype=x.dtype)
    got = module(x)
    assert backend.is_own(got) and tuple(got.shape) == x64.shape
    want = reference.forward("instance_norm", x64[None], channel_axis=channel_axis)[0][0]
    assert_close(backend.to_numpy(got), want, "float64")


def test_array_module_channels_last_and_axis():
    """The array-API modules take axis=/channel_axis= like the functions."""
    x64 = np.random.default_rng(8).standard_normal((2, 3, 5, 4))
    got = anynorm.GroupNorm(2, 4, channel_axis=-1, dtype=np.float64)(x64)
    want = reference.forward("group_norm", x64, num_groups=2, channel_axis=-1)[0]
    assert_close(got, want, "float64")
    got = anynorm.LayerNorm(3, axis=1, dtype=np.float64)(x64)
    assert_close(got, reference.forward("layer_norm", x64, axis=1)[0], "float64")


# --- input shape errors name the input, not the module's weight ---------------------------------

# (module, input shape, what the message must say)
WRONG_INPUTS = [
    (lambda ns: ns.LayerNorm(128), (2, 64), r"\[\*, 128\].*got an input of shape \(2, 64\)"),
    (lambda ns: ns.LayerNorm((3, 128)), (2, 3, 64), r"\[\*, 3, 128\].*got an input of shape \(2, 3, 64\)"),
    (lambda ns: ns.LayerNorm(128), (64,), r"\[\*, 128\].*got an input of shape \(64,\)"),
    (lambda ns: ns.LayerNorm(96, axis=1), (2, 64, 7, 7), r"sizes \(96,\) on axis=1.*got an input of shape \(2, 64, 7, 7\)"),
    (lambda ns: ns.LayerNorm((2, 96), axis=(0, -1)), (2, 5, 64), r"sizes \(2, 96\).*got an input of shape \(2, 5, 64\)"),
    (lambda ns: ns.LayerNorm(128, elementwise_affine=False), (2, 64), r"\[\*, 128\].*shape \(2, 64\)"),
    (lambda ns: ns.RMSNorm(128), (2, 64), r"\[\*, 128\].*got an input of shape \(2, 64\)"),
    (lambda ns: ns.RMSNorm(8, axis=0), (4, 8), r"sizes \(8,\) on axis=0.*got an input of shape \(4, 8\)"),
    (lambda ns: ns.GroupNorm(4, 32), (2, 16, 5), r"32 channels on channel_axis=1.*got an input of shape \(2, 16, 5\)"),
    (lambda ns: ns.GroupNorm(4, 32, channel_axis=-1), (2, 5, 16), r"32 channels on channel_axis=-1.*shape \(2, 5, 16\)"),
    (lambda ns: ns.GroupNorm(4, 32, channel_axis=3), (2, 32, 5), r"32 channels on channel_axis=3.*shape \(2, 32, 5\)"),
    (lambda ns: ns.InstanceNorm(4), (2, 3, 5), r"num_features=4.*4 channels on channel_axis=1.*shape \(2, 3, 5\)"),
    (lambda ns: ns.InstanceNorm(4, affine=True, channel_axis=-1), (2, 5, 3), r"4 channels on channel_axis=-1.*shape \(2, 5, 3\)"),
]


@pytest.mark.parametrize("flavour", ["anynorm.nn", "anynorm"])
@pytest.mark.parametrize("make, shape, message", WRONG_INPUTS, ids=[f"{i}" for i in range(len(WRONG_INPUTS))])
def test_module_input_errors_name_the_input(flavour, make, shape, message):
    """A wrong input's error names the input's shape and what the module expected (issue 18:
    ``LayerNorm(128)`` given 64 features blamed ``weight must have shape (64,)``)."""
    ns = nn if flavour == "anynorm.nn" else anynorm
    module = make(ns)
    x = torch.zeros(shape) if flavour == "anynorm.nn" else np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=message) as info:
        module(x)
    text = str(info.value)
    assert "weight" not in text and "expected" in text
    assert text.startswith(f"{flavour}.{type(module).__name__}(")


@pytest.mark.parametrize("flavour", ["anynorm.nn", "anynorm"])
def test_module_input_check_lets_good_inputs_and_other_errors_through(flavour):
    """Right shapes run; a non-array stays the function's TypeError; a bad axis the function's ValueError."""
    ns = nn if flavour == "anynorm.nn" else anynorm
    asarray = torch.zeros if flavour == "anynorm.nn" else (lambda s: np.zeros(s, np.float32))
    assert tuple(ns.LayerNorm(96, axis=1)(asarray((2, 96, 3))).shape) == (2, 96, 3)
    assert tuple(ns.LayerNorm((2, 96), axis=(0, -1))(asarray((2, 5, 96))).shape) == (2, 5, 96)
    assert tuple(ns.RMSNorm((3, 4), axis=(-1, -2))(asarray((2, 3, 4))).shape) == (2, 3, 4)
    assert tuple(ns.GroupNorm(2, 4, channel_axis=-1)(asarray((2, 3, 4))).shape) == (2, 3, 4)
    with pytest.raises(TypeError, match="x must be an array"):
        ns.LayerNorm(4)([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(ValueError, match="axis"):
        ns.LayerNorm((4, 4), axis=(1, 1))(asarray((2, 4, 4)))
    ln = ns.LayerNorm(3)
    ln.axis = 0  # changing the axis later changes what the check expects
    assert tuple(ln(asarray((3, 5))).shape) == (3, 5)
    with pytest.raises(ValueError, match=r"axis=0.*shape \(5, 3\)"):
        ln(asarray((5, 3)))


def test_array_module_input_check_skips_unknown_sizes():
    """Dask arrays of unknown chunk sizes have nan in their shape: the module leaves them to the
    function, which normalizes over known axes and names what is wrong otherwise."""
    da = pytest.importorskip("dask.array")
    a = np.random.default_rng(5).standard_normal((4, 6)).astype(np.float32)
    x = da.from_array(a, chunks=2)
    x = x[x[:, 0] > -10]  # shape (nan, 6), every row kept
    assert np.isnan(x.shape[0])
    for module in (anynorm.LayerNorm(6, xp=da), anynorm.GroupNorm(2, 6, xp=da)):
        got = module(x).compute()
        assert got.shape == (4, 6)
    assert_close(anynorm.LayerNorm(6, xp=da)(x).compute(), anynorm.LayerNorm(6)(a), "float32")
    with pytest.raises(ValueError, match=r"weight must have shape \(6,\)"):
        anynorm.LayerNorm(5, xp=da)(x)
    with pytest.raises(ValueError, match="known sizes.*compute_chunk_sizes"):
        anynorm.LayerNorm(4, axis=0, xp=da)(x)


# --- pickling: torch.save of a model, multiprocessing -------------------------------------------

PICKLED = [
    (lambda ns: ns.LayerNorm(8), (2, 8)),
    (lambda ns: ns.LayerNorm((3, 8), axis=(1, -1)), (2, 3, 5, 8)),
    (lambda ns: ns.RMSNorm(8, axis=0), (8, 3)),
    (lambda ns: ns.GroupNorm(2, 4, channel_axis=-1), (2, 5, 4)),
    (lambda ns: ns.InstanceNorm(4, affine=True), (2, 4, 5)),
]


@pytest.mark.parametrize("flavour", ["anynorm.nn", "anynorm"])
@pytest.mark.parametrize("make, shape", PICKLED, ids=[str(i) for i in range(len(PICKLED))])
def test_modules_pickle(flavour, make, shape):
    """pickle and torch.save round trips give a module that computes the same and still checks
    its input (the check's picker is a closure, remade on load; array modules name their
    namespace)."""
    import io
    import pickle

    ns = nn if flavour == "anynorm.nn" else anynorm
    module = make(ns)
    x = torch.randn(shape) if flavour == "anynorm.nn" else np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    for copy in (pickle.loads(pickle.dumps(module)), torch.load(buffer, weights_only=False)):
        got, want = copy(x), module(x)
        assert type(got) is type(want)
        assert np.array_equal(np.asarray(got.detach() if flavour == "anynorm.nn" else got),
                              np.asarray(want.detach() if flavour == "anynorm.nn" else want))
        wrong = tuple(s + 1 for s in shape)
        bad = torch.zeros(wrong) if flavour == "anynorm.nn" else np.zeros(wrong, np.float32)
        with pytest.raises(ValueError, match="got an input of shape"):
            copy(bad)


def test_fx_symbolic_trace_records_one_node_a_module():
    """torch.fx.symbolic_trace (torchvision's feature extraction, FX quantization) of a model
    holding every anynorm.nn module: one call_function node per module (tracing into the
    shape checks failed on proxies), the GraphModule computes the same, with gradients."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.ln, self.gn = nn.LayerNorm(8, axis=1), nn.GroupNorm(2, 8)
            self.inorm, self.rms = nn.InstanceNorm(8, affine=True), nn.RMSNorm(6)

        def forward(self, x):
            return self.rms(self.inorm(self.gn(self.ln(self.conv(x)))))

    net = randomize(Net(), 5)
    graph_module = torch.fx.symbolic_trace(net)
    calls = [n.target.__name__ for n in graph_module.graph.nodes if n.op == "call_function"]
    assert calls == ["_fx_layer_norm", "_fx_group_norm", "_fx_instance_norm", "_fx_rms_norm"]
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(6))
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [graph_module(xs[0]), net(xs[1])]
    assert torch.equal(outs[0], outs[1])
    for out in outs:
        out.square().sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
