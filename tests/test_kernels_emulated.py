"""The CUDA kernels of ``kernels/*.cu`` run on the CPU under the emulation header
(``tests/emulation/``) and checked against a float64 NumPy reference.

First the harness proves itself on its own kernels (``tests/emulation/selftest.cu``): a block
reduction, shuffle/vote semantics, bit-exact half/bfloat16 rounding, and deliberately broken
kernels it must report. Then every kernel family runs forward and backward on small odd
shapes, all four dtypes, with and without weight/bias/residual, misaligned buffers and
parameter strides. Launch configurations follow ``kernels/README.md``. A GPU run stays the
final word on speed and the memory model; this catches indexing, reduction, bounds and
barrier bugs without one.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("anynorm_emu_harness", _HERE / "emulation" / "emu_harness.py")
emu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = emu
_spec.loader.exec_module(emu)

pytestmark = pytest.mark.skipif(emu.compiler() is None or not hasattr(os, "fork"),
                                reason="the CUDA emulation needs g++ and fork()")

KERNELS = _HERE.parent / "kernels"
DTYPES = ("float32", "float64", "float16", "bfloat16")
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
ACC = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}
# Output tolerance relative to the result's scale: a few ulps of the dtype.
TOL = {"float64": 1e-12, "float32": 3e-6, "float16": 2e-3, "bfloat16": 1.6e-2}
STAT_TOL = {"float64": 1e-12, "float32": 3e-6, "float16": 3e-6, "bfloat16": 3e-6}


# ---- the harness on its own kernels ------------------------------------------------------------

SELFTEST_NAMES = ["block_sum<float, float, true>", "block_sum<float, float, false>",
                  "block_sum<__half, float, true>", "block_sum<double, double, true>", "warp_probe",
                  "convert", "oob_write", "divergent_barrier", "exited_lane", "misaligned_load",
                  "uninit_shared"]


@pytest.fixture(scope="module")
def selftest():
    return emu.build_many([([_HERE / "emulation" / "selftest.cu"], SELFTEST_NAMES, "selftest")])[0]


@pytest.mark.parametrize("block", [32, 96, 256, 1024])
@pytest.mark.parametrize("schedule", [0, 1, 7])
def test_selftest_block_sum(selftest, block, schedule):
    rng = np.random.default_rng(block)
    x = rng.standard_normal((5, 777)).astype(np.float32)
    out = emu.empty(5, "float32")
    selftest.get_function("block_sum<float, float, true>")((2,), (block,), (emu.to_device(x), out, 5, 777),
                                                            schedule=schedule)
    np.testing.assert_allclose(out.get(), x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_selftest_block_sum_dtypes(selftest, dtype):
    x = np.linspace(-2, 3, 3 * 45).reshape(3, 45)
    acc = "float64" if dtype == "float64" else "float32"
    name = f"block_sum<{CTYPES[dtype]}, {'double' if acc == 'float64' else 'float'}, true>"
    out = emu.empty(3, acc)
    selftest.get_function(name)((3,), (64,), (emu.to_device(x, dtype), out, 3, 45))
    want = x.astype(np.float16).astype(np.float64).sum(1) if dtype == "float16" else x.sum(1)
    np.testing.assert_allclose(out.get(), want, rtol=1e-6 if dtype == "float16" else 1e-13)


def test_selftest_missing_barrier_is_caught(selftest):
    """Without the __syncthreads, warp 0 reads partial sums other warps have not written yet."""
    x = np.ones((4, 300), np.float32)
    out = emu.empty(4, "float32")
    selftest.get_function("block_sum<float, float, false>")((4,), (256,), (emu.to_device(x), out, 4, 300),
                                                             schedule=0)
    assert not np.allclose(out.get(), 300.0)


def _shfl_expected(mode, arg, width):
    out = []
    for lane in range(32):
        seg = lane // width * width
        if mode == 0:
            src = seg + arg % width
        elif mode == 1:
            src = lane - arg if lane - seg >= arg else lane
        elif mode == 2:
            src = lane + arg if lane - seg + arg < width else lane
        else:
            src = lane ^ arg
            src = lane if src >= seg + width else src  # later groups give the caller's own value
        out.append(src * 10)
    return out


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("arg,width", [(1, 32), (5, 32), (16, 32), (3, 8), (1, 16), (16, 16), (7, 4)])
def test_selftest_shuffles(selftest, mode, arg, width):
    out = emu.empty(64, "int32")
    selftest.get_function("warp_probe")((1,), (64,), (out, mode, arg, width))
    assert out.get().tolist() == _shfl_expected(mode, arg, width) * 2


def test_selftest_votes(selftest):
    probe = selftest.get_function("warp_probe")
    out = emu.empty(32, "int32")
    probe((1,), (32,), (out, 4, 3, 32))
    assert out.get()[0] == np.int32(np.uint32(sum(1 << k for k in range(0, 32, 3))).view(np.int32))
    probe((1,), (32,), (out, 5, 31, 32))
    assert out.get().tolist() == [1] * 32
    probe((1,), (32,), (out, 6, 31, 32))
    assert out.get().tolist() == [0] * 32


def _round_bits(value: float, mbits: int, emin: int, emax: int, ebits: int) -> int:
    """Exact round-to-nearest-even of a double into a small binary format, with fractions."""
    sign = 0x8000 if math.copysign(1.0, value) < 0 else 0
    a = Fraction(abs(value))
    inf = ((1 << ebits) - 1) << mbits
    if a == 0:
        return sign
    e = max(math.frexp(float(a))[1] - 1, emin)  # exponent of the leading bit (exact for a double)
    q = round(a / Fraction(2) ** (e - mbits))  # Python rounds halves to even
    if q >= 1 << (mbits + 1):
        q, e = q >> 1, e + 1
    if e > emax:
        return sign | inf
    if q < 1 << mbits:  # subnormal
        return sign | q
    return sign | ((e + (1 << (ebits - 1)) - 1) << mbits) | (q - (1 << mbits))


def _conversion_inputs():
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 70000.0, 2.0**-24, 2.0**-25, 2.0**-26,
               3 * 2.0**-26, 2.0**-14, 2.0**-15 * 1.5, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8,
               1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-30, 3.0e38, 3.4e38, 1e-39, 2.0**-133, 2.0**-134,
               -2.0**-134 * 1.5, 0.1, -7.25, 1234.5678]
    f = np.concatenate([special, rng.standard_normal(200) * 10.0 ** rng.integers(-8, 6, 200)])
    d = f.astype(np.float64) * (1 + rng.standard_normal(f.size) * 1e-9)
    d[:len(special)] = special
    return f.astype(np.float32), d


def test_selftest_half_bfloat16_rounding_is_bit_exact(selftest):
    f, d = _conversion_inputs()
    n = f.size
    outs = [emu.empty(n, "uint16") for _ in range(4)] + [emu.empty(n, "float32") for _ in range(2)]
    selftest.get_function("convert")((2,), (64,), (emu.to_device(f), emu.to_device(d), *outs, n))
    h_f, b_f, h_d, b_d, back_h, back_b = (o.get() for o in outs)
    half = lambda v: _round_bits(float(v), 10, -14, 15, 5)  # noqa: E731
    bf16 = lambda v: _round_bits(float(v), 7, -126, 127, 8)  # noqa: E731
    assert h_f.tolist() == f.astype(np.float16).view(np.uint16).tolist()
    assert h_f.tolist() == [half(v) for v in f]
    assert h_d.tolist() == [half(v) for v in d]
    assert h_d.tolist() == d.astype(np.float16).view(np.uint16).tolist()
    assert b_f.tolist() == [bf16(v) for v in f]
    assert b_f.tolist() == emu.bf16_bits(f).tolist()
    assert b_d.tolist() == [bf16(v) for v in d]
    np.testing.assert_array_equal(back_h, f.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(back_b, emu.bf16_to_float(b_f))


def test_selftest_out_of_bounds_write_is_caught(selftest):
    out = emu.empty(63, "float32")
    with pytest.raises(emu.EmulationError, match="out of bounds"):
        selftest.get_function("oob_write")((1,), (64,), (out, 63))


def test_selftest_divergent_barrier_is_caught(selftest):
    with pytest.raises(emu.EmulationError, match="divergent"):
        selftest.get_function("divergent_barrier")((1,), (32,), (emu.empty(32, "float32"),))


def test_selftest_exited_shuffle_lane_is_caught(selftest):
    with pytest.raises(emu.EmulationError, match="exited"):
        selftest.get_function("exited_lane")((1,), (32,), (emu.empty(32, "float32"),))


def test_selftest_misaligned_vector_load_is_caught(selftest):
    x = emu.to_device(np.ones(64, np.float32))
    with pytest.raises(emu.EmulationError, match="misaligned"):
        selftest.get_function("misaligned_load")((1,), (32,), (x, emu.empty(32, "float32")))


def test_selftest_uninitialized_shared_memory_reads_nan(selftest):
    out = emu.empty(1, "float32")
    selftest.get_function("uninit_shared")((1,), (32,), (out,))
    assert np.isnan(out.get()[0])


def test_selftest_bad_launch_is_caught(selftest):
    out = emu.empty(5, "float32")
    args = (emu.to_device(np.ones((5, 8), np.float32)), out, 5, 8)
    with pytest.raises(emu.EmulationError, match="exceeds"):
        selftest.get_function("block_sum<float, float, true>")((1,), (2048,), args)
    with pytest.raises(emu.EmulationError, match="multiple of 32"):
        selftest.get_function("block_sum<float, float, true>")((1,), (48,), args)
    with pytest.raises(TypeError):
        selftest.get_function("block_sum<float, float, true>")((1,), (32,), args[:3])


# ---- anynorm's kernels --------------------------------------------------------------------------

# Register-cache sizes built per dtype (a subset keeps the cold compile short; V = 16 / itemsize
# elements per vector: every dtype gets a scalar-only size and vector sizes).
WARP_ITEMS = {"float32": (1, 2, 4, 8, 32), "float64": (1, 2, 16), "float16": (1, 8, 16),
              "bfloat16": (2, 8)}
ROWS_BLOCK, BLOCK = 128, 256


def _names():
    per_file = {"rows.cu": [], "cols.cu": [], "finish.cu": [], "params.cu": []}
    for dtype, ctype in CTYPES.items():
        for items in WARP_ITEMS[dtype]:
            per_file["rows.cu"] += [f"rows_fwd_warp<{ctype}, {items}>", f"rows_bwd_warp<{ctype}, {items}>"]
        per_file["rows.cu"] += [f"rows_stats_partial<{ctype}>", f"rows_grad_partial<{ctype}>"]
        per_file["cols.cu"] += [f"cols_stats_partial<{ctype}>", f"cols_grad_partial<{ctype}>"]
        per_file["finish.cu"] += [f"{k}<{ctype}>" for k in
                                  ("stats_finalize", "grad_finalize", "apply_fwd", "apply_bwd")]
        per_file["params.cu"] += [f"{k}<{ctype}>" for k in
                                  ("param_grad_cols", "param_grad_rows", "param_grad_finish")]
    return per_file


class Kernels:
    """The emulated kernels, fetched as ``kernels("rows_fwd_warp", "float32", items=4)``."""

    def __init__(self):
        jobs = [([KERNELS / f], names, f.split(".")[0]) for f, names in _names().items()]
        self._by_name = {}
        for module in emu.build_many(jobs):
            for name in module.names:
                self._by_name[name] = module

    def __call__(self, kernel, dtype, items=None):
        name = f"{kernel}<{CTYPES[dtype]}" + (f", {items}>" if items else ">")
        return self._by_name[name].get_function(name)


@pytest.fixture(scope="module")
def kernels():
    return Kernels()


def _ceil(a, b):
    return -(-a // b)


class Case:
    """A normalization problem: a real-shaped x, the axes its statistics reduce (in ``view``
    shape), the axis its parameters run along, and the kernels' buffer layout of x's memory."""

    def __init__(self, name, shape, view, axes, param_axis, outer, reduced, inner, group=1,
                 p_div=1, p_len=None):
        self.name, self.shape, self.view, self.axes, self.param_axis = name, shape, view, axes, param_axis
        self.outer, self.reduced, self.inner, self.group = outer, reduced, inner, group
        self.p_div = p_div
        self.p_len = p_len if p_len is not None else shape[param_axis]
        self.total = outer * reduced * inner
        self.slices = outer * (inner // group)
        assert self.total == math.prod(shape) == math.prod(view)

    def __repr__(self):
        return f"{self.name}{self.shape}"

    @property
    def a_len(self):
        return self.total // (self.p_len * self.p_div)

    def full(self, p):
        """A (p_len,) parameter broadcast to x's view shape."""
        shape = [1] * len(self.shape)
        shape[self.param_axis] = self.shape[self.param_axis]
        return np.broadcast_to(np.reshape(p, shape), self.shape).reshape(self.view)


def layer_norm_rows(rows, count):
    return Case("ln_rows", (rows, count), (rows, count), (1,), 1, rows, count, 1, p_len=count)


def instance_norm_nchw(n, c, h, w):
    return Case("in_nchw", (n, c, h, w), (n, c, h, w), (2, 3), 1, n * c, h * w, 1, p_div=h * w)


def group_norm_nchw(n, c, h, w, g):
    return Case("gn_nchw", (n, c, h, w), (n, g, c // g, h, w), (2, 3, 4), 1, n * g, c // g * h * w, 1,
                p_div=h * w)


def layer_norm_channels_first(n, c, h, w):
    return Case("ln_cf", (n, c, h, w), (n, c, h, w), (1,), 1, n, c, h * w, p_div=h * w)


def instance_norm_nhwc(n, h, w, c):
    return Case("in_nhwc", (n, h, w, c), (n, h, w, c), (1, 2), 3, n, h * w, c)


def group_norm_nhwc(n, h, w, c, g):
    return Case("gn_nhwc", (n, h, w, c), (n, h, w, g, c // g), (1, 2, 4), 3, n, h * w, c, group=c // g)


# ---- float64 reference ----------------------------------------------------------------------------

def ref_forward(case, x, w, b, center, eps):
    """(y, mean, rstd) in float64; mean/rstd flattened in slice order."""
    v = x.reshape(case.view)
    mean = v.mean(case.axes, keepdims=True) if center else np.zeros_like(v.mean(case.axes, keepdims=True))
    rstd = 1.0 / np.sqrt(((v - mean) ** 2).mean(case.axes, keepdims=True) + eps)
    y = (v - mean) * rstd
    if w is not None:
        y = y * case.full(w)
    if b is not None:
        y = y + case.full(b)
    return y.reshape(case.shape), mean.reshape(-1), rstd.reshape(-1)


def ref_backward(case, dy, x, w, center, eps):
    """(dx, dweight, dbias) in float64 with statistics recomputed in float64."""
    v, d = x.reshape(case.view), dy.reshape(case.view)
    mean = v.mean(case.axes, keepdims=True) if center else 0.0
    rstd = 1.0 / np.sqrt(((v - mean) ** 2).mean(case.axes, keepdims=True) + eps)
    xhat = (v - mean) * rstd
    g = d * (case.full(w) if w is not None else 1.0)
    mg = g.mean(case.axes, keepdims=True) if center else 0.0
    dx = rstd * (g - mg - xhat * (g * xhat).mean(case.axes, keepdims=True))
    other = tuple(a for a in range(len(case.shape)) if a != case.param_axis)
    dw = (d * xhat).reshape(case.shape).sum(other)
    db = d.reshape(case.shape).sum(other)
    return dx.reshape(case.shape), dw, db


def _data(case, dtype, seed, shift=3.0):
    """x rounded to dtype (values and float64 copy), weights/bias in the accumulation dtype."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(case.shape) * 2.0 + shift
    p = case.p_len
    w = (1.0 + 0.5 * rng.standard_normal(p)).astype(ACC[dtype]).astype(np.float64)
    b = (0.5 * rng.standard_normal(p)).astype(ACC[dtype]).astype(np.float64)
    return x, w, b


def _rounded(a, dtype):
    """Values of ``a`` after rounding to dtype, as float64."""
    if dtype == "bfloat16":
        return emu.bf16_to_float(emu.bf16_bits(a)).astype(np.float64).reshape(np.shape(a))
    return np.asarray(a).astype(dtype).astype(np.float64)


def _close(got, want, tol, what, scale=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.maximum(1.0, np.abs(want)) if scale is None else scale
    err = np.abs(got - want) / scale
    bad = ~(err <= tol)  # NaN counts as bad
    if bad.any():
        i = np.flatnonzero(bad.ravel())
        raise AssertionError(f"{what}: {i.size} of {err.size} elements off (tol {tol:g}); first at flat "
                             f"index {i[:6].tolist()}: got {got.ravel()[i[:6]].tolist()}, want "
                             f"{want.ravel()[i[:6]].tolist()}")


# ---- pipelines (launch configurations from kernels/README.md) -----------------------------------

def _acc_buf(n, dtype):
    return emu.empty(max(1, n), ACC[dtype])


def _opt(flag, make):
    return make() if flag else None


def run_forward(kernels, case, dtype, x, w, b, *, center=1, eps=1e-5, res=None, want_y=True,
                path="warp", items=None, chunk=None, offset=0, grid=None, schedule=None):
    """Launch the forward kernels; returns float64 (y, h, mean, rstd) (None where not produced)."""
    A = ACC[dtype]
    xd = emu.to_device(x.reshape(-1), dtype, offset)
    rd = None if res is None else emu.to_device(res.reshape(-1), dtype, offset)
    hd = None if res is None else emu.empty(case.total, dtype, offset)
    yd = emu.empty(case.total, dtype, offset) if want_y else None
    wd = None if w is None else emu.to_device(w, A)
    bd = None if b is None else emu.to_device(b, A)
    mean = emu.empty(case.slices, A) if center else None
    rstd = emu.empty(case.slices, A)
    outer, reduced, inner, group = case.outer, case.reduced, case.inner, case.group
    launch = dict(schedule=schedule)
    if path == "warp":
        assert inner == 1 and reduced <= 32 * items
        grid = grid or min(_ceil(outer, ROWS_BLOCK // 32), 65535 * 16)
        kernels("rows_fwd_warp", dtype, items)(
            (grid,), (ROWS_BLOCK,), (xd, rd, hd, yd, wd, bd, mean, rstd, outer, reduced, case.p_div,
                                     case.p_len, center, eps), **launch)
    else:
        nchunk = _ceil(reduced, chunk)
        ws = [_acc_buf(outer * nchunk * inner, dtype) for _ in range(3)]
        if path == "rows":
            assert inner == 1
            kernels("rows_stats_partial", dtype)((nchunk, min(outer, 65535)), (BLOCK,),
                                                 (xd, rd, hd, *ws, outer, reduced, chunk), **launch)
        else:
            kernels("cols_stats_partial", dtype)((_ceil(inner, 32), nchunk, min(outer, 65535)), (32, 8),
                                                 (xd, rd, hd, *ws, outer, reduced, inner, chunk), **launch)
        kernels("stats_finalize", dtype)((min(_ceil(case.slices, BLOCK), 65535),), (BLOCK,),
                                         (*ws, mean, rstd, outer, nchunk, inner, group, center, eps), **launch)
        if want_y:
            kernels("apply_fwd", dtype)((grid or _ceil(case.total, BLOCK),), (BLOCK,),
                                        (hd if res is not None else xd, yd, wd, bd, mean, rstd, case.total,
                                         reduced, inner, group, case.p_div, case.p_len, center), **launch)
    get = lambda d: None if d is None else d.get_float()  # noqa: E731
    return get(yd), get(hd), get(mean), get(rstd)


def run_backward(kernels, case, dtype, dy, x, w, mean, rstd, *, center=1, path="warp", items=None,
                 chunk=None, offset=0, grid=None, schedule=None):
    """Launch the dx kernels with the given statistics; returns float64 dx."""
    A = ACC[dtype]
    dyd, xd = emu.to_device(dy.reshape(-1), dtype, offset), emu.to_device(x.reshape(-1), dtype, offset)
    dxd = emu.empty(case.total, dtype, offset)
    wd = None if w is None else emu.to_device(w, A)
    md = emu.to_device(mean, A) if center else None
    rd = emu.to_device(rstd, A)
    outer, reduced, inner, group = case.outer, case.reduced, case.inner, case.group
    launch = dict(schedule=schedule)
    if path == "warp":
        grid = grid or min(_ceil(outer, ROWS_BLOCK // 32), 65535 * 16)
        kernels("rows_bwd_warp", dtype, items)(
            (grid,), (ROWS_BLOCK,), (dyd, xd, wd, md, rd, dxd, outer, reduced, case.p_div, case.p_len,
                                     center), **launch)
        return dxd.get_float()
    nchunk = _ceil(reduced, chunk)
    ws = [_acc_buf(outer * nchunk * inner, dtype) for _ in range(2)]
    if path == "rows":
        kernels("rows_grad_partial", dtype)((nchunk, min(outer, 65535)), (BLOCK,),
                                            (dyd, xd, wd, md, rd, *ws, outer, reduced, chunk, case.p_div,
                                             case.p_len, center), **launch)
    else:
        kernels("cols_grad_partial", dtype)((_ceil(inner, 32), nchunk, min(outer, 65535)), (32, 8),
                                            (dyd, xd, wd, md, rd, *ws, outer, reduced, inner, group, chunk,
                                             case.p_div, case.p_len, center), **launch)
    means = [_acc_buf(case.slices, dtype) for _ in range(2)]
    kernels("grad_finalize", dtype)((min(_ceil(case.slices, BLOCK), 65535),), (BLOCK,),
                                    (*ws, *means, outer, nchunk, inner, group, float(case.reduced * group)),
                                    **launch)
    kernels("apply_bwd", dtype)((grid or _ceil(case.total, BLOCK),), (BLOCK,),
                                (dyd, xd, wd, md, rd, *means, dxd, case.total, reduced, inner, group,
                                 case.p_div, case.p_len, center), **launch)
    return dxd.get_float()


def run_param_grads(kernels, case, dtype, dy, x, mean, rstd, *, center=1, with_bias=True, chunk=None,
                    schedule=None):
    """Launch dweight/dbias kernels; returns float64 (dweight, dbias)."""
    A = ACC[dtype]
    dyd, xd = emu.to_device(dy.reshape(-1), dtype), emu.to_device(x.reshape(-1), dtype)
    md = emu.to_device(mean, A) if center else None
    rd = emu.to_device(rstd, A)
    a_len, p_len, b_len = case.a_len, case.p_len, case.p_div
    nchunk = _ceil(a_len, chunk)
    part_w, part_b = _acc_buf(nchunk * p_len, dtype), _acc_buf(nchunk * p_len, dtype)
    part_b = part_b if with_bias else None
    geometry = (case.reduced, case.inner, case.group)
    launch = dict(schedule=schedule)
    if b_len == 1:
        kernels("param_grad_cols", dtype)((_ceil(p_len, 32), nchunk), (32, 8),
                                          (dyd, xd, md, rd, part_w, part_b, a_len, p_len, *geometry, chunk,
                                           center), **launch)
    else:
        kernels("param_grad_rows", dtype)((p_len, nchunk), (BLOCK,),
                                          (dyd, xd, md, rd, part_w, part_b, a_len, p_len, b_len, *geometry,
                                           chunk, center), **launch)
    dw, db = emu.empty(p_len, A), (emu.empty(p_len, A) if with_bias else None)
    kernels("param_grad_finish", dtype)((min(_ceil(p_len, BLOCK), 65535),), (BLOCK,),
                                        (part_w, part_b, dw, db, p_len, nchunk), **launch)
    return dw.get_float(), (db.get_float() if with_bias else None)


def _items(dtype, count):
    return next(k for k in WARP_ITEMS[dtype] if 32 * k >= count)


def check_forward(kernels, case, dtype, *, center=1, weight=True, bias=True, residual=False,
                  want_y=True, eps=1e-5, seed=0, **kw):
    x, w, b = _data(case, dtype, seed)
    w, b = (w if weight else None), (b if bias and center else None)
    res = np.random.default_rng(seed + 1).standard_normal(case.shape) if residual else None
    y, h, mean, rstd = run_forward(kernels, case, dtype, x, w, b, center=center, eps=eps, res=res,
                                   want_y=want_y, **kw)
    xr = _rounded(x, dtype)
    if residual:
        want_h = _rounded(xr + _rounded(res, dtype), dtype)  # x + res rounded once to dtype
        np.testing.assert_array_equal(h.reshape(case.shape), want_h, err_msg=f"h of {case} {dtype}")
        xr = want_h
    y_ref, mean_ref, rstd_ref = ref_forward(case, xr, w, b, center, eps)
    _close(rstd, rstd_ref, STAT_TOL[dtype], f"rstd of {case} {dtype}", scale=np.abs(rstd_ref))
    if center:
        _close(mean, mean_ref, STAT_TOL[dtype], f"mean of {case} {dtype}")
    if want_y:
        _close(y.reshape(case.shape), y_ref, TOL[dtype], f"y of {case} {dtype}")
    else:
        assert y is None


def check_backward(kernels, case, dtype, *, center=1, weight=True, eps=1e-5, seed=0, **kw):
    x, w, _ = _data(case, dtype, seed)
    w = w if weight else None
    dy = np.random.default_rng(seed + 2).standard_normal(case.shape)
    xr, dyr = _rounded(x, dtype), _rounded(dy, dtype)
    _, mean, rstd = ref_forward(case, xr, None, None, center, eps)
    mean, rstd = mean.astype(ACC[dtype]), rstd.astype(ACC[dtype])
    dx = run_backward(kernels, case, dtype, dy, x, w, mean, rstd, center=center, **kw)
    dx_ref, _, _ = ref_backward(case, dyr, xr, w, center, eps)
    scale = max(1.0, float(np.abs(dx_ref).max()))
    _close(dx.reshape(case.shape), dx_ref, TOL[dtype] * 4, f"dx of {case} {dtype}", scale=scale)


# ---- rows, one warp per row ----------------------------------------------------------------------

_COUNTS = {"float32": (1, 3, 7, 31, 32, 33, 100, 127, 128, 129, 257, 1000, 1024),
           "float64": (1, 3, 33, 64, 257, 512), "float16": (1, 7, 32, 33, 255, 257, 512),
           "bfloat16": (3, 31, 64, 256)}
_ROW_CASES = [(d, c) for d in DTYPES for c in _COUNTS[d]]


@pytest.mark.parametrize("dtype,count", _ROW_CASES)
def test_rows_warp_forward(kernels, dtype, count):
    case = layer_norm_rows(6, count)
    check_forward(kernels, case, dtype, path="warp", items=_items(dtype, count))


@pytest.mark.parametrize("dtype,count", _ROW_CASES)
def test_rows_warp_backward(kernels, dtype, count):
    case = layer_norm_rows(6, count)
    check_backward(kernels, case, dtype, path="warp", items=_items(dtype, count))


_VARIANTS = {
    "rms": dict(center=0, bias=False),
    "no_params": dict(weight=False, bias=False),
    "residual": dict(residual=True),
    "stats_only": dict(want_y=False),
    "misaligned": dict(offset=1, residual=True),
    "grid_stride": dict(grid=1),
    "schedule_reverse": dict(schedule=1),
    "schedule_random": dict(schedule=5),
}


@pytest.mark.parametrize("variant", list(_VARIANTS))
@pytest.mark.parametrize("dtype,count", [("float32", 64), ("float16", 48), ("bfloat16", 256), ("float64", 30)])
def test_rows_warp_forward_variants(kernels, dtype, count, variant):
    case = layer_norm_rows(9, count)
    check_forward(kernels, case, dtype, path="warp", items=_items(dtype, count), **_VARIANTS[variant])


@pytest.mark.parametrize("variant", ["rms", "no_params", "misaligned", "grid_stride", "schedule_random"])
@pytest.mark.parametrize("dtype,count", [("float32", 64), ("float16", 48), ("float64", 30)])
def test_rows_warp_backward_variants(kernels, dtype, count, variant):
    opts = {k: v for k, v in _VARIANTS[variant].items() if k in ("center", "weight", "offset", "grid",
                                                                 "schedule")}
    check_backward(kernels, layer_norm_rows(9, count), dtype, path="warp", items=_items(dtype, count), **opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("make", [lambda: instance_norm_nchw(2, 3, 5, 7), lambda: group_norm_nchw(2, 6, 3, 5, 3)],
                         ids=["instance_nchw", "group_nchw"])
def test_rows_warp_param_stride(kernels, dtype, make):
    """NCHW instance/group norm: p = (e / HW) % C inside a row."""
    case = make()
    items = _items(dtype, case.reduced)
    check_forward(kernels, case, dtype, path="warp", items=items)
    check_backward(kernels, case, dtype, path="warp", items=items)
