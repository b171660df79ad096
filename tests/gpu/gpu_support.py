"""Helpers of the GPU suite: comparisons with dtype-aware tolerances and uniform calls of the
public API (``forward`` -> (y, h, mean, rstd), ``backward`` -> (dx, dweight, dbias))."""

from __future__ import annotations

import numpy as np


def to_f64(a):
    """A float64 NumPy copy of a CuPy array or torch tensor (None stays None)."""
    if a is None:
        return None
    if hasattr(a, "detach"):
        return a.detach().double().cpu().numpy()
    import cupy

    return cupy.asnumpy(a).astype(np.float64)


# (rtol, atol) for outputs and for statistics, by input dtype name.
TOLERANCES = {
    "float64": ((1e-10, 1e-10), (1e-10, 1e-10)),
    "float32": ((2e-5, 2e-5), (2e-5, 2e-5)),
    "float16": ((1e-2, 1e-2), (1e-4, 1e-4)),
    "bfloat16": ((2e-2, 4e-2), (1e-4, 1e-4)),
}


def dtype_name(dtype) -> str:
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def assert_close(actual, expected, dtype, kind="output", what=""):
    out_tol, stats_tol = TOLERANCES[dtype_name(dtype)]
    rtol, atol = stats_tol if kind == "stats" else out_tol
    a, e = to_f64(actual), to_f64(expected)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


# Parameter-gradient tolerance, normwise: max|a - e| <= rtol * max(1, max|e|).
REDUCTION_RTOL = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 4e-2}


def assert_close_normwise(actual, expected, dtype, what=""):
    a, e = to_f64(actual), to_f64(expected)
    assert a.shape == e.shape, (what, a.shape, e.shape)
    scale = max(1.0, float(np.abs(e).max(initial=0.0)))
    err = float(np.abs(a - e).max(initial=0.0))
    assert err <= REDUCTION_RTOL[dtype_name(dtype)] * scale, f"{what}: max error {err} at scale {scale}"


# ---- calling the public API uniformly --------------------------------------------------

def forward(op, x, w=None, b=None, residual=None, **kw):
    """``(y, h, mean, rstd)`` from the public function (h/mean None where they do not apply)."""
    import anynorm

    if op == "layer_norm":
        out = anynorm.layer_norm(x, w, b, axis=kw.get("axis", -1), return_stats=True, residual=residual)
    elif op == "rms_norm":
        out = anynorm.rms_norm(x, w, axis=kw.get("axis", -1), eps=kw.get("eps"), return_stats=True,
                               residual=residual)
    elif op == "instance_norm":
        out = anynorm.instance_norm(x, w, b, channel_axis=kw["channel_axis"], return_stats=True)
    else:
        out = anynorm.group_norm(x, kw["num_groups"], w, b, channel_axis=kw["channel_axis"],
                                 return_stats=True)
    out = list(out)
    h = out.pop(1) if residual is not None else None
    y, *stats = out
    mean, rstd = (None, stats[0]) if op == "rms_norm" else stats
    return y, h, mean, rstd


def backward(op, dy, x, w=None, stats=None, **kw):
    """``(dx, dweight, dbias)`` from the public ``*_backward`` (dbias None for RMS norm)."""
    import anynorm

    if op == "layer_norm":
        return anynorm.layer_norm_backward(dy, x, w, axis=kw.get("axis", -1), stats=stats)
    if op == "rms_norm":
        dx, dw = anynorm.rms_norm_backward(dy, x, w, axis=kw.get("axis", -1), eps=kw.get("eps"),
                                           stats=stats)
        return dx, dw, None
    if op == "instance_norm":
        return anynorm.instance_norm_backward(dy, x, w, channel_axis=kw["channel_axis"], stats=stats)
    return anynorm.group_norm_backward(dy, x, kw["num_groups"], w, channel_axis=kw["channel_axis"],
                                       stats=stats)


def param_shape(op, shape, **kw):
    if op in ("layer_norm", "rms_norm"):
        axis = kw.get("axis", -1)
        axes = sorted(a % len(shape) for a in (axis if isinstance(axis, tuple) else (axis,)))
        return tuple(shape[a] for a in axes)
    return (shape[kw["channel_axis"]],)
