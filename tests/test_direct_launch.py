"""Bound schedules launched by cuLaunchKernel itself (``_launcher.DirectStep``), checked
without a GPU: the driver call is replaced by one that reads the argument words the way the
driver does (through the parameter array's addresses) and compares them with the arguments
CuPy's own launch would have been given."""

from __future__ import annotations

import ctypes
import struct

import numpy as np
import pytest

pytest.importorskip("cupy")

from anynorm._cuda import _launcher, _layout, _schedule  # noqa: E402
from anynorm._plan import make_plan  # noqa: E402

H100 = _schedule.DeviceInfo(sm_count=132, smem_optin=227 * 1024, cluster_max=8)


class FakeFunction:
    """Stands in for a CUDA function (``_launcher._Function`` is patched to this type)."""

    max_dynamic_shared_size_bytes = 0

    def __init__(self, ptr):
        self.ptr = ptr


def _schedules(dtype):
    x = np.zeros((6, 100, 10), np.float32)
    w = np.ones(100, np.float32)
    plan = make_plan("layer_norm", x, w, w, axis=1)  # channels-first: several kernels back
    layout = _layout.plan_layout(plan, (1000, 10, 1), True)
    present = {"w", "b", "mean", "rstd"}
    return (_schedule.schedule_forward(plan, dtype, layout, present, device=H100),
            _schedule.schedule_backward(plan, dtype, layout, {"w", "mean", "rstd", "dw", "db"},
                                        device=H100))


def _expected_word(value):
    if value is None:
        return 0
    raw = np.asarray(value).tobytes()
    return int.from_bytes(raw.ljust(8, b"\0"), "little")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_launch_words_are_the_arguments(monkeypatch, dtype):
    functions = {}

    def get_kernel(name, dtype, items=None):
        return functions.setdefault((name, items), FakeFunction(1000 + len(functions)))

    launches, steps = [], iter(())

    def launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        # as the driver reads them: the k-th parameter's bytes at the k-th address
        addresses = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        words = [ctypes.c_uint64.from_address(addresses[k]).value for k in range(len(next(steps).template))]
        launches.append((function, (gx, gy, gz), (bx, by, bz), smem, stream, extra, words))

    monkeypatch.setattr(_launcher, "get_kernel", get_kernel)
    monkeypatch.setattr(_launcher, "_Function", FakeFunction)
    monkeypatch.setattr(_launcher, "_launch_kernel", launch_kernel)
    monkeypatch.setattr(_launcher, "_current_context", lambda: 1)
    for schedule in _schedules(dtype):
        bound = _launcher.bind(schedule)
        assert bound.direct is not None and len(bound.direct) == len(schedule.steps)
        ptrs = [0x7F0000000000 + 0x100000 * k for k in range(12)]
        launches.clear()
        steps = iter(schedule.steps)
        bound.run(ptrs, 0xABC)
        assert len(launches) == len(schedule.steps)
        for step, (function, grid, block, smem, stream, extra, words) in zip(schedule.steps, launches):
            assert function == functions[(step.name, step.items)].ptr
            assert grid == tuple(step.grid) + (1,) * (3 - len(step.grid))
            assert block == tuple(step.block) + (1,) * (3 - len(step.block))
            assert (smem, stream, extra) == (step.smem, 0xABC, 0)
            pointers = {position: ptrs[slot.index] + slot.offset for position, slot in step.slots}
            for k, value in enumerate(step.template):
                want = pointers[k] if k in pointers else _expected_word(value)
                # an int or float argument is read from the low bytes of its word
                width = 8 if k in pointers or value is None else np.asarray(value).itemsize
                assert words[k] & ((1 << 8 * width) - 1) == want, (step.name, k, value)


def test_words_hold_float64_eps_and_negative_ints():
    assert _launcher._word(np.float64(1e-5)) == struct.unpack("<Q", struct.pack("<d", 1e-5))[0]
    assert _launcher._word(np.int32(-3)) == 0xFFFFFFFD
    assert _launcher._word(np.int64(-3)) == 2 ** 64 - 3
    assert _launcher._word(None) == 0


def test_a_thread_without_a_context_gets_one_before_its_launch(monkeypatch):
    """autograd's device thread had no current context at its first backward (an H200:
    CUDA_ERROR_INVALID_CONTEXT from cuLaunchKernel): the bound launch makes the device's
    primary context current first (cudaFree(0)), as CuPy's own launch does."""
    calls = []
    monkeypatch.setattr(_launcher, "get_kernel", lambda name, dtype, items=None: FakeFunction(7))
    monkeypatch.setattr(_launcher, "_Function", FakeFunction)
    monkeypatch.setattr(_launcher, "_launch_kernel", lambda *args: calls.append("launch"))
    monkeypatch.setattr(_launcher, "_current_context", lambda: 0)
    monkeypatch.setattr(_launcher.cupy.cuda.runtime, "free", lambda ptr: calls.append(("free", ptr)))
    bound = _launcher.bind(_schedules("float32")[0])
    bound.run([0] * 12, 0)
    assert calls[0] == ("free", 0) and calls[1:] == ["launch"] * len(bound.direct)


def test_other_callables_take_cupys_call(monkeypatch):
    """The emulator's kernels and host_overhead.py's stand-ins are no CUDA functions: no
    direct steps, their own call with CuPy's argument holders."""
    seen = []

    class Kernel:
        max_dynamic_shared_size_bytes = 0

        def __call__(self, grid, block, args, shared_mem=0, stream=None):
            seen.append(len(args))

    monkeypatch.setattr(_launcher, "get_kernel", lambda name, dtype, items=None: Kernel())
    bound = _launcher.bind(_schedules("float32")[0])
    assert bound.direct is None
    bound.run([0] * 12, None)
    assert seen == [len(step.template) for step in _schedules("float32")[0].steps]
