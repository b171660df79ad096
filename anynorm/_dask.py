"""The Dask executor: normalization over axes that span chunks, in memory bounded by a few chunks.

Two paths, chosen per call from ``x``'s chunks:

* **blockwise** (every normalized axis inside one chunk; for group norm also every chunk of
  the channel axis made of whole groups): ``map_blocks`` runs the chunk's own executor
  (NumPy's for NumPy chunks; for CuPy chunks whatever ``choose`` picks, the CUDA kernels
  where they apply) on each chunk, one pass, as if the chunk were the whole array.
* **two passes** (a normalized axis spans chunks):

  1. statistics as a tree reduction (``dask.array.reduction``) of small per-chunk partials
     ``(count, shift, correction, M2)`` per normalized slice, merged with Chan's formula in
     float64 (the partials are slice-sized, not chunk-sized); per chunk the partial is the
     corrected two-pass of the array-API core on the chunk in the accumulation dtype (float32
     for half inputs), its sums accumulated in float64.  Group norm takes partials per channel and merges each group's channels the
     same way, so its channel axis may be cut anywhere: no rechunk of ``x``.
  2. an elementwise pass over ``x`` read again from its source: :func:`reread` clones ``x``'s
     graph (as ``dask.graph_manipulation.bind`` does) and makes the clone's roots wait for
     the statistics, so the source chunks are recomputed or re-read after the statistics
     rather than held from pass 1.

  The mean is carried into pass 2 as ``hi + lo`` (``hi`` its rounding to the accumulation
  dtype, ``lo`` the remainder), and ``y = (x - hi) * a + (b - lo * a)`` with
  ``a = rstd * weight``: float32 data offset by 1e6 keeps float32 rounding (``x - hi`` is
  exact near the mean), never ``E[x^2] - E[x]^2``.

  Backward is the same shape: one reduction of per-chunk sums of ``g = dy * weight`` and
  ``g * (x - mean)`` (with the statistics themselves when ``stats`` is None, the centred
  sums moved by Chan's correction), then one elementwise pass over re-read ``x`` and ``dy``
  whose tasks also give each chunk's ``dweight``/``dbias`` partials (a tree reduction over
  the non-parameter axes sums them).

Chunk arithmetic goes through the chunk's own array namespace (``array_api_compat``), so the
same graph serves NumPy and CuPy chunks.  Results stay lazy.  Memory: a few chunks per worker
thread plus the statistics (one float64 value per slice per row).
"""

from __future__ import annotations

import math

import array_api_compat
import dask.array as da
import numpy as np
from dask.base import clone_key, tokenize
from dask.core import flatten
from dask.graph_manipulation import bind, checkpoint
from dask.highlevelgraph import HighLevelGraph

try:  # dask's task spec (2025 on): clone the low-level graph ourselves
    from dask._task_spec import Task, TaskRef, convert_legacy_graph
except ImportError:  # older dask: graph_manipulation.bind (right for Blockwise layers)
    Task = None

__all__ = ["forward", "backward", "spans_chunks", "reread"]


# --- geometry ------------------------------------------------------------------------------

class _ChunkPlan:
    """What the chunk functions need, as plain picklable values (tasks travel to workers).

    ``red``: axes of ``x`` each chunk's partials reduce over (group norm: every axis but the
    batch and the channels, partials per channel); ``par``: axes weight/bias lie along.
    """

    def __init__(self, plan):
        shape, c = plan.shape, plan.channel_axis
        self.op, self.eps, self.count = plan.op, plan.eps, plan.count
        self.dtype, self.acc_dtype = np.dtype(plan.dtype), np.dtype(plan.acc_dtype)
        self.center, self.reduce_axes = plan.center, plan.reduce_axes
        self.channel_axis, self.num_groups = c, plan.num_groups
        self.group = plan.op == "group_norm"
        self.gs = shape[c] // plan.num_groups if self.group else 1
        layer = plan.op in ("layer_norm", "rms_norm")
        self.red = plan.reduce_axes if layer else tuple(a for a in range(len(shape)) if a not in (0, c))
        self.par = plan.param_axes if layer else (c,)
        self.nonpar = tuple(a for a in range(len(shape)) if a not in self.par)


class _Geom:
    """How one plan lies on ``x``'s chunks (built per call, at graph time)."""

    def __init__(self, plan, chunks):
        cp = self.cp = _ChunkPlan(plan)
        self.plan, self.chunks = plan, chunks
        shape = plan.shape
        # statistics on x's axes: size 1 on the reduced axes (group norm: per channel)
        self.s_chunks = tuple((1,) if a in cp.red else ch for a, ch in enumerate(chunks))
        self.part_chunks = tuple((1,) * len(ch) if a in cp.red else ch for a, ch in enumerate(chunks))
        self.p_shape = tuple(s if a in cp.par else 1 for a, s in enumerate(shape))
        self.p_chunks = tuple(ch if a in cp.par else (1,) for a, ch in enumerate(chunks))
        c = cp.channel_axis
        self.g_shape = tuple(1 if a in cp.red else (plan.num_groups if cp.group and a == c else s)
                             for a, s in enumerate(shape))

    def param_on_x(self, w):
        return None if w is None else da.reshape(w, self.p_shape).rechunk(self.p_chunks)

    def per_channel(self, s):
        """Group-level statistics on x's axes -> one value per channel, in x's chunks."""
        if s is None:
            return None
        if self.cp.group:
            s = da.repeat(s, self.cp.gs, axis=self.cp.channel_axis)
        return s.rechunk(self.s_chunks)

    def given(self, s):
        """Caller's statistics (public shape) -> per channel on x's axes, in x's chunks."""
        return self.per_channel(da.reshape(s, self.g_shape))

    def public(self, s):
        return None if s is None else da.reshape(s, self.plan.stats_shape)


def _blockwise(plan, x) -> bool:
    """True when each chunk holds whole normalized slices (the one-pass path)."""
    cp = _ChunkPlan(plan)
    if any(len(x.chunks[a]) > 1 for a in cp.red):
        return False
    return not cp.group or all(k % cp.gs == 0 for k in x.chunks[cp.channel_axis])


def spans_chunks(plan, x) -> bool:
    """True when a normalized slice of ``x`` is cut by chunk boundaries (the two-pass path)."""
    return not _blockwise(plan, x)


def _meta(x, dtype, ndim=None):
    xp = array_api_compat.array_namespace(x._meta)
    return xp.empty((0,) * (x.ndim if ndim is None else ndim), dtype=dtype)


# --- reading the source again ------------------------------------------------------------------

def _after(value, _blocker):
    return value


def reread(arrays, after):
    """Copies of ``arrays`` whose whole graphs are cloned (new keys, so their chunks are
    recomputed or re-read, never held from an earlier use) and whose root tasks wait for
    ``after`` (the statistics).

    ``dask.graph_manipulation.bind`` does this for Blockwise layers, but (dask 2026.8) it does
    not rename the keys inside the ``Task`` objects of materialized layers such as
    ``rechunk``: the clone's tasks then still point at the original chunks, which stay alive
    from the statistics pass to the end.  So the low-level graph is cloned here, node by node.
    """
    if Task is None:
        return list(bind(list(arrays), list(after)))
    blocker = checkpoint(*after)
    seed = tokenize(blocker.key, *(a.name for a in arrays))
    graph = {}
    for a in arrays:
        graph.update(a.__dask_graph__())
    graph = convert_legacy_graph(graph)
    todo = [k for a in arrays for k in flatten(a.__dask_keys__())]
    reached = set()
    while todo:
        k = todo.pop()
        if k not in reached:
            reached.add(k)
            todo.extend(graph[k].dependencies)
    subs = {k: clone_key(k, seed) for k in reached}
    cloned = {}
    for k in reached:
        node, new = graph[k], subs[k]
        if node.dependencies:
            cloned[new] = node.substitute(subs, key=new)
        else:  # a root: reads or makes the source; wait for the statistics first
            cloned[new] = Task(new, _after, node, TaskRef(blocker.key))
    out = []
    for a in arrays:
        name = clone_key(a.name, seed)
        hlg = HighLevelGraph.from_collections(name, cloned, dependencies=[blocker])
        out.append(da.Array(hlg, name, chunks=a.chunks, meta=a._meta))
    return out


# --- per-chunk partials (run inside tasks) -----------------------------------------------------

def _acc(cp, xp, arr):
    return xp.astype(arr, cp.acc_dtype, copy=False)


def _sum64(cp, xp, arr, axes=None):
    """Sum over ``axes`` (default: the reduced ones), keepdims, accumulated in float64.

    A chunk's rows are summed one after another when the reduced axis is not the last
    (NumPy is pairwise only along a contiguous run), so a float32 accumulator would lose
    sqrt(rows) ulps; a float64 one costs a cast in NumPy's buffer, not a float64 copy."""
    return xp.sum(arr, axis=cp.red if axes is None else axes, keepdims=True, dtype=xp.float64)


def _centred(cp, xp, xa):
    """The chunk's corrected two-pass: ``(shift, correction, x - shift - correction)``;
    ``shift`` in the accumulation dtype (so ``x - shift`` is exact near the mean), the
    correction (the mean of those differences) in float64."""
    n = math.prod(xa.shape[a] for a in cp.red)
    shift = xp.astype(_sum64(cp, xp, xa) / n, cp.acc_dtype)
    diff = xa - shift
    corr = _sum64(cp, xp, diff) / n
    return shift, corr, diff - xp.astype(corr, cp.acc_dtype)


def _stat_partial(xc, *, cp, kind):
    """One chunk's statistics partial, rows stacked on a new axis 0, float64.

    ``kind``: "chan" -> (count, shift, correction, M2), the chunk's mean being
    ``shift + correction`` (kept apart: their sum would round); "sumsq" -> (sum(x^2),).
    """
    xp = array_api_compat.array_namespace(xc)
    f64 = xp.float64
    xa = _acc(cp, xp, xc)
    if kind == "sumsq":
        rows = [_sum64(cp, xp, xa * xa)]
    else:
        shift, corr, d = _centred(cp, xp, xa)
        m2 = _sum64(cp, xp, d * d)
        n = float(math.prod(xa.shape[a] for a in cp.red))
        rows = [xp.full_like(m2, n), xp.astype(shift, f64), corr, m2]
    return xp.stack(rows, axis=0)


def _grad_partial(dyc, xc, wc, *stats, cp, kind):
    """One chunk's backward partial, rows stacked on axis 0, float64.

    ``kind``: "given" -> (sum(g), sum(g * xhat)) with the caller's mean/rstd, and where
    centred also (sum(x - mean), sum(g * rstd)), which take back the given mean's rounding;
    "chan" -> (count, shift, correction, M2, sum(g), sum(g * (x - chunk mean)));
    "sumsq" (RMS norm, no stats) -> (sum(x^2), sum(g * x)).
    """
    xp = array_api_compat.array_namespace(xc)
    f64 = xp.float64
    xa = _acc(cp, xp, xc)
    ga = _acc(cp, xp, dyc)
    if wc is not None:
        ga = ga * _acc(cp, xp, wc)

    def s(arr):
        return _sum64(cp, xp, arr)

    if kind == "given":
        xcen = xa - _acc(cp, xp, stats[0]) if cp.center else xa
        rc = _acc(cp, xp, stats[-1])
        rows = [s(ga), s(ga * (xcen * rc))]
        if cp.center:
            rows += [s(xcen), s(ga * rc)]
    elif kind == "sumsq":
        rows = [s(xa * xa), s(ga * xa)]
    else:
        shift, corr, d = _centred(cp, xp, xa)
        m2 = s(d * d)
        n = float(math.prod(xa.shape[a] for a in cp.red))
        rows = [xp.full_like(m2, n), xp.astype(shift, f64), corr, m2, s(ga), s(ga * d)]
    return xp.stack(rows, axis=0)


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


def _tree(parts, axes, merge):
    """Tree-reduce stacked partials (rows on axis 0) over ``axes`` of x (keepdims)."""
    if all(parts.numblocks[a + 1] == 1 and parts.shape[a + 1] == 1 for a in axes):
        return parts
    return da.reduction(parts, _identity, merge, combine=merge, axis=tuple(a + 1 for a in axes),
                        keepdims=True, dtype=parts.dtype, concatenate=True,
                        meta=_meta(parts, parts.dtype))


def _partials(fn, g, arrays, nrows, x, **kwargs):
    """Per-chunk partials of ``fn``: one size-1 block per chunk along the reduced axes."""
    xp = array_api_compat.array_namespace(x._meta)
    return da.map_blocks(fn, *arrays, cp=g.cp, new_axis=0, chunks=((nrows,),) + g.part_chunks,
                         dtype="float64", meta=_meta(x, xp.float64, x.ndim + 1), **kwargs)


def _merged(g, parts, merge):
    """Partials -> one set of rows per normalized slice (group norm: per group)."""
    cp = g.cp
    s = _tree(parts, cp.red, merge)
    if not cp.group:
        return s
    # per channel -> per group: split the channel axis into (groups, channels per group)
    c = cp.channel_axis + 1
    shp = s.shape
    s = da.reshape(s, shp[:c] + (cp.num_groups, cp.gs) + shp[c + 1:])
    s = _tree(s, (c,), merge)  # axis c + 1 of the split array (the channels of a group)
    return s[(slice(None),) * (c + 1) + (0,)]


# --- statistics ----------------------------------------------------------------------------

def _split_mean(plan, big, small):
    """The float64 pair ``big + small`` as ``hi + lo`` in the accumulation dtype."""
    hi = (big + small).astype(plan.acc_dtype)
    return hi, ((big - hi.astype(big.dtype)) + small).astype(plan.acc_dtype)


def _statistics(plan, g, x):
    """``(hi, lo, rstd)`` at group level on x's axes (Dask, accumulation dtype)."""
    if plan.center:
        s = _merged(g, _partials(_stat_partial, g, (x,), 4, x, kind="chan"), _merge_chan)
        hi, lo = _split_mean(plan, s[1], s[2])
        var = s[3] / s[0]
    else:
        s = _merged(g, _partials(_stat_partial, g, (x,), 1, x, kind="sumsq"), _merge_sum)
        hi = lo = None
        var = s[0] / plan.count
    return hi, lo, (1.0 / da.sqrt(var + plan.eps)).astype(plan.acc_dtype)


# --- elementwise passes (run inside tasks) ---------------------------------------------------

def _apply_chunk(xc, hi, lo, rstd, wc, bc, *, cp):
    """``y = (x - hi) * a + (b - lo * a)`` with ``a = rstd * weight`` for one chunk."""
    xp = array_api_compat.array_namespace(xc)
    xa = _acc(cp, xp, xc)
    a = rstd if wc is None else rstd * _acc(cp, xp, wc)
    if cp.center:
        c = -(lo * a)
        if bc is not None:
            c = c + _acc(cp, xp, bc)
        y = (xa - hi) * a + c
    else:
        y = xa * a
        if bc is not None:
            y = y + _acc(cp, xp, bc)
    return xp.astype(y, cp.dtype, copy=False)


def _param_rows(dyc, xhat, cp):
    """One chunk's ``(sum(dy * xhat), sum(dy))`` over the non-parameter axes (keepdims,
    float64, stacked on a new axis 0): the partials of dweight and dbias."""
    xp = array_api_compat.array_namespace(dyc)
    dya = _acc(cp, xp, dyc)

    def s(arr):
        return _sum64(cp, xp, arr, cp.nonpar) if cp.nonpar else xp.astype(arr, xp.float64)

    return xp.stack([s(dya * xhat), s(dya)], axis=0)


def _dx_chunk(dyc, xc, hi, lo, rstd, mg, mgx, wc, *, cp, param_rows):
    """``dx = rstd * (g - xhat * mean(g * xhat) - mean(g))`` of one chunk; with
    ``param_rows`` also the chunk's dweight/dbias partials: ``(dx, rows)`` from one task."""
    xp = array_api_compat.array_namespace(xc)
    xhat = _acc(cp, xp, xc)
    if cp.center:
        xhat = (xhat - hi) - lo
    xhat = xhat * rstd
    ga = _acc(cp, xp, dyc)
    if wc is not None:
        ga = ga * _acc(cp, xp, wc)
    inner = ga - xhat * mgx
    del ga
    if cp.center:
        inner = inner - mg
    dx = xp.astype(rstd * inner, cp.dtype, copy=False)
    return (dx, _param_rows(dyc, xhat, cp)) if param_rows else dx


# --- blockwise path: the chunk's own executor --------------------------------------------------

def _chunk_call(cp, xc, wc, bc, stats):
    """The plan, executor and arguments that run one chunk as a whole array."""
    from ._backend import choose
    from ._plan import namespace_of, plan_for
    xp = namespace_of(xc)
    shape = tuple(xc.shape)
    layer = cp.op in ("layer_norm", "rms_norm")
    groups = shape[cp.channel_axis] // cp.gs if cp.group else None
    pshape = tuple(shape[a] for a in cp.par)
    cplan = plan_for(cp.op, xp, shape, cp.dtype, cp.reduce_axes if layer else -1,
                     1 if layer else cp.channel_axis, groups, cp.eps,
                     None if wc is None else pshape, None if bc is None else pshape, False)
    wc = None if wc is None else xp.reshape(wc, pshape)
    bc = None if bc is None else xp.reshape(bc, pshape)
    if cp.group:  # per-channel statistics -> per group
        stats = [s[(slice(None),) * cp.channel_axis + (slice(None, None, cp.gs),)] for s in stats]
    stats = [xp.reshape(s, cplan.stats_shape) for s in stats]
    return cplan, choose(cplan, xc), wc, bc, stats


def _y_chunk(xc, wc, bc, *, cp):
    cplan, ex, wc, bc, _ = _chunk_call(cp, xc, wc, bc, [])
    return ex.forward(cplan, xc, wc, bc, None)[0]


def _bwd_chunk(dyc, xc, wc, *stats, cp):
    """The chunk executor's backward: ``dx``, or ``(dx, dweight/dbias partial rows)``.

    The weight comes in the accumulation dtype, so that the chunk's dweight/dbias partials
    are summed as the in-memory path sums them (not rounded to a float16 weight's dtype).
    """
    cplan, ex, wc, _, stats = _chunk_call(cp, xc, wc, None, list(stats))
    mean, rstd = (stats if cp.center else [None] + stats) if stats else (None, None)
    dx, dw, db = ex.backward(cplan, dyc, xc, wc, mean, rstd)
    if dw is None:
        return dx
    xp = array_api_compat.array_namespace(dx)
    pshape = tuple(s if a in cp.par else 1 for a, s in enumerate(xc.shape))
    return dx, xp.stack([xp.astype(xp.reshape(v, pshape), xp.float64) for v in (dw, db)], axis=0)


def _pick(pair, i):
    return pair[i]


# --- the executor interface ------------------------------------------------------------------

def forward(plan, x, weight=None, bias=None, residual=None):
    """Return ``(y, h, mean, rstd)`` as lazy Dask arrays (see the module docstring)."""
    h = x + residual if residual is not None else None
    src = h if h is not None else x
    g = _Geom(plan, src.chunks)
    w, b = g.param_on_x(weight), g.param_on_x(bias)
    hi, lo, rstd = _statistics(plan, g, src)
    meta = _meta(src, plan.dtype)
    if _blockwise(plan, src):
        y = da.map_blocks(_y_chunk, src, w, b, cp=g.cp, dtype=plan.dtype, meta=meta)
    else:
        small = [g.per_channel(a) for a in (hi, lo, rstd)]
        # the parameters count as statistics: in memory before the source is read again
        (again,) = reread([src], [a for a in small + [w, b] if a is not None])
        y = da.map_blocks(_apply_chunk, again, *small, w, b, cp=g.cp, dtype=plan.dtype, meta=meta)
    return y, h, g.public(hi), g.public(rstd)


def backward(plan, dy, x, weight=None, mean=None, rstd=None):
    """Return ``(dx, dweight, dbias)`` as lazy Dask arrays; stats in public shape or None.

    One task per chunk makes both ``dx`` and the chunk's dweight/dbias partials (a tree
    reduction sums them), so each chunk of ``x`` and ``dy`` has one consumer in the last
    pass and is freed as soon as it has been used.
    """
    if dy.chunks != x.chunks:
        dy = dy.rechunk(x.chunks)
    g = _Geom(plan, x.chunks)
    cp = g.cp
    w = g.param_on_x(weight)
    given = [] if rstd is None else [g.given(s) for s in ((mean, rstd) if plan.center else (rstd,))]
    rows = weight is not None
    out_dtype, out_meta = (object, np.empty((0,) * x.ndim, object)) if rows else (plan.dtype, _meta(x, plan.dtype))

    if _blockwise(plan, x):
        wa = None if w is None else w.astype(plan.acc_dtype)
        out = da.map_blocks(_bwd_chunk, dy, x, wa, *given, cp=cp, dtype=out_dtype, meta=out_meta)
    else:
        acc = plan.acc_dtype
        if given:
            k = 4 if plan.center else 2
            s = _merged(g, _partials(_grad_partial, g, [dy, x, w] + given, k, x, kind="given"), _merge_sum)
            mg, mgx = s[0] / plan.count, s[1] / plan.count
            hi = lo = None
            if plan.center:
                # xhat about the given mean less its slice's mean (lo: what its rounding to the
                # statistics' dtype left out): sum(g * xhat) loses lo * sum(g * rstd)
                lo64 = s[2] / plan.count
                mgx = mgx - lo64 * s[3] / plan.count
                hi, lo = given[0].astype(acc), g.per_channel(lo64.astype(acc))
            r = given[-1].astype(acc)
        elif plan.center:
            s = _merged(g, _partials(_grad_partial, g, [dy, x, w], 6, x, kind="chan"), _merge_chan)
            r64 = 1.0 / da.sqrt(s[3] / s[0] + plan.eps)
            hi, lo = _split_mean(plan, s[1], s[2])
            r = r64.astype(acc)
            mg, mgx = s[4] / plan.count, r64 * s[5] / plan.count
        else:
            s = _merged(g, _partials(_grad_partial, g, [dy, x, w], 2, x, kind="sumsq"), _merge_sum)
            r64 = 1.0 / da.sqrt(s[0] / plan.count + plan.eps)
            hi = lo = mg = None
            r = r64.astype(acc)
            mgx = r64 * s[1] / plan.count
        # per channel on x's chunks (the caller's statistics already are)
        small = [a if given or a is None else g.per_channel(a) for a in (hi, lo, r)]
        small += [None if a is None else g.per_channel(a.astype(acc)) for a in (mg, mgx)]
        dy2, x2 = reread([dy, x], [a for a in small + [w] if a is not None])
        out = da.map_blocks(_dx_chunk, dy2, x2, *small, w, cp=cp, param_rows=rows,
                            dtype=out_dtype, meta=out_meta)
    if not rows:
        return out, None, None
    dx = da.map_blocks(_pick, out, 0, dtype=plan.dtype, meta=_meta(x, plan.dtype))
    xp = array_api_compat.array_namespace(x._meta)
    chunks = ((2,),) + tuple((1,) * len(ch) if a in cp.nonpar else ch for a, ch in enumerate(x.chunks))
    parts = da.map_blocks(_pick, out, 1, new_axis=0, chunks=chunks, dtype="float64",
                          meta=_meta(x, xp.float64, x.ndim + 1))
    parts = _tree(parts, cp.nonpar, _merge_sum)

    def param(row):
        return da.reshape(row.astype(weight.dtype), plan.param_shape)

    return dx, param(parts[0]), param(parts[1])
