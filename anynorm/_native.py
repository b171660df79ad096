"""anynorm's CPU kernels (``kernels/cpu.cpp``), compiled at first use and called by ctypes.

NumPy cannot fuse the passes of a normalization: its best row path reads each block of rows
six times from cache (a sum, ``x - m``, a dot product, ``* rstd``, ``* w``, ``+ b``) and sits
at 3.2-3.4x the time of ``np.copyto`` for float32 rows of 4096, 5-7x for rows of 768.  The C++
kernels read a row (or a strip of a sample's columns) from memory once and keep it in cache
for their passes: :func:`rows_kernel` for statistics over trailing axes, :func:`cols_kernel`
for statistics over a middle axis (channels-first layer norm, NHWC instance/group norm),
:func:`rows_backward_kernel` and :func:`cols_backward_kernel` for the gradients through
both (x and dy read from memory once, dx written once, where the NumPy backward's passes
took 7-13x the time of a copy).

Where the host has a C++ compiler (``ANYNORM_CXX``, ``CXX``, else the first of ``c++``,
``g++``, ``clang++`` on PATH), the library is built once per source, compiler and CPU
(``-O3 -march=native``) into ``$ANYNORM_CACHE_DIR`` (default ``$XDG_CACHE_HOME/anynorm`` or
``~/.cache/anynorm``) and loaded from there by later processes.  Without a compiler, or with
``ANYNORM_NATIVE=0``, every kernel function returns None and the NumPy executor runs its NumPy passes (the same
results to float32 rounding); :data:`status` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from ._cuda._sources import kernel_dir

__all__ = ["address", "cols_backward_kernel", "cols_kernel", "far_kernel", "rows_backward_kernel", "rows_kernel",
           "rows_packed_kernel", "cols_packed_kernel", "RowsCall", "ColsCall", "status", "SOURCE",
           "use_openmp"]

SOURCE = "cpu.cpp"
_FLAGS = (["-O3", "-march=native"], ["-O3"])  # the second where the first is refused
_COMPILE_SECONDS = 120

_lock = threading.Lock()
_library = None  # the loaded ctypes library, False once loading failed
status = "not loaded yet"

_ARGS = {
    "rows": [ctypes.c_void_p] * 6 + [ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_double],
    "cols": [ctypes.c_void_p] * 6 + [ctypes.c_longlong] * 5 + [ctypes.c_int, ctypes.c_double],
    "rows_bwd": [ctypes.c_void_p] * 4 + [ctypes.c_longlong] + [ctypes.c_void_p] * 4
    + [ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_double],
    "cols_bwd": [ctypes.c_void_p] * 8 + [ctypes.c_longlong] * 5 + [ctypes.c_int, ctypes.c_double],
    "segmented_bwd": [ctypes.c_void_p] * 8 + [ctypes.c_longlong] * 4 + [ctypes.c_int, ctypes.c_double],
    "far": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_double],
    "rows_packed": [ctypes.c_void_p] * 7,
    "cols_packed": [ctypes.c_void_p] * 7,
}
_SUFFIX = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}
_SUFFIXES = (*_SUFFIX.values(), "bf16")  # every entry point, bfloat16 (ml_dtypes) included


_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def address(a):
    """The address of NumPy array ``a``'s first element, for the kernels' pointer arguments:
    through ctypes' view of its buffer where that is writable, C-contiguous NumPy floats
    (0.3 us), else ``a.ctypes.data`` (0.8 us: a NumPy call passes 5-8 of them)."""
    if a.dtype.kind == "f" and a.flags.writeable and a.flags.c_contiguous and a.size:
        return _addressof(_from_buffer(a))
    return a.ctypes.data


def _suffix(dtype):
    """The entry points' suffix for ``dtype``: NumPy's floats, and ``ml_dtypes.bfloat16``
    (NumPy has no bfloat16; JAX's and, through :mod:`anynorm._torch`, torch's arrive as it)."""
    dtype = np.dtype(dtype)
    suffix = _SUFFIX.get(dtype)
    if suffix is None and dtype.kind == "V" and dtype.name == "bfloat16" and dtype.itemsize == 2:
        return "bf16"
    return suffix


def _compiler():
    for name in (os.environ.get("ANYNORM_CXX"), os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = name and shutil.which(name)
        if path:
            return os.path.realpath(path)
    return None


def _cache_dir():
    root = os.environ.get("ANYNORM_CACHE_DIR")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "anynorm")
    return root


def _cpu_signature():
    """What -march=native depends on: the CPU's model and feature flags where Linux says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def _build(compiler, source_path, cache):
    """Path of the built library (built now unless the cache has it), or raise OSError."""
    with open(source_path, "rb") as f:
        source = f.read()
    st = os.stat(compiler)
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), str((st.st_size, st.st_mtime_ns)).encode(),
                                     _cpu_signature().encode(), platform.machine().encode()])).hexdigest()[:24]
    target = os.path.join(cache, f"cpu-{key}.so")
    if os.path.isfile(target):
        return target
    os.makedirs(cache, exist_ok=True)
    errors = []
    for flags in _FLAGS:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        cmd = [compiler, *flags, "-shared", "-fPIC", "-o", tmp, source_path]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_SECONDS)
        except (OSError, subprocess.SubprocessError) as exc:
            proc, out = None, str(exc)
        else:
            out = proc.stderr.strip()
        if proc is not None and proc.returncode == 0:
            os.replace(tmp, target)  # atomic: concurrent builders each leave a whole file
            return target
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}: {out[-500:]}")
    raise OSError("; ".join(errors))


def _load():
    global status
    if os.environ.get("ANYNORM_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        status = "disabled by ANYNORM_NATIVE"
        return False
    compiler = _compiler()
    if compiler is None:
        status = "no C++ compiler found (ANYNORM_CXX, CXX, c++, g++, clang++)"
        return False
    try:
        path = _build(compiler, os.path.join(kernel_dir(), SOURCE), _cache_dir())
        lib = ctypes.CDLL(path)
    except OSError as exc:
        status = f"build or load failed: {exc}"
        return False
    for kind, args in _ARGS.items():
        for suffix in (*_SUFFIXES, "hp_f16", "hp_bf16"):
            fn = getattr(lib, f"anynorm_{kind}_{suffix}", None)
            if fn is not None:
                fn.argtypes, fn.restype = args, ctypes.c_int
    status = f"loaded {path}"
    return lib


def _kernel(kind, dtype, prefix=""):
    global _library
    suffix = _suffix(dtype)
    if suffix is None:
        return None
    suffix = prefix + suffix
    lib = _library
    if lib is None:
        with _lock:
            if _library is None:
                _library = _load()
            lib = _library
    return getattr(lib, f"anynorm_{kind}_{suffix}", None) if lib else None


def rows_kernel(dtype):
    """The ctypes function normalizing rows of ``dtype`` (float16/32/64, ml_dtypes' bfloat16),
    or None.

    ``fn(x, res, h, y, w, b, w_run, mean, rstd, rows, n, center, eps)`` with buffer addresses
    (0 for absent ones): see ``kernels/cpu.cpp``.  Returns non-zero on bad sizes.
    """
    return _kernel("rows", dtype)


class RowsCall(ctypes.Structure):
    """The sizes of a :func:`rows_packed_kernel` call (``kernels/cpu.cpp``'s ``RowsCall``)."""

    _fields_ = [("rows", ctypes.c_longlong), ("n", ctypes.c_longlong), ("w_run", ctypes.c_longlong),
                ("w_count", ctypes.c_longlong), ("center", ctypes.c_longlong), ("eps", ctypes.c_double),
                ("segments", ctypes.c_longlong), ("seg_stride", ctypes.c_longlong),
                ("threads", ctypes.c_longlong)]

    def __init__(self, rows, n, w_run, w_count, center, eps, segments=1, seg_stride=0, threads=1):
        super().__init__(rows, n, w_run, w_count, center, eps, segments, seg_stride, threads)


def use_openmp(parallel, thread_num, num_threads):
    """Hand the kernels the addresses of the process's OpenMP entry points (``GOMP_parallel``,
    ``omp_get_thread_num``, ``omp_get_num_threads``: :mod:`anynorm._torch_openmp` finds
    torch's), on whose team a :class:`RowsCall` of ``threads > 1`` runs its rows; False where
    the kernels are not built."""
    if rows_packed_kernel(np.float32) is None:  # loads the library
        return False
    fn = _library.anynorm_use_openmp
    fn.argtypes, fn.restype = [ctypes.c_void_p] * 3, None
    fn(parallel, thread_num, num_threads)
    return True


def rows_packed_kernel(dtype, half_params=False):
    """:func:`rows_kernel` with a call's sizes packed, for calls whose sizes repeat, or None.

    ``fn(x, y, w, b, mean, rstd, sizes)``: buffer addresses (0 for absent w, b, mean, rstd)
    and the address of a :class:`RowsCall` ``(rows, n, w_run, w_count, center, eps,
    segments, seg_stride, threads)``, where ``w_count > 0`` takes run-indexed parameters modulo
    ``w_count`` (one sample's channels serve every sample) and ``segments > 1`` reads each
    row as that many runs of ``n / segments`` elements, ``seg_stride`` apart, the row r's
    first at ``r * n / segments`` (x as (A, R, B) normalized over A and B), and ``threads >
    1`` cuts the rows among that many threads of the OpenMP team :func:`use_openmp` gave
    (on the calling thread without one); no residual.  w
    and b are float32 for float16/bfloat16 x, or, with ``half_params`` (float16 and
    bfloat16 only), of x's own dtype.  A ctypes call costs ~70 ns an argument: seven here,
    fourteen in :func:`rows_kernel`.
    """
    if half_params and _suffix(dtype) not in ("f16", "bf16"):
        return None
    return _kernel("rows_packed", dtype, "hp_" if half_params else "")


class ColsCall(ctypes.Structure):
    """The sizes of a :func:`cols_packed_kernel` call (``kernels/cpu.cpp``'s ``ColsCall``)."""

    _fields_ = [("samples", ctypes.c_longlong), ("P", ctypes.c_longlong), ("Q", ctypes.c_longlong),
                ("group", ctypes.c_longlong), ("strip", ctypes.c_longlong),
                ("param_rows", ctypes.c_longlong), ("eps", ctypes.c_double), ("threads", ctypes.c_longlong)]

    def __init__(self, samples, P, Q, group, strip, param_rows, eps, threads=1):
        super().__init__(samples, P, Q, group, strip, param_rows, eps, threads)


def cols_packed_kernel(dtype, half_params=False):
    """:func:`cols_kernel` with a call's sizes packed (as :func:`rows_packed_kernel`), or None.

    ``fn(x, y, w, b, mean, rstd, sizes)``: buffer addresses (0 for absent w, b) and the
    address of a :class:`ColsCall` ``(samples, P, Q, group, strip, param_rows, eps,
    threads)``; ``threads > 1`` shares the samples among that many threads of the OpenMP team
    :func:`use_openmp` gave.
    """
    if half_params and _suffix(dtype) not in ("f16", "bf16"):
        return None
    return _kernel("cols_packed", dtype, "hp_" if half_params else "")


def rows_backward_kernel(dtype):
    """The ctypes function taking the gradients through rows of ``dtype``, or None.

    ``fn(x, dy, dx, w, w_run, mean, rstd, dw, db, rows, n, center, eps)`` with buffer
    addresses (0 for absent ones; rstd 0: the statistics taken again from x; dw, db float64,
    added to): see ``kernels/cpu.cpp``.  Returns non-zero on bad sizes.
    """
    return _kernel("rows_bwd", dtype)


def segmented_backward_kernel(dtype):
    """The ctypes function taking the gradients through segmented rows of ``dtype`` (x as
    (A, R, B) normalized over A and B, as :class:`RowsCall` with ``segments``), or None.

    ``fn(x, dy, dx, w, mean, rstd, dw, db, rows, n, segments, seg_stride, center, eps)`` with
    buffer addresses as :func:`rows_backward_kernel`'s.
    """
    return _kernel("segmented_bwd", dtype)


def cols_backward_kernel(dtype):
    """The ctypes function taking the gradients through columns of ``dtype``, or None.

    ``fn(x, dy, dx, w, mean, rstd, dw, db, samples, P, Q, group, strip, param_rows, eps)``
    (mean and rstd 0 together: taken again from x; dw, db float64, added to): see
    ``kernels/cpu.cpp``.  Returns non-zero on bad sizes.
    """
    return _kernel("cols_bwd", dtype)


def far_kernel(dtype):
    """The ctypes function checking statistics of ``dtype`` (float16, ml_dtypes' bfloat16,
    float32, float64) for conditioning, or None.

    ``fn(mean, rstd, n, limit)`` with the addresses of n contiguous values each: 1 where
    some ``|mean * rstd|`` exceeds ``limit``, else 0 (NaN passes): see ``kernels/cpu.cpp``.
    """
    return _kernel("far", dtype)


def cols_kernel(dtype):
    """The ctypes function normalizing the columns of samples viewed as (B, P, Q), or None.

    ``fn(x, y, w, b, mean, rstd, samples, P, Q, group, strip, param_rows, eps)``: see
    ``kernels/cpu.cpp``.  Returns non-zero on bad sizes.
    """
    return _kernel("cols", dtype)
