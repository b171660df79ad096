"""Run CUDA kernels on the CPU: compile ``.cu`` sources with g++ against ``cuda_emu.h`` into a
shared library of ``extern "C"`` launchers, then launch them from Python on emulated device
memory, mirroring CuPy's ``RawModule(...).get_function(name)(grid, block, args)``.

Every launch runs in a forked child, so a kernel that crashes (out-of-bounds access,
misaligned vector access caught by UBSan, stack overflow) or hangs fails the test instead of
the test process. Device buffers live in shared anonymous memory with 0xFF canaries before
and after the data: reading them poisons results with NaN, writing them is reported.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
KERNEL_DIR = HERE.parent.parent / "kernels"
CXX = os.environ.get("ANYNORM_EMU_CXX", "g++")
FLAGS = (
    "-std=c++17", "-O1", "-pthread", "-fPIC", "-shared", "-fvisibility=hidden",
    "-ftrivial-auto-var-init=pattern",  # uninitialized locals read as a loud pattern, not 0
    "-fsanitize=alignment,bounds,null,return,shift,vla-bound,signed-integer-overflow,"
    "integer-divide-by-zero",
    "-fno-sanitize-recover=all",
)
GUARD = 256  # canary bytes on each side of every buffer
_ALIGN = 256  # data start alignment before any deliberate offset, as cudaMalloc


class EmulationError(AssertionError):
    """A kernel misbehaved under emulation (the message says how); fails the test."""


def compiler() -> str | None:
    """Path of the host compiler, or None when there is none."""
    return shutil.which(CXX)


def _cache_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"anynorm-emu-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _wrapper_source(sources, names) -> str:
    lines = ['#include "cuda_emu.h"']
    lines += [f'#include "{Path(s).resolve()}"' for s in sources]
    lines += [
        '#define EMU_EXPORT extern "C" __attribute__((visibility("default")))',
        "EMU_EXPORT const void* emu_anchor() { return (const void*)&emu_anchor; }",
        "EMU_EXPORT void emu_set_shared_regions(const unsigned long long* r, int n) {",
        "    emu::rt.shared_regions.clear();",
        "    for (int i = 0; i < n; ++i)",
        "        emu::rt.shared_regions.emplace_back((unsigned char*)r[2 * i], (size_t)r[2 * i + 1]);",
        "}",
        "EMU_EXPORT void emu_set_max_dynamic_smem(unsigned long long n) { emu::rt.max_dynamic_smem = n; }",
    ]
    for i, name in enumerate(names):
        lines += [
            f"EMU_EXPORT int emu_sig_{i}(char* buf, int len) {{",
            f"    return std::snprintf(buf, (size_t)len, \"%s\", emu::signature(&{name}).c_str());",
            "}",
            f"EMU_EXPORT int emu_run_{i}(const unsigned* cfg, unsigned long long smem, int schedule,"
            " void** args, char* err, int errlen) {",
            f"    return emu::launch_c(&{name}, cfg, smem, schedule, args, err, errlen);",
            "}",
        ]
    return "\n".join(lines) + "\n"


def _digest(text, sources) -> str:
    h = hashlib.sha256(text.encode())
    h.update(" ".join((CXX,) + FLAGS).encode())
    dirs = {HERE, HERE / "include"} | {Path(s).resolve().parent for s in sources}
    for d in sorted(dirs):
        for f in sorted(d.glob("*")):
            if f.suffix in (".cu", ".cuh", ".h"):
                h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:20]


def build(sources, names, tag="module") -> Path:
    """Compile ``sources`` (``.cu`` files) with launchers for the C++ ``names`` (template
    instantiations, like CuPy's ``name_expressions``); cached by content. Returns the .so path."""
    text = _wrapper_source(sources, names)
    out = _cache_dir() / f"{tag}-{_digest(text, sources)}.so"
    if out.exists():
        return out
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    src = tmp.with_suffix(".cpp")
    src.write_text(text)
    cmd = [CXX, *FLAGS, "-I", str(HERE), "-I", str(HERE / "include"), str(src), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    src.unlink(missing_ok=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise EmulationError(f"g++ failed to compile {[str(s) for s in sources]} under the emulation "
                             f"header:\n{proc.stderr[-6000:]}")
    os.replace(tmp, out)
    return out


def build_many(jobs) -> list:
    """``build`` several (sources, names, tag) jobs in parallel; returns Modules in order."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        paths = list(pool.map(lambda job: build(*job), jobs))
    return [Module(path, job[1]) for path, job in zip(paths, jobs)]


def _shared_statics(path: Path):
    """(file offset, size) of every function-local static: the kernels' __shared__ arrays."""
    out = subprocess.run(["nm", "-S", "--defined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    anchor, regions = None, []
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[-1] == "emu_anchor":
            anchor = int(parts[0], 16)
        if len(parts) != 4 or parts[2] not in "bBdDuV":
            continue
        name = parts[3]
        if name.startswith("_ZZ") and not name.startswith(("_ZZN3emu", "_ZZNSt", "_ZZSt")):
            regions.append((int(parts[0], 16), int(parts[1], 16)))
    return anchor, regions


# ---- device memory -------------------------------------------------------------------------

_NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16,
       "int32": np.int32, "int64": np.int64, "uint16": np.uint16, "uint32": np.uint32,
       "uint8": np.uint8}
# Kernel pointee code -> the DeviceArray dtype names it accepts.
_POINTEE = {"f4": ("float32",), "f8": ("float64",), "h2": ("float16", "uint16"),
            "b2": ("bfloat16", "uint16"), "i4": ("int32",), "i8": ("int64",), "u4": ("uint32",),
            "u2": ("uint16", "float16", "bfloat16"), "u1": ("uint8",)}


def bf16_bits(a) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even, via float32."""
    f = np.ascontiguousarray(a, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = np.where(np.isnan(f), 0x7FFF, r)
    return r.astype(np.uint16)


def bf16_to_float(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class DeviceArray:
    """Emulated device memory shared with the forked launcher, fenced by 0xFF canaries.

    ``dtype`` is a name (``"bfloat16"`` is stored as uint16 bits); ``offset`` shifts the data
    start by that many elements from a 256-byte boundary (misaligned views).
    """

    def __init__(self, shape, dtype: str, offset: int = 0):
        self.shape = tuple(int(s) for s in np.atleast_1d(shape)) if np.ndim(shape) else (int(shape),)
        self.dtype = dtype
        np_dtype = np.dtype(_NP[dtype])
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * np_dtype.itemsize
        self._start = _ALIGN + offset * np_dtype.itemsize
        total = self._start + self.nbytes + GUARD + _ALIGN
        self._mem = mmap.mmap(-1, total)  # anonymous and MAP_SHARED: the forked child writes here
        raw = np.frombuffer(self._mem, dtype=np.uint8)
        raw[:] = 0xFF
        self._raw = raw
        self.array = raw[self._start:self._start + self.nbytes].view(np_dtype).reshape(self.shape)
        self.ptr = raw.ctypes.data + self._start

    def get(self) -> np.ndarray:
        """A host copy (uint16 bits for bfloat16)."""
        return self.array.copy()

    def get_float(self) -> np.ndarray:
        """A float64 host copy (bfloat16 decoded)."""
        if self.dtype == "bfloat16":
            return bf16_to_float(self.array).astype(np.float64)
        return self.array.astype(np.float64)

    def guard_damage(self):
        """Byte offsets (relative to the data start) of damaged canaries, or an empty list."""
        before = np.flatnonzero(self._raw[self._start - GUARD:self._start] != 0xFF) - GUARD
        end = self._start + self.nbytes
        after = np.flatnonzero(self._raw[end:end + GUARD] != 0xFF) + self.nbytes
        return list(before) + list(after)


def to_device(a, dtype: str | None = None, offset: int = 0) -> DeviceArray:
    """Copy a host array to emulated device memory (floats are rounded to ``dtype``)."""
    a = np.asarray(a)
    dtype = dtype or a.dtype.name
    d = DeviceArray(a.shape, dtype, offset)
    d.array[...] = bf16_bits(a).reshape(a.shape) if dtype == "bfloat16" else a.astype(_NP[dtype])
    return d


def empty(shape, dtype: str, offset: int = 0) -> DeviceArray:
    """Uninitialized device memory: every byte 0xFF (NaN for floats), as a loud poison."""
    return DeviceArray(shape, dtype, offset)


def shared_empty(shape, dtype) -> np.ndarray:
    """A plain NumPy array in memory the forked launcher shares (0xFF-filled, no canaries):
    the stand-in for a device array when driving code written for CuPy."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mem = mmap.mmap(-1, max(n, 1) + _ALIGN)
    raw = np.frombuffer(mem, dtype=np.uint8)
    raw[:] = 0xFF
    return raw[:n].view(dtype).reshape(shape)


# ---- modules and launches -------------------------------------------------------------------

_SCALARS = {"i1": ctypes.c_int8, "i2": ctypes.c_int16, "i4": ctypes.c_int32, "i8": ctypes.c_int64,
            "u1": ctypes.c_uint8, "u2": ctypes.c_uint16, "u4": ctypes.c_uint32, "u8": ctypes.c_uint64,
            "f4": ctypes.c_float, "f8": ctypes.c_double}


def unhold(a):
    """CuPy's argument holders read back: ``CScalar`` as its NumPy scalar, ``CIntptr`` as the
    address it holds (np.uint64, a raw address)."""
    kind = type(a).__name__
    if kind == "CIntptr":
        return np.uint64(ctypes.c_uint64.from_address(a.ptr).value)
    if kind == "CScalar":
        return np.dtype(a.dtype).type(a.value)
    return a


def _as_cupy_passes(a):
    """A Python scalar as the 8-byte value RawKernel makes of it (bool: 1 byte)."""
    if isinstance(a, bool):
        return np.bool_(a)
    if isinstance(a, int):
        return np.int64(a)
    if isinstance(a, float):
        return np.float64(a)
    return a


def _check_width(name, k, code, a):
    """CuPy copies an argument's own bytes: its width and kind must be the parameter's."""
    want = np.dtype(code)
    if isinstance(a, np.generic) and (a.dtype.itemsize != want.itemsize or a.dtype.kind != want.kind):
        raise TypeError(f"{name} argument {k}: a {a.dtype} value for a {want} parameter "
                        f"(CuPy would pass its {a.dtype.itemsize} bytes)")


class CupyLaunched:
    """A kernel launched under CuPy's argument rules: Python ints and floats become 8-byte
    values, NumPy scalars and CuPy's holders keep their width, which must be the parameter's.
    (Plain ``Kernel`` calls convert each argument to its parameter's type, for tests that
    drive kernels directly.)"""

    def __init__(self, kernel, cluster=1):
        self.kernel = kernel
        self.cluster = cluster  # blocks per cluster: a GPU kernel's compiled __cluster_dims__

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        return self.kernel(grid, block, args, shared_mem, cupy_widths=True, cluster=self.cluster)

    @property
    def max_dynamic_shared_size_bytes(self):
        return self.kernel.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n):
        self.kernel.max_dynamic_shared_size_bytes = n


class Module:
    """A compiled emulation library; ``get_function(name)`` as CuPy's RawModule."""

    def __init__(self, path: Path, names):
        self.path = Path(path)
        self.lib = ctypes.CDLL(str(self.path))
        self.names = list(names)
        anchor, regions = _shared_statics(self.path)
        self.lib.emu_anchor.restype = ctypes.c_void_p
        base = self.lib.emu_anchor() - anchor
        flat = (ctypes.c_ulonglong * (2 * len(regions) + 1))(
            *[v for off, size in regions for v in (base + off, size)])
        self.lib.emu_set_shared_regions(flat, len(regions))
        self.shared_bytes = sum(size for _, size in regions)
        self.max_dynamic_smem = 48 * 1024  # as emu::Runtime starts
        self._functions = {}

    def get_function(self, name: str) -> "Kernel":
        if name not in self._functions:
            self._functions[name] = Kernel(self, name, self.names.index(name))
        return self._functions[name]


class Kernel:
    """One instantiation; ``kernel(grid, block, args, shared_mem=0, schedule=None)``."""

    def __init__(self, module: Module, name: str, index: int):
        self.module, self.name = module, name
        buf = ctypes.create_string_buffer(1024)
        getattr(module.lib, f"emu_sig_{index}")(buf, len(buf))
        self.signature = [c for c in buf.value.decode().split(",") if c]
        self._run = getattr(module.lib, f"emu_run_{index}")
        self._run.restype = ctypes.c_int
        self._cupy = None
        self._max_smem = 48 * 1024  # a function attribute on a GPU: each kernel its own

    def as_cupy(self, cluster=1) -> CupyLaunched:
        """This kernel under CuPy's argument rules (one wrapper per kernel), its blocks in
        clusters of ``cluster`` (what a GPU kernel compiles in with __cluster_dims__)."""
        if self._cupy is None or self._cupy.cluster != cluster:
            self._cupy = CupyLaunched(self, cluster)
        return self._cupy

    def _pack(self, args, cupy_widths=False):
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments, got {len(args)}")
        values, arrays = [], []
        for k, (code, a) in enumerate(zip(self.signature, args)):
            a = unhold(a)
            if cupy_widths:
                a = _as_cupy_passes(a)
            if code.startswith("p"):
                if isinstance(a, DeviceArray):
                    want = _POINTEE.get(code[1:])
                    if want is not None and a.dtype not in want:
                        raise TypeError(f"{self.name} argument {k}: a {a.dtype} buffer for a pointer "
                                        f"to {code[1:]}")
                    values.append(ctypes.c_void_p(a.ptr))
                    arrays.append((k, a))
                elif isinstance(a, np.ndarray):  # a shared_empty array, or read-only input
                    want = _POINTEE.get(code[1:])
                    name = "bfloat16" if a.dtype == np.int16 else a.dtype.name
                    if want is not None and name not in want:
                        raise TypeError(f"{self.name} argument {k}: a {a.dtype} array for a pointer "
                                        f"to {code[1:]}")
                    values.append(ctypes.c_void_p(a.ctypes.data))
                elif a is None or (isinstance(a, (int, np.integer)) and int(a) == 0
                                   and (not cupy_widths or a.itemsize == 8)):
                    values.append(ctypes.c_void_p(0))
                elif isinstance(a, np.uint64):  # a raw address (a tensor's data_ptr), unchecked
                    values.append(ctypes.c_void_p(int(a)))
                else:
                    raise TypeError(f"{self.name} argument {k}: expected a DeviceArray or 0, got {a!r}")
            elif code in ("h2", "b2"):
                bits = np.float16(a).view(np.uint16) if code == "h2" else bf16_bits([a])[0]
                values.append(ctypes.c_uint16(int(bits)))
            elif code in _SCALARS:
                if cupy_widths:
                    _check_width(self.name, k, code, a)
                ctype = _SCALARS[code]
                is_int = isinstance(a, (int, np.integer)) and not isinstance(a, bool)
                if code[0] in "iu" and not is_int:
                    raise TypeError(f"{self.name} argument {k}: expected an integer, got {a!r}")
                values.append(ctype(int(a) if code[0] in "iu" else float(a)))
            else:
                raise TypeError(f"{self.name} argument {k}: unsupported parameter kind {code}")
        return values, arrays

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._max_smem

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, n):
        """As CuPy's RawKernel attribute (per function, as cuFuncSetAttribute): launches of this
        kernel may then take up to ``n`` bytes."""
        self._max_smem = int(n)

    def __call__(self, grid, block, args, shared_mem=0, schedule=None, timeout=60.0, cupy_widths=False,
                 cluster=1):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if schedule is None:
            schedule = int(os.environ.get("ANYNORM_EMU_SCHEDULE", "0"))
        values, arrays = self._pack(args, cupy_widths)
        if self.module.max_dynamic_smem != self._max_smem:  # the runtime holds one limit
            self.module.lib.emu_set_max_dynamic_smem(ctypes.c_ulonglong(self._max_smem))
            self.module.max_dynamic_smem = self._max_smem
        argv = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        cfg = (ctypes.c_uint * 7)(*grid, *block, cluster)
        where = f"{self.name} grid={grid} block={block} cluster={cluster} schedule={schedule}"
        status = _run_forked(lambda err: self._run(cfg, ctypes.c_ulonglong(shared_mem), schedule, argv,
                                                   err, 4096), timeout, where)
        if status:
            raise EmulationError(f"{where}: {status}")
        for k, a in arrays:
            damage = a.guard_damage()
            if damage:
                raise EmulationError(f"{where}: argument {k} ({a.dtype}, {a.size} elements) was written "
                                     f"out of bounds at byte offsets {damage[:8]} from its start")


def _run_forked(call, timeout, where) -> str:
    """Run ``call(errbuf)`` in a forked child; '' on success, else what went wrong."""
    shm = mmap.mmap(-1, 8192)
    err = (ctypes.c_char * 4096).from_buffer(shm, 8)
    log = tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        # The child runs only the compiled kernel (no Python threads, no JAX) and leaves with
        # os._exit; glibc makes malloc usable after fork. JAX's warning does not apply.
        warnings.simplefilter("ignore", RuntimeWarning)
        pid = os.fork()
    if pid == 0:  # child: run, report through shared memory, never return into pytest
        code = 3
        try:
            os.dup2(log.fileno(), 2)
            rc = call(err)
            shm[0:4] = int(rc).to_bytes(4, "little")
            code = 0
        finally:
            os._exit(code)
    try:
        status = _wait(pid, timeout)
    finally:
        del err
    log.seek(0)
    stderr = log.read()[-3000:].decode(errors="replace").strip()
    log.close()
    if status is None:
        return f"timed out after {timeout:.0f} s (a hang: a spin-wait on another block cannot work " \
               "when blocks run one at a time)"
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        return f"crashed with {sig} (SIGSEGV: out-of-bounds access or stack overflow){_tail(stderr)}"
    if os.WEXITSTATUS(status) != 0:
        return f"died with exit status {os.WEXITSTATUS(status)} (1: an UndefinedBehaviorSanitizer " \
               f"finding such as a misaligned vector access){_tail(stderr)}"
    if int.from_bytes(shm[0:4], "little") != 0:
        return shm[8:8 + 4096].split(b"\0", 1)[0].decode(errors="replace") + _tail(stderr)
    return ""


def _tail(stderr: str) -> str:
    return f"\n--- kernel stderr ---\n{stderr}" if stderr else ""


def _wait(pid, timeout):
    """Wait for ``pid``; its status, or None after killing it at ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            if fd is not None:
                select.select([fd], [], [], left)
            else:
                time.sleep(min(0.005, left))
    finally:
        if fd is not None:
            os.close(fd)
