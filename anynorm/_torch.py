"""The torch CPU executor: PyTorch's fused routines, or the NumPy executor on the same memory.

``torch.native_layer_norm`` and ``torch._fused_rms_norm`` compute exactly the contract's
formula (biased variance, eps inside the square root) and return the statistics, with
autograd; they serve float32/float64 layer/RMS norm over trailing axes (what
``F.layer_norm`` runs).  ``torch.native_group_norm`` serves group norm with channels on
axis 1 of a contiguous tensor, or channels last (NHWC memory), as ``F.group_norm`` does;
``torch.native_batch_norm`` over the (1, N*C, spatial) view serves instance norm, as
``F.instance_norm`` does.

When no gradient is recorded, the blocked NumPy executor runs on the tensors' own memory
(``Tensor.numpy()``, zero-copy) wherever it is the faster or the more accurate: layer/RMS
rows longer than ``NATIVE_MAX_ROW``, instance norm, channels-first layer norm over long
runs, float16.  With autograd
on, layouts without a torch routine take the array-API core, whose torch operations
autograd differentiates.  bfloat16 (no NumPy dtype) and torch.compile tracing also do.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from . import _numpy, _reference

__all__ = ["forward", "backward"]

_NUMPY_DTYPES = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
                 torch.float64: np.dtype(np.float64)}
NATIVE_MAX_ROW = 2048
SHORT_RUN = 1024


def _same_dtype(plan, *params):
    return plan.dtype in (torch.float32, torch.float64) and all(
        p is None or p.dtype == plan.dtype for p in params)


def _trailing(plan):
    ndim, k = len(plan.shape), len(plan.reduce_axes)
    return plan.reduce_axes == tuple(range(ndim - k, ndim))


def native_forward(plan, src, weight, bias):
    """``(y, mean, rstd)`` from a torch routine, or None where none gives the same answer."""
    if not _same_dtype(plan, weight, bias) or src.numel() == 0:
        return None
    if plan.op in ("layer_norm", "rms_norm"):
        # other axes: the normalized ones moved last (torch copies to rows), as ConvNeXt does
        ndim = len(plan.shape)
        order = [a for a in range(ndim) if a not in plan.reduce_axes] + list(plan.reduce_axes)
        inverse = sorted(range(ndim), key=order.__getitem__)
        moved = not _trailing(plan)
        src = src.permute(order) if moved else src
        normalized = list(plan.param_shape)
        if plan.op == "rms_norm":
            y, rstd = torch._fused_rms_norm(src, normalized, weight, plan.eps)
            mean = None
        else:
            y, mean, rstd = torch.native_layer_norm(src, normalized, weight, bias, plan.eps)
        if moved:
            y, rstd = y.permute(inverse), rstd.permute(inverse)
            mean = None if mean is None else mean.permute(inverse)
        return y, _stats(plan, mean), _stats(plan, rstd)
    n, c = plan.shape[0], plan.shape[plan.channel_axis]
    spatial = math.prod(plan.shape) // (n * c)
    order = _channels_first(plan)
    if plan.op == "instance_norm":
        return _instance_norm(plan, src, weight, bias, n, c, order)
    groups = plan.num_groups
    if order is None:
        if not src.is_contiguous():
            return None
        y, mean, rstd = torch.native_group_norm(src, weight, bias, n, c, spatial, groups, plan.eps)
        return y, _stats(plan, mean), _stats(plan, rstd)
    if plan.op != "group_norm" or not _channels_last_memory(src.permute(order)):
        return None
    # channels last (NHWC): torch's channels-last kernel on the NCHW view, as F.group_norm runs
    y, mean, rstd = torch.native_group_norm(src.permute(order), weight, bias, n, c, spatial, groups,
                                            plan.eps)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return y.permute(inverse), _stats(plan, mean), _stats(plan, rstd)


def _instance_norm(plan, src, weight, bias, n, c, order):
    """Instance norm as ``F.instance_norm`` runs it: batch norm's training-mode kernel over the
    (1, N*C, spatial) view, weight and bias repeated per sample.  torch's group-norm kernel
    with C groups gives the same formula but loses more digits on rows far from zero."""
    nchw = src if order is None else src.permute(order)
    repeat = (lambda p: None if p is None else p.repeat(n))
    y, mean, rstd = torch.native_batch_norm(nchw.reshape(1, n * c, -1), repeat(weight), repeat(bias),
                                            None, None, True, 0.0, plan.eps)
    y = y.reshape(nchw.shape)
    if order is not None:
        y = y.permute(sorted(range(len(order)), key=order.__getitem__))
    return y, _stats(plan, mean), _stats(plan, rstd)


def _stats(plan, t):
    """A statistic in the public shape (torch's row kernels already give it: no reshape)."""
    if t is None or t.shape == plan.stats_shape:
        return t
    return t.reshape(plan.stats_shape)


def _channels_first(plan):
    """None when channels are on axis 1, else the permutation that puts them there."""
    c = plan.channel_axis
    if c == 1:
        return None
    return [0, c] + [a for a in range(1, len(plan.shape)) if a != c]


def _channels_last_memory(view):
    """True for an NCHW (NCDHW) view whose memory is channels-last, which torch's kernels take."""
    if view.dim() == 4:
        return view.is_contiguous(memory_format=torch.channels_last)
    if view.dim() == 5:
        return view.is_contiguous(memory_format=torch.channels_last_3d)
    return False


def _numpy_plan(plan):
    """The same plan, described in NumPy's terms (made once per plan)."""
    numpy_plan = plan.memo.get("numpy")
    if numpy_plan is None:
        import array_api_compat.numpy as xp

        numpy_plan = plan.memo["numpy"] = dataclasses.replace(
            plan, xp=xp, dtype=_NUMPY_DTYPES[plan.dtype], acc_dtype=_NUMPY_DTYPES[plan.acc_dtype])
    return numpy_plan


def _numpy_eligible(plan, *tensors):
    """True when the NumPy executor may run on these tensors' memory: CPU, plain tensors of a
    NumPy dtype, no gradient to record, not being traced by torch.compile."""
    if plan.dtype not in _NUMPY_DTYPES or torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES:
            return False
        if grad and t.requires_grad:
            return False
    return True


def _as_numpy(t):
    return None if t is None else t.detach().numpy()


def _as_torch(a):
    return None if a is None else torch.from_numpy(a)


def _prefers_native(plan):
    """Where torch's own routine beats the NumPy executor on the CPU (measured, see
    asv_bench/README.md): group norm; layer/RMS norm rows up to NATIVE_MAX_ROW long (beyond
    that torch's row kernel falls to a fraction of memory bandwidth); other layer/RMS axes
    when the contiguous run after them is short (ConvNeXt's late stages: 14 x 14)."""
    if plan.op in ("layer_norm", "rms_norm"):
        if _trailing(plan):
            return plan.count <= NATIVE_MAX_ROW
        return math.prod(plan.shape[plan.reduce_axes[-1] + 1:]) < SHORT_RUN
    return plan.op == "group_norm"


def forward(plan, x, weight=None, bias=None, residual=None):
    """Return ``(y, h, mean, rstd)`` as :func:`anynorm._reference.forward` does."""
    if not _prefers_native(plan) and _numpy_eligible(plan, x, weight, bias, residual):
        outs = _numpy.forward(_numpy_plan(plan), _as_numpy(x), _as_numpy(weight), _as_numpy(bias),
                              _as_numpy(residual))
        return tuple(_as_torch(a) for a in outs)
    h = _reference.add_residual(plan, x, residual) if residual is not None else None
    native = native_forward(plan, h if h is not None else x, weight, bias)
    if native is None:
        return _reference.forward(plan, x, weight, bias, residual)
    y, mean, rstd = native
    return y, h, mean, rstd


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """Return ``(dx, dweight, dbias)`` as :func:`anynorm._reference.backward` does."""
    if _numpy_eligible(plan, dy, x, weight, mean, rstd):
        outs = _numpy.backward(_numpy_plan(plan), _as_numpy(dy), _as_numpy(x), _as_numpy(weight),
                               _as_numpy(mean), _as_numpy(rstd))
        return tuple(_as_torch(a) for a in outs)
    return _reference.backward(plan, dy, x, weight, mean, rstd)
