"""The public functions: plan the call once, then hand it to one executor.

Formula (per normalized slice of n elements)::

    mean = sum(x) / n;  var = sum((x - mean)^2) / n;  rstd = 1 / sqrt(var + eps)
    y    = (x - mean) * rstd * weight + bias          (RMS norm: y = x * rstd * weight,
                                                        rstd = 1 / sqrt(sum(x^2) / n + eps))
"""

from __future__ import annotations

from ._backend import choose
from ._plan import make_plan, namespace_of

__all__ = [
    "layer_norm", "rms_norm", "instance_norm", "group_norm",
    "layer_norm_backward", "rms_norm_backward", "instance_norm_backward", "group_norm_backward",
]


def _forward(op, x, weight, bias, residual, return_stats, **where):
    plan = make_plan(op, x, weight, bias, residual, **where)
    y, h, mean, rstd = choose(plan, x).forward(plan, x, weight, bias, residual)
    out = (y,) if residual is None else (y, h)
    if return_stats:
        out += (rstd,) if op == "rms_norm" else (mean, rstd)
    return out[0] if len(out) == 1 else out


def _stats(plan, x, stats):
    """Split and check ``stats`` as ``return_stats=True`` gave it; (None, None) when absent."""
    if stats is None:
        return None, None
    wanted = 2 if plan.center else 1
    if not isinstance(stats, (tuple, list)):
        stats = (stats,)
    if len(stats) != wanted:
        names = "(mean, rstd)" if plan.center else "(rstd,)"
        raise ValueError(f"stats must be {names} as return_stats=True gives them, got {len(stats)} items")
    namespace_of(x, **{f"stats[{i}]": s for i, s in enumerate(stats)})
    for i, s in enumerate(stats):
        if tuple(s.shape) != plan.stats_shape:
            raise ValueError(f"stats[{i}] must have shape {plan.stats_shape}, got {tuple(s.shape)}")
    return (stats[0], stats[1]) if plan.center else (None, stats[0])


def _backward(op, dy, x, weight, stats, **where):
    plan = make_plan(op, x, weight, **where)
    namespace_of(x, dy=dy)
    if tuple(dy.shape) != plan.shape:
        raise ValueError(f"dy must have x's shape {plan.shape}, got shape {tuple(dy.shape)}")
    if not plan.xp.isdtype(dy.dtype, "real floating"):
        raise TypeError(f"dy must have a real floating-point dtype, got {dy.dtype}")
    mean, rstd = _stats(plan, x, stats)
    return choose(plan, x).backward(plan, dy, x, weight, mean, rstd)


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, return_stats=False, residual=None):
    """Layer norm of ``x`` over ``axis`` (an int or a tuple of ints, jointly).

    ``weight``/``bias``: shape ``tuple(x.shape[a] for a in sorted(axes))``.  Returns ``y``
    (x's shape, dtype and library); ``(y, mean, rstd)`` with ``return_stats`` (stats keep
    the normalized axes as size 1); with ``residual`` the input is ``h = x + residual`` and
    ``h`` follows ``y``: ``(y, h)`` or ``(y, h, mean, rstd)``.
    """
    return _forward("layer_norm", x, weight, bias, residual, return_stats, axis=axis, eps=eps)


def rms_norm(x, weight=None, *, axis=-1, eps=None, return_stats=False, residual=None):
    """RMS norm: ``y = x / sqrt(mean(x^2) + eps) * weight`` over ``axis``.

    ``eps=None`` means ``finfo(x.dtype).eps``.  Returns ``y``, ``(y, rstd)`` with
    ``return_stats``; with ``residual``: ``(y, h)`` or ``(y, h, rstd)``.
    """
    return _forward("rms_norm", x, weight, None, residual, return_stats, axis=axis, eps=eps)


def instance_norm(x, weight=None, bias=None, *, channel_axis=1, eps=1e-5, return_stats=False):
    """Instance norm: statistics per (sample, channel) over every other axis.

    Axis 0 is the batch; ``weight``/``bias`` have shape ``(C,)``; ``channel_axis=-1`` is the
    channels-last layout.  Stats keep the spatial axes as size 1: ``(N, C, 1, 1)`` for NCHW.
    """
    return _forward("instance_norm", x, weight, bias, None, return_stats,
                    channel_axis=channel_axis, eps=eps)


def group_norm(x, num_groups, weight=None, bias=None, *, channel_axis=1, eps=1e-5, return_stats=False):
    """Group norm: channels split into ``num_groups`` consecutive groups.

    Statistics per (sample, group) over the group's channels and every non-batch axis;
    ``weight``/``bias`` have shape ``(C,)``; stats have shape ``(N, num_groups)``.
    """
    return _forward("group_norm", x, weight, bias, None, return_stats,
                    channel_axis=channel_axis, num_groups=num_groups, eps=eps)


def layer_norm_backward(dy, x, weight=None, *, axis=-1, eps=1e-5, stats=None):
    """Gradients ``(dx, dweight, dbias)`` of :func:`layer_norm` given ``dy = dL/dy``.

    ``stats``: the ``(mean, rstd)`` that ``return_stats=True`` gave, or None to recompute.
    ``dweight``/``dbias`` are None when ``weight`` is None.
    """
    return _backward("layer_norm", dy, x, weight, stats, axis=axis, eps=eps)


def rms_norm_backward(dy, x, weight=None, *, axis=-1, eps=None, stats=None):
    """Gradients ``(dx, dweight)`` of :func:`rms_norm`; ``stats`` is ``(rstd,)`` or None."""
    dx, dweight, _ = _backward("rms_norm", dy, x, weight, stats, axis=axis, eps=eps)
    return dx, dweight


def instance_norm_backward(dy, x, weight=None, *, channel_axis=1, eps=1e-5, stats=None):
    """Gradients ``(dx, dweight, dbias)`` of :func:`instance_norm`."""
    return _backward("instance_norm", dy, x, weight, stats, channel_axis=channel_axis, eps=eps)


def group_norm_backward(dy, x, num_groups, weight=None, *, channel_axis=1, eps=1e-5, stats=None):
    """Gradients ``(dx, dweight, dbias)`` of :func:`group_norm`."""
    return _backward("group_norm", dy, x, weight, stats, channel_axis=channel_axis,
                     num_groups=num_groups, eps=eps)
