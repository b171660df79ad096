"""The array-API executor: standard functions only, no in-place writes.

It serves every library array-api-compat knows (array-api-strict proves it stays inside
the standard; Dask stays lazy, JAX traceable, torch differentiable).

Forward, per slice over ``plan.reduce_axes`` (two-pass, in ``plan.acc_dtype``)::

    mean = sum(x) / n                      (0 for RMS norm)
    rstd = 1 / sqrt(sum((x - mean)^2) / n + eps)
    y    = (x - mean) * rstd * weight + bias

Backward, with ``xhat = (x - mean) * rstd`` and ``g = dy * weight``::

    dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))   (no mean(g) for RMS norm)
    dweight = sum(dy * xhat)    dbias = sum(dy)              (over the non-parameter axes)
"""

from __future__ import annotations

__all__ = ["forward", "backward", "add_residual"]


def _acc(plan, arr):
    return plan.xp.astype(arr, plan.acc_dtype, copy=False)


def _param(plan, arr):
    """A weight/bias in the accumulation dtype, shaped to broadcast against the view."""
    xp = plan.xp
    return xp.reshape(xp.astype(arr, plan.acc_dtype, copy=False), plan.param_view_shape)


def _view(plan, arr):
    return _acc(plan, plan.xp.reshape(arr, plan.view_shape))


def add_residual(plan, x, residual):
    """``h = x + residual`` in x's dtype (what a pre-norm block carries forward)."""
    return x + residual


def centred_statistics(plan, xv):
    """``(mean or None, rstd, xc)`` of the view ``xv``: keepdims, in the accumulation dtype,
    with ``xc = xv - mean`` (``xv`` itself for RMS norm).

    Corrected two-pass: ``xv - shift`` is exact near the mean (both far from zero: Sterbenz),
    and the mean of those small differences corrects it.  Subtracting ``shift + correction``
    as one rounded number instead would lose the rows' offset's rounding (a float32 row near
    1e6 would come out worse than torch's).  The shift itself is ``x0 + mean(x - x0)`` with
    ``x0`` the slice's first element, not ``mean(x)``: a plain float32 sum of values near 1e6
    over strided axes (no pairwise summation) is off by many units, which the correction's
    own sum would then carry into ``y`` (1e-5 and more at 1e6); ``x - x0`` is small.
    """
    xp = plan.xp
    axes = plan.reduce_axes
    if plan.center:
        first = xv[tuple(slice(0, 1) if a in axes else slice(None) for a in range(xv.ndim))]
        shift = first + xp.mean(xv - first, axis=axes, keepdims=True)
        diff = xv - shift
        correction = xp.mean(diff, axis=axes, keepdims=True)
        mean, xc = shift + correction, diff - correction
    else:
        mean, xc = None, xv
    var = xp.mean(xc * xc, axis=axes, keepdims=True)
    return mean, 1.0 / xp.sqrt(var + plan.eps), xc


def statistics(plan, xv):
    """(mean or None, rstd) of the view ``xv``, keepdims, in the accumulation dtype."""
    mean, rstd, _ = centred_statistics(plan, xv)
    return mean, rstd


def forward(plan, x, weight=None, bias=None, residual=None):
    """Return ``(y, h, mean, rstd)``; ``h`` is None without a residual, ``mean`` for RMS norm."""
    xp = plan.xp
    h = add_residual(plan, x, residual) if residual is not None else None
    xv = _view(plan, h if h is not None else x)
    mean, rstd, xc = centred_statistics(plan, xv)
    y = xc * rstd
    if weight is not None:
        y = y * _param(plan, weight)
    if bias is not None:
        y = y + _param(plan, bias)
    y = xp.reshape(xp.astype(y, plan.dtype, copy=False), plan.shape)
    if mean is not None:
        mean = xp.reshape(mean, plan.stats_shape)
    return y, h, mean, xp.reshape(rstd, plan.stats_shape)


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """Return ``(dx, dweight, dbias)``; stats in public shape, recomputed when None."""
    xp = plan.xp
    xv = _view(plan, x)
    dyv = _view(plan, dy)
    if rstd is None:
        _, rstd_v, xc = centred_statistics(plan, xv)
    else:
        rstd_v = xp.reshape(_acc(plan, rstd), plan.stats_view_shape)
        xc = xv
        if plan.center:
            # about the given mean, then the slice's mean of that: the given one is rounded to
            # the statistics' dtype, which would put |mean| * rstd ulps into every xhat
            xc = xv - xp.reshape(_acc(plan, mean), plan.stats_view_shape)
            xc = xc - xp.mean(xc, axis=plan.reduce_axes, keepdims=True)
    xhat = xc * rstd_v
    g = dyv * _param(plan, weight) if weight is not None else dyv
    axes = plan.reduce_axes
    proj = xp.mean(g * xhat, axis=axes, keepdims=True)
    inner = g - xhat * proj
    if plan.center:
        inner = inner - xp.mean(g, axis=axes, keepdims=True)
    dx = xp.reshape(xp.astype(rstd_v * inner, plan.dtype, copy=False), plan.shape)
    if weight is None:
        return dx, None, None
    others = plan.nonparam_axes

    def param_sum(arr):
        summed = xp.sum(arr, axis=others) if others else arr
        return xp.reshape(xp.astype(summed, weight.dtype, copy=False), plan.param_shape)

    return dx, param_sum(dyv * xhat), param_sum(dyv)
