"""Dask arrays whose chunk sizes are unknown (NaN) along axes the norm does not reduce.

Boolean indexing (``x[x[:, 0] > 0]``), ``DataFrame.to_dask_array()`` and ``.values`` leave
the row counts of the chunks unknown.  A norm whose statistics do not depend on those axes
(layer/RMS norm over the other axes, instance and group norm with an unknown batch) needs no
count there: the normalized axes (for instance/group norm also the channels) are rechunked
into single chunks, then each chunk is normalized as a whole array by its own library's
path (``map_blocks``; CuPy chunks take the CUDA kernels), one pass, lazily::

    y[block] = op(x[block], weight, bias)          statistics per block the same way
    dweight  = sum over blocks of op_backward(dy[block], x[block], weight)[1]

Validation is the usual one, made on a stand-in of ``x``'s known sizes (size 1 where
unknown).  An unknown size on a normalized, parameter or channel axis still raises the
ValueError that asks for ``x.compute_chunk_sizes()``: the slice counts are needed there.
"""

from __future__ import annotations

import array_api_compat
import dask.array as da
import numpy as np

from ._dask import _Geom, _pick
from ._plan import make_plan, unknown_size

__all__ = ["forward_call", "backward_call"]


def _unknown_axes(shape) -> set:
    return {a for a, s in enumerate(shape) if unknown_size(s)}


def _stand_in(x):
    """A lazy Dask array of x's dtype with x's known sizes (1 where unknown): what the usual
    validation and planning read."""
    shape = tuple(1 if unknown_size(s) else s for s in x.shape)
    return da.zeros(shape, dtype=x.dtype, chunks=-1)


def _same_pattern(name, arr, x):
    """``arr`` has x's shape as far as it is known, NaN where x's is: else the usual error."""
    if (not isinstance(arr, da.Array) or arr.ndim != x.ndim
            or _unknown_axes(arr.shape) != _unknown_axes(x.shape)
            or any(p != q for p, q in zip(arr.shape, x.shape)
                   if not (unknown_size(p) or unknown_size(q)))):
        raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got shape "
                         f"{tuple(getattr(arr, 'shape', ()))}")


class _Geometry:
    """What the chunk functions need, from the stand-in's plan: the axes made whole
    (normalized, parameter and channel axes), the arguments of the public function."""

    def __init__(self, plan, x, original_error):
        self.plan = plan
        layer = plan.op in ("layer_norm", "rms_norm")
        ndim = len(plan.shape)
        whole = set(plan.reduce_axes) if layer else set(range(1, ndim))
        if _unknown_axes(x.shape) & whole:
            raise original_error
        self.whole = {a: -1 for a in sorted(whole)}
        if layer:
            self.kw = {"axis": plan.reduce_axes, "eps": plan.eps}
        else:
            self.kw = {"channel_axis": plan.channel_axis, "eps": plan.eps}
        self.groups = plan.num_groups if plan.op == "group_norm" else None

    def on_x(self, chunks):
        """The Dask executor's geometry on the rechunked x: parameters laid on x's axes
        (``param_on_x``, ``p_shape``), parameter and other axes (``cp.par``, ``cp.nonpar``)."""
        return _Geom(self.plan, chunks)

    def stats_chunks(self, chunks):
        """Block structure of the statistics on x's axes: keepdims shapes, or group norm's
        (N, groups) with size-1 axes after (dask's ``drop_axis`` would concatenate blocks)."""
        if self.plan.op == "group_norm":
            return (chunks[0], (self.groups,)) + ((1,),) * (len(chunks) - 2)
        return tuple((1,) if a in self.plan.reduce_axes else ch for a, ch in enumerate(chunks))

    def public(self, s):
        """Statistics on x's axes -> their public shape."""
        if self.plan.op == "group_norm":
            return s[(slice(None), slice(None)) + (0,) * (len(self.plan.shape) - 2)]
        return s

    def stats_on_x(self, s):
        """Caller's statistics aligned with x's blocks ((N, groups) gains size-1 axes)."""
        if self.plan.op == "group_norm":
            return s[(slice(None), slice(None)) + (None,) * (len(self.plan.shape) - 2)].rechunk(
                {1: -1})
        return s.rechunk({a: -1 for a in self.whole})


def _geometry(op, x, stand_in, axis, channel_axis, num_groups, eps, original_error):
    """The :class:`_Geometry` of the call's axes, before its parameters are checked against
    the stand-in (whose size 1 on an unknown normalized axis would misname the problem)."""
    bare = make_plan(op, stand_in, axis=axis, channel_axis=channel_axis,
                     num_groups=num_groups, eps=eps, cache=False)
    return _Geometry(bare, x, original_error)


def _chunk_params(xc, wc, bc, pshape):
    xp = array_api_compat.array_namespace(xc)
    return [None if p is None else xp.reshape(p, pshape) for p in (wc, bc)]


def _forward_chunk(xc, wc, bc, rc, *, op, groups, kw, pshape, stats):
    """``(y, h, mean, rstd)`` of one block, as the public function gives them on it."""
    from . import _functional

    w, b = _chunk_params(xc, wc, bc, pshape)
    args = (xc, groups) if op == "group_norm" else (xc,)
    args += (w,) if op == "rms_norm" else (w, b)
    extra = {"residual": rc} if rc is not None else {}
    out = getattr(_functional, op)(*args, return_stats=stats, **kw, **extra)
    if not stats and rc is None:
        return out
    out = list(out) if isinstance(out, tuple) else [out]
    y = out.pop(0)
    h = out.pop(0) if rc is not None else None
    rstd = out.pop() if stats else None
    mean = out.pop() if stats and op != "rms_norm" else None
    if stats and op == "group_norm":  # (n, groups) on x's axes, as stats_chunks lays them
        xp = array_api_compat.array_namespace(xc)
        on_x = tuple(rstd.shape) + (1,) * (xc.ndim - 2)
        mean, rstd = xp.reshape(mean, on_x), xp.reshape(rstd, on_x)
    return y, h, mean, rstd


def forward_call(op, x, weight, bias, residual, stats, axis, channel_axis, num_groups, eps,
                 original_error):
    """``(plan, run)`` as :func:`anynorm._calls.forward_call` gives them, for a Dask ``x``
    with unknown chunk sizes (``original_error`` raised where the norm needs them)."""
    if residual is not None:
        _same_pattern("residual", residual, x)
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    stand_in = _stand_in(x)
    geom = _geometry(op, x, stand_in, axis, channel_axis, num_groups, eps, original_error)
    plan = make_plan(op, stand_in, weight, bias, None if residual is None else stand_in,
                     axis=axis, channel_axis=channel_axis, num_groups=num_groups, eps=eps,
                     cache=False)

    def run(x, weight, bias, residual):
        xr = x.rechunk(geom.whole)
        rr = None if residual is None else residual.rechunk(geom.whole)
        on_x = geom.on_x(xr.chunks)
        w, b = on_x.param_on_x(weight), on_x.param_on_x(bias)
        chunk = dict(op=op, groups=geom.groups, kw=geom.kw, pshape=plan.param_shape, stats=stats)
        meta = xr._meta
        if not stats and rr is None:
            y = da.map_blocks(_forward_chunk, xr, w, b, rr, **chunk, dtype=plan.dtype, meta=meta)
            return y, None, None, None
        parts = da.map_blocks(_forward_chunk, xr, w, b, rr, **chunk, dtype=object,
                              meta=np.empty((0,) * xr.ndim, object))
        y = da.map_blocks(_pick, parts, 0, dtype=plan.dtype, meta=meta)
        h = None if rr is None else da.map_blocks(_pick, parts, 1, dtype=plan.dtype, meta=meta)
        mean = rstd = None
        if stats:
            acc_meta = array_api_compat.array_namespace(meta).empty((0,) * xr.ndim,
                                                                    dtype=plan.acc_dtype)
            kw = dict(chunks=geom.stats_chunks(xr.chunks), dtype=plan.acc_dtype, meta=acc_meta)
            rstd = geom.public(da.map_blocks(_pick, parts, 3, **kw))
            mean = geom.public(da.map_blocks(_pick, parts, 2, **kw)) if plan.center else None
        return y, h, mean, rstd

    return plan, run


def _backward_chunk(dyc, xc, wc, *stats, op, groups, kw, pshape, p_on_x):
    """``dx`` of one block, or ``(dx, its dweight/dbias as float64 rows on x's axes)``."""
    from . import _functional

    xp = array_api_compat.array_namespace(xc)
    w = None if wc is None else xp.reshape(wc, pshape)
    if op == "group_norm":
        stats = [xp.reshape(s, s.shape[:2]) for s in stats]
    given = {"stats": tuple(stats)} if stats else {}
    args = (dyc, xc, groups, w) if op == "group_norm" else (dyc, xc, w)
    grads = getattr(_functional, op + "_backward")(*args, **kw, **given)
    if w is None:
        return grads[0]
    rows = [xp.astype(xp.reshape(g, (1,) + p_on_x), xp.float64) for g in grads[1:]]
    return grads[0], xp.concat(rows, axis=0)


class _Backward:
    """The executor :func:`backward_call` pairs with the stand-in's plan."""

    def __init__(self, geom):
        self.geom = geom

    def backward(self, plan, dy, x, weight=None, mean=None, rstd=None):
        """``(dx, dweight, dbias)`` (``dbias`` None for RMS norm or without a weight)."""
        geom = self.geom
        xr, dyr = x.rechunk(geom.whole), dy.rechunk(geom.whole)
        on_x = geom.on_x(xr.chunks)
        w = on_x.param_on_x(None if weight is None else weight.astype(plan.acc_dtype))
        stats = [geom.stats_on_x(s) for s in (mean, rstd) if s is not None]
        chunk = dict(op=plan.op, groups=geom.groups, kw=geom.kw, pshape=plan.param_shape,
                     p_on_x=on_x.p_shape)
        if w is None:
            dx = da.map_blocks(_backward_chunk, dyr, xr, w, *stats, **chunk, dtype=plan.dtype,
                               meta=xr._meta)
            return dx, None, None
        parts = da.map_blocks(_backward_chunk, dyr, xr, w, *stats, **chunk, dtype=object,
                              meta=np.empty((0,) * xr.ndim, object))
        dx = da.map_blocks(_pick, parts, 0, dtype=plan.dtype, meta=xr._meta)
        k = 2 if plan.center else 1
        chunks = ((k,),) + tuple((1,) * len(ch) if a in on_x.cp.nonpar else ch
                                 for a, ch in enumerate(xr.chunks))
        meta = array_api_compat.array_namespace(xr._meta).empty((0,) * (xr.ndim + 1),
                                                                dtype=np.float64)
        rows = da.map_blocks(_pick, parts, 1, new_axis=0, chunks=chunks, dtype=np.float64,
                             meta=meta)
        sums = rows.sum(axis=tuple(1 + a for a in on_x.cp.nonpar))

        def param(i):
            return da.reshape(sums[i], plan.param_shape).astype(weight.dtype)

        return dx, param(0), (param(1) if plan.center else None)


def backward_call(op, dy, x, weight, stats, axis, channel_axis, num_groups, eps, validate,
                  original_error):
    """``(plan, executor)`` as :func:`anynorm._calls.backward_call` gives them, for a Dask
    ``x`` with unknown chunk sizes; ``validate`` checks dy and stats on the stand-ins."""
    _same_pattern("dy", dy, x)
    stand_in = _stand_in(x)
    geom = _geometry(op, x, stand_in, axis, channel_axis, num_groups, eps, original_error)
    plan = make_plan(op, stand_in, weight, axis=axis, channel_axis=channel_axis,
                     num_groups=num_groups, eps=eps, cache=False)
    if stats is not None:  # validated as stand-ins too: size 1 where unknown, as the plan's
        items = tuple(_stand_in(s) if isinstance(s, da.Array) else s
                      for s in (stats if isinstance(stats, (tuple, list)) else (stats,)))
        stats = items if isinstance(stats, (tuple, list)) else items[0]
    validate(plan, stand_in, _stand_in(dy), stats)
    return plan, _Backward(geom)
