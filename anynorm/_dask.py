"""The Dask executor: normalization over axes that span chunks, in memory bounded by a few chunks.

Two paths, chosen per call from ``x``'s chunks:

* **blockwise** (every normalized axis inside one chunk): ``map_blocks`` runs the chunk's own
  executor (NumPy's for NumPy chunks, the CUDA kernels or the array-API core for CuPy chunks)
  on each chunk, one pass, as if the chunk were the whole array.
* **two passes** (a normalized axis spans chunks):

  1. statistics as a tree reduction (``dask.array.reduction``) of small per-chunk partials
     ``(count, mean, M2)`` per normalized slice, merged with Chan's formula in float64 (the
     partials are slice-sized, not chunk-sized); per chunk the partial is the corrected
     two-pass of the array-API core, in the accumulation dtype (float32 for half inputs);
  2. an elementwise pass over ``x`` read again from its source: ``dask.graph_manipulation.bind``
     clones ``x``'s graph and makes the clone's roots wait for the statistics, so the source
     chunks are recomputed or re-read after the statistics rather than held from pass 1.

  The mean is carried into pass 2 as ``hi + lo`` (``hi`` its rounding to the accumulation
  dtype, ``lo`` the remainder), and ``y = (x - hi) * a + (b - lo * a)`` with
  ``a = rstd * weight``: float32 data offset by 1e6 keeps float32 rounding (``x - hi`` is
  exact near the mean), never ``E[x^2] - E[x]^2``.

  Backward is the same shape: one reduction of per-chunk sums of ``g = dy * weight`` and
  ``g * (x - mean)`` (with the statistics themselves when ``stats`` is None, the centred sums
  shifted by Chan's correction), then one elementwise pass over re-read ``x`` and ``dy``;
  ``dweight``/``dbias`` are ordinary Dask sums over the non-parameter axes.

Group norm works in ``x``'s own axes: the channel axis is rechunked to whole groups, and each
chunk is viewed as ``(..., groups, channels/group, ...)`` inside the chunk function.  Chunk
arithmetic goes through the chunk's own array namespace (``array_api_compat``), so the same
graph serves NumPy and CuPy chunks.  Results stay lazy.
"""

from __future__ import annotations

import math

import array_api_compat
import dask.array as da
from dask.graph_manipulation import bind

__all__ = ["forward", "backward", "spans_chunks"]


# --- geometry ------------------------------------------------------------------------------

class _ChunkPlan:
    """What the chunk functions need from a :class:`~anynorm._plan.Plan`, picklable."""

    def __init__(self, plan):
        import numpy as np
        self.op, self.shape, self.eps, self.count = plan.op, plan.shape, plan.eps, plan.count
        self.dtype, self.acc_dtype = np.dtype(plan.dtype), np.dtype(plan.acc_dtype)
        self.center, self.reduce_axes = plan.center, plan.reduce_axes
        self.channel_axis, self.num_groups = plan.channel_axis, plan.num_groups


class _Geom:
    """How one plan lies on ``x``'s axes and chunks.

    ``red``: axes of ``x`` that the statistics run over across chunks (group norm: every axis
    but the batch and the channels; the channels are cut into whole groups per chunk);
    ``par``: axes of ``x`` that weight/bias lie along; ``s_shape``/``s_chunks``: the
    statistics laid on ``x``'s axes (size 1 on ``red``, groups on group norm's channel axis).
    """

    def __init__(self, plan, chunks):
        # plain values only (no namespace module): the chunk functions travel to workers
        self.plan = _ChunkPlan(plan)
        shape = plan.shape
        ndim = len(shape)
        self.group = plan.op == "group_norm"
        c = plan.channel_axis
        if self.group:
            self.gs = shape[c] // plan.num_groups
            self.red = tuple(a for a in range(ndim) if a not in (0, c))
        else:
            self.gs = 1
            self.red = plan.reduce_axes
        self.par = plan.param_axes if plan.op in ("layer_norm", "rms_norm") else (c,)
        self.nonpar = tuple(a for a in range(ndim) if a not in self.par)
        self.chunks = chunks
        self.s_shape = tuple(1 if a in self.red else (plan.num_groups if self.group and a == c else s)
                             for a, s in enumerate(shape))
        self.s_chunks = tuple((1,) if a in self.red else
                              tuple(k // self.gs for k in ch) if self.group and a == c else ch
                              for a, ch in enumerate(chunks))
        self.p_shape = tuple(s if a in self.par else 1 for a, s in enumerate(shape))
        self.p_chunks = tuple(ch if a in self.par else (1,) for a, ch in enumerate(chunks))

    # chunk-level views (called inside tasks, on the chunk's own arrays)
    def view(self, arr):
        """An array on ``x``'s axes viewed as the plan's view (group norm: channels split)."""
        if not self.group:
            return arr
        c, s = self.plan.channel_axis, tuple(arr.shape)
        xp = array_api_compat.array_namespace(arr)
        return xp.reshape(arr, s[:c] + (s[c] // self.gs, self.gs) + s[c + 1:])

    def unview(self, arr, like_shape):
        xp = array_api_compat.array_namespace(arr)
        return arr if not self.group else xp.reshape(arr, tuple(like_shape))

    def s_view(self, arr):
        """Statistics on ``x``'s axes -> keepdims in the view (group norm: a size-1 axis)."""
        if not self.group:
            return arr
        xp = array_api_compat.array_namespace(arr)
        return xp.expand_dims(arr, axis=self.plan.channel_axis + 1)

    def s_unview(self, arr):
        if not self.group:
            return arr
        xp = array_api_compat.array_namespace(arr)
        return xp.squeeze(arr, axis=self.plan.channel_axis + 1)

    # Dask-level conversions between public arrays and arrays on x's axes
    def param_on_x(self, w):
        return None if w is None else da.reshape(w, self.p_shape).rechunk(self.p_chunks)

    def stats_on_x(self, s):
        return da.reshape(s, self.s_shape).rechunk(self.s_chunks)

    def stats_public(self, s, plan):
        return da.reshape(s, plan.stats_shape)


def spans_chunks(plan, x) -> bool:
    """True when a normalized axis of ``x`` is cut into several chunks (the two-pass path)."""
    red = (tuple(a for a in range(len(plan.shape)) if a not in (0, plan.channel_axis))
           if plan.op == "group_norm" else plan.reduce_axes)
    return any(len(x.chunks[a]) > 1 for a in red)


def _whole_groups(plan, x):
    """Group norm: rechunk the channel axis so that every chunk holds whole groups."""
    if plan.op != "group_norm":
        return x
    c = plan.channel_axis
    gs = plan.shape[c] // plan.num_groups
    if all(k % gs == 0 for k in x.chunks[c]):
        return x
    per = max(1, round(max(x.chunks[c]) / gs))
    return x.rechunk({c: per * gs})


def _meta(x, dtype, ndim=None):
    meta = x._meta
    xp = array_api_compat.array_namespace(meta)
    shape = (0,) * (x.ndim if ndim is None else ndim)
    return xp.empty(shape, dtype=dtype)


def _f64(xp):
    return xp.float64


# --- per-chunk partials (run inside tasks) -----------------------------------------------------

def _acc(plan, xp, arr):
    return xp.astype(arr, plan.acc_dtype, copy=False)


def _count(plan, xv):
    return math.prod(xv.shape[a] for a in plan.reduce_axes)


def _stat_partial(xc, *, g, kind):
    """Rows of one chunk's statistics partial, stacked on a new axis 0, float64, on x's axes.

    ``kind``: "chan" -> (count, shift, correction, M2), the chunk's mean being
    ``shift + correction`` (kept apart: their sum would round); "sumsq" -> (sum(x^2),).
    """
    plan = g.plan
    xp = array_api_compat.array_namespace(xc)
    xv = _acc(plan, xp, g.view(xc))
    axes = plan.reduce_axes
    f64 = _f64(xp)
    if kind == "sumsq":
        rows = [xp.astype(xp.sum(xv * xv, axis=axes, keepdims=True), f64)]
    else:
        shift = xp.mean(xv, axis=axes, keepdims=True)
        diff = xv - shift
        corr = xp.mean(diff, axis=axes, keepdims=True)
        d = diff - corr
        del diff
        m2 = xp.astype(xp.sum(d * d, axis=axes, keepdims=True), f64)
        shift, corr = xp.astype(shift, f64), xp.astype(corr, f64)
        rows = [xp.full_like(m2, float(_count(plan, xv))), shift, corr, m2]
    return xp.stack([g.s_unview(r) for r in rows], axis=0)


def _grad_partial(dyc, xc, wc, *stats, g, kind):
    """Rows of one chunk's backward partial (float64, stacked on axis 0, on x's axes).

    ``kind``: "given" -> (sum(g), sum(g * xhat)) with the caller's mean/rstd;
    "chan" -> (count, shift, correction, M2, sum(g), sum(g * (x - chunk mean)));
    "sumsq" (RMS norm, no stats) -> (sum(x^2), sum(g * x)).
    """
    plan = g.plan
    xp = array_api_compat.array_namespace(xc)
    f64 = _f64(xp)
    axes = plan.reduce_axes
    xv = _acc(plan, xp, g.view(xc))
    gv = _acc(plan, xp, g.view(dyc))
    if wc is not None:
        gv = gv * _acc(plan, xp, g.view(wc))

    def s(arr):
        return xp.astype(xp.sum(arr, axis=axes, keepdims=True), f64)

    if kind == "given":
        rstd = _acc(plan, xp, g.s_view(stats[-1]))
        xc_ = xv - _acc(plan, xp, g.s_view(stats[0])) if plan.center else xv
        rows = [s(gv), s(gv * (xc_ * rstd))]
    elif kind == "sumsq":
        rows = [s(xv * xv), s(gv * xv)]
    else:
        shift = xp.mean(xv, axis=axes, keepdims=True)
        diff = xv - shift
        corr = xp.mean(diff, axis=axes, keepdims=True)
        d = diff - corr
        del diff
        m2 = s(d * d)
        rows = [xp.full_like(m2, float(_count(plan, xv))), xp.astype(shift, f64), xp.astype(corr, f64),
                m2, s(gv), s(gv * d)]
    return xp.stack([g.s_unview(r) for r in rows], axis=0)


def _identity(a, axis=None, keepdims=True, **kwargs):
    return a


def _merge_sum(a, axis=None, keepdims=True, **kwargs):
    xp = array_api_compat.array_namespace(a)
    return xp.sum(a, axis=axis, keepdims=True)


def _merge_chan(a, axis=None, keepdims=True, **kwargs):
    """Chan's merge of stacked partials (count, shift, correction, M2[, s, s_centred]...).

    Each mean is the pair ``shift + correction``; the merged mean is again a pair: ``M`` (the
    rounded weighted mean) and ``r``, the weighted mean of ``(shift_i - M) + correction_i``,
    which is accurate because ``shift_i - M`` is.  With ``d_i`` the chunk mean minus the merged
    one, ``M2 = sum(M2_i) + sum(n_i * d_i^2)`` and a centred sum ``sc`` moves with the mean:
    ``sc = sum(sc_i + d_i * s_i)``.  Differences of means, never raw second moments.
    """
    xp = array_api_compat.array_namespace(a)
    ax = tuple(i - 1 for i in axis)

    def tot(v):
        return xp.sum(v, axis=ax, keepdims=True)

    n, shift, corr, m2 = a[0], a[1], a[2], a[3]
    total = tot(n)
    big = tot(n * (shift + corr)) / total
    off = shift - big
    small = tot(n * (off + corr)) / total
    d = off + (corr - small)
    rows = [total, big, small, tot(m2) + tot(n * d * d)]
    for k in range(4, a.shape[0], 2):
        sk, sck = a[k], a[k + 1]
        rows += [tot(sk), tot(sck + d * sk)]
    return xp.stack(rows, axis=0)


def _reduce(parts, g, merge, nrows):
    """Tree-reduce per-chunk partials (rows on axis 0) over the normalized axes."""
    if all(len(parts.chunks[a + 1]) == 1 for a in g.red):
        return parts
    return da.reduction(parts, _identity, merge, combine=merge, axis=tuple(a + 1 for a in g.red),
                        keepdims=True, dtype=parts.dtype, concatenate=True,
                        meta=_meta(parts, parts.dtype))


def _partials(fn, g, arrays, nrows, x, **kwargs):
    # one size-1 block per chunk along the reduced axes, the statistics' blocks elsewhere
    chunks = ((nrows,),) + tuple((1,) * len(g.chunks[a]) if a in g.red else ch
                                 for a, ch in enumerate(g.s_chunks))
    return da.map_blocks(fn, *arrays, g=g, new_axis=0, chunks=chunks, dtype="float64",
                         meta=_meta(x, _f64(array_api_compat.array_namespace(x._meta)), x.ndim + 1),
                         **kwargs)


# --- statistics ----------------------------------------------------------------------------

def _statistics(plan, g, h):
    """``(hi, lo, rstd)`` on x's axes (Dask, accumulation dtype); ``hi`` None for RMS norm."""
    if plan.center:
        s = _reduce(_partials(_stat_partial, g, (h,), 4, h, kind="chan"), g, _merge_chan, 4)
        hi, lo = _split_mean(plan, s[1], s[2])
        var = s[3] / s[0]
    else:
        s = _reduce(_partials(_stat_partial, g, (h,), 1, h, kind="sumsq"), g, _merge_sum, 1)
        hi = lo = None
        var = s[0] / plan.count
    return hi, lo, (1.0 / da.sqrt(var + plan.eps)).astype(plan.acc_dtype)


def _split_mean(plan, big, small):
    """The float64 pair ``big + small`` as ``hi + lo`` in the accumulation dtype."""
    hi = (big + small).astype(plan.acc_dtype)
    return hi, ((big - hi.astype(big.dtype)) + small).astype(plan.acc_dtype)


# --- elementwise passes (run inside tasks) ---------------------------------------------------

def _apply_chunk(xc, hi, lo, rstd, wc, bc, *, g):
    """``y = (x - hi) * a + (b - lo * a)`` with ``a = rstd * weight`` for one chunk."""
    plan = g.plan
    xp = array_api_compat.array_namespace(xc)
    xv = _acc(plan, xp, g.view(xc))
    a = _acc(plan, xp, g.s_view(rstd))
    if wc is not None:
        a = a * _acc(plan, xp, g.view(wc))
    if plan.center:
        shift = g.s_view(hi)
        c = -(g.s_view(lo) * a)
        if bc is not None:
            c = c + _acc(plan, xp, g.view(bc))
        y = (xv - shift) * a + c
    else:
        y = xv * a
        if bc is not None:
            y = y + _acc(plan, xp, g.view(bc))
    return g.unview(xp.astype(y, plan.dtype, copy=False), xc.shape)


def _xhat_chunk(xc, hi, lo, rstd, *, g):
    """``xhat = ((x - hi) - lo) * rstd`` of one chunk, accumulation dtype, on x's axes."""
    plan = g.plan
    xp = array_api_compat.array_namespace(xc)
    xv = _acc(plan, xp, g.view(xc))
    if plan.center:
        xv = (xv - g.s_view(hi)) - g.s_view(lo)
    return g.unview(xv * g.s_view(rstd), xc.shape)


def _dx_chunk(dyc, xc, hi, lo, rstd, mg, mgx, wc, *, g):
    """``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))`` of one chunk."""
    plan = g.plan
    xp = array_api_compat.array_namespace(xc)
    xv = _acc(plan, xp, g.view(xc))
    r = g.s_view(rstd)
    if plan.center:
        xv = (xv - g.s_view(hi)) - g.s_view(lo)
    xhat = xv * r
    gv = _acc(plan, xp, g.view(dyc))
    if wc is not None:
        gv = gv * _acc(plan, xp, g.view(wc))
    inner = gv - xhat * g.s_view(mgx)
    if plan.center:
        inner = inner - g.s_view(mg)
    return g.unview(xp.astype(r * inner, plan.dtype, copy=False), xc.shape)


# --- blockwise path: the chunk's own executor --------------------------------------------------

def _run_chunk(plan, g, xc, wc, bc, *, which, dyc=None, mean=None, rstd=None):
    """Run the chunk's own executor on one chunk (x's axes); return one of its results."""
    from ._backend import choose
    from ._plan import namespace_of, plan_for
    xp = namespace_of(xc)
    shape = tuple(xc.shape)
    groups = shape[plan.channel_axis] // g.gs if g.group else None
    pshape = tuple(shape[a] for a in g.par)
    layer = plan.op in ("layer_norm", "rms_norm")
    cplan = plan_for(plan.op, xp, shape, plan.dtype, plan.reduce_axes if layer else -1,
                     1 if layer else plan.channel_axis, groups, plan.eps,
                     None if wc is None else pshape, None if bc is None else pshape, False)
    if wc is not None:
        wc = xp.reshape(wc, pshape)
    if bc is not None:
        bc = xp.reshape(bc, pshape)
    ex = choose(cplan, xc)
    if which == "y":
        return ex.forward(cplan, xc, wc, bc, None)[0]
    if mean is not None:
        mean = xp.reshape(mean, cplan.stats_shape)
    if rstd is not None:
        rstd = xp.reshape(rstd, cplan.stats_shape)
    return ex.backward(cplan, dyc, xc, wc, mean, rstd)[0]


def _y_chunk(xc, wc, bc, *, g):
    return _run_chunk(g.plan, g, xc, wc, bc, which="y")


def _bwd_chunk(dyc, xc, wc, *stats, g):
    plan = g.plan
    mean, rstd = (stats if plan.center else (None,) + stats) if stats else (None, None)
    return _run_chunk(plan, g, xc, wc, None, which="dx", dyc=dyc, mean=mean, rstd=rstd)


# --- the executor interface ------------------------------------------------------------------

def forward(plan, x, weight=None, bias=None, residual=None):
    """Return ``(y, h, mean, rstd)`` as lazy Dask arrays (see the module docstring)."""
    h = x + residual if residual is not None else None
    src = _whole_groups(plan, h if h is not None else x)
    g = _Geom(plan, src.chunks)
    w, b = g.param_on_x(weight), g.param_on_x(bias)
    hi, lo, rstd = _statistics(plan, g, src)
    if spans_chunks(plan, src):
        # pass 2 reads the source again, after the statistics: bind clones src's graph
        again = bind(src, [r for r in (hi, lo, rstd) if r is not None])
        args = [again, hi, lo, rstd, w, b]
        y = da.map_blocks(_apply_chunk, *args, g=g, dtype=plan.dtype, meta=_meta(src, plan.dtype))
    else:
        y = da.map_blocks(_y_chunk, src, w, b, g=g, dtype=plan.dtype,
                          meta=_meta(src, plan.dtype))
    mean = g.stats_public(hi, plan) if hi is not None else None
    return y, h, mean, g.stats_public(rstd, plan)


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """Return ``(dx, dweight, dbias)`` as lazy Dask arrays; stats in public shape or None."""
    x = _whole_groups(plan, x)
    dy = dy.rechunk(x.chunks)
    g = _Geom(plan, x.chunks)
    w = g.param_on_x(weight)
    given = rstd is not None
    if given:
        s_given = [g.stats_on_x(s) for s in ((mean, rstd) if plan.center else (rstd,))]
    spans = spans_chunks(plan, x)

    if spans:
        if given:
            parts = _partials(_grad_partial, g, [dy, x, w] + s_given, 2, x, kind="given")
            s = _reduce(parts, g, _merge_sum, 2)
            mg, mgx = s[0] / plan.count, s[1] / plan.count
            hi = s_given[0].astype(plan.acc_dtype) if plan.center else None
            lo = da.zeros_like(hi) if plan.center else None
            r = s_given[-1].astype(plan.acc_dtype)
        elif plan.center:
            parts = _partials(_grad_partial, g, [dy, x, w], 6, x, kind="chan")
            s = _reduce(parts, g, _merge_chan, 6)
            r64 = 1.0 / da.sqrt(s[3] / s[0] + plan.eps)
            hi, lo = _split_mean(plan, s[1], s[2])
            r = r64.astype(plan.acc_dtype)
            mg, mgx = s[4] / plan.count, r64 * s[5] / plan.count
        else:
            parts = _partials(_grad_partial, g, [dy, x, w], 2, x, kind="sumsq")
            s = _reduce(parts, g, _merge_sum, 2)
            r64 = 1.0 / da.sqrt(s[0] / plan.count + plan.eps)
            hi = lo = None
            r = r64.astype(plan.acc_dtype)
            mg, mgx = None, r64 * s[1] / plan.count
        mg = mg.astype(plan.acc_dtype) if mg is not None else None
        mgx = mgx.astype(plan.acc_dtype)
        small = [a for a in (hi, lo, r, mg, mgx) if a is not None]
        dy2, x2 = bind([dy, x], small)
        dx = da.map_blocks(_dx_chunk, dy2, x2, hi, lo, r, mg, mgx, w, g=g, dtype=plan.dtype,
                           meta=_meta(x, plan.dtype))
    else:
        if given:
            hi = s_given[0].astype(plan.acc_dtype) if plan.center else None
            lo = da.zeros_like(hi) if plan.center else None
            r = s_given[-1].astype(plan.acc_dtype)
            stats_args = s_given
        else:
            hi, lo, r = _statistics(plan, g, x) if weight is not None else (None, None, None)
            stats_args = []
        x2, dy2 = x, dy
        dx = da.map_blocks(_bwd_chunk, dy, x, w, *stats_args, g=g, dtype=plan.dtype,
                           meta=_meta(x, plan.dtype))
    if weight is None:
        return dx, None, None
    xhat = da.map_blocks(_xhat_chunk, x2, hi, lo, r, g=g, dtype=plan.acc_dtype,
                         meta=_meta(x, plan.acc_dtype))
    dya = dy2.astype(plan.acc_dtype)

    def param_sum(arr):
        summed = da.sum(arr, axis=g.nonpar) if g.nonpar else arr
        return da.reshape(summed.astype(weight.dtype), plan.param_shape)

    return dx, param_sum(dya * xhat), param_sum(dya)
