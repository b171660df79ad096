"""Jagged nested tensors (``torch.nested``, layout ``torch.jagged``: variable-length
sequences): layer and RMS norm over the axes after the ragged one, as torch's LayerNorm and
RMSNorm take them, exact at offsets where torch's kernel is not, gradients through autograd."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import anynorm  # noqa: E402
import anynorm.nn  # noqa: E402

LENGTHS = (3, 5, 1)


def _sequences(tail, offset, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn((n, *tail), generator=g, dtype=torch.float64) * 2 + offset for n in LENGTHS]


def _jagged(seqs, dtype=torch.float32, grad=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "the nested API is in prototype stage"
        return torch.nested.nested_tensor([s.to(dtype) for s in seqs], layout=torch.jagged,
                                          requires_grad=grad)


@pytest.mark.parametrize("offset", [0.0, 1e4])
@pytest.mark.parametrize("op,tail,axis", [
    ("layer_norm", (16,), -1), ("layer_norm", (4, 16), (-2, -1)), ("layer_norm", (4, 16), 2),
    ("rms_norm", (16,), -1), ("rms_norm", (4, 16), (2, 3))])
def test_forward_and_gradients_per_sequence(op, tail, axis, offset):
    seqs = _sequences(tail, offset)
    nt = _jagged(seqs, grad=True)
    axes = axis if isinstance(axis, tuple) else (axis,)
    pshape = tuple(nt.shape[a] for a in sorted(a % nt.dim() for a in axes))
    g = torch.Generator().manual_seed(1)
    w = (torch.rand(pshape, generator=g) + 0.5).requires_grad_()
    b = torch.rand(pshape, generator=g) - 0.5
    fn = getattr(anynorm, op)
    y = fn(nt, w, axis=axis) if op == "rms_norm" else fn(nt, w, b, axis=axis)
    assert y.is_nested and y.shape[0] == len(LENGTHS) and y.dtype == torch.float32
    # per sequence, float64 of the same float32 input
    w64, b64 = w.detach().double(), b.double()
    seq_axes = tuple(a - 1 for a in sorted(a % nt.dim() for a in axes))
    want = [fn(s.float().double(), w64, axis=seq_axes) if op == "rms_norm"
            else fn(s.float().double(), w64, b64, axis=seq_axes) for s in seqs]
    for got, ref in zip(y.unbind(), want):
        err = float((got.detach().double() - ref).abs().max())
        assert err <= 2e-6 * max(1.0, float(ref.abs().max())), err
    dy = torch.randn(y.values().shape, generator=g)
    gx, gw = torch.autograd.grad(y.values(), (nt, w), dy)
    xs = [s.float().double().requires_grad_() for s in seqs]
    w64 = w64.requires_grad_()
    refs = [fn(x, w64, axis=seq_axes) if op == "rms_norm" else fn(x, w64, b64, axis=seq_axes)
            for x in xs]
    want_x = torch.autograd.grad(torch.cat(refs), xs + [w64], dy.double())
    for got, ref in zip(gx.unbind(), want_x[:-1]):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw.double(), want_x[-1], rtol=1e-4, atol=1e-4)


def test_statistics_residual_and_modules():
    seqs = _sequences((16,), 100.0)
    nt = _jagged(seqs)
    y, mean, rstd = anynorm.layer_norm(nt, return_stats=True)
    assert mean.is_nested and tuple(mean.unbind()[1].shape) == (5, 1)
    for m, s in zip(mean.unbind(), seqs):
        torch.testing.assert_close(m.double(), s.float().double().mean(-1, keepdim=True),
                                   rtol=1e-6, atol=1e-5)
    y, h = anynorm.rms_norm(nt, residual=nt)
    for hh, s in zip(h.unbind(), seqs):
        torch.testing.assert_close(hh, 2 * s.float())
    for ours, theirs in ((anynorm.nn.LayerNorm(16), torch.nn.LayerNorm(16)),
                         (anynorm.nn.RMSNorm(16), torch.nn.RMSNorm(16))):
        got, want = ours(nt), theirs(nt)
        assert got.is_nested and got.shape[0] == want.shape[0]
        for a, b in zip(got.unbind(), want.unbind()):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=2e-3)  # torch's: 1e-3 off at 100


def test_what_a_jagged_tensor_cannot_take():
    nt = _jagged(_sequences((4, 16), 0.0))
    with pytest.raises(ValueError, match="batch or ragged axis"):
        anynorm.layer_norm(nt, axis=1)
    with pytest.raises(ValueError, match="batch or ragged axis"):
        anynorm.rms_norm(nt, axis=(0, -1))
    with pytest.raises(TypeError, match="group_norm of a nested tensor"):
        anynorm.group_norm(nt, 2, channel_axis=2)
    with pytest.raises(TypeError, match="autograd gives its gradients"):
        anynorm.layer_norm_backward(nt, nt)
