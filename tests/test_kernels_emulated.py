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

import importlib
import importlib.util
import math
import os
import sys
import types
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from anynorm._cuda import _schedule  # pure: no CuPy needed

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("anynorm_emu_harness", _HERE / "emulation" / "emu_harness.py")
emu = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = emu
_spec.loader.exec_module(emu)

pytestmark = pytest.mark.skipif(emu.compiler() is None or not hasattr(os, "fork"),
                                reason="the CUDA emulation needs g++ and fork()")

# ANYNORM_EMU_KERNEL_DIR runs the suite on another copy of the sources (e.g. a mutated one).
KERNELS = Path(os.environ.get("ANYNORM_EMU_KERNEL_DIR", _HERE.parent / "kernels"))
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


def test_selftest_cupy_argument_widths(selftest):
    """Under CuPy's rules an argument passes its own bytes: a Python int or an int64 for an
    int parameter is refused (on a GPU it would shift every later argument), an int32 and
    CuPy's own holders (what anynorm._cuda._args makes) pass."""
    from anynorm._cuda import _args

    probe = selftest.get_function("warp_probe").as_cupy()
    out = emu.empty(64, "int32")
    for bad in (1, np.int64(1), _args.i64(1), np.int16(1), np.float32(1)):
        with pytest.raises(TypeError, match="argument 1"):
            probe((1,), (64,), (out, bad, np.int32(5), np.int32(32)))
    probe((1,), (64,), (out, _args.i32(1), np.int32(5), _args.i32(32)))
    assert out.get().tolist() == _shfl_expected(1, 5, 32) * 2
    assert int(emu.unhold(_args.address(123456))) == 123456


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


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # values past 65504
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

# Register-cache sizes built per dtype: all for float32, a subset elsewhere to keep the cold
# compile short (V = 16 / itemsize elements per vector: each dtype gets scalar and vector sizes).
BUILD_ITEMS = {"float32": (1, 2, 4, 8, 16), "float64": (1, 2, 8, 16), "float16": (1, 8, 16),
               "bfloat16": (2, 8, 16)}
ROWS_BLOCK, BLOCK = 128, 256  # warp-per-row block, others (block-per-row: row_threads)
FINISH_BLOCK = (32, 16)  # param_grad_finish


def _private_cuda(module: str):
    """Import ``anynorm/_cuda/<module>.py`` as a private copy whose ``cupy`` is NumPy on shared
    memory (no CuPy or GPU needed); ``sys.modules`` is left as it was found."""
    fake = types.ModuleType("cupy")
    fake.empty = lambda shape, dtype: emu.shared_empty(shape, dtype)
    fake.ascontiguousarray = np.ascontiguousarray
    fake.transpose = np.transpose
    fake.cuda = types.SimpleNamespace(Device=lambda *a: types.SimpleNamespace(id=0, attributes={}))
    fake.RawKernel = type("RawKernel", (), {})
    tricks = types.ModuleType("cupy.lib.stride_tricks")
    tricks.as_strided = np.lib.stride_tricks.as_strided
    fake.lib = types.ModuleType("cupy.lib")
    fake.lib.stride_tricks = tricks
    pkg = types.ModuleType("anynorm_emu_cuda")
    pkg.__path__ = [str(_HERE.parent / "anynorm" / "_cuda")]
    names = ("cupy", "cupy.lib", "cupy.lib.stride_tricks", "anynorm_emu_cuda")
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update({"cupy": fake, "cupy.lib": fake.lib, "cupy.lib.stride_tricks": tricks,
                        "anynorm_emu_cuda": pkg})
    try:
        return importlib.import_module(f"anynorm_emu_cuda.{module}")
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        for name in [n for n in sys.modules if n.startswith("anynorm_emu_cuda.")]:
            sys.modules.pop(name)


_compile = _private_cuda("_compile")  # the executor's list of kernels and instantiations


def items_built(kernel, dtype):
    """The ITEMS values of ``kernel`` built for ``dtype`` (empty: no ITEMS parameter); every
    cluster size of the cluster kernels (a launch's grid is whole clusters of its size)."""
    items = _compile.items_of(kernel, dtype)
    if kernel.endswith("_cluster"):
        return items
    return tuple(k for k in items if k in BUILD_ITEMS[dtype]) or items[:1]


def _build_jobs():
    """(sources, names, tag) per file; rows.cu split in two so both cores compile."""
    jobs = []
    for file, kernels in _compile.KERNELS.items():
        groups = (DTYPES[:2], DTYPES[2:]) if file == "rows.cu" else (DTYPES,)
        for dtypes in groups:
            names = []
            for dtype in dtypes:
                for kernel in kernels:
                    for items in items_built(kernel, dtype) or (None,):
                        names.append(_compile.name_expression(kernel, dtype, items))
            jobs.append(([KERNELS / file], names, f"{file.split('.')[0]}-{dtypes[0]}"))
    return jobs


class Kernels:
    """The emulated kernels, fetched as ``kernels("rows_fwd_warp", "float32", items=4)``."""

    def __init__(self, jobs=None):
        self._by_name = {}
        for module in emu.build_many(jobs or _build_jobs()):
            for name in module.names:
                self._by_name[name] = module

    def __call__(self, kernel, dtype, items=None):
        name = _compile.name_expression(kernel, dtype, items)
        return self._by_name[name].get_function(name)


def kernel_set(files, kernels, tag):
    """:class:`Kernels` of some files' kernels alone (every ITEMS listed, every dtype): the
    smaller builds of the test modules of one file."""
    jobs = [([KERNELS / f for f in files],
             [_compile.name_expression(k, dtype, i) for k in kernels for i in (_compile.items_of(k, dtype) or (None,))],
             f"{tag}-{dtype}") for dtype in DTYPES]
    return Kernels(jobs)


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


def _opt_in(function, smem):
    """Let ``function`` take ``smem`` bytes of dynamic shared memory (opted in past 48 KiB, as
    the launcher does)."""
    if smem > 48 * 1024:
        function.max_dynamic_shared_size_bytes = smem


def _tile_bytes(case, dtype, width, copies):
    """Dynamic shared memory of the tile kernels: ``copies`` (reduced, width) tiles of dtype."""
    return copies * case.reduced * width * (2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize)


def run_forward(kernels, case, dtype, x, w, b, *, center=1, eps=1e-5, res=None, want_y=True,
                path="warp", items=None, chunk=None, offset=0, grid=None, schedule=None, params_in_t=False,
                slots=3, param_offset=0, stash=None):
    """Launch the forward kernels; returns float64 (y, h, mean, rstd) (None where not produced).

    ``grid`` replaces every grid extent that a kernel loops over (rows, outer, slices,
    elements): 1 makes each kernel walk its whole range from a single block or warp group.
    ``params_in_t`` (tile, block and lean paths): weight and bias stored in x's dtype
    (``param_in_t`` flags), ``param_offset`` elements past a 16-byte boundary.
    ``slots`` (block and lean paths): the row slots of stage the launch gives the block (as the
    launcher does: ``_schedule.fwd_slot_bytes`` each; 0 or 1: no room, rows read as they go);
    ``stash`` (lean path, 16-bit rows): room for the parameters past them
    (``_schedule.lean_stash_bytes``) and ``param_in_t``'s bit 2 (None: where they are float32)."""
    A = ACC[dtype]
    xd = emu.to_device(x.reshape(-1), dtype, offset)
    rd = None if res is None else emu.to_device(res.reshape(-1), dtype, offset)
    hd = None if res is None else emu.empty(case.total, dtype, offset)
    yd = emu.empty(case.total, dtype, offset) if want_y else None
    P = dtype if params_in_t else A
    wd = None if w is None else emu.to_device(w, P, param_offset)
    bd = None if b is None else emu.to_device(b, P, param_offset)
    pin = (int(w is not None) | int(b is not None) << 1) if params_in_t else 0
    mean = emu.empty(case.slices, A) if center else None
    rstd = emu.empty(case.slices, A)
    outer, reduced, inner, group = case.outer, case.reduced, case.inner, case.group
    launch = dict(schedule=schedule)
    if path == "sample":  # columns, a sample across a cluster of ``items`` blocks (samples.cu)
        assert res is None
        function, smem = sample_kernel(kernels, "cols_fwd_cluster", case, dtype, items, 1)
        function(((grid or outer) * items,), (SAMPLE_BLOCK,),
                 (xd, yd, wd, bd, mean, rstd, outer, reduced, inner, case.p_div, case.p_len, center, eps, pin),
                 shared_mem=smem, cluster=items, **launch)
    elif path == "tile":  # columns, one (reduced, width) tile per block in shared memory
        width = items
        kernels("cols_fwd_tile", dtype)((_ceil(inner, width), grid or min(outer, 65535)), (BLOCK,),
                                        (xd, rd, hd, yd, wd, bd, mean, rstd, outer, reduced, inner, group,
                                         width, case.p_div, case.p_len, center, eps, pin),
                                        shared_mem=_tile_bytes(case, dtype, width, 1), **launch)
    elif path in ("warp", "block", "lean"):  # rows held in registers: a warp or a block per row
        per_row = 32 if path == "warp" else row_threads(reduced, items)
        assert inner == 1 and reduced <= per_row * items
        grid = grid or (_ceil(outer, ROWS_BLOCK // 32) if path == "warp" else outer)
        function = kernels(f"rows_fwd_{path}", dtype, items)
        smem = 0
        if path != "warp" and dtype != "float64":
            smem = slots * _schedule.fwd_slot_bytes(dtype, items, per_row, res is not None)
            if path == "lean" and (not params_in_t if stash is None else stash):
                smem += _schedule.lean_stash_bytes(dtype, items, per_row)
                pin |= 4
            _opt_in(function, smem)
        function((grid,), (ROWS_BLOCK if path == "warp" else per_row,),
                 (xd, rd, hd, yd, wd, bd, mean, rstd, outer, reduced, case.p_div, case.p_len, center, eps, pin),
                 shared_mem=smem, **launch)
    else:
        nchunk = _ceil(reduced, chunk)
        ws = [_acc_buf(outer * nchunk * inner, dtype) for _ in range(3)]
        if path == "rows":  # statistics of x - x[row start], the mean's rounding handed to apply
            assert inner == 1
            kernels("rows_stats_partial", dtype)((nchunk, grid or min(outer, 65535)), (BLOCK,),
                                                 (xd, rd, hd, *ws, outer, reduced, chunk), **launch)
            lo = _acc_buf(outer, dtype) if center else None
            src = hd if res is not None else xd
            kernels("rows_stats_finalize", dtype)((grid or min(_ceil(outer, BLOCK), 65535),), (BLOCK,),
                                                  (src, *ws, mean, rstd, lo, outer, reduced, nchunk, center, eps),
                                                  **launch)
            if want_y:
                kernels("rows_apply_fwd", dtype)((grid or _ceil(case.total, BLOCK),), (BLOCK,),
                                                 (src, yd, wd, bd, mean, lo, rstd, case.total, reduced,
                                                  case.p_div, case.p_len, center, 0), **launch)
        else:  # shifted partials (v - the slice's first element): cols_apply_fwd writes y and the mean
            cgrid = (_ceil(inner, 32), nchunk, grid or min(outer, 65535))
            kernels("cols_stats_partial", dtype)(cgrid, (32, 8), (xd, rd, hd, *ws, outer, reduced, inner, chunk,
                                                                  group, center), **launch)
            shifted = _acc_buf(case.slices, dtype) if center else None
            kernels("stats_finalize", dtype)((grid or min(_ceil(case.slices, BLOCK), 65535),), (BLOCK,),
                                             (*ws, shifted, rstd, outer, nchunk, inner, group, center, eps),
                                             **launch)
            kernels("cols_apply_fwd", dtype)(cgrid, (32, 8),
                                             (hd if res is not None else xd, yd, wd, bd, shifted, rstd, mean,
                                              outer, reduced, inner, group, chunk, case.p_div, case.p_len,
                                              center, 0), **launch)
    get = lambda d: None if d is None else d.get_float()  # noqa: E731
    return get(yd), get(hd), get(mean), get(rstd)


SAMPLE_BLOCK = 256  # samples.cu: SAMPLE_THREADS


def sample_kernel(kernels, name, case, dtype, c, copies):
    """(emulated kernel, dynamic smem bytes) of a samples.cu kernel with clusters of ``c``,
    its shared memory as the launcher sizes it (``_schedule.sample_smem``)."""
    per_col = case.inner % (case.p_div * case.p_len) == 0
    smem = _schedule.sample_smem(case.reduced, case.inner, dtype, c, copies, per_col)
    function = kernels(name, dtype, c)
    _opt_in(function, smem)
    return function, smem


def tile_bwd_kernel(case, dtype, width, param_grads=False, param_rows=0):
    """The tile backward the launcher takes at this width: cols_bwd_tile_vec where the
    arithmetic goes in shared-memory vectors (``_schedule.tile_bwd_vector``), else cols_bwd_tile."""
    itemsize = 2 if dtype in ("float16", "bfloat16") else np.dtype(dtype).itemsize
    vector = _schedule.tile_bwd_vector(case, width, itemsize, param_grads, param_rows)
    return "cols_bwd_tile_vec" if vector else "cols_bwd_tile"


def run_backward(kernels, case, dtype, dy, x, w, mean, rstd, *, center=1, path="warp", items=None,
                 chunk=None, offset=0, grid=None, schedule=None, kernel=None, params_in_t=False, ahead=False):
    """Launch the dx kernels with the given statistics; returns float64 dx. ``kernel`` (tile
    path): the tile backward to take instead of the launcher's choice (``tile_bwd_kernel``);
    ``params_in_t`` (tile path): the weight stored in x's dtype; ``ahead`` (block path): the
    launch gives the block room for that many slots (True: one) of ``block_stage_bytes`` to
    read rows ahead into."""
    A = ACC[dtype]
    dyd, xd = emu.to_device(dy.reshape(-1), dtype, offset), emu.to_device(x.reshape(-1), dtype, offset)
    dxd = emu.empty(case.total, dtype, offset)
    wd = None if w is None else emu.to_device(w, dtype if params_in_t else A)
    pin = int(params_in_t and w is not None)
    md = emu.to_device(mean, A) if center else None
    rd = emu.to_device(rstd, A)
    outer, reduced, inner, group = case.outer, case.reduced, case.inner, case.group
    launch = dict(schedule=schedule)
    if path == "sample":  # a cluster of ``items`` blocks a sample; ``grid``: clusters
        function, smem = sample_kernel(kernels, "cols_bwd_cluster", case, dtype, items, 2)
        function(((grid or outer) * items,), (SAMPLE_BLOCK,),
                 (dyd, xd, wd, rd, dxd, None, None, outer, reduced, inner, case.p_div, case.p_len, center, pin),
                 shared_mem=smem, cluster=items, **launch)
        return dxd.get_float()
    if path == "tile":
        width = items
        # a persistent 1-D grid over the (o, tile) items (``grid``: fewer blocks, several items each)
        kernels(kernel or tile_bwd_kernel(case, dtype, width), dtype)(
            (grid or outer * _ceil(inner, width),), (BLOCK,),
            (dyd, xd, wd, md, rd, dxd, None, None, outer, reduced, inner, group, width, case.p_div, case.p_len,
             0, center, pin), shared_mem=_tile_bytes(case, dtype, width, 2), **launch)
        return dxd.get_float()
    if path in ("warp", "block"):
        grid = grid or (_ceil(outer, ROWS_BLOCK // 32) if path == "warp" else outer)
        threads = ROWS_BLOCK if path == "warp" else row_threads(reduced, items)
        function = kernels(f"rows_bwd_{path}", dtype, items)
        smem = int(ahead) * _schedule.block_stage_bytes(dtype, items, threads)
        _opt_in(function, smem)
        function((grid,), (threads,), (dyd, xd, wd, md, rd, dxd, outer, reduced, case.p_div, case.p_len, center, 0),
                 shared_mem=smem, **launch)
        return dxd.get_float()
    nchunk = _ceil(reduced, chunk)
    ws = [_acc_buf(outer * nchunk * inner, dtype) for _ in range(2)]
    means = [_acc_buf(case.slices, dtype) for _ in range(2)]
    fgrid = (grid or min(_ceil(case.slices, BLOCK), 65535),)
    if path == "rows":  # with sum(x - mean) per chunk: rows_grad_finalize takes the mean's rounding out
        wsd = _acc_buf(outer * nchunk, dtype) if center else None
        kernels("rows_grad_partial", dtype)((nchunk, grid or min(outer, 65535)), (BLOCK,),
                                            (dyd, xd, wd, md, rd, *ws, wsd, outer, reduced, chunk, case.p_div,
                                             case.p_len, 1, center, 0), **launch)
        kernels("rows_grad_finalize", dtype)((grid or min(_ceil(outer, BLOCK), 65535),), (BLOCK,),
                                             (*ws, wsd, md if center else None, rd, *means, outer, nchunk,
                                              float(reduced)), **launch)
    else:  # with sum(x - mean) per (o, chunk, i): the saved mean's rounding comes out in the finalize
        ws_x = _acc_buf(outer * nchunk * inner, dtype) if center else None
        kernels("cols_grad_partial", dtype)((_ceil(inner, 32), nchunk, grid or min(outer, 65535)), (32, 8),
                                            (dyd, xd, wd, md, rd, *ws, ws_x, outer, reduced, inner, group,
                                             chunk, case.p_div, case.p_len, center, 0), **launch)
        kernels("cols_grad_finalize", dtype)(fgrid, (BLOCK,), (*ws, ws_x, None, md, rd, *means, None, None, None, outer,
                                                               nchunk, inner, group, float(case.reduced * group),
                                                               center, 0), **launch)
    kernels("apply_bwd", dtype)((grid or _ceil(case.total, BLOCK),), (BLOCK,),
                                (dyd, xd, wd, md, rd, *means, dxd, case.total, reduced, inner, group,
                                 case.p_div, case.p_len, center, 0), **launch)
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
    kernels("param_grad_finish", dtype)((min(_ceil(p_len, 32), 65535),), FINISH_BLOCK,
                                        (part_w, part_b, dw, db, p_len, nchunk, 0), **launch)
    return dw.get_float(), (db.get_float() if with_bias else None)


def _items(dtype, count, kernel="rows_fwd_warp", width=32):
    return next(k for k in items_built(kernel, dtype) if width * k >= count)


def row_threads(count, items):
    """The block of a block-per-row kernel, as the launcher sizes it: a power of two of
    threads (at least a warp) holding ``count`` elements at ``items`` each."""
    return 1 << max(5, (_ceil(count, items) - 1).bit_length())


def check_forward(kernels, case, dtype, *, center=1, weight=True, bias=True, residual=False,
                  want_y=True, eps=1e-5, seed=0, **kw):
    x, w, b = _data(case, dtype, seed)
    w, b = (w if weight else None), (b if bias and center else None)
    if kw.get("params_in_t"):  # stored in dtype: the reference takes the rounded values
        w, b = (None if w is None else _rounded(w, dtype)), (None if b is None else _rounded(b, dtype))
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
    if kw.get("params_in_t") and w is not None:  # stored in dtype: the reference takes the rounded values
        w = _rounded(w, dtype)
    dy = np.random.default_rng(seed + 2).standard_normal(case.shape)
    xr, dyr = _rounded(x, dtype), _rounded(dy, dtype)
    _, mean, rstd = ref_forward(case, xr, None, None, center, eps)
    mean, rstd = mean.astype(ACC[dtype]), rstd.astype(ACC[dtype])
    dx = run_backward(kernels, case, dtype, dy, x, w, mean, rstd, center=center, **kw)
    dx_ref, _, _ = ref_backward(case, dyr, xr, w, center, eps)
    scale = max(1.0, float(np.abs(dx_ref).max()))
    _close(dx.reshape(case.shape), dx_ref, TOL[dtype] * 4, f"dx of {case} {dtype}", scale=scale)


# ---- rows, one warp per row ----------------------------------------------------------------------

_COUNTS = {"float32": (1, 3, 7, 31, 32, 33, 100, 127, 128, 129, 257, 500, 512),
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


# ---- rows, one 256-thread block per row (medium rows) ---------------------------------------------

_BLOCK_COUNTS = {"float32": (1, 33, 256, 257, 1000, 1025, 2048, 2049, 4100, 8192, 8193, 16384),
                 "float64": (3, 700, 2048, 3001), "float16": (7, 1024, 2050, 4096),
                 "bfloat16": (5, 1500, 2048, 16000)}
_BLOCK_CASES = [(d, c) for d in DTYPES for c in _BLOCK_COUNTS[d]]


def _block_items(dtype, count, kernel="rows_fwd_block"):
    return next(k for k in items_built(kernel, dtype)
                if row_threads(count, k) <= _compile.block_threads_max(kernel, dtype))


@pytest.mark.parametrize("dtype,count", _BLOCK_CASES)
def test_rows_block_forward(kernels, dtype, count):
    check_forward(kernels, layer_norm_rows(3, count), dtype, path="block", items=_block_items(dtype, count))


@pytest.mark.parametrize("dtype,count", [(d, c) for d, c in _BLOCK_CASES
                                         if c <= _compile.block_threads_max("rows_bwd_block", d)
                                         * _compile.items_of("rows_bwd_block", d)[-1]])
def test_rows_block_backward(kernels, dtype, count):
    check_backward(kernels, layer_norm_rows(3, count), dtype, path="block",
                   items=_block_items(dtype, count, "rows_bwd_block"))


@pytest.mark.parametrize("variant", ["rms", "no_params", "residual", "stats_only", "misaligned", "grid_stride",
                                     "schedule_random"])
@pytest.mark.parametrize("dtype,count", [("float32", 1028), ("float16", 2000)])
def test_rows_block_variants(kernels, dtype, count, variant):
    case, items = layer_norm_rows(2, count), _block_items(dtype, count)
    check_forward(kernels, case, dtype, path="block", items=items, **_VARIANTS[variant])
    opts = {k: v for k, v in _VARIANTS[variant].items() if k in ("center", "weight", "offset", "grid",
                                                                 "schedule")}
    check_backward(kernels, case, dtype, path="block", items=items, **opts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_block_param_stride(kernels, dtype):
    case = group_norm_nchw(2, 4, 9, 37, 2)  # rows of 666, p = (e / 333) % 4
    items = _block_items(dtype, case.reduced)
    check_forward(kernels, case, dtype, path="block", items=items)
    check_backward(kernels, case, dtype, path="block", items=items)


# The block forward reading its next rows ahead into a ring of row slots (cp.async): (dtype,
# rows, count, grid). Blocks with several rows each (the ring wraps), the last one with fewer,
# blocks with none; one, two and four vectors a thread (float32 ITEMS=16), a row shorter than
# its block's slots; 16-bit ITEMS=8 and float64 ignore the room (FwdStaged).
_FWD_AHEAD_ROWS = [("bfloat16", 11, 4096, 3), ("float16", 9, 1000, 2), ("float32", 10, 2048, 4),
                   ("float32", 7, 12000, 2), ("bfloat16", 3, 16384, 5), ("float32", 5, 520, 1),
                   ("float64", 5, 700, 2)]


@pytest.mark.parametrize("variant", ["ln", "rms", "residual", "stats_only", "misaligned", "random"])
@pytest.mark.parametrize("slots", [0, 2, 3, 4])
@pytest.mark.parametrize("dtype,rows,count,grid", _FWD_AHEAD_ROWS)
def test_rows_block_forward_reads_ahead(kernels, dtype, rows, count, grid, slots, variant):
    """rows_fwd_block with room for 0 (rows read as they go), 2, 3 or 4 row slots: y, h and the
    statistics as from rows read as they go, on grids that leave each block several rows;
    misaligned rows (no 16-byte vectors) read as they go even with the room."""
    opts = {"ln": {}, "rms": _VARIANTS["rms"], "residual": _VARIANTS["residual"],
            "stats_only": _VARIANTS["stats_only"], "misaligned": _VARIANTS["misaligned"],
            "random": dict(schedule=5, residual=True)}[variant]
    check_forward(kernels, layer_norm_rows(rows, count), dtype, path="block", items=_block_items(dtype, count),
                  grid=grid, slots=slots, **opts)


# rows_fwd_lean (plain rows, the weight and bias a thread holds across its rows: in registers,
# or for 16-bit rows with float32 ones in its stash past the ring): (dtype, rows, count, grid) as
# above, its instantiations only (two vectors a thread). Rows it cannot stage (no room for the
# ring or the stash, misaligned x or parameters) are read as they go, as rows_fwd_block reads them.
_LEAN_ROWS = [("bfloat16", 11, 4096, 3), ("float16", 9, 1000, 2), ("float32", 10, 2048, 4), ("bfloat16", 3, 16384, 5),
              ("float32", 5, 520, 1), ("float16", 7, 776, 3)]
_LEAN_VARIANTS = {"ln": {}, "rms": _VARIANTS["rms"], "residual": _VARIANTS["residual"],
                  "stats_only": _VARIANTS["stats_only"], "no_params": _VARIANTS["no_params"],
                  "weight_only": dict(bias=False), "random": dict(schedule=5, residual=True),
                  "misaligned": _VARIANTS["misaligned"], "params_misaligned": dict(param_offset=1),
                  "params_f32": dict(params_in_t=False), "params_f32_residual": dict(params_in_t=False, residual=True),
                  "params_f32_rms": dict(params_in_t=False, **_VARIANTS["rms"]),
                  "params_f32_misaligned": dict(params_in_t=False, param_offset=1),
                  "params_f32_no_stash": dict(params_in_t=False, stash=False),
                  "params_stashed": dict(stash=True), "params_stashed_residual": dict(stash=True, residual=True)}


@pytest.mark.parametrize("variant", list(_LEAN_VARIANTS))
@pytest.mark.parametrize("slots", [0, 2, 4])
@pytest.mark.parametrize("dtype,rows,count,grid", _LEAN_ROWS)
def test_rows_lean_forward(kernels, dtype, rows, count, grid, slots, variant):
    """rows_fwd_lean on grids that leave each block several rows (the ring wraps, the last
    block has fewer): y, h and the statistics against float64, its parameters in x's dtype
    (as the launcher passes them), with the variants that send it back to rows read as they go."""
    opts = dict(params_in_t=True) | _LEAN_VARIANTS[variant]
    check_forward(kernels, layer_norm_rows(rows, count), dtype, path="lean", items=_block_items(dtype, count,
                                                                                                "rows_fwd_lean"),
                  grid=grid, slots=slots, **opts)


# Rows whose parameter is not the position in the row (NCHW instance and group norm): staged
# where every 16-byte vector lies in one parameter's segment (one parameter a vector), read as
# they go where a segment ends inside a vector (HW = 42: rows of whole float32 vectors whose
# channels end mid-vector).
_FWD_AHEAD_SEGMENTS = [instance_norm_nchw(3, 4, 16, 32), group_norm_nchw(3, 8, 16, 16, 2),
                       group_norm_nchw(2, 8, 4, 10, 4), group_norm_nchw(2, 32, 6, 7, 2)]


@pytest.mark.parametrize("variant", ["ln", "residual", "random"])
@pytest.mark.parametrize("slots", [0, 2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", _FWD_AHEAD_SEGMENTS, ids=lambda c: f"{c.name}{'x'.join(map(str, c.shape))}")
def test_rows_block_forward_reads_ahead_segments(kernels, case, dtype, slots, variant):
    """rows_fwd_block's ring over rows of several parameters (a weight and bias a channel),
    on a grid that leaves each block several rows: y and the statistics as from rows read as
    they go."""
    opts = {"ln": {}, "residual": _VARIANTS["residual"], "random": dict(schedule=5)}[variant]
    check_forward(kernels, case, dtype, path="block", items=_block_items(dtype, case.reduced), grid=2,
                  slots=slots, **opts)


# ---- rows with dweight/dbias summed on the way (rows_bwd_{warp,block}_[row_]params) ---------------

def check_row_param_grads(kernels, case, dtype, *, path, grid, per_row=False, center=1, with_bias=True,
                          offset=0, schedule=None, ahead=False):
    """The row backward that also sums dweight/dbias (per position and block; per row with
    ``per_row``), then param_grad_finish: dx, dweight and dbias against float64 formulas.
    ``ahead`` (block and multi paths): room for that many slots (True: one) to read rows
    ahead into (past the sums)."""
    A = ACC[dtype]
    kind = "row_params" if per_row else "params"
    kernel_name = "rows_bwd_multi" if path == "multi" else f"rows_bwd_{path}_{kind}"
    if path == "multi":  # teams of one 16-byte vector a thread, several rows a block
        items, threads = _compile.MULTI_ITEMS[dtype], 256
    elif path == "warp":
        items, threads = _items(dtype, case.reduced, kernel_name), ROWS_BLOCK
    else:
        items = _block_items(dtype, case.reduced, kernel_name)
        threads = row_threads(case.reduced, items)
    x, w, _ = _data(case, dtype, 5)
    dy = np.random.default_rng(6).standard_normal(case.shape)
    xr, dyr = _rounded(x, dtype), _rounded(dy, dtype)
    _, mean, rstd = ref_forward(case, xr, None, None, center, 1e-5)
    dyd, xd = emu.to_device(dy.reshape(-1), dtype, offset), emu.to_device(x.reshape(-1), dtype, offset)
    dxd = emu.empty(case.total, dtype, offset)
    nchunk = case.a_len if per_row else grid  # partial rows: one per sample, or one per block
    parts = [_acc_buf(nchunk * case.p_len, dtype) for _ in range(2)]
    part_b = parts[1] if with_bias else None
    kernel = kernels(kernel_name, dtype, items)
    # a block's sums per (item, thread) wait in shared memory
    smem = 0 if path != "block" or per_row else 2 * items * threads * np.dtype(A).itemsize
    slot = _schedule.MULTI_BWD_SLOT if path == "multi" else _schedule.block_stage_bytes(dtype, items, threads)
    smem += int(ahead) * slot
    _opt_in(kernel, smem)
    kernel((grid,), (threads,),
           (dyd, xd, emu.to_device(w, A), emu.to_device(mean.astype(A), A) if center else None,
            emu.to_device(rstd.astype(A), A), dxd, parts[0], part_b, case.outer, case.reduced,
            *((case.p_len,) if per_row else ()), center, 0), shared_mem=smem, schedule=schedule)
    dw, db = emu.empty(case.p_len, A), (emu.empty(case.p_len, A) if with_bias else None)
    kernels("param_grad_finish", dtype)((min(_ceil(case.p_len, 32), 65535),), FINISH_BLOCK,
                                        (parts[0], part_b, dw, db, case.p_len, nchunk, 0), schedule=schedule)
    dx_ref, dw_ref, db_ref = ref_backward(case, dyr, xr, w, center, 1e-5)
    _close(dxd.get_float().reshape(case.shape), dx_ref, TOL[dtype] * 4, f"dx of {case} {dtype}",
           scale=max(1.0, float(np.abs(dx_ref).max())))
    n_terms = case.total // case.p_len
    _close(dw.get_float(), dw_ref, STAT_TOL[dtype] * 4, f"dweight of {case} {dtype}", scale=max(1.0, n_terms))
    if with_bias and center:
        _close(db.get_float(), db_ref, STAT_TOL[dtype] * 4, f"dbias of {case} {dtype}", scale=max(1.0, n_terms))


# (path, dtype, rows, count, grid): rows dealt to fewer teams than rows (several rows per
# team, teams with none), odd and vector-wide counts, one team per block and four per block.
_FUSED_ROWS = [("multi", "float32", 9, 250, 1), ("multi", "float32", 37, 33, 3), ("multi", "float64", 11, 64, 2),
               ("multi", "float16", 13, 255, 2), ("multi", "bfloat16", 6, 64, 4), ("multi", "float32", 3, 1, 2),
               ("multi", "bfloat16", 5, 2048, 2), ("multi", "float32", 40, 1000, 3),
               ("block", "float32", 5, 2049, 2), ("block", "float16", 7, 1024, 3), ("block", "float64", 4, 3001, 3),
               ("block", "bfloat16", 3, 2048, 1), ("block", "bfloat16", 3, 16384, 2),  # 128 KiB of sums
               ("block", "bfloat16", 4, 12000, 3), ("block", "float32", 3, 12000, 2)]  # float32 at ITEMS=16
_FUSED_VARIANTS = {"ln": dict(), "rms": dict(center=0), "no_bias": dict(with_bias=False),
                   "misaligned": dict(offset=1), "reverse": dict(schedule=1)}


@pytest.mark.parametrize("variant", list(_FUSED_VARIANTS))
@pytest.mark.parametrize("path,dtype,rows,count,grid", _FUSED_ROWS)
def test_rows_backward_with_param_grads(kernels, path, dtype, rows, count, grid, variant):
    """Plain rows: dx as rows_bwd_* gives it, and dweight/dbias from the per-block sums of the
    same pass."""
    check_row_param_grads(kernels, layer_norm_rows(rows, count), dtype, path=path, grid=grid,
                          **_FUSED_VARIANTS[variant])


# (path, dtype, n, c, h, w, grid): NCHW instance norm, p = row % C.
_ROW_PARAM_ROWS = [("warp", "float32", 3, 5, 7, 9, 2), ("warp", "float64", 2, 3, 4, 4, 1),
                   ("warp", "bfloat16", 4, 3, 5, 5, 3), ("warp", "float16", 2, 6, 16, 16, 2),
                   ("block", "float32", 2, 3, 40, 41, 2), ("block", "bfloat16", 3, 2, 32, 32, 1),
                   ("block", "float64", 2, 2, 30, 70, 3)]


@pytest.mark.parametrize("variant", ["ln", "no_bias", "misaligned", "reverse"])
@pytest.mark.parametrize("path,dtype,n,c,h,w,grid", _ROW_PARAM_ROWS)
def test_rows_backward_with_row_param_grads(kernels, path, dtype, n, c, h, w, grid, variant):
    """NCHW instance norm: each row's dweight/dbias terms summed by its team in the same pass
    (part[row]), then param_grad_finish over the batch."""
    check_row_param_grads(kernels, instance_norm_nchw(n, c, h, w), dtype, path=path, grid=grid, per_row=True,
                          **_FUSED_VARIANTS[variant])


# The block backwards reading each next row ahead into the room the launch gives them (cp.async
# stage past the sums): (kernel kind, dtype, rows, count, grid). Several rows a block (grid-stride
# over a stage that moves on), blocks with none, one and two vectors a thread, rows of 16-bit
# ITEMS=16 (rows_bwd_block and _row_params ignore the room there: BlockAhead), float64 (no stage).
_AHEAD_ROWS = [("", "float32", 7, 1000, 3), ("", "bfloat16", 9, 4096, 2), ("", "float16", 5, 1024, 7),
               ("", "float32", 4, 8192, 1), ("", "bfloat16", 3, 12000, 2), ("", "float64", 5, 700, 2),
               ("params", "float32", 7, 2049, 2), ("params", "bfloat16", 9, 4096, 4),
               ("params", "float16", 4, 16384, 3), ("params", "float64", 3, 3001, 2),
               ("row_params", "float32", 2, 3, 40, 2), ("row_params", "bfloat16", 3, 2, 64, 4),
               ("row_params", "float16", 2, 3, 128, 4),
               # rows_bwd_multi: groups of 16 rows of 96 (teams of 16, 4 idle threads each), of
               # one row of 2048, of 256 rows of 4 (float32); float64 reads as it goes
               ("multi", "bfloat16", 200, 96, 2), ("multi", "float16", 20, 2048, 2), ("multi", "float32", 2000, 4, 1),
               ("multi", "float32", 45, 1000, 3), ("multi", "float64", 20, 64, 2)]


@pytest.mark.parametrize("variant", ["ln", "rms", "misaligned", "random"])
@pytest.mark.parametrize("slots", [1, 2, 4])
@pytest.mark.parametrize("spec", _AHEAD_ROWS, ids=lambda s: "-".join(map(str, s)))
def test_rows_block_backward_reads_ahead(kernels, spec, slots, variant):
    """The block backwards and rows_bwd_multi with room for 1, 2 or 4 slots of stage (the
    launcher gives 1 to the block kernels of two vectors a thread, up to 4 to 16-bit ITEMS=8
    and rows_bwd_multi, which take a ring of 2 or more and read as they go with 1): dx (and
    dweight/dbias) as from rows read as they go, on grids that leave each block several rows
    (groups of rows); misaligned rows (no 16-byte vectors) read as they go even with the room."""
    opts = {"ln": {}, "rms": dict(center=0), "misaligned": dict(offset=1), "random": dict(schedule=5)}[variant]
    kind, dtype = spec[0], spec[1]
    if kind == "":
        _, _, rows, count, grid = spec
        check_backward(kernels, layer_norm_rows(rows, count), dtype, path="block",
                       items=_block_items(dtype, count, "rows_bwd_block"), grid=grid, ahead=slots, **opts)
    elif kind in ("params", "multi"):
        _, _, rows, count, grid = spec
        check_row_param_grads(kernels, layer_norm_rows(rows, count), dtype, path="block" if kind == "params" else kind,
                              grid=grid, ahead=slots, **opts)
    else:  # NCHW instance norm rows of h x h, p = row % C
        _, _, n, c, h, grid = spec
        check_row_param_grads(kernels, instance_norm_nchw(n, c, h, h), dtype, path="block", grid=grid,
                              per_row=True, ahead=slots, **opts)


# ---- rows, split into chunks (long rows) -----------------------------------------------------------

# (dtype, count, chunk): several chunks per row, chunk starts off the 16-byte grid, a short tail.
_SPLIT_ROWS = [("float32", 1500, 512), ("float32", 1025, 300), ("float32", 257, 64), ("float64", 700, 256),
               ("float16", 1030, 512), ("float16", 333, 100), ("bfloat16", 1100, 1024), ("float32", 33, 1)]


@pytest.mark.parametrize("dtype,count,chunk", _SPLIT_ROWS)
def test_rows_split_forward(kernels, dtype, count, chunk):
    check_forward(kernels, layer_norm_rows(3, count), dtype, path="rows", chunk=chunk, residual=True)


@pytest.mark.parametrize("dtype,count,chunk", _SPLIT_ROWS)
def test_rows_split_backward(kernels, dtype, count, chunk):
    check_backward(kernels, layer_norm_rows(3, count), dtype, path="rows", chunk=chunk)


@pytest.mark.parametrize("variant", ["rms", "no_params", "stats_only", "misaligned", "grid_stride",
                                     "schedule_random"])
def test_rows_split_variants(kernels, variant):
    opts = _VARIANTS[variant]
    check_forward(kernels, layer_norm_rows(2, 1200), "float32", path="rows", chunk=512, **opts)
    opts = {k: v for k, v in opts.items() if k in ("center", "weight", "offset", "grid", "schedule")}
    check_backward(kernels, layer_norm_rows(2, 1200), "float32", path="rows", chunk=512, **opts)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_split_param_stride(kernels, dtype):
    case = group_norm_nchw(2, 4, 9, 37, 2)  # rows of 666, p = (e / 333) % 4
    check_forward(kernels, case, dtype, path="rows", chunk=256)
    check_backward(kernels, case, dtype, path="rows", chunk=256)


# ---- columns (inner > 1) -----------------------------------------------------------------------------

_COL_CASES = [
    ("ln_cf", lambda: layer_norm_channels_first(2, 5, 3, 11), 2),  # inner 33: a second, nearly empty tile
    ("ln_cf_long", lambda: layer_norm_channels_first(1, 70, 2, 4), 16),
    ("in_nhwc", lambda: instance_norm_nhwc(2, 3, 5, 7), 4),
    ("gn_nhwc", lambda: group_norm_nhwc(2, 4, 3, 12, 3), 5),  # group = 4 inner positions per statistic
    ("gn_nhwc_wide", lambda: group_norm_nhwc(1, 3, 3, 40, 5), 9),
]


# ---- columns, one shared-memory tile per block (tiles.cu) ---------------------------------------------

# (name, case, tile width): widths that are multiples of group, leave a partial last tile, cover
# all of inner in one tile, or give one thread per column (width 256 in a 256-thread block).
_TILE_CASES = [
    ("ln_cf", lambda: layer_norm_channels_first(2, 5, 3, 11), 8),  # inner 33: 5 tiles, the last 1 wide
    ("ln_cf_whole", lambda: layer_norm_channels_first(3, 7, 2, 5), 10),  # one tile holds all of inner
    ("ln_cf_long", lambda: layer_norm_channels_first(1, 70, 2, 4), 3),  # 85 lanes per column, 1 idle thread
    ("ln_cf_wide", lambda: layer_norm_channels_first(2, 3, 1, 300), 256),  # one thread per column;
    # std/mean about 0.02 over 3 channels: needs the corrected two-pass mean
    ("in_nhwc", lambda: instance_norm_nhwc(2, 3, 5, 7), 4),
    ("gn_nhwc", lambda: group_norm_nhwc(2, 4, 3, 12, 3), 8),  # group 4: two statistics per tile
    ("gn_nhwc_odd", lambda: group_norm_nhwc(1, 3, 3, 30, 5), 18),  # group 6, width 18: last tile 12 wide
    # inner and width multiples of 8: 16-byte vector loads in every dtype (the cases above
    # take them where inner and width are multiples of 16 / itemsize, else scalar loads)
    ("ln_cf_vec", lambda: layer_norm_channels_first(2, 9, 4, 12), 16),  # 3 tiles of 16
    ("gn_nhwc_vec", lambda: group_norm_nhwc(2, 3, 3, 96, 32), 48),  # group 3, 2 tiles of 48
    ("in_nhwc_vec", lambda: instance_norm_nhwc(1, 5, 5, 40), 32),  # last tile: 8 of 32 columns
]


# Every columns case down both paths: (id, case, launch options).
_COLUMN_RUNS = ([(f"split-{name}", make, dict(path="cols", chunk=chunk)) for name, make, chunk in _COL_CASES]
                + [(f"tile-{name}", make, dict(path="tile", items=width)) for name, make, width in _TILE_CASES])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,path", _COLUMN_RUNS, ids=[c[0] for c in _COLUMN_RUNS])
def test_columns_forward(kernels, dtype, name, make, path):
    check_forward(kernels, make(), dtype, **path, residual=dtype != "float64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,path", _COLUMN_RUNS, ids=[c[0] for c in _COLUMN_RUNS])
def test_columns_backward(kernels, dtype, name, make, path):
    check_backward(kernels, make(), dtype, **path)


def tile_param_grads_launch(kernels, case, dtype, dy, x, w, mean, rstd, width, *, blocks=None,
                            with_bias=True, schedule=None, kernel=None):
    """cols_bwd_tile with dweight/dbias partials on a persistent grid of ``blocks`` (default:
    a block per (o, tile) item), then param_grad_finish: (dx, dweight, dbias or None), float64.
    ``p = r`` (param_rows): one partial row per block, kept in shared memory after the tiles."""
    A = ACC[dtype]
    param_rows = int(case.p_div == case.inner)
    assert param_rows or (case.p_div == 1 and case.p_len == case.inner)
    items = case.outer * _ceil(case.inner, width)
    blocks = blocks or items
    nchunk = blocks if param_rows else case.outer
    parts = [_acc_buf(nchunk * case.p_len, dtype) for _ in range(2)]
    part_b = parts[1] if with_bias else None
    dyd, xd = emu.to_device(dy.reshape(-1), dtype), emu.to_device(x.reshape(-1), dtype)
    dxd = emu.empty(case.total, dtype)
    smem = _tile_bytes(case, dtype, width, 2) + (2 * case.reduced * np.dtype(A).itemsize if param_rows else 0)
    kernels(kernel or tile_bwd_kernel(case, dtype, width, True, param_rows), dtype)(
        (blocks,), (BLOCK,),
        (dyd, xd, emu.to_device(w, A), emu.to_device(mean.astype(A), A), emu.to_device(rstd.astype(A), A), dxd,
         parts[0], part_b, case.outer, case.reduced, case.inner, case.group, width, case.p_div, case.p_len,
         param_rows, 1, 0), shared_mem=smem, schedule=schedule)
    dw, db = emu.empty(case.p_len, A), (emu.empty(case.p_len, A) if with_bias else None)
    kernels("param_grad_finish", dtype)((1,), FINISH_BLOCK, (parts[0], part_b, dw, db, case.p_len, nchunk, 0))
    return dxd.get_float(), dw.get_float(), (db.get_float() if with_bias else None)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,width", _TILE_CASES, ids=[c[0] for c in _TILE_CASES])
def test_tile_param_grads(kernels, dtype, name, make, width, with_bias):
    """cols_bwd_tile's dweight/dbias partial sums (then param_grad_finish) and its dx in the
    same launch; p is the tile's row (channels-first layer norm) or column (NHWC norms)."""
    case = make()
    x, w, _ = _data(case, dtype, 3)
    dy = np.random.default_rng(4).standard_normal(case.shape)
    xr, dyr = _rounded(x, dtype), _rounded(dy, dtype)
    _, mean, rstd = ref_forward(case, xr, None, None, 1, 1e-5)
    dx, dw, db = tile_param_grads_launch(kernels, case, dtype, dy, x, w, mean, rstd, width, with_bias=with_bias)
    check_tile_param_grads(case, dtype, dyr, xr, w, dx, dw, db)


# (id, case, width): a persistent grid of fewer blocks than (o, tile) items; odd sizes
_PERSISTENT_TILE_CASES = [
    ("ln_cf_7x7", lambda: layer_norm_channels_first(3, 12, 7, 7), 8),  # p = r, HW = 49: 7 tiles of 8
    ("ln_cf_c13", lambda: layer_norm_channels_first(2, 13, 3, 11), 8),  # p = r, C = 13, last tile 1 wide
    ("ln_cf_c5_whole", lambda: layer_norm_channels_first(4, 5, 2, 5), 10),  # p = r, a tile per o;
    # 4 items: with 5 blocks one takes none and writes a partial row of zeros
    ("in_nhwc_c13", lambda: instance_norm_nhwc(3, 3, 4, 13), 4),  # p = i, C = 13: 4 tiles per o
    ("in_nhwc_hw1", lambda: instance_norm_nhwc(3, 1, 1, 24), 8),  # p = i, HW = 1: one row
    ("gn_nhwc_hw1", lambda: group_norm_nhwc(2, 1, 1, 40, 5), 16),  # p = i, HW = 1, group 8
]


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("blocks", [1, 2, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name,make,width", _PERSISTENT_TILE_CASES, ids=[c[0] for c in _PERSISTENT_TILE_CASES])
def test_tile_param_grads_persistent(kernels, dtype, name, make, width, blocks, with_bias):
    """cols_bwd_tile on a persistent grid of ``blocks``, each taking (o, tile) items
    q = b, b + blocks, ...: dx, and dweight/dbias (p = r: one partial row per block, summed
    over its items in shared memory; p = i: per o) against the float64 reference; and the
    same bits under a reversed schedule of the block's threads (fixed orders, no atomics)."""
    case = make()
    x, w, _ = _data(case, dtype, 5)
    dy = np.random.default_rng(6).standard_normal(case.shape)
    xr, dyr = _rounded(x, dtype), _rounded(dy, dtype)
    _, mean, rstd = ref_forward(case, xr, None, None, 1, 1e-5)
    got = tile_param_grads_launch(kernels, case, dtype, dy, x, w, mean, rstd, width, blocks=blocks,
                                  with_bias=with_bias)
    check_tile_param_grads(case, dtype, dyr, xr, w, *got)
    again = tile_param_grads_launch(kernels, case, dtype, dy, x, w, mean, rstd, width, blocks=blocks,
                                    with_bias=with_bias, schedule=1)
    for a, b in zip(got, again):
        assert (a is None and b is None) or np.array_equal(a, b)


def check_tile_param_grads(case, dtype, dyr, xr, w, dx, dw, db, tol=4):
    """dx, dweight and dbias (None: not asked) against the float64 reference."""
    dx_ref, dw_ref, db_ref = ref_backward(case, dyr, xr, w, 1, 1e-5)
    _close(dx.reshape(case.shape), dx_ref, TOL[dtype] * tol, f"dx of {case} {dtype}",
           scale=max(1.0, float(np.abs(dx_ref).max())))
    n_terms = case.total // case.p_len  # as test_param_grads
    _close(dw, dw_ref, STAT_TOL[dtype] * tol, f"dweight of {case} {dtype}", scale=max(1.0, n_terms))
    if db is not None:
        _close(db, db_ref, STAT_TOL[dtype] * tol, f"dbias of {case} {dtype}", scale=max(1.0, n_terms))


@pytest.mark.parametrize("variant", ["rms", "no_params", "stats_only", "misaligned", "grid_stride",
                                     "schedule_reverse", "schedule_random"])
@pytest.mark.parametrize("path", [dict(path="cols", chunk=4), dict(path="tile", items=6)],
                         ids=["split", "tile"])
def test_columns_variants(kernels, path, variant):
    """Both columns paths (cols.cu + finish.cu, tiles.cu) on group norm NHWC, group 3."""
    case = group_norm_nhwc(3, 3, 3, 12, 4)
    check_forward(kernels, case, "float32", **path, **_VARIANTS[variant])
    opts = {k: v for k, v in _VARIANTS[variant].items() if k in ("center", "weight", "offset", "grid",
                                                                 "schedule")}
    check_backward(kernels, case, "float32", **path, **opts)


# ---- dweight / dbias ---------------------------------------------------------------------------------

_PARAM_CASES = [
    ("ln_rows", lambda: layer_norm_rows(37, 45), 8),  # b_len == 1: param_grad_cols, 2 tiles of 32
    ("ln_rows_one_chunk", lambda: layer_norm_rows(5, 3), 64),
    ("in_nchw", lambda: instance_norm_nchw(3, 4, 5, 7), 2),  # b_len = 35: param_grad_rows
    ("gn_nchw", lambda: group_norm_nchw(5, 6, 2, 3, 2), 3),
    ("ln_cf", lambda: layer_norm_channels_first(3, 5, 3, 11), 1),
    ("gn_nhwc", lambda: group_norm_nhwc(4, 3, 5, 12, 3), 7),  # b_len == 1, a_len = 60
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,make,chunk", _PARAM_CASES, ids=[c[0] for c in _PARAM_CASES])
def test_param_grads(kernels, dtype, name, make, chunk):
    case = make()
    x, _, _ = _data(case, dtype, 3)
    dy = np.random.default_rng(4).standard_normal(case.shape)
    xr, dyr = _rounded(x, dtype), _rounded(dy, dtype)
    _, mean, rstd = ref_forward(case, xr, None, None, 1, 1e-5)
    mean, rstd = mean.astype(ACC[dtype]), rstd.astype(ACC[dtype])
    dw, db = run_param_grads(kernels, case, dtype, dy, x, mean, rstd, chunk=chunk)
    _, dw_ref, db_ref = ref_backward(case, dyr, xr, np.ones(case.p_len), 1, 1e-5)
    n_terms = case.total // case.p_len
    tol = STAT_TOL[dtype] * 4
    _close(dw, dw_ref, tol, f"dweight of {case} {dtype}", scale=max(1.0, n_terms))
    _close(db, db_ref, tol, f"dbias of {case} {dtype}", scale=max(1.0, n_terms))


@pytest.mark.parametrize("schedule", [1, 9])
def test_param_grads_rms_no_bias(kernels, schedule):
    case = instance_norm_nchw(2, 3, 4, 5)
    x, _, _ = _data(case, "float32", 5)
    dy = np.random.default_rng(6).standard_normal(case.shape)
    xr, dyr = _rounded(x, "float32"), _rounded(dy, "float32")
    _, mean, rstd = ref_forward(case, xr, None, None, 0, 1e-5)
    dw, db = run_param_grads(kernels, case, "float32", dy, x, None, rstd.astype(np.float32), center=0,
                             with_bias=False, chunk=1, schedule=schedule)
    _, dw_ref, _ = ref_backward(case, dyr, xr, np.ones(case.p_len), 0, 1e-5)
    assert db is None
    _close(dw, dw_ref, 1e-5, f"dweight of RMS {case}", scale=40.0)


# ---- end to end: anynorm's own schedules and launcher (anynorm/_cuda/_schedule.py,
# _launcher.py) on the emulated kernels ----

def _load_launch(kernels):
    """A private ``_launcher`` (and ``_schedule``) on the emulated kernels and a small
    device (6 blocks target); buffers are NumPy arrays in shared memory."""
    launch = _private_cuda("_launcher")
    schedule = launch._schedule

    def get_kernel(kernel, dtype, items=None):
        if items is not None:  # a size not built for this dtype: the next larger one
            items = next(k for k in items_built(kernel, dtype) + _compile.items_of(kernel) if k >= items)
        # the launch code's argument widths checked; a cluster kernel's ITEMS is its cluster size
        return kernels(kernel, dtype, items).as_cupy(items if kernel.endswith("_cluster") else 1)

    def buffer_arg(buf, slot):
        """The array itself (the emulator checks its dtype), a typed view of the scratch."""
        if buf is None or slot.dtype is None:
            return buf
        return buf.reshape(-1)[slot.offset:slot.offset + slot.count * slot.dtype.itemsize].view(slot.dtype)

    launch.get_kernel = get_kernel
    launch.buffer_arg = buffer_arg
    launch.device_info = lambda device: schedule.DeviceInfo(132, 227 * 1024, 8)  # an H100's
    launch._current_device = lambda: 0
    launch._current_stream = lambda: None
    launch._scratch = lambda n: emu.shared_empty(n, np.uint8) if n else None
    launch._memo = lambda plan: {}  # nothing kept: other files bind other kernels for a plan
    schedule._target_blocks = lambda: 6  # a small "device", so long extents really split
    schedule._tile_budgets = lambda dtype: (8 * 1024,)  # columns take tiles of a few columns
    schedule._smem_limit = lambda: 227 * 1024  # an H100's
    return launch


@pytest.fixture(scope="module")
def launch(kernels):
    return _load_launch(kernels)


def _ref_call(op, x, w, b, dy, *, axis=-1, channel_axis=1, groups=None, eps=1e-5):
    """float64 (y, mean, rstd, dx, dweight, dbias) straight from the API's formulas."""
    nd = x.ndim
    if op in ("layer_norm", "rms_norm"):
        axes = axis if isinstance(axis, tuple) else (axis,)
        par = tuple(sorted(a % nd for a in axes))
        view, red = x.shape, par
    else:
        c = channel_axis % nd
        par = (c,)
        if op == "instance_norm":
            view, red = x.shape, tuple(a for a in range(1, nd) if a != c)
        else:
            view = x.shape[:c] + (groups, x.shape[c] // groups) + x.shape[c + 1:]
            red = tuple(a for a in range(1, nd + 1) if a != c)
    pshape = [x.shape[a] if a in par else 1 for a in range(nd)]
    full = lambda p: np.broadcast_to(np.reshape(p, pshape), x.shape).reshape(view)  # noqa: E731
    v, d = x.reshape(view), dy.reshape(view)
    center = op != "rms_norm"
    mean = v.mean(red, keepdims=True) if center else np.zeros(v.mean(red, keepdims=True).shape)
    rstd = 1.0 / np.sqrt(((v - mean) ** 2).mean(red, keepdims=True) + eps)
    xhat = (v - mean) * rstd
    y = xhat * (full(w) if w is not None else 1.0) + (full(b) if b is not None else 0.0)
    g = d * (full(w) if w is not None else 1.0)
    mg = g.mean(red, keepdims=True) if center else 0.0
    dx = rstd * (g - mg - xhat * (g * xhat).mean(red, keepdims=True))
    other = tuple(a for a in range(nd) if a not in par)
    dw = (d * xhat).reshape(x.shape).sum(other)
    db = d.reshape(x.shape).sum(other)
    return (y.reshape(x.shape), mean.reshape(-1), rstd.reshape(-1), dx.reshape(x.shape), dw.reshape(-1),
            db.reshape(-1))


def _plan(op, x, w, b, res=None, **kw):
    from anynorm._plan import make_plan
    if op == "group_norm":
        return make_plan(op, x, w, b, res, channel_axis=kw.get("channel_axis", 1),
                         num_groups=kw["groups"])
    if op == "instance_norm":
        return make_plan(op, x, w, b, res, channel_axis=kw.get("channel_axis", 1))
    return make_plan(op, x, w, b, res, axis=kw.get("axis", -1), eps=None if op == "rms_norm" else 1e-5)


# (op, shape, kwargs, memory order of x): covers every kernel path the executor chooses.
_E2E = [
    ("layer_norm", (4, 7, 33), dict(axis=-1), None),  # rows, one warp per row
    ("layer_norm", (3, 1100), dict(axis=-1), None),  # rows, split into chunks
    ("layer_norm", (2, 5, 3, 4), dict(axis=1), None),  # channels-first: columns
    ("layer_norm", (4, 5, 3), dict(axis=(-2, -1)), None),
    ("layer_norm", (6, 40), dict(axis=0), None),  # columns over the leading axis
    ("layer_norm", (5, 12), dict(axis=-1), (1, 0)),  # transposed memory: copied to rows
    ("rms_norm", (5, 40), dict(axis=-1), None),
    ("rms_norm", (3, 6, 7), dict(axis=1), None),
    ("instance_norm", (2, 3, 4, 5), dict(channel_axis=1), None),  # NCHW: rows with p_div = HW
    ("instance_norm", (2, 4, 5, 6), dict(channel_axis=-1), None),  # NHWC: columns
    ("instance_norm", (2, 6, 4, 5), dict(channel_axis=1), (0, 2, 3, 1)),  # NCHW logical, NHWC memory
    ("group_norm", (2, 6, 3, 3), dict(channel_axis=1, groups=3), None),
    ("group_norm", (2, 3, 3, 12), dict(channel_axis=-1, groups=4), None),  # columns with group = 3
    ("group_norm", (3, 8, 5, 7), dict(channel_axis=1, groups=2), (0, 2, 3, 1)),
]


def _in_order(a, order):
    """``a`` with the same values, its memory laid out in ``order`` (shared memory)."""
    if order is None:
        out = emu.shared_empty(a.shape, a.dtype)
        out[...] = a
        return out
    mem = emu.shared_empty(tuple(a.shape[k] for k in order), a.dtype)
    mem[...] = np.transpose(a, order)
    return np.transpose(mem, np.argsort(order))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("op,shape,kw,order", _E2E, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in _E2E])
def test_executor_end_to_end(launch, op, shape, kw, order, dtype):
    """forward then backward through ``_launcher`` exactly as the CUDA executor calls it."""
    rng = np.random.default_rng(len(shape) * 7 + shape[-1])
    A = ACC[dtype]
    x = _in_order((rng.standard_normal(shape) * 1.5 + 2).astype(dtype), order)
    dy = _in_order(rng.standard_normal(shape).astype(dtype), order)
    plan = _plan(op, x, None, None, **kw)
    pshape = plan.param_shape
    w = (1 + 0.3 * rng.standard_normal(pshape)).astype(A)
    b = (0.2 * rng.standard_normal(pshape)).astype(A) if op != "rms_norm" else None
    plan = _plan(op, x, w, b, **kw)
    eps = plan.eps
    y = _in_order(np.zeros(shape, dtype), order)
    mean = None if op == "rms_norm" else emu.shared_empty(plan.stats_shape, A)
    rstd = emu.shared_empty(plan.stats_shape, A)
    launch.forward(plan, dtype, x, w, b, None, y, None, mean, rstd)
    y_ref, mean_ref, rstd_ref, dx_ref, dw_ref, db_ref = _ref_call(
        op, x.astype(np.float64), w.astype(np.float64), None if b is None else b.astype(np.float64),
        dy.astype(np.float64), eps=eps, **kw)
    _close(rstd.reshape(-1), rstd_ref, STAT_TOL[dtype] * 3, f"{op} rstd", scale=rstd_ref)
    if mean is not None:
        _close(mean.reshape(-1), mean_ref, STAT_TOL[dtype] * 3, f"{op} mean")
    _close(y, y_ref, TOL[dtype], f"{op} y")
    for given in (True, False):  # statistics passed in, then recomputed by the executor
        dx = _in_order(np.zeros(shape, dtype), order)
        dw = emu.shared_empty(pshape, A)
        db = None if b is None else emu.shared_empty(pshape, A)
        launch.backward(plan, dtype, dy, x, w, mean if given else None, rstd if given else None, dx, dw, db)
        scale = max(1.0, float(np.abs(dx_ref).max()))
        _close(dx, dx_ref, TOL[dtype] * 4, f"{op} dx (stats given: {given})", scale=scale)
        n_terms = x.size // w.size
        _close(dw.reshape(-1), dw_ref, STAT_TOL[dtype] * 4, f"{op} dweight", scale=max(1.0, n_terms))
        if db is not None:
            _close(db.reshape(-1), db_ref, STAT_TOL[dtype] * 4, f"{op} dbias", scale=max(1.0, n_terms))


def test_executor_end_to_end_residual(launch):
    """layer_norm(x, residual=r): h = x + r written once, y normalizes h."""
    rng = np.random.default_rng(11)
    x, r = (emu.shared_empty((6, 70), np.float16) for _ in range(2))
    x[...], r[...] = rng.standard_normal((6, 70)), rng.standard_normal((6, 70))
    w, b = np.ones(70, np.float32), np.zeros(70, np.float32)
    plan = _plan("layer_norm", x, w, b, r, axis=-1)
    y, h = emu.shared_empty(x.shape, np.float16), emu.shared_empty(x.shape, np.float16)
    mean, rstd = emu.shared_empty(plan.stats_shape, np.float32), emu.shared_empty(plan.stats_shape, np.float32)
    launch.forward(plan, "float16", x, w, b, r, y, h, mean, rstd)
    np.testing.assert_array_equal(h, x + r)
    y_ref = _ref_call("layer_norm", h.astype(np.float64), None, None, np.zeros(h.shape))[0]
    _close(y, y_ref, TOL["float16"], "residual y")
