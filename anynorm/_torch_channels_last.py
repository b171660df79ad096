"""Group and instance norm of channels-last torch CPU tensors under autograd: torch's forward
kernel, a backward in float32 blocks of samples.

torch's CPU backward for channels-last group norm (``native_group_norm_backward`` on NHWC
memory) loops over each group's few channels: with one or two channels a group it is 10-40x
slower than on contiguous memory (32 x 64 x 56 x 56, torch 2.13, 2 threads: bfloat16 instance
norm 92-104 ms, float32 28-34 ms, where contiguous NCHW memory takes 2.4 ms).  The
backward here works on the (N, HW, C) view of the same memory, a few samples at a time, with
vectorized torch operations over the channels::

    xhat = (x - mean) * rstd                      per (n, group)
    P[n, c] = sum_hw dy,   Q[n, c] = sum_hw dy * xhat
    dbias = sum_n P,       dweight = sum_n Q
    A = sum_{c in g} w P / m,   B = sum_{c in g} w Q / m      (m = HW x channels a group)
    dx = rstd * (w dy - A - xhat B)

in float32 (float64 for float64 inputs), each block's float32 values made from x's dtype by
the first operation that reads it (torch's type promotion: no whole-array conversion), and
rounded once into dx.  A backward that builds a graph (``create_graph=True``) differentiates
the forward's formula in torch operations instead (torch's ``native_group_norm_backward``
has no derivative).
"""

from __future__ import annotations

import torch

__all__ = ["group_norm"]

# float32 bytes of x's part of one block of samples; with dy's, xhat's and a product's the
# block's working set is about 3x this, in a shared L3 (32 MiB here).  Measured (2 threads,
# backward ms at 256 KiB / 1 / 4 / 16 MiB): 32 x 64 x 56 x 56 bfloat16 instance norm 23.9 /
# 11.2 / 5.3 / 28.3, 8 x 1280 x 8 x 8 2.7 / 0.9 / 0.7 / 0.7; 2 and 4 MiB level elsewhere.
# A sample larger than this is cut into runs of its spatial positions, which then reads x
# and dy twice.
_BLOCK_BYTES = 1 << 21


def group_norm(t, w, b, n, c, spatial, groups, eps):
    """``torch.native_group_norm(t, w, b, n, c, spatial, groups, eps)`` for ``t`` in
    channels-last memory (N, C, *spatial strided as N, *spatial, C): ``(y, mean, rstd)``,
    y in t's layout, statistics (N, groups); the blocked backward when autograd records."""
    if torch.is_grad_enabled() and (t.requires_grad or (w is not None and w.requires_grad)
                                    or (b is not None and b.requires_grad)):
        return _ChannelsLastGroupNorm.apply(t, w, b, n, c, spatial, groups, eps)
    return torch.native_group_norm(t, w, b, n, c, spatial, groups, eps)


class _ChannelsLastGroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(t, w, b, n, c, spatial, groups, eps):
        return torch.native_group_norm(t, w, b, n, c, spatial, groups, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        t, w, b, n, c, spatial, groups, eps = inputs
        _, mean, rstd = output
        ctx.save_for_backward(t, w, b, mean, rstd)
        ctx.sizes = n, c, spatial, groups, eps

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        # torch's kernel ignores gradients reaching the statistics; so does this backward
        t, w, b, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        n, c, spatial, groups, eps = ctx.sizes
        if torch.is_grad_enabled():  # create_graph: autograd of the composite formula
            grads = _composite_grads(dy, t, w, b, n, groups, eps, need)
        else:
            grads = backward(dy, t, mean, rstd, w, groups, need[0], need[1] and w is not None,
                             b.dtype if need[2] and b is not None else None)
        return (*grads, None, None, None, None, None)


def _composite_grads(dy, t, w, b, n, groups, eps, need):
    """``(dx, dweight, dbias)`` that autograd can differentiate again (double backward):
    the forward's formula in torch operations, differentiated with ``create_graph``
    (torch's ``native_group_norm_backward`` has no derivative of its own)."""
    with torch.enable_grad():
        half = t.dtype in (torch.float16, torch.bfloat16)
        v = (t.float() if half else t).reshape(n, groups, -1)
        mean = v.mean(-1, keepdim=True)
        centred = v - mean
        y = (centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + eps)).reshape(t.shape)
        shape = (1, -1) + (1,) * (t.dim() - 2)
        if w is not None:
            y = y * w.reshape(shape)
        if b is not None:
            y = y + b.reshape(shape)
        leaves = [a for a, wanted in zip((t, w, b), need) if wanted]
        found = iter(torch.autograd.grad(y.to(t.dtype), leaves, dy, create_graph=True,
                                         allow_unused=True))
    return tuple(next(found) if wanted else None for wanted in need)


def _nhwc(t, n, spatial, c):
    """The (N, HW, C) view of channels-last ``t`` (a copy where ``t`` is not: ``dy`` may come
    in any layout)."""
    return t.permute(0, *range(2, t.dim()), 1).reshape(n, spatial, c)


def backward(dy, x, mean, rstd, w, groups, need_x=True, need_w=True, bias_dtype=None):
    """``(dx, dweight, dbias)`` of group norm over channels-last ``x`` (N, C, *spatial)
    given its statistics ``mean``/``rstd`` (N, groups): dx in x's dtype and layout (None
    unless ``need_x``), dweight in ``w``'s dtype (None unless ``need_w`` and a weight),
    dbias in ``bias_dtype`` (None when that is None)."""
    n, c = x.shape[:2]
    spatial = x.numel() // max(1, n * c)
    d = c // groups
    acc = torch.float64 if x.dtype is torch.float64 else torch.float32
    xs, dys = _nhwc(x, n, spatial, c), _nhwc(dy, n, spatial, c)
    dx = dxs = None
    if need_x:  # made as (N, *spatial, C) memory, seen as (N, C, *spatial): x's layout
        dx_last = torch.empty((n, *x.shape[2:], c), dtype=x.dtype)
        dxs = dx_last.view(n, spatial, c)
        dx = dx_last.permute(0, x.dim() - 1, *range(1, x.dim() - 1))
    # per (sample, channel): the group's statistics, the weight folded in
    mc = mean.to(acc).repeat_interleave(d, 1)
    rc = rstd.to(acc).repeat_interleave(d, 1)
    wf = None if w is None else w.to(acc)
    p = torch.empty((n, c), dtype=acc)
    q = torch.empty((n, c), dtype=acc)
    per_sample = spatial * c * acc.itemsize
    if per_sample <= _BLOCK_BYTES:
        step, run = max(1, _BLOCK_BYTES // max(1, per_sample)), spatial
    else:
        step, run = 1, max(1, _BLOCK_BYTES * spatial // per_sample)
    blocks = [(s, min(s + step, n), h, min(h + run, spatial))
              for s in range(0, n, step) for h in range(0, spatial, run)]
    shape = (min(step, n), min(run, spatial), c)
    xhat = torch.empty(shape, dtype=acc)
    work = torch.empty(shape, dtype=acc)

    def centred(s, e, h, k):
        """xhat of samples s:e, positions h:k, in the reused buffer."""
        out = xhat[:e - s, :k - h]
        torch.sub(xs[s:e, h:k], mc[s:e, None], out=out)
        return out.mul_(rc[s:e, None])

    def dx_block(s, e, h, k, xh, out):
        """dx of samples s:e, positions h:k, from their xhat (overwritten) and the finished
        sums p, q of those samples; ``out``: a float32 buffer of the block's shape."""
        ps, qs = p[s:e], q[s:e]
        if wf is not None:
            ps, qs = ps * wf, qs * wf
        # the group means A, B, spread back over the group's channels
        a = ps.view(e - s, groups, d).sum(2, keepdim=True).div_(m).expand(e - s, groups, d)
        bq = qs.view(e - s, groups, d).sum(2, keepdim=True).div_(m).expand(e - s, groups, d)
        r = rc[s:e]
        scale = r if wf is None else r * wf         # rstd w
        shift = (r * a.reshape(e - s, c))[:, None]   # rstd A
        slope = (r * bq.reshape(e - s, c))[:, None]  # rstd B
        torch.mul(dys[s:e, h:k], scale[:, None], out=out)
        out.sub_(shift).sub_(xh.mul_(slope))
        dxs[s:e, h:k].copy_(out)

    m = spatial * d
    single = run == spatial  # one block holds whole samples: xhat serves both passes
    for s, e, h, k in blocks:
        g = dys[s:e, h:k]
        xh = centred(s, e, h, k)
        prod = work[:e - s, :k - h]
        torch.mul(g, xh, out=prod)
        if h == 0:
            torch.sum(g, 1, dtype=acc, out=p[s:e])
            torch.sum(prod, 1, out=q[s:e])
        else:
            p[s:e] += g.sum(1, dtype=acc)
            q[s:e] += prod.sum(1)
        if single and need_x:
            dx_block(s, e, h, k, xh, prod)
    if need_x and not single:
        for s, e, h, k in blocks:
            dx_block(s, e, h, k, centred(s, e, h, k), work[:e - s, :k - h])
    dw = q.sum(0).to(w.dtype) if need_w and w is not None else None
    db = None if bias_dtype is None else p.sum(0).to(bias_dtype)
    return dx, dw, db
