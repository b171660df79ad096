"""The kernels' (outer, reduced, inner) factorization, checked on the CPU.

For inputs of many memory layouts, ``plan_layout`` picks a buffer; a NumPy model of the
kernels' index maps (README: slice ``s`` and parameter ``p`` of element ``e``, the
``(a_len, p_len, b_len)`` parameter view) then computes outputs, statistics and gradients
from that buffer alone, which must match the reference executor. This checks the layout
logic and the index formulas the kernels rely on; the kernels' arithmetic is checked by the
emulation harness and the GPU suite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("cupy", exc_type=ImportError)  # anynorm._cuda needs CuPy to import
_layout = pytest.importorskip("anynorm._cuda._layout", exc_type=ImportError)

from anynorm import _reference  # noqa: E402
from anynorm._plan import make_plan  # noqa: E402


def _buffer(plan, layout, arr):
    """The kernel buffer of ``arr``: its own memory when laid out as the buffer (as
    ``_launcher.input_buffer`` decides), else one copy in layout order."""
    if _is_buffer(plan, layout, arr):
        return np.lib.stride_tricks.as_strided(arr, shape=(arr.size,), strides=(arr.itemsize,))
    assert layout.copy or arr is not _buffer.x, "x itself must never need a copy in a zero-copy layout"
    return np.ascontiguousarray(np.transpose(arr.reshape(plan.view_shape), layout.order)).ravel()


def _is_buffer(plan, layout, arr):
    want = _layout.buffer_strides(plan, layout)
    have = _layout.view_strides(plan, [s // arr.itemsize for s in arr.strides])
    return all(n == 1 or w == h for n, w, h in zip(plan.view_shape, want, have))


def _unbuffer(plan, layout, buf):
    """Logical array of ``plan.shape`` from a buffer in layout order."""
    ordered = buf.reshape([plan.view_shape[a] for a in layout.order])
    return np.transpose(ordered, np.argsort(layout.order)).reshape(plan.shape)


def _index_maps(layout):
    e = np.arange(layout.total)
    if layout.inner == 1:
        s = e // layout.reduced
    else:
        s = (e // (layout.reduced * layout.inner)) * (layout.inner // layout.group) + (e % layout.inner) // layout.group
    p = (e // layout.p_div) % layout.p_len
    a, rest = np.divmod(e, layout.p_len * layout.b_len)
    assert np.array_equal(rest // layout.b_len, p)  # the (a_len, p_len, b_len) view agrees
    assert layout.a_len * layout.p_len * layout.b_len == layout.total
    return s, p


def _model_forward(plan, layout, x, w, b):
    v = _buffer(plan, layout, x).astype(np.float64)
    s, p = _index_maps(layout)
    n = np.bincount(s, minlength=layout.slices)
    assert (n == plan.count).all()
    mean = np.bincount(s, v, layout.slices) / n if plan.center else np.zeros(layout.slices)
    var = np.bincount(s, (v - mean[s]) ** 2, layout.slices) / n
    rstd = 1 / np.sqrt(var + plan.eps)
    y = (v - mean[s]) * rstd[s]
    if w is not None:
        y = y * w.reshape(-1)[p]
    if b is not None:
        y = y + b.reshape(-1)[p]
    stats = plan.stats_shape
    return _unbuffer(plan, layout, y), mean.reshape(stats), rstd.reshape(stats)


def _model_backward(plan, layout, dy, x, w):
    v = _buffer(plan, layout, x)
    d = _buffer(plan, layout, dy)
    s, p = _index_maps(layout)
    _, mean, rstd = _model_forward(plan, layout, x, None, None)
    mean, rstd = mean.reshape(-1), rstd.reshape(-1)
    xhat = (v - mean[s]) * rstd[s]
    g = d * w.reshape(-1)[p]
    mg = np.bincount(s, g, layout.slices) / plan.count if plan.center else np.zeros(layout.slices)
    mgx = np.bincount(s, g * xhat, layout.slices) / plan.count
    dx = rstd[s] * (g - mg[s] - xhat * mgx[s])
    dw = np.bincount(p, d * xhat, layout.p_len).reshape(plan.param_shape)
    db = np.bincount(p, d, layout.p_len).reshape(plan.param_shape)
    return _unbuffer(plan, layout, dx), dw, db


def _strided(shape, memory_order=None, step=None, rng=None):
    """float64 array of ``shape`` whose memory runs in ``memory_order`` (outermost first),
    optionally a non-dense slice (every ``step``-th element of the last axis)."""
    rng = rng or np.random.default_rng(0)
    order = memory_order or tuple(range(len(shape)))
    big = [shape[a] for a in order]
    if step:
        big[-1] *= step
    base = rng.standard_normal(big) * 3 + 1
    if step:
        base = base[..., ::step]
    return np.transpose(base, np.argsort(order))


CASES = [
    # (op, shape, kwargs, memory order or None, non-dense step or None, expected kind)
    ("layer_norm", (3, 5, 7), dict(axis=-1), None, None, "rows"),
    ("layer_norm", (3, 5, 7), dict(axis=(-2, -1)), None, None, "rows"),
    ("layer_norm", (2, 3, 4, 5), dict(axis=1), None, None, "cols"),  # ConvNeXt channels-first
    ("layer_norm", (2, 3, 4, 5), dict(axis=(1, 2)), None, None, "cols"),
    ("layer_norm", (2, 3, 4, 5), dict(axis=(1, 3)), None, None, "copy"),
    ("layer_norm", (4, 6), dict(axis=0), None, None, "cols"),
    ("layer_norm", (3, 5, 7), dict(axis=(-2, -1)), (0, 2, 1), None, "copy"),
    ("layer_norm", (3, 5, 7), dict(axis=-1), (1, 0, 2), None, "copy"),
    ("layer_norm", (3, 5, 7), dict(axis=-1), None, 2, "copy"),
    ("layer_norm", (1, 5, 1, 7), dict(axis=(1, 3)), None, None, "rows"),
    ("layer_norm", (6,), dict(axis=0), None, None, "rows"),
    ("rms_norm", (3, 5, 7), dict(axis=-1), None, None, "rows"),
    ("rms_norm", (2, 3, 4, 5), dict(axis=1), None, None, "cols"),
    ("instance_norm", (2, 3, 4, 5), dict(channel_axis=1), None, None, "rows"),
    ("instance_norm", (2, 4, 5, 3), dict(channel_axis=-1), None, None, "cols"),  # NHWC
    ("instance_norm", (2, 3, 4, 5), dict(channel_axis=1), (0, 2, 3, 1), None, "cols"),  # channels_last
    ("instance_norm", (2, 3, 4, 5), dict(channel_axis=1), (1, 0, 2, 3), None, "copy"),
    ("instance_norm", (2, 3, 4, 5), dict(channel_axis=2), None, None, "cols"),  # group = 5
    ("instance_norm", (2, 3, 4, 5), dict(channel_axis=2), None, 2, "copy"),
    ("group_norm", (2, 4, 5, 6), dict(channel_axis=-1, num_groups=3), None, 2, "copy"),
    ("group_norm", (2, 4, 6, 5), dict(channel_axis=2, num_groups=3), (0, 2, 1, 3), None, "rows"),
    ("instance_norm", (2, 3, 1, 1), dict(channel_axis=1), None, None, "rows"),
    ("group_norm", (2, 6, 4, 5), dict(channel_axis=1, num_groups=3), None, None, "rows"),
    ("group_norm", (2, 4, 5, 6), dict(channel_axis=-1, num_groups=3), None, None, "cols"),  # NHWC
    ("group_norm", (2, 6, 4, 5), dict(channel_axis=1, num_groups=2), (0, 2, 3, 1), None, "cols"),
    ("group_norm", (2, 4, 5, 6), dict(channel_axis=-1, num_groups=6), None, None, "cols"),
    ("group_norm", (2, 4, 5, 6), dict(channel_axis=-1, num_groups=1), None, None, "rows"),
    ("group_norm", (2, 6, 4, 5), dict(channel_axis=1, num_groups=3), None, 3, "copy"),
    ("group_norm", (3, 6, 7), dict(channel_axis=1, num_groups=6), None, None, "rows"),
]


def _kind(layout):
    return "copy" if layout.copy else ("rows" if layout.rows else "cols")


@pytest.mark.parametrize("with_params", [True, False])
@pytest.mark.parametrize("op, shape, kwargs, memory_order, step, kind", CASES)
def test_layout_model_matches_reference(op, shape, kwargs, memory_order, step, kind, with_params):
    rng = np.random.default_rng(1)
    x = _strided(shape, memory_order, step, rng)
    _buffer.x = x
    plan0 = make_plan(op, x, **kwargs)
    w = rng.standard_normal(plan0.param_shape) if with_params else None
    b = rng.standard_normal(plan0.param_shape) if with_params and op != "rms_norm" else None
    plan = make_plan(op, x, w, b, **kwargs)
    layout = _layout.plan_layout(plan, [s // x.itemsize for s in x.strides])
    if with_params:
        assert _kind(layout) == kind, layout
    assert layout.total == x.size and layout.inner % layout.group == 0
    y, mean, rstd = _model_forward(plan, layout, x, w, b)
    ry, _, rmean, rrstd = _reference.forward(plan, x, w, b)
    np.testing.assert_allclose(y, ry, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(rstd, rrstd, rtol=1e-10)
    if plan.center:
        np.testing.assert_allclose(mean, rmean, rtol=1e-10, atol=1e-12)

    dy = rng.standard_normal(shape)
    wb = w if w is not None else np.ones(plan.param_shape)
    bplan = make_plan(op, x, wb, **kwargs)
    blayout = _layout.plan_layout(bplan, [s // x.itemsize for s in x.strides], True)
    dx, dw, db = _model_backward(bplan, blayout, dy, x, wb)
    rdx, rdw, rdb = _reference.backward(bplan, dy, x, wb)
    np.testing.assert_allclose(dx, rdx, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(dw, rdw, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(db, rdb, rtol=1e-9, atol=1e-10)


def test_canonical_order_is_always_rows():
    for op, shape, kwargs, *_ in CASES:
        plan = make_plan(op, np.zeros(shape), np.ones(make_plan(op, np.zeros(shape), **kwargs).param_shape),
                         **kwargs)
        layout = _layout._factor(plan, _layout.canonical_order(plan), True)
        assert layout is not None and layout.rows, (op, shape, kwargs)
        assert layout.outer * layout.reduced == math.prod(shape)


@pytest.mark.parametrize("op, shape, kwargs, memory_order, step, kind", CASES)
def test_copies_land_in_a_buffer_the_kernels_read_as_it_is(op, shape, kwargs, memory_order, step, kind):
    """The torch runner's copies (``_torch_ops._copied``): x and another input (residual or
    dy) of another memory order go to ``shared_layout`` -- x's layout where x is a buffer,
    else the other's, else the canonical order -- and a dense array of ``array_strides`` in
    it is that layout's buffer (no further copy), from which the kernels' index maps give the
    reference's outputs."""
    rng = np.random.default_rng(2)
    x = _strided(shape, memory_order, step, rng)
    plan0 = make_plan(op, x, **kwargs)
    w = rng.standard_normal(plan0.param_shape)
    plan = make_plan(op, x, w, w if op != "rms_norm" else None, **kwargs)
    strides = [s // x.itemsize for s in x.strides]
    dense = list(np.ones(shape).strides)
    dense = [s // 8 for s in dense]
    own = _layout.plan_layout(plan, strides)
    for other in (None, dense, strides):
        layout = _layout.shared_layout(plan, strides, other)
        assert not layout.copy
        if not own.copy:
            assert layout == own  # x a buffer: x's own layout, the other input copied
        elif other is not None and not _layout.plan_layout(plan, other).copy:
            assert layout == _layout.plan_layout(plan, other)
        else:
            assert layout.rows and layout.order == _layout.plan_layout(plan, strides).order
        elements = _layout.array_strides(plan, layout)
        buf = np.lib.stride_tricks.as_strided(np.empty(x.size), shape, [e * 8 for e in elements])
        buf[...] = x
        assert _is_buffer(plan, layout, buf), (layout, elements)
        _buffer.x = buf
        y, mean, rstd = _model_forward(plan, layout, buf, w, w if op != "rms_norm" else None)
        ry, _, _, rrstd = _reference.forward(plan, x, w, w if op != "rms_norm" else None)
        np.testing.assert_allclose(y, ry, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(rstd, rrstd, rtol=1e-10)


# ---- tile widths of the shared-memory columns kernels (tiles.cu) ------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from anynorm._cuda import _schedule  # noqa: E402  (pure: no CuPy needed)


@settings(max_examples=300, deadline=None)
@given(outer=st.integers(1, 5000), reduced=st.integers(1, 5000), per_group=st.integers(1, 300),
       group=st.integers(1, 40), itemsize=st.sampled_from([2, 4, 8]), copies=st.sampled_from([1, 2]),
       budget=st.integers(0, 256 * 1024), target=st.integers(1, 2000))
def test_tile_width_fits_and_covers_whole_statistics(outer, reduced, per_group, group, itemsize, copies,
                                                       budget, target):
    inner = per_group * group
    plain = _schedule.tile_width(outer, reduced, inner, group, itemsize, copies, budget, target)
    vector = _schedule.tile_width(outer, reduced, inner, group, itemsize, copies, budget, target,
                                  vector_compute=True)
    assert (plain is None) == (vector is None)  # the forward's preference only orders the widths
    fit = min(budget // (copies * reduced * itemsize), 256)
    for width in (plain, vector):
        if width is None:  # nothing fits: not all of inner, no sector-wide tile, no 16-byte vectors
            step = math.lcm(group, 16 // itemsize)
            assert inner > fit and fit // group * group * itemsize < 32 and fit // step * step * itemsize < 16
            continue
        assert 1 <= width <= min(inner, 256) and width % group == 0
        assert copies * reduced * width * itemsize <= budget
        # all of inner, whole sectors, or whole 16-byte vectors where sector-wide tiles are too few
        assert width == inner or width * itemsize >= 32 or (width * itemsize >= 16 and width * itemsize % 16 == 0)
    if plain is not None and _schedule.tile_vector_compute(plain, itemsize):
        assert _schedule.tile_vector_compute(vector, itemsize)


@pytest.mark.parametrize("shape, itemsize, group, plain, want, vector_form", [
    ((64, 96, 56 * 56), 4, 1, 136, 128, True),  # ConvNeXt stage 1, float32 forward: 32 vectors of 4
    ((64, 192, 28 * 28), 2, 1, 96, 64, True),  # stage 2 bfloat16: 16 vectors, not 24
    ((64, 384, 14 * 14), 4, 1, 24, 16, True),  # stage 3 float32
    ((64, 96, 56 * 56), 2, 1, 256, 256, True),  # bfloat16 stage 1: 64 vectors already
    ((32, 3136, 64), 2, 1, 8, 8, True),  # NHWC instance norm: 2 vectors
    ((32, 784, 320), 2, 10, 20, 20, False),  # NHWC group norm, C / G = 10: no such width
])
def test_forward_tile_widths_take_the_vector_form(shape, itemsize, group, plain, want, vector_form):
    """The forward's widths are those cols_fwd_tile works in shared-memory vectors (a power of
    two, at most 64, of 4-column vectors) where one fits the budget (53120 bytes: an H100's
    first tier, 4 blocks per SM)."""
    outer, reduced, inner = shape
    budget, target = 53120, 4 * 132
    assert _schedule.tile_width(outer, reduced, inner, group, itemsize, 1, budget, target) == plain
    got = _schedule.tile_width(outer, reduced, inner, group, itemsize, 1, budget, target, vector_compute=True)
    assert got == want and _schedule.tile_vector_compute(got, itemsize) == vector_form


@pytest.mark.parametrize("shape, dtype_size, copies, want", [
    ((64, 96, 56 * 56), 2, 1, 256),  # ConvNeXt stage 1, bfloat16 forward: the widest tile, 48 KiB
    # stage 4: 128 blocks at width 32 and 256 at 16 are too few for 528; 16 bytes (8) give 448
    ((64, 768, 49), 2, 1, 8),
    ((64, 768, 49), 4, 2, 4),  # float32 backward: 8 columns give 448 blocks, 4 (16 bytes) 832
    ((64, 96, 56 * 56), 8, 2, 40),  # float64 backward: 42 columns fit, 40 in whole sectors
    ((64, 70000, 3), 4, 1, None),  # a long reduced axis: the split path
])
def test_tile_width_examples(shape, dtype_size, copies, want):
    outer, reduced, inner = shape
    got = _schedule.tile_width(outer, reduced, inner, 1, dtype_size, copies, 64 * 1024, 4 * 132)
    assert got == want


@pytest.mark.parametrize("shape, dtype, copies, want", [
    # NHWC instance norm 32 x 56 x 56 x 64: the first tier (52 KiB, 4 blocks per H100 SM)
    # holds 3136 rows of 16 bytes (512 blocks); the backward's two tiles take the second
    # tier (98 KiB: 8 columns make 256 blocks, 4 make 512)
    ((32, 3136, 64), "float32", 1, (4, 512, 3136 * 4 * 4)),
    ((32, 3136, 64), "float32", 2, (4, 512, 2 * 3136 * 4 * 4)),
    # bfloat16: 8 columns (16 bytes), 256 blocks, in the first tier
    ((32, 3136, 64), "bfloat16", 1, (8, 256, 3136 * 8 * 2)),
    ((32, 784, 256), "float32", 1, (8, 1024, 784 * 8 * 4)),  # the first tier holds it
    ((64, 768, 49), "float32", 2, (4, 832, 2 * 768 * 4 * 4)),  # ConvNeXt stage 4 backward
    ((64, 70000, 3), "float32", 1, None),  # longer than any tile
])
def test_tile_tiers_on_h100(monkeypatch, shape, dtype, copies, want):
    """``_tile`` with an H100's budgets: 52 KiB first (4 blocks per SM), then its 227 KiB
    opt-in limit."""
    monkeypatch.setattr(_schedule, "_smem_limit", lambda: 232448)
    monkeypatch.setattr(_schedule, "_target_blocks", lambda: _schedule._BLOCKS_PER_SM * 132)
    assert _schedule._tile_budgets("float32")[0] == (232448 + 1024) // 4 - 1024 - _schedule._tile_static_smem("float32")
    outer, reduced, inner = shape
    layout = _layout.Layout(order=(0, 1, 2), copy=False, outer=outer, reduced=reduced, inner=inner,
                            group=1, p_div=1, p_len=inner)
    got = _schedule._tile(layout, dtype, copies)
    if want is None:
        assert got is None
    else:
        width, blocks, smem = want
        assert got == (width, (-(-inner // width), min(outer, 65535)), smem)
        assert outer * got[1][0] == blocks
