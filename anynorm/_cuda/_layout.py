"""Turn a Plan and ``x``'s strides into the kernels' (outer, reduced, inner) factorization.

The kernels read one dense buffer whose element ``e = (o * reduced + r) * inner + i``.
Strides decide: the view axes (group norm's channel axis split into ``(G, C/G)``) are ordered
by decreasing stride; when ``x`` is dense in that order (any permutation of a contiguous
array: C order, channels-last, transposes) and its axes fall as
``kept* reduced+ [kept+ [reduced+]]`` the buffer is ``x``'s own memory (zero copy):

* ``kept* reduced+``                  -> rows    (inner == 1)
* ``kept* reduced+ kept+``            -> columns (statistics per (o, i))
* ``kept* reduced+ kept+ reduced+``   -> columns with ``group`` = the trailing reduced size
  (channels-last group norm: statistics per (o, i // group))

The statistics' kept axes must also run in their logical order (so the statistics come out
in the public shape) and, when there are parameters, the parameter axes must be one run in
logical order (``p = (e // p_div) % p_len``). Anything else (non-dense views, overlapping or
negative strides, other axis orders) is copied once into the canonical order "kept axes,
then reduced axes" (group norm: the ``C/G`` axis first among them), always a rows layout;
outputs are then copied back once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Layout", "plan_layout", "view_strides", "buffer_strides", "array_strides", "shared_layout"]


@dataclass(frozen=True)
class Layout:
    """The kernel buffer of one call.

    ``order``: view axes in buffer order (outermost first; size-1 axes included).
    ``copy``: True when ``x`` must be copied into this order first.
    Parameter view for dweight/dbias: ``(a_len, p_len, b_len)`` with ``b_len == p_div``.
    """

    order: tuple
    copy: bool
    outer: int
    reduced: int
    inner: int
    group: int
    p_div: int
    p_len: int

    @property
    def rows(self) -> bool:
        return self.inner == 1

    @property
    def total(self) -> int:
        return self.outer * self.reduced * self.inner

    @property
    def slices(self) -> int:
        return self.outer * (self.inner // self.group)

    @property
    def b_len(self) -> int:
        return self.p_div

    @property
    def a_len(self) -> int:
        return self.total // (self.p_len * self.p_div) if self.total else 0


def view_strides(plan, strides) -> tuple:
    """Element strides of ``plan.view_shape`` for an array of shape ``plan.shape``."""
    strides = tuple(int(s) for s in strides)
    if plan.num_groups is None:
        return strides
    c = plan.channel_axis
    per_group = plan.shape[c] // plan.num_groups
    return strides[:c] + (strides[c] * per_group, strides[c]) + strides[c + 1:]


def buffer_strides(plan, layout: Layout) -> tuple:
    """Element strides, in view axes, of a dense buffer laid out in ``layout.order``."""
    out = [0] * len(plan.view_shape)
    step = 1
    for axis in reversed(layout.order):
        out[axis] = step
        step *= plan.view_shape[axis]
    return tuple(out)


def array_strides(plan, layout: Layout) -> tuple:
    """Element strides, in ``plan.shape`` axes, of a dense buffer laid out in ``layout.order``
    (group norm's channel axis steps as its within-group view axis, or as the group axis
    where a group holds one channel)."""
    strides = buffer_strides(plan, layout)
    if plan.num_groups is None:
        return strides
    c = plan.channel_axis
    within = plan.view_shape[c + 1] > 1
    return strides[:c] + (strides[c + 1] if within else strides[c],) + strides[c + 2:]


def _memory_order(shape, strides):
    """View axes by decreasing stride when the array is dense in that order, else None."""
    big = [a for a, n in enumerate(shape) if n != 1]
    if any(strides[a] <= 0 for a in big):
        return None
    big.sort(key=lambda a: -strides[a])
    step = 1
    for a in reversed(big):
        if strides[a] != step:
            return None
        step *= shape[a]
    return tuple(big) + tuple(a for a, n in enumerate(shape) if n == 1)


def _runs(roles):
    """Collapse a role string like 'KKRRK' into its runs: ['K', 'R', 'K']."""
    out = []
    for r in roles:
        if not out or out[-1] != r:
            out.append(r)
    return out


def _factor(plan, order, need_params):
    """The Layout of ``order``, or None when the kernels cannot read that order as is."""
    shape = plan.view_shape
    big = [a for a in order if shape[a] != 1]
    reduce = set(plan.reduce_axes)
    roles = "".join("R" if a in reduce else "K" for a in big)
    runs = _runs(roles.lstrip("K"))
    if runs not in ([], ["R"], ["R", "K"], ["R", "K", "R"]):
        return None
    kept = [a for a in big if a not in reduce]
    if kept != sorted(kept):  # statistics would not come out in the public order
        return None
    lead = len(roles) - len(roles.lstrip("K"))
    sizes = [shape[a] for a in big]
    rest = roles[lead:]
    n_red = len(rest) - len(rest.lstrip("R"))
    n_inner_kept = len(rest[n_red:]) - len(rest[n_red:].lstrip("K"))
    outer = math.prod(sizes[:lead])
    reduced = math.prod(sizes[lead:lead + n_red])
    inner_kept = math.prod(sizes[lead + n_red:lead + n_red + n_inner_kept])
    group = math.prod(sizes[lead + n_red + n_inner_kept:])
    p_div, p_len = 1, 1
    params = [i for i, a in enumerate(big) if a in plan.param_axes]
    if need_params and params:
        if params != list(range(params[0], params[-1] + 1)):
            return None
        if [big[i] for i in params] != sorted(big[i] for i in params):
            return None
        p_len = math.prod(sizes[i] for i in params)
        p_div = math.prod(sizes[params[-1] + 1:])
    return Layout(order=tuple(order), copy=False, outer=outer, reduced=reduced,
                  inner=inner_kept * group, group=group, p_div=p_div, p_len=p_len)


def canonical_order(plan) -> tuple:
    """Kept axes then reduced axes, each in logical order: always a rows layout.

    Group norm puts the ``C/G`` axis first among the reduced ones, next to the group axis
    (the last kept one), so that the channel index ``g * C/G + c`` stays one run.
    """
    kept = tuple(a for a in range(len(plan.view_shape)) if a not in plan.reduce_axes)
    reduced = tuple(plan.reduce_axes)
    if plan.num_groups is not None:
        within = plan.channel_axis + 1
        reduced = (within,) + tuple(a for a in reduced if a != within)
    return kept + reduced


def plan_layout(plan, strides, need_params=None) -> Layout:
    """The kernel layout for an ``x`` with these element ``strides`` (``plan.shape`` axes).

    ``need_params``: whether the parameter index must be exact (default: the plan has a
    weight or bias); the backward asks for it when it computes dweight/dbias.
    """
    if need_params is None:
        need_params = plan.has_weight or plan.has_bias
    key = ("layout", tuple(strides), need_params)  # worked out once per plan and strides
    layout = plan.memo.get(key)
    if layout is None:
        layout = plan.memo[key] = _choose_layout(plan, key[1], need_params)
    return layout


def _choose_layout(plan, strides, need_params) -> Layout:
    order = _memory_order(plan.view_shape, view_strides(plan, strides))
    layout = _factor(plan, order, need_params) if order is not None else None
    if layout is not None:
        return layout
    layout = _factor(plan, canonical_order(plan), need_params)
    assert layout is not None and layout.rows, (plan, layout)
    return Layout(**{**layout.__dict__, "copy": True})


def shared_layout(plan, strides, other_strides, need_params=None) -> Layout:
    """The layout two arrays of one call (x and the residual, or x and dy) are read in when
    they are not both laid out as the buffer of x's: x's own where its memory is a buffer (the
    other is copied into it), else the other's (x is copied), else the canonical order (both
    are). ``Layout.copy`` is then False: the layout names the buffer the copies are made in."""
    if need_params is None:
        need_params = plan.has_weight or plan.has_bias
    for given in (strides, other_strides):
        if given is not None:
            layout = plan_layout(plan, given, need_params)
            if not layout.copy:
                return layout
    return _factor(plan, canonical_order(plan), need_params)
