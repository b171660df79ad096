"""The public functions: plan the call once, then hand it to one executor.

Formula (per normalized slice of n elements)::

    mean = sum(x) / n;  var = sum((x - mean)^2) / n;  rstd = 1 / sqrt(var + eps)
    y    = (x - mean) * rstd * weight + bias          (RMS norm: y = x * rstd * weight,
                                                        rstd = 1 / sqrt(sum(x^2) / n + eps))
"""

from __future__ import annotations

from ._calls import backward_call, forward_call
from ._plan import check_float, namespace_of

__all__ = [
    "layer_norm", "rms_norm", "instance_norm", "group_norm",
    "layer_norm_backward", "rms_norm_backward", "instance_norm_backward", "group_norm_backward",
]


def _forward(op, x, weight, bias, residual, return_stats, axis, channel_axis, num_groups, eps):
    """One forward call (arguments by position: keywords cost each tiny call ~0.1 us)."""
    plan, run = forward_call(op, x, weight, bias, residual, return_stats, axis, channel_axis,
                             num_groups, eps)
    y, h, mean, rstd = run(x, weight, bias, residual)
    if not return_stats and residual is None:  # the plain call: no tuple to build
        return y
    out = (y,) if residual is None else (y, h)
    if return_stats:
        out += (rstd,) if op == "rms_norm" else (mean, rstd)
    return out[0] if len(out) == 1 else out


def _split_stats(plan, stats):
    """``(mean, rstd)`` from ``stats`` as ``return_stats=True`` gave it ((None, None) when absent)."""
    if stats is None:
        return None, None
    if not isinstance(stats, (tuple, list)):
        stats = (stats,)
    return (stats[0], stats[1]) if plan.center else (None, stats[0])


def _check_backward(plan, x, dy, stats):
    """dy and stats of a ``*_backward`` call (once per call signature)."""
    namespace_of(x, dy=dy)
    if tuple(dy.shape) != plan.shape:
        raise ValueError(f"dy must have x's shape {plan.shape}, got shape {tuple(dy.shape)}")
    check_float(plan.xp, "dy", dy)
    if stats is None:
        return
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


def _backward(op, dy, x, weight, stats, axis=-1, channel_axis=1, num_groups=None, eps=1e-5):
    plan, executor = backward_call(op, dy, x, weight, stats, axis, channel_axis, num_groups, eps,
                                   _check_backward)
    mean, rstd = _split_stats(plan, stats)
    return executor.backward(plan, dy, x, weight, mean, rstd)


def layer_norm(x, weight=None, bias=None, *, axis=-1, eps=1e-5, return_stats=False, residual=None):
    """Layer norm of ``x`` over ``axis`` (an int or a tuple of ints, jointly).

    For the n elements x of each slice over the normalized axes::

        mean = sum(x) / n
        var  = sum((x - mean)^2) / n          # biased, as in PyTorch
        rstd = 1 / sqrt(var + eps)
        y    = (x - mean) * rstd * weight + bias

    Statistics accumulate in float32 for float16/bfloat16 inputs (float64 for float64) with a
    two-pass or Welford algorithm.  ``y`` has ``x``'s shape, dtype, device and library; torch
    autograd works through it.

    Args:
        x: a floating-point array of any array-API library (NumPy, torch, CuPy, Dask, JAX, ...).
        weight, bias: None or arrays of ``x``'s library, shape
            ``tuple(x.shape[a] for a in sorted(axes))``: ``(D,)`` for ``axis=-1``, ``(C,)``
            for ``axis=1`` on NCHW input (ConvNeXt's channels-first LayerNorm).
        axis: int or tuple of ints, any order, negatives allowed; default -1.
        eps: a finite float >= 0; default 1e-5.
        return_stats: also return ``mean`` and ``rstd`` (float32 for float16/bfloat16 input,
            else ``x``'s dtype), the normalized axes kept as size 1.
        residual: None or an array of ``x``'s shape, dtype and library: then the norm is of
            ``h = x + residual`` (a pre-norm transformer block's residual add, fused), and
            ``h`` is returned after ``y``.

    Returns:
        ``y``; ``(y, mean, rstd)`` with ``return_stats``; ``(y, h)`` or ``(y, h, mean, rstd)``
        with ``residual``.

    Example::

        >>> import numpy as np, anynorm
        >>> x = np.random.default_rng(0).standard_normal((4, 5, 3)).astype(np.float32)
        >>> y = anynorm.layer_norm(x, axis=(-2, -1))            # statistics over 5 x 3
        >>> y, mean, rstd = anynorm.layer_norm(x, axis=1, return_stats=True)
        >>> mean.shape
        (4, 1, 3)
        >>> import torch
        >>> t = torch.randn(8, 96, 14, 14, requires_grad=True)
        >>> y = anynorm.layer_norm(t, torch.ones(96), torch.zeros(96), axis=1)
        >>> y.sum().backward()                                  # t.grad: autograd works
        >>> y, h = anynorm.layer_norm(t, residual=torch.randn(8, 96, 14, 14))

    Raises:
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``weight``,
            ``bias`` or ``residual`` come from another library.
        ValueError: an axis out of range or repeated; ``weight``/``bias`` of the wrong shape;
            ``residual`` not of ``x``'s shape and dtype; ``eps`` negative or not finite; a
            normalized extent of size 0; a 0-d ``x``; arrays on different devices.  (A batch
            of size 0 is no error: the result is empty.)
    """
    return _forward("layer_norm", x, weight, bias, residual, return_stats, axis, 1, None, eps)


def rms_norm(x, weight=None, *, axis=-1, eps=None, return_stats=False, residual=None):
    """RMS norm: ``y = x / sqrt(mean(x^2) + eps) * weight`` over ``axis``.

    For the n elements x of each slice over the normalized axes (no centring)::

        rstd = 1 / sqrt(sum(x^2) / n + eps)
        y    = x * rstd * weight

    Args:
        x: a floating-point array of any array-API library.
        weight: None or an array of ``x``'s library, shape
            ``tuple(x.shape[a] for a in sorted(axes))``.
        axis: int or tuple of ints, any order, negatives allowed; default -1.
        eps: a finite float >= 0, or None (the default): ``finfo(x.dtype).eps``, as in PyTorch.
        return_stats: also return ``rstd`` (float32 for float16/bfloat16 input), the
            normalized axes kept as size 1.
        residual: None or an array of ``x``'s shape, dtype and library: the norm is then of
            ``h = x + residual``, and ``h`` is returned after ``y``.

    Returns:
        ``y``; ``(y, rstd)`` with ``return_stats``; ``(y, h)`` or ``(y, h, rstd)`` with ``residual``.

    Example::

        >>> import numpy as np, anynorm
        >>> x = np.random.default_rng(0).standard_normal((2, 16, 64)).astype(np.float32)
        >>> y, rstd = anynorm.rms_norm(x, np.ones(64, np.float32), return_stats=True)
        >>> rstd.shape
        (2, 16, 1)
        >>> import torch
        >>> h = torch.randn(2, 16, 4096, dtype=torch.bfloat16)
        >>> y, h2 = anynorm.rms_norm(h, torch.ones(4096, dtype=torch.bfloat16), residual=h)

    Raises:
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``weight``
            or ``residual`` come from another library.
        ValueError: an axis out of range or repeated; ``weight`` of the wrong shape;
            ``residual`` not of ``x``'s shape and dtype; ``eps`` negative or not finite; a
            normalized extent of size 0; a 0-d ``x``; arrays on different devices.
    """
    return _forward("rms_norm", x, weight, None, residual, return_stats, axis, 1, None, eps)


def instance_norm(x, weight=None, bias=None, *, channel_axis=1, eps=1e-5, return_stats=False):
    """Instance norm: statistics per (sample, channel) over every other axis.

    Axis 0 is the batch.  For the n elements x of one (sample, channel)::

        mean = sum(x) / n;  var = sum((x - mean)^2) / n;  rstd = 1 / sqrt(var + eps)
        y    = (x - mean) * rstd * weight[c] + bias[c]

    Args:
        x: a floating-point array of any array-API library, at least 2-d (batch, channels,
            any number of spatial axes).
        weight, bias: None or arrays of ``x``'s library, shape ``(C,)``.
        channel_axis: the channels' axis, not 0; default 1 (NCHW); -1 for channels-last
            (NHWC) input: the channel-wise layer norm of convolution outputs.
        eps: a finite float >= 0; default 1e-5.
        return_stats: also return ``mean`` and ``rstd``, every axis but the batch and the
            channels kept as size 1: ``(N, C, 1, 1)`` for NCHW.

    Returns:
        ``y``, or ``(y, mean, rstd)`` with ``return_stats``.

    Example::

        >>> import numpy as np, anynorm
        >>> img = np.random.default_rng(1).standard_normal((2, 16, 8, 8)).astype(np.float32)
        >>> y, mean, rstd = anynorm.instance_norm(img, return_stats=True)
        >>> mean.shape
        (2, 16, 1, 1)
        >>> y = anynorm.instance_norm(img.transpose(0, 2, 3, 1), channel_axis=-1)   # NHWC
        >>> import torch
        >>> t = torch.randn(2, 16, 8, 8, 8, requires_grad=True)                       # 3-d images
        >>> anynorm.instance_norm(t, torch.ones(16), torch.zeros(16)).sum().backward()

    Raises:
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``weight``
            or ``bias`` come from another library.
        ValueError: ``channel_axis`` out of range or 0 (the batch); ``weight``/``bias`` not
            of shape ``(C,)``; ``eps`` negative or not finite; a spatial extent of size 0;
            a 0-d ``x``; arrays on different devices.
    """
    return _forward("instance_norm", x, weight, bias, None, return_stats, -1, channel_axis,
                    None, eps)


def group_norm(x, num_groups, weight=None, bias=None, *, channel_axis=1, eps=1e-5, return_stats=False):
    """Group norm: channels split into ``num_groups`` consecutive groups.

    Statistics per (sample, group) over the group's channels and every non-batch axis, as in
    PyTorch and ONNX.  For the n elements x of one (sample, group)::

        mean = sum(x) / n;  var = sum((x - mean)^2) / n;  rstd = 1 / sqrt(var + eps)
        y    = (x - mean) * rstd * weight[c] + bias[c]

    Args:
        x: a floating-point array of any array-API library, at least 2-d.
        num_groups: a positive divisor of the channel count C.
        weight, bias: None or arrays of ``x``'s library, shape ``(C,)``.
        channel_axis: the channels' axis, not 0; default 1 (NCHW); -1 for channels-last (NHWC).
        eps: a finite float >= 0; default 1e-5.
        return_stats: also return ``mean`` and ``rstd``, shape ``(N, num_groups)``.

    Returns:
        ``y``, or ``(y, mean, rstd)`` with ``return_stats``.

    Example::

        >>> import numpy as np, anynorm
        >>> img = np.random.default_rng(1).standard_normal((2, 16, 8, 8)).astype(np.float32)
        >>> y, mean, rstd = anynorm.group_norm(img, 4, return_stats=True)   # 4 groups of 4
        >>> mean.shape
        (2, 4)
        >>> import torch
        >>> nhwc = torch.randn(2, 8, 8, 256)
        >>> y = anynorm.group_norm(nhwc, 32, torch.ones(256), torch.zeros(256), channel_axis=-1)

    Raises:
        TypeError: ``x`` is not an array; its dtype is integer, bool or complex; ``weight``
            or ``bias`` come from another library.
        ValueError: ``num_groups`` not a positive divisor of the channel count;
            ``channel_axis`` out of range or 0 (the batch); ``weight``/``bias`` not of shape
            ``(C,)``; ``eps`` negative or not finite; a 0-d ``x``; arrays on different devices.
    """
    return _forward("group_norm", x, weight, bias, None, return_stats, -1, channel_axis,
                    num_groups, eps)


def layer_norm_backward(dy, x, weight=None, *, axis=-1, eps=1e-5, stats=None):
    """Gradients ``(dx, dweight, dbias)`` of :func:`layer_norm` given ``dy = dL/dy``.

    For libraries without autograd (NumPy, CuPy); torch users get the same from autograd.
    With ``xhat = (x - mean) * rstd`` and ``g = dy * weight``, per normalized slice::

        dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))
        dweight = sum(dy * xhat),  dbias = sum(dy)      # over every axis but the normalized ones

    Args:
        dy: the gradient of the loss with respect to ``y``: ``x``'s shape and library.
        x, weight, axis, eps: as given to :func:`layer_norm` (``x`` is ``h = x + residual``
            after a fused residual call; both ``x`` and ``residual`` then receive ``dx``).
        stats: the ``(mean, rstd)`` that ``return_stats=True`` gave, or None to recompute them.

    Returns:
        ``(dx, dweight, dbias)``; ``dweight`` and ``dbias`` are None when ``weight`` is None.

    Example::

        >>> import numpy as np, anynorm
        >>> x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
        >>> w = np.ones(8, np.float32)
        >>> y, mean, rstd = anynorm.layer_norm(x, w, return_stats=True)
        >>> dx, dw, db = anynorm.layer_norm_backward(np.ones_like(x), x, w, stats=(mean, rstd))
        >>> import torch                       # the same numbers autograd gives on tensors
        >>> dx, dw, db = anynorm.layer_norm_backward(torch.ones(4, 8), torch.randn(4, 8), torch.ones(8))

    Raises:
        TypeError: as :func:`layer_norm`; ``dy`` from another library or not real floating-point.
        ValueError: as :func:`layer_norm`; ``dy`` not of ``x``'s shape; ``stats`` not two
            arrays of the statistics' shape.
    """
    return _backward("layer_norm", dy, x, weight, stats, axis=axis, eps=eps)


def rms_norm_backward(dy, x, weight=None, *, axis=-1, eps=None, stats=None):
    """Gradients ``(dx, dweight)`` of :func:`rms_norm` given ``dy = dL/dy``.

    With ``xhat = x * rstd`` and ``g = dy * weight``, per normalized slice::

        dx      = rstd * (g - xhat * mean(g * xhat))
        dweight = sum(dy * xhat)                        # over every axis but the normalized ones

    Args:
        dy: the gradient of the loss with respect to ``y``: ``x``'s shape and library.
        x, weight, axis, eps: as given to :func:`rms_norm`.
        stats: ``(rstd,)`` (or ``rstd``) as ``return_stats=True`` gave it, or None to recompute.

    Returns:
        ``(dx, dweight)``; ``dweight`` is None when ``weight`` is None.

    Example::

        >>> import numpy as np, anynorm
        >>> x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
        >>> y, rstd = anynorm.rms_norm(x, return_stats=True)
        >>> dx, dw = anynorm.rms_norm_backward(np.ones_like(x), x, stats=(rstd,))   # dw is None
        >>> import torch
        >>> dx, dw = anynorm.rms_norm_backward(torch.ones(4, 8), torch.randn(4, 8), torch.ones(8))

    Raises:
        TypeError: as :func:`rms_norm`; ``dy`` from another library or not real floating-point.
        ValueError: as :func:`rms_norm`; ``dy`` not of ``x``'s shape; ``stats`` not one array
            of the statistics' shape.
    """
    dx, dweight, _ = _backward("rms_norm", dy, x, weight, stats, axis=axis, eps=eps)
    return dx, dweight


def instance_norm_backward(dy, x, weight=None, *, channel_axis=1, eps=1e-5, stats=None):
    """Gradients ``(dx, dweight, dbias)`` of :func:`instance_norm` given ``dy = dL/dy``.

    With ``xhat = (x - mean) * rstd`` and ``g = dy * weight[c]``, per (sample, channel)::

        dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))
        dweight = sum(dy * xhat),  dbias = sum(dy)      # per channel, over every other axis

    Args:
        dy: the gradient of the loss with respect to ``y``: ``x``'s shape and library.
        x, weight, channel_axis, eps: as given to :func:`instance_norm`.
        stats: the ``(mean, rstd)`` that ``return_stats=True`` gave, or None to recompute them.

    Returns:
        ``(dx, dweight, dbias)``; ``dweight`` and ``dbias`` are None when ``weight`` is None.

    Example::

        >>> import numpy as np, anynorm
        >>> x = np.random.default_rng(0).standard_normal((2, 3, 5, 5))
        >>> dx, dw, db = anynorm.instance_norm_backward(np.ones_like(x), x, np.ones(3))
        >>> import torch
        >>> t = torch.randn(2, 5, 5, 3)                                       # NHWC
        >>> dx, dw, db = anynorm.instance_norm_backward(torch.ones_like(t), t, torch.ones(3),
        ...                                             channel_axis=-1)

    Raises:
        TypeError: as :func:`instance_norm`; ``dy`` from another library or not real floating-point.
        ValueError: as :func:`instance_norm`; ``dy`` not of ``x``'s shape; ``stats`` not two
            arrays of the statistics' shape.
    """
    return _backward("instance_norm", dy, x, weight, stats, channel_axis=channel_axis, eps=eps)


def group_norm_backward(dy, x, num_groups, weight=None, *, channel_axis=1, eps=1e-5, stats=None):
    """Gradients ``(dx, dweight, dbias)`` of :func:`group_norm` given ``dy = dL/dy``.

    With ``xhat = (x - mean) * rstd`` and ``g = dy * weight[c]``, per (sample, group)::

        dx      = rstd * (g - mean(g) - xhat * mean(g * xhat))
        dweight = sum(dy * xhat),  dbias = sum(dy)      # per channel, over every other axis

    Args:
        dy: the gradient of the loss with respect to ``y``: ``x``'s shape and library.
        x, num_groups, weight, channel_axis, eps: as given to :func:`group_norm`.
        stats: the ``(mean, rstd)`` that ``return_stats=True`` gave (shape
            ``(N, num_groups)``), or None to recompute them.

    Returns:
        ``(dx, dweight, dbias)``; ``dweight`` and ``dbias`` are None when ``weight`` is None.

    Example::

        >>> import numpy as np, anynorm
        >>> x = np.random.default_rng(0).standard_normal((2, 8, 4, 4))
        >>> y, mean, rstd = anynorm.group_norm(x, 2, return_stats=True)
        >>> dx, dw, db = anynorm.group_norm_backward(np.ones_like(x), x, 2, stats=(mean, rstd))
        >>> import torch
        >>> t = torch.randn(2, 8, 4, 4)
        >>> dx, dw, db = anynorm.group_norm_backward(torch.ones_like(t), t, 2, torch.ones(8))

    Raises:
        TypeError: as :func:`group_norm`; ``dy`` from another library or not real floating-point.
        ValueError: as :func:`group_norm`; ``dy`` not of ``x``'s shape; ``stats`` not two
            arrays of shape ``(N, num_groups)``.
    """
    return _backward("group_norm", dy, x, weight, stats, channel_axis=channel_axis,
                     num_groups=num_groups, eps=eps)
