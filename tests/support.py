"""Test support: the array libraries under test, conversions, tolerances and call adapters.

A :class:`Backend` turns float64 NumPy data into an array of its library (in a named dtype)
and back, so every test can generate data once, run anynorm on any library and compare with
the float64 reference in ``reference.py``.
"""

from __future__ import annotations

import importlib
import math
import re
import threading
from dataclasses import dataclass

import array_api_compat
import numpy as np
import pytest

import anynorm

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
NO_BFLOAT16 = ("float16", "float32", "float64")
# The float dtypes each backend can hold (known before its library is imported).
BACKEND_DTYPES = {"numpy": NO_BFLOAT16, "numpy-readonly": NO_BFLOAT16, "torch": FLOAT_DTYPES,
                  "torch-autograd": FLOAT_DTYPES, "array-api-strict": ("float32", "float64"), "dask": NO_BFLOAT16, "jax": FLOAT_DTYPES,
                  "cupy": NO_BFLOAT16, "torch-cuda": FLOAT_DTYPES}
# Libraries where each call costs a graph build or a compilation: large test matrices are thinned there.
SLOW_BACKENDS = ("dask", "jax")

# Relative/absolute tolerance of a result against the float64 reference computed on the same
# (already rounded) input: a few units in the last place of the output dtype.
TOLERANCE = {"float64": 1e-12, "float32": 2e-5, "float16": 4e-3, "bfloat16": 2e-2}


def autograd_nodes(y, depth=4) -> str:
    """Names of the autograd nodes within ``depth`` steps of ``y`` (which route a torch call
    took: its own autograd.Function or torch's kernel), space-separated."""
    names, level = [], [y.grad_fn]
    for _ in range(depth):
        level = [f for f in level if f is not None]
        names += [type(f).__name__ for f in level]
        level = [g for f in level for g, _ in f.next_functions]
    return " ".join(names)


def tol(dtype_name: str) -> dict:
    """``rtol``/``atol`` for results in ``dtype_name``."""
    t = TOLERANCE[dtype_name]
    return {"rtol": t, "atol": t}


MACHINE_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def default_eps(op: str, dtype_name: str) -> float:
    """The eps anynorm uses when none is given: 1e-5, or finfo(dtype).eps for RMS norm."""
    return MACHINE_EPS[dtype_name] if op == "rms_norm" else 1e-5


def stats_dtype(dtype_name: str) -> str:
    """The dtype the contract gives statistics for inputs of ``dtype_name``."""
    return "float32" if dtype_name in ("float16", "bfloat16") else dtype_name


@dataclass
class Backend:
    """One array library (or one flavour of it) as the tests see it."""

    name: str
    xp: object  # the library's module (torch, jax.numpy, ...)
    dtypes: tuple  # float dtype names it supports
    is_own: object  # array -> bool: the array belongs to this library
    to_numpy_raw: object  # array -> NumPy array (values as held)
    make_raw: object  # (float64 ndarray, dtype name) -> array
    lazy: bool = False
    dtype_source: object = None  # where the dtype objects live, when not on ``xp``

    def dtype(self, name):
        return getattr(self.dtype_source or self.xp, name)

    def asarray(self, data, dtype="float64"):
        """``data`` (anything NumPy takes) as an array of this library in ``dtype``."""
        if dtype not in self.dtypes:
            pytest.skip(f"{self.name} has no {dtype}")
        return self.make_raw(np.asarray(data, dtype=np.float64), dtype)

    def to_numpy(self, arr):
        """A float64 NumPy copy of ``arr`` (None stays None)."""
        if arr is None:
            return None
        return np.array(self.to_numpy_raw(arr), dtype=np.float64)

    def check(self, result, shape, dtype):
        """Assert ``result`` is this library's array of ``shape`` and ``dtype`` (a name)."""
        assert self.is_own(result), f"expected a {self.name} array, got {type(result)}"
        assert tuple(result.shape) == tuple(shape)
        assert result.dtype == self.dtype(dtype), f"dtype {result.dtype}, expected {dtype}"


def _numpy(readonly):
    def make(data, dtype):
        arr = data.astype(dtype)
        arr.setflags(write=not readonly)
        return arr

    return Backend("numpy-readonly" if readonly else "numpy", np, NO_BFLOAT16,
                   array_api_compat.is_numpy_array, np.asarray, make)


def _torch(device, autograd=False):
    """torch tensors on ``device``; with ``autograd`` every float tensor requires grad, so the
    executors' autograd-recording paths run the same tests."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch-cuda needs a CUDA GPU")

    def to_numpy(t):
        return t.detach().to("cpu", torch.float64).numpy()

    def make(data, dtype):
        t = torch.asarray(data, device=device).to(getattr(torch, dtype))
        return t.requires_grad_() if autograd and t.is_floating_point() else t

    name = "torch" if device == "cpu" else "torch-cuda"
    return Backend(name + ("-autograd" if autograd else ""), torch, FLOAT_DTYPES,
                   array_api_compat.is_torch_array, to_numpy, make)


def _strict():
    xs = importlib.import_module("array_api_strict")
    return Backend("array-api-strict", xs, BACKEND_DTYPES["array-api-strict"], lambda arr: type(arr).__module__.startswith("array_api_strict"),
                   np.from_dlpack, lambda data, dtype: xs.asarray(data, dtype=getattr(xs, dtype)))


def dask_chunks(shape):
    """Two chunks along every axis longer than one: each normalized axis spans several chunks."""
    return tuple(max(1, math.ceil(s / 2)) for s in shape)


def _dask():
    da = importlib.import_module("dask.array")

    def make(data, dtype):
        return da.from_array(data.astype(dtype), chunks=dask_chunks(data.shape))

    def is_own(arr):
        return array_api_compat.is_dask_array(arr)

    return Backend("dask", da, NO_BFLOAT16, is_own,
                   lambda arr: np.asarray(arr.compute()), make, lazy=True, dtype_source=np)


def _jax():
    jax = importlib.import_module("jax")
    jax.config.update("jax_enable_x64", True)  # float64 must stay float64
    jnp = importlib.import_module("jax.numpy")
    return Backend("jax", jnp, FLOAT_DTYPES, array_api_compat.is_jax_array,
                   lambda arr: np.asarray(arr).astype(np.float64),
                   lambda data, dtype: jnp.asarray(data, dtype=getattr(jnp, dtype)))


def _cupy():
    cp = importlib.import_module("cupy")
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, no device
        count = 0
    if not count:
        pytest.skip("cupy needs a CUDA GPU")
    return Backend("cupy", cp, NO_BFLOAT16, array_api_compat.is_cupy_array,
                   lambda arr: arr.get(), lambda data, dtype: cp.asarray(data.astype(dtype)))


_FACTORIES = {
    "numpy": lambda: _numpy(False),
    "numpy-readonly": lambda: _numpy(True),
    "torch": lambda: _torch("cpu"),
    "torch-autograd": lambda: _torch("cpu", autograd=True),
    "array-api-strict": _strict,
    "dask": _dask,
    "jax": _jax,
    "cupy": _cupy,
    "torch-cuda": lambda: _torch("cuda"),
}
BACKEND_NAMES = tuple(_FACTORIES)
_LIBRARY = {"torch": "torch", "torch-autograd": "torch", "torch-cuda": "torch", "array-api-strict": "array_api_strict", "dask": "dask.array",
            "jax": "jax", "cupy": "cupy"}
_cache: dict = {}


def get_backend(name: str) -> Backend:
    """The backend ``name``, skipping the test when its library (or GPU) is missing."""
    if name not in _cache:
        pytest.importorskip(_LIBRARY.get(name, "numpy"))
        _cache[name] = _FACTORIES[name]()
    return _cache[name]


# --- calling the four operations uniformly ---------------------------------------------------

def call(op, x, weight=None, bias=None, **kw):
    """``anynorm.<op>`` with weight/bias passed the way its signature wants them."""
    fn = getattr(anynorm, op)
    if op == "rms_norm":
        assert bias is None, "rms_norm has no bias"
        return fn(x, weight, **kw)
    if op == "group_norm":
        kw = dict(kw)
        return fn(x, kw.pop("num_groups"), weight, bias, **kw)
    return fn(x, weight, bias, **kw)


def call_backward(op, dy, x, weight=None, **kw):
    """``anynorm.<op>_backward``, always as ``(dx, dweight, dbias)`` (dbias None for RMS norm)."""
    fn = getattr(anynorm, op + "_backward")
    if op == "group_norm":
        kw = dict(kw)
        return fn(dy, x, kw.pop("num_groups"), weight, **kw)
    out = fn(dy, x, weight, **kw)
    return (*out, None) if op == "rms_norm" else out


def param_shape(op, shape, *, axis=-1, channel_axis=1, num_groups=None):
    """The weight/bias shape the contract gives for ``op`` on ``shape``."""
    if op in ("layer_norm", "rms_norm"):
        axes = axis if isinstance(axis, (tuple, list)) else (axis,)
        return tuple(shape[a] for a in sorted(a % len(shape) for a in axes))
    return (shape[channel_axis],)


def has_bias(op):
    return op != "rms_norm"


@dataclass(frozen=True)
class Case:
    """One normalization problem: an operation, an input shape and where it normalizes."""

    op: str
    shape: tuple
    where: tuple = ()  # (keyword, value) pairs: axis / channel_axis / num_groups

    @property
    def kw(self) -> dict:
        return dict(self.where)

    @property
    def param_shape(self):
        return param_shape(self.op, self.shape, **self.kw)

    def __str__(self):
        args = ",".join(f"{k}={v}" for k, v in self.where)
        return f"{self.op}{self.shape}{'[' + args + ']' if args else ''}"


def case(op, shape, **where):
    return Case(op, tuple(shape), tuple(where.items()))


# A spread of layouts: trailing and leading axes, unsorted/negative/list axes, channels first,
# channels last, channels in the middle, rank 1 to 5, 2-D group norm.
CASES = (
    case("layer_norm", (4, 8)),
    case("layer_norm", (7,), axis=0),
    case("layer_norm", (2, 3, 4, 5), axis=(1, 3)),
    case("layer_norm", (2, 3, 5), axis=(-1, 0)),
    case("layer_norm", (3, 4, 5), axis=[2, 1]),
    case("layer_norm", (2, 6, 3, 4), axis=1),
    case("layer_norm", (2, 2, 3, 2, 3), axis=(-3, -2, -1)),
    case("rms_norm", (4, 8)),
    case("rms_norm", (2, 3, 4, 5), axis=(0, 2)),
    case("rms_norm", (2, 6, 3, 4), axis=1),
    case("instance_norm", (2, 3, 5)),
    case("instance_norm", (2, 4, 3, 5), channel_axis=-1),
    case("instance_norm", (2, 3, 4, 5), channel_axis=2),
    case("instance_norm", (2, 3, 2, 3, 2)),
    case("group_norm", (2, 6, 5), num_groups=3),
    case("group_norm", (2, 6, 4, 3), num_groups=2),
    case("group_norm", (2, 4, 3, 6), num_groups=3, channel_axis=-1),
    case("group_norm", (3, 6), num_groups=2),
    case("group_norm", (2, 6, 2, 2, 2), num_groups=6),
    case("group_norm", (2, 4, 3), num_groups=1),
)


def make_inputs(c: Case, seed=0, *, affine=True, offset=0.5, scale=2.0):
    """float64 NumPy ``(x, weight, bias)`` for ``c`` (weight/bias None without ``affine``)."""
    rng = np.random.default_rng(seed)
    x = offset + scale * rng.standard_normal(c.shape)
    if not affine:
        return x, None, None
    weight = 1.0 + 0.5 * rng.standard_normal(c.param_shape)
    bias = rng.standard_normal(c.param_shape) if has_bias(c.op) else None
    return x, weight, bias


def assert_close(actual, expected, dtype_name, *, scale=1.0, what="result"):
    """Compare a float64 NumPy ``actual`` with the reference at the tolerance of ``dtype_name``.

    ``scale`` widens the absolute tolerance for quantities larger than O(1).
    """
    t = TOLERANCE[dtype_name]
    np.testing.assert_allclose(actual, expected, rtol=t, atol=t * scale, err_msg=what)


def torch_functional(op, x, weight=None, bias=None, *, eps=None, axis=-1, channel_axis=1, num_groups=None):
    """The same call through ``torch.nn.functional``: the normalized axes (or the channel axis)
    are moved where torch wants them, and the result is moved back."""
    import torch
    import torch.nn.functional as F

    ndim = x.ndim
    if op in ("layer_norm", "rms_norm"):
        axes = sorted(a % ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,)))
        kept = [a for a in range(ndim) if a not in axes]
        moved = x.permute(*kept, *axes)
        normalized = [x.shape[a] for a in axes]
        if op == "layer_norm":
            out = F.layer_norm(moved, normalized, weight, bias, 1e-5 if eps is None else eps)
        else:
            out = F.rms_norm(moved, normalized, weight, eps)
        return out.permute(*np.argsort(kept + axes).tolist())
    moved = torch.movedim(x, channel_axis, 1)
    if op == "instance_norm":
        out = F.instance_norm(moved, weight=weight, bias=bias, eps=1e-5 if eps is None else eps)
    else:
        out = F.group_norm(moved, num_groups, weight, bias, 1e-5 if eps is None else eps)
    return torch.movedim(out, 1, channel_axis)


def sass_loops(text):
    """The loops of a ``cuobjdump -sass`` listing: for every branch back (a BRA to a lower
    address), its instructions from the branch's target to the branch, in order (text only,
    the predicate included)."""
    code = [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    loops = []
    for address, instruction in code:
        branch = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", instruction)
        if branch and int(branch.group(1), 16) < address:
            loops.append([i for a, i in code if int(branch.group(1), 16) <= a <= address])
    return loops


def run_in_threads(work, n):
    """``work(i)`` for ``i`` in ``range(n)``, each on its own thread, all released at once;
    the first exception any of them raised is raised here."""
    errors, barrier = [], threading.Barrier(n)

    def run(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # reported below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def build_wheel(repo, out_dir):
    """``pip wheel`` of ``repo`` into ``out_dir``; returns the CompletedProcess.  One build at a
    time (a lock file beside the repository's ``build/``): two pytest-xdist workers building
    at once share setuptools' ``build/`` directory and one of them fails."""
    import fcntl
    import subprocess
    import sys
    import tempfile
    import zlib

    lock = f"{tempfile.gettempdir()}/anynorm-wheel-{zlib.crc32(str(repo).encode()):08x}.lock"
    cmd = [sys.executable, "-m", "pip", "wheel", str(repo), "--no-deps", "--no-build-isolation", "-q",
           "-w", str(out_dir)]
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


# (op, shape, keyword arguments, parameter shape) of small calls the packed column kernel
# takes: channels-first layer norm (one axis, two), group/instance norm with channels last
# layer/RMS norm over outer and inner axes: the row kernel's segmented rows (x as (A, R, B))
PACKED_SEGMENTED_CASES = [
    ("layer_norm", (7, 13, 33), {"axis": (0, 2)}, (7, 33)),
    ("layer_norm", (3, 5, 8, 9), {"axis": (0, 2, 3)}, (3, 8, 9)),
    ("layer_norm", (2, 3, 4, 1030), {"axis": (0, 1, 3)}, (2, 3, 1030)),  # past SEG_VECTOR_MAX
    ("rms_norm", (300, 4, 16), {"axis": (0, 2)}, (300, 16)),  # float32 lanes added part-way
]
PACKED_COLUMN_CASES = [
    ("layer_norm", (2, 96, 5, 5), {"axis": 1}, (96,)),
    ("layer_norm", (3, 4, 6, 9), {"axis": (1, 2)}, (4, 6)),
    ("group_norm", (2, 5, 5, 8), {"num_groups": 4, "channel_axis": -1}, (8,)),
    ("group_norm", (2, 9, 12), {"num_groups": 3, "channel_axis": -1}, (12,)),
    ("instance_norm", (2, 5, 6, 8), {"channel_axis": -1}, (8,)),
]


def count_packed_kernel_calls(monkeypatch, record=lambda half_params, sizes: half_params):
    """A list that grows by one entry for every call of a packed CPU kernel
    (``anynorm._native.rows_packed_kernel``/``cols_packed_kernel``) looked up from now on:
    ``record(half_params, sizes)``, by default the call's ``half_params`` flag (``sizes``: its
    ``RowsCall``/``ColsCall``); the call cache is cleared so that runners look their kernels
    up again."""
    from anynorm import _calls, _native

    calls = []

    def counting(real, struct):
        def counted(dtype, half_params=False):
            kernel = real(dtype, half_params)
            if kernel is None:
                return None

            def call(*args):
                calls.append(record(half_params, struct.from_address(args[-1])))
                return kernel(*args)
            return call
        return counted

    for name, struct in (("rows_packed_kernel", _native.RowsCall), ("cols_packed_kernel", _native.ColsCall)):
        monkeypatch.setattr(_native, name, counting(getattr(_native, name), struct))
    _calls.clear()
    return calls
