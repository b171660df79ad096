"""RMS norm of torch CPU rows in blocks: the forward of half rows, and forward + backward
wherever autograd records.

torch's CPU RMS norm (``_fused_rms_norm``) is composite: whole-array float32 conversions
and temporaries, and under autograd a graph of a dozen whole-array operations (measured,
2 threads: 8192 x 4096 float32 forward + backward 460-500 ms where ``F.layer_norm``'s takes
100; 8192 x 768 43 ms against 7).  Here rows ``x`` (normalized axes last, viewed as
``(rows, n)``) go through blocks of ``_BLOCK_BYTES`` of float32 (float64 for float64)::

    rstd = 1 / sqrt(sum(x^2) / n + eps)             (torch.linalg.vector_norm, squared)
    y    = x * rstd * w

    p  = dy * x;   dweight = p^T rstd   (the column sums of dy * xhat)
    dx = rstd * (w dy - rstd^2 (p @ w) / n * x)  -  drstd * rstd^3 * x / n

(the last term: a gradient reaching the returned rstd, as torch's composite passes one).
A backward that builds a graph (``create_graph=True``) differentiates the composite
formula instead.
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm"]

_HALF = (torch.float16, torch.bfloat16)
# float32 bytes of x's part of one block of rows.  Measured (2 threads, ms forward /
# backward, blocks of 128 KiB, 256 KiB, 1 MiB, 2 MiB): 8192 x 4096 float32 154/117, 80/88,
# 68/77, 62/81; bfloat16 100/118, 53/83, 38/74, 39/62; 8192 x 768 bfloat16 10/14, 5.5/11,
# 3.1/6.6, 2.2/7.5 (torch's ops split a block between threads: small blocks pay that often).
_BLOCK_BYTES = 1 << 20
# Elements from which a call autograd records takes the blocked function rather than torch's
# composite (whose graph costs less than a Python autograd.Function on small arrays).
# Measured, rows of 768, forward + backward us composite / blocked: 64 rows float32 191/320,
# bfloat16 245/397; 256 rows 905/456, 1027/817; 1024 rows 4204/1651, 6228/1779.
_AUTOGRAD_MIN_ELEMENTS = 1 << 17


def rms_norm(t, normalized, count, w, eps):
    """``(y, None, rstd)``: torch's ``_fused_rms_norm(t, normalized, w, eps)`` results for
    rows ``t`` (the ``normalized`` axes last, ``count`` elements a row), rstd float32 for
    half inputs.  Blocked where autograd records (from ``_AUTOGRAD_MIN_ELEMENTS``), and
    for half rows larger than a block without autograd; else torch's routine."""
    if torch.is_grad_enabled() and (t.requires_grad or (w is not None and w.requires_grad)):
        if t.numel() >= _AUTOGRAD_MIN_ELEMENTS:
            y, rstd = _RMSRows.apply(t, w, len(normalized), count, eps)
        else:
            y, rstd = torch._fused_rms_norm(t, normalized, w, eps)
        return y, None, rstd
    if t.dtype in _HALF and t.nbytes * 2 > _BLOCK_BYTES:
        y, rstd = _forward(t, w, len(normalized), count, eps)
        return y, None, rstd
    y, rstd = torch._fused_rms_norm(t, normalized, w, eps)
    return y, None, rstd


def _acc(dtype):
    return torch.float64 if dtype is torch.float64 else torch.float32


def _step(count, acc):
    """Rows a block."""
    return max(1, _BLOCK_BYTES // (acc.itemsize * count))


def _forward(t, w, k, count, eps):
    """``(y, rstd)`` in blocks of rows: one read of x, one write of y."""
    rows = t.numel() // count
    acc = _acc(t.dtype)
    x2 = t.reshape(rows, count)
    y = torch.empty((rows, count), dtype=t.dtype)
    rstd = torch.empty((rows, 1), dtype=acc)
    step = _step(count, acc)
    half = t.dtype in _HALF
    buf = torch.empty((min(step, rows), count), dtype=acc) if half else None
    wf = None if w is None else w.reshape(count).to(acc)
    scale = 1.0 / count
    for i in range(0, rows, step):
        j = min(i + step, rows)
        r = rstd[i:j]
        if half:
            xf = buf[:j - i]
            xf.copy_(x2[i:j])
            out = xf
        else:
            xf, out = x2[i:j], y[i:j]
        torch.linalg.vector_norm(xf, dim=1, keepdim=True, out=r)  # accumulates in acc
        r.square_().mul_(scale).add_(eps).rsqrt_()
        torch.mul(xf, r, out=out)
        if wf is not None:
            out.mul_(wf)
        if half:
            y[i:j].copy_(out)
    keep = t.shape[:t.dim() - k] + (1,) * k
    return y.view(t.shape), rstd.view(keep)


class _RMSRows(torch.autograd.Function):
    @staticmethod
    def forward(t, w, k, count, eps):
        return _forward(t, w, k, count, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        t, w, k, count, eps = inputs
        ctx.save_for_backward(t, w, output[1])
        ctx.k, ctx.count, ctx.eps = k, count, eps
        ctx.set_materialize_grads(False)  # an output no gradient reaches: None, no pass

    @staticmethod
    def backward(ctx, dy, drstd):
        t, w, rstd = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if dy is None and drstd is None:  # no gradient reached either output
            return None, None, None, None, None
        if torch.is_grad_enabled():  # create_graph: autograd of the composite formula
            dx, dw = _composite_grads(dy, drstd, t, w, ctx.k, ctx.eps, need_x, need_w)
        else:
            dx, dw = backward(dy, drstd, t, w, rstd, ctx.count, need_x, need_w)
        return dx, dw, None, None, None


def backward(dy, drstd, x, w, rstd, count, need_x=True, need_w=True):
    """``(dx, dweight)`` of RMS norm over rows ``x`` (the normalized axes last, ``count``
    elements a row) given its ``rstd``; ``dy``/``drstd`` the gradients reaching y and rstd
    (either may be None); None where not needed.

    Per block, with ``p = dy * x`` (float32): ``dweight += p^T rstd``; ``dx = rstd * (w dy
    + k * x)``, ``k = -rstd^2 (p @ w) / n - drstd rstd^2 / n`` per row: six passes, two of
    them BLAS reads."""
    rows = x.numel() // count
    acc = rstd.dtype
    x2 = x.reshape(rows, count)
    r2 = rstd.reshape(rows, 1)
    wf = None if w is None else w.reshape(count).to(acc)
    step = _step(count, acc)
    work = torch.empty((min(step, rows), count), dtype=acc)
    dx = torch.empty((rows, count), dtype=x.dtype) if need_x else None
    dw = torch.zeros(count, dtype=acc) if need_w and w is not None else None
    scale = -1.0 / count
    if dy is None:  # only rstd's gradient: dx = -drstd rstd^3 x / n
        if dx is not None:
            torch.mul(x2, drstd.reshape(rows, 1).to(acc) * r2.pow(3) * scale, out=dx)
    else:
        dy2 = dy.reshape(rows, count)
        extra = None if drstd is None else drstd.reshape(rows, 1).to(acc) * r2.square() * scale
        for i in range(0, rows, step):
            j = min(i + step, rows)
            r = r2[i:j]
            p = work[:j - i]
            torch.mul(dy2[i:j], x2[i:j], out=p)
            if dw is not None:
                dw.addmv_(p.t(), r.view(-1))
            if not need_x:
                continue
            k = (p.sum(1) if wf is None else torch.mv(p, wf))[:, None].mul_(r * r * scale)
            if extra is not None:
                k += extra[i:j]
            if wf is None:
                p.copy_(dy2[i:j])
            else:
                torch.mul(dy2[i:j], wf, out=p)
            p.addcmul_(x2[i:j], k)
            torch.mul(p, r, out=dx[i:j])
    return (None if dx is None else dx.view(x.shape),
            None if dw is None else dw.view(w.shape).to(w.dtype))


def _composite_grads(dy, drstd, t, w, k, eps, need_x, need_w):
    """``(dx, dweight)`` that autograd can differentiate again (double backward)."""
    with torch.enable_grad():
        v = t.float() if t.dtype in _HALF else t
        dims = tuple(range(t.dim() - k, t.dim()))
        rstd = torch.rsqrt(v.square().mean(dims, keepdim=True) + eps)
        y = v * rstd
        if w is not None:
            y = y * w
        outs, grads = [], []
        if dy is not None:
            outs.append(y.to(t.dtype))
            grads.append(dy)
        if drstd is not None:
            outs.append(rstd)
            grads.append(drstd)
        leaves = [a for a, wanted in ((t, need_x), (w, need_w)) if wanted]
        found = iter(torch.autograd.grad(outs, leaves, grads, create_graph=True,
                                         allow_unused=True))
    return next(found) if need_x else None, next(found) if need_w else None
