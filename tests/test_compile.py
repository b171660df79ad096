"""``torch.compile(fullgraph=True)`` of modules built from anynorm's layers and functions on
CPU tensors: one graph, the eager results, and no warning that torch.nn's own layers do not
also give. (CUDA tensors trace through the ``anynorm::`` custom ops: tests/gpu.)"""

from __future__ import annotations

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
