"""The peers anynorm is measured against: tutorial NumPy code and torch.nn.functional."""

from __future__ import annotations

import numpy as np

from .common import EPS, case


def _axes(op, shape, kwargs):
    """``(statistics axes, parameter broadcast shape)`` of a case, in x's own axes."""
    ndim = len(shape)
    if op in ("layer_norm", "rms_norm"):
        axis = kwargs.get("axis", -1)
        axes = tuple(sorted(a % ndim for a in (axis if isinstance(axis, tuple) else (axis,))))
        return axes, tuple(shape[a] if a in axes else 1 for a in range(ndim))
    c = kwargs.get("channel_axis", 1) % ndim
    return tuple(a for a in range(ndim) if a not in (0, c)), tuple(
        shape[a] if a == c else 1 for a in range(ndim))


def naive_numpy(name, x, weight, bias):
    """Normalization as tutorials write it in NumPy: mean, var, then whole-array arithmetic."""
    op, shape, kwargs = case(name)
    axes, pshape = _axes(op, shape, kwargs)
    w = weight.reshape(pshape)
    if op == "rms_norm":
        return x / np.sqrt(np.mean(x ** 2, axis=axes, keepdims=True) + EPS) * w
    b = bias.reshape(pshape)
    if op == "group_norm":
        c = kwargs.get("channel_axis", 1) % len(shape)
        groups = kwargs["num_groups"]
        xg = x.reshape(shape[:c] + (groups, shape[c] // groups) + shape[c + 1:])
        gaxes = tuple(a for a in range(xg.ndim) if a not in (0, c))
        mean = xg.mean(axis=gaxes, keepdims=True)
        var = xg.var(axis=gaxes, keepdims=True)
        return ((xg - mean) / np.sqrt(var + EPS)).reshape(shape) * w + b
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + EPS) * w + b


def torch_functional(name, x, weight, bias):
    """The same normalization by ``torch.nn.functional``.

    Channels-last cases go through a permuted (channels_last memory) NCHW view, which
    F.group_norm/F.instance_norm take natively; ConvNeXt's channels-first LayerNorm is
    permuted to channels-last for F.layer_norm and back, as ConvNeXt code does.
    """
    import torch.nn.functional as F

    op, shape, kwargs = case(name)
    ndim = len(shape)
    if op in ("layer_norm", "rms_norm"):
        axis = kwargs.get("axis", -1)
        axes = sorted(a % ndim for a in (axis if isinstance(axis, tuple) else (axis,)))
        rest = [a for a in range(ndim) if a not in axes]
        order = rest + axes
        moved = order != list(range(ndim))
        xt = x.permute(order) if moved else x
        normalized = [shape[a] for a in axes]
        if op == "rms_norm":
            y = F.rms_norm(xt, normalized, weight, EPS)
        else:
            y = F.layer_norm(xt, normalized, weight, bias, EPS)
        if moved:
            inverse = sorted(range(ndim), key=order.__getitem__)
            y = y.permute(inverse)
        return y
    c = kwargs.get("channel_axis", 1) % ndim
    order = [0, c] + [a for a in range(1, ndim) if a != c]
    xt = x.permute(order) if c != 1 else x
    if op == "instance_norm":
        y = F.instance_norm(xt, weight=weight, bias=bias, eps=EPS)
    else:
        y = F.group_norm(xt, kwargs["num_groups"], weight, bias, EPS)
    if c != 1:
        y = y.permute(sorted(range(ndim), key=order.__getitem__))
    return y


def torch_backward(name, x, weight, bias, dy):
    """A callable running torch's backward of :func:`torch_functional`'s graph, built once
    and kept (``retain_graph``): what autograd runs after F's forward, its permutes
    included; None where torch has no backward for the dtype on this device."""
    import torch

    leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias)]
    with torch.enable_grad():
        y = torch_functional(name, *leaves)
    try:
        torch.autograd.grad(y, leaves, dy, retain_graph=True)
    except RuntimeError:  # e.g. "not implemented for 'Half'"
        return None
    return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)
