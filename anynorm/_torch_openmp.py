"""The NumPy executor's threads for a torch call: torch's own OpenMP team.

After a parallel torch op on CPU, torch's OpenMP threads spin before they sleep (libgomp:
``GOMP_SPINCOUNT``, 300000 pauses by default, a few milliseconds).  anynorm's thread pool,
started in that time, shares the cores with them.  On this project's 2-core VM, one call
right after an ``F.layer_norm``, torch's team against the pool, median of 60 interleaved
rounds: the backward of 2730 x 768 float32 rows 0.73 against 1.07 ms (0.68x), 32768 x 64
0.74x, bfloat16 0.66-0.69x; the forward of 32768 x 64 0.68-0.71x (with
``OMP_WAIT_POLICY=passive``, nothing spinning, the pool was as fast as the team).  So where
torch runs on libgomp (or a runtime with its entry points, as LLVM's and Intel's do) and this
module finds it among the loaded libraries, :func:`team` returns a :class:`Team` that runs a
call's parts as one ``GOMP_parallel`` region, each part on one of the team's threads: a ctypes
callback that takes the GIL for the bookkeeping and drops it in the kernel call, as the pool's
threads do.  Where it finds none (macOS, Windows, two runtimes loaded, or
``ANYNORM_TORCH_OPENMP=0`` in the environment), :func:`team` returns None and the pool runs
the parts.  A region opened inside another (anynorm called from an OpenMP thread) has one
thread, which runs every part in turn.

The CPU kernels take the same entry points (:func:`kernels_on_team`): a packed call past one
thread's share (:mod:`anynorm._torch_direct`) opens its region in C, each thread its own rows
or samples, with no Python on the team's threads.  A child forked after the team ran has none
of its threads (libgomp would wait on them for ever, as torch's own parallel ops do in such a
child): there every call runs on one thread.
"""

from __future__ import annotations

import ctypes
import os
import threading

from . import _native

__all__ = ["Team", "team", "kernels_on_team"]

_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # names of OpenMP runtimes that export GOMP_parallel
_TEAM = None  # the Team once looked for, False where there is none
_KERNELS = None  # whether the CPU kernels have the team's entry points, once asked
_LOCK = threading.Lock()
_BODY = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Team:
    """Runs tasks (callables of no arguments) on the threads of one OpenMP region."""

    def __init__(self, parallel, thread_num, num_threads):
        self._parallel, self._thread_num, self._num_threads = parallel, thread_num, num_threads
        # the entry points' addresses, for the CPU kernels' own regions
        self.entry_points = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (parallel, thread_num, num_threads))

    def run(self, tasks):
        """``[task() for task in tasks]``, the tasks spread over ``len(tasks)`` threads; the
        first exception a task raised is raised here once all have run."""
        results, errors = [None] * len(tasks), []

        def body(_data):  # on each of the region's threads, which may be fewer than asked
            tid, count = self._thread_num(), self._num_threads()
            for i in range(tid, len(tasks), count):
                try:
                    results[i] = tasks[i]()
                except BaseException as error:  # noqa: BLE001 (raised again below)
                    errors.append(error)

        self._parallel(_BODY(body), None, len(tasks), 0)  # not ctypes.cast: that makes a cycle
        if errors:
            error = errors.pop(0)
            errors.clear()  # no cycle through the tracebacks' frames
            raise error
        return results


def team():
    """torch's OpenMP team as a :class:`Team`, or None where its runtime is not found."""
    global _TEAM
    if _TEAM is None:
        with _LOCK:
            if _TEAM is None:
                entries = _find()
                _TEAM = Team(*entries) if entries else False
    return _TEAM or None


def _forget_in_child():
    """After fork: the parent's team has no threads here (libgomp would wait on them for
    ever, as torch's own parallel ops do in such a child), so calls run on one thread."""
    global _TEAM, _KERNELS
    if _KERNELS:
        _native.use_openmp(None, None, None)
    _TEAM = _KERNELS = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def kernels_on_team():
    """True where the CPU kernels run a ``RowsCall``'s threads on torch's team (in C, no
    Python on the team's threads): :func:`team` found it and the kernels are built."""
    global _KERNELS
    if _KERNELS is None:
        found = team()
        _KERNELS = found is not None and _native.use_openmp(*found.entry_points)
    return _KERNELS


def _find():
    """The entry points of the one OpenMP runtime the process has loaded (torch's), or None."""
    if os.environ.get("ANYNORM_TORCH_OPENMP", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    paths = _loaded_runtimes()
    if len(paths) != 1:
        return None
    try:
        lib = ctypes.CDLL(paths[0], mode=getattr(os, "RTLD_NOLOAD", 0))
        parallel, thread_num, num_threads = lib.GOMP_parallel, lib.omp_get_thread_num, lib.omp_get_num_threads
    except (OSError, AttributeError):
        return None
    parallel.argtypes = [_BODY, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    thread_num.argtypes = num_threads.argtypes = []
    thread_num.restype = num_threads.restype = ctypes.c_int
    return parallel, thread_num, num_threads


def _loaded_runtimes():
    """Paths of the OpenMP runtimes mapped into this process (Linux: ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(None, 5) for line in maps]
    except OSError:
        return []
    paths = {f[5].strip() for f in fields if len(f) == 6}
    return sorted(p for p in paths if os.path.basename(p).startswith(_RUNTIMES) and ".so" in p)
