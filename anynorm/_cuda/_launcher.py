"""Bind a schedule (``_schedule``) to the current device's compiled kernels and launch it.

:class:`BoundLaunch` is a :class:`~._schedule.Schedule` whose steps hold the compiled
functions and argument templates of CuPy holders; :meth:`BoundLaunch.run` fills in the call's
pointers (``ptrs[slot] + offset``) and launches every step on a stream: that is all a repeat
call does. :func:`forward_launch` / :func:`backward_launch` compute and bind one per call
signature (plan, layout, which buffers are present, parameter dtypes, device), kept in the
plan's memo.

Where x's memory is not the layout's dense buffer (``Layout.copy``: non-dense views, other
axis orders) or the residual's or dy's is not x's, the torch runner copies what is off
into the buffer :func:`copied_forward` / :func:`copied_backward` name (x's, else the other
input's, else the canonical order) with torch (x and a residual: their sum, the kernels then
normalize it) and launches their bound schedule; for CuPy arrays :func:`forward` /
:func:`backward` copy the inputs into dense buffers in the layout's order, run the same kind
of bound schedule on them, and copy the outputs back (:func:`input_buffer`,
:func:`output_buffer`, :func:`store`).
"""

from __future__ import annotations

import ctypes
import functools
import threading

import cupy
import numpy as np
from cupy.cuda.function import Function as _Function
from cupy_backends.cuda.api.driver import ctxGetCurrent as _current_context
from cupy_backends.cuda.api.driver import launchKernel as _launch_kernel
from cupy.lib.stride_tricks import as_strided

from . import _schedule
from ._args import NULL, address, kernel_arg
from ._compile import CLUSTER_SIZES, get_kernel
from ._layout import array_strides, buffer_strides, plan_layout, shared_layout, view_strides
from ._schedule import BACKWARD_SLOTS, FORWARD_SLOTS, DeviceInfo

__all__ = ["BoundLaunch", "bind", "device_info", "opt_in", "forward_launch", "backward_launch",
           "forward_present", "backward_present", "dense_forward", "dense_backward",
           "copied_forward", "copied_backward",
           "forward", "backward", "kernel_params", "element_strides", "is_buffer", "strides_are_buffer",
           "input_buffer",
           "output_buffer", "store"]


# ---- the device ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def device_info(device_id: int) -> DeviceInfo:
    """The :class:`DeviceInfo` of CUDA device ``device_id`` (asked once)."""
    runtime = cupy.cuda.runtime
    device = cupy.cuda.Device(device_id)
    return DeviceInfo(int(device.attributes["MultiProcessorCount"]),
                      int(runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                     device_id)),
                      max(CLUSTER_SIZES) if int(device.compute_capability) >= 90 else 1)


def _current_device() -> int:
    return cupy.cuda.runtime.getDevice()


def _current_stream():
    return cupy.cuda.get_current_stream()


def _memo(plan) -> dict:
    """Where a plan keeps what its call signatures bound (``plan.memo``)."""
    return plan.memo


def opt_in(function, smem) -> None:
    """Let ``function`` take ``smem`` bytes of dynamic shared memory (cuFuncSetAttribute)
    where its limit is lower: the driver's limit starts at 48 KiB less the function's static
    shared memory, which only the compiler knows (rows_bwd_multi's 16 KiB of sums left its
    32 KiB ring refused on an H100 when this went by the schedule's figures)."""
    if smem > function.max_dynamic_shared_size_bytes:
        function.max_dynamic_shared_size_bytes = smem


# ---- bound schedules ---------------------------------------------------------------------------

def _word(value) -> int:
    """A schedule constant (a NumPy scalar of the parameter's width, None: a null pointer) as
    the 8-byte word the kernel's parameter is read from (little-endian: an int or float in
    its low bytes)."""
    if value is None:
        return 0
    return int.from_bytes(np.asarray(value).tobytes().ljust(8, b"\0"), "little")


class DirectStep:
    """One kernel of a bound schedule launched by ``cuLaunchKernel`` itself: its arguments'
    values sit in 8-byte words made at bind time, a launch writes its pointers into their
    words and hands the driver the words' addresses. CuPy's ``Function.__call__`` converted
    every argument on every launch: 11.5 us a launch on an H200's host (cProfile,
    2026-11-27), where a bare 4-argument RawKernel took 5.5-6.5."""

    __slots__ = ("function", "dims", "smem", "words", "addresses", "params", "slots", "lock")

    def __init__(self, function_ptr, grid, block, smem, template, slots):
        self.function, self.smem, self.slots = function_ptr, smem, slots
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        self.dims = grid + block
        n = max(1, len(template))
        self.words = (ctypes.c_uint64 * n)(*map(_word, template))
        base = ctypes.addressof(self.words)
        self.addresses = (ctypes.c_void_p * n)(*[base + 8 * k for k in range(len(template))])
        self.params = ctypes.addressof(self.addresses)
        self.lock = threading.Lock()  # the words are shared: one launch writes them at a time

    def launch(self, ptrs, stream_ptr):
        gx, gy, gz, bx, by, bz = self.dims
        words = self.words
        with self.lock:
            for position, index, offset in self.slots:
                words[position] = ptrs[index] + offset
            _launch_kernel(self.function, gx, gy, gz, bx, by, bz, self.smem, stream_ptr, self.params, 0)


class BoundLaunch:
    """A schedule bound to the current device's compiled functions; :meth:`run` launches it
    on new buffers."""

    __slots__ = ("steps", "slots", "scratch_bytes", "names", "direct")

    def __init__(self, schedule):
        self.scratch_bytes, self.names = schedule.scratch_bytes, schedule.names
        steps, slots, direct = [], [], []
        for step in schedule.steps:
            function = get_kernel(step.name, step.dtype, step.items)
            opt_in(function, step.smem)
            if isinstance(function, cupy.RawKernel):
                # the current device's CUDA function behind it (what RawKernel.__call__
                # calls), which also takes the stream
                function = function.kernel
            pointers = {position for position, _ in step.slots}
            template = [None if k in pointers else kernel_arg(a) for k, a in enumerate(step.template)]
            positions = tuple((position, slot.index, slot.offset) for position, slot in step.slots)
            steps.append((function, step.grid, step.block, step.smem, template, positions))
            slots.append(step.slots)
            if isinstance(function, _Function):
                direct.append(DirectStep(function.ptr, step.grid, step.block, step.smem,
                                         [None if k in pointers else a for k, a in enumerate(step.template)],
                                         positions))
        self.steps, self.slots = tuple(steps), tuple(slots)
        # every step a CUDA function: cuLaunchKernel directly (other callables: the emulator's
        # kernels, host_overhead.py's stand-ins, take CuPy's call)
        self.direct = tuple(direct) if len(direct) == len(steps) else None

    def run(self, ptrs, stream):
        """Launch every step on ``stream`` (a CuPy stream, or with :attr:`direct` also a raw
        stream pointer) with the buffers at the integer addresses ``ptrs`` (slot order)."""
        if self.direct is not None:
            stream_ptr = stream if type(stream) is int else stream.ptr
            if not _current_context():
                # a thread that has made no CUDA runtime call has no current context (autograd's
                # device thread on its first backward: CUDA_ERROR_INVALID_CONTEXT on an H200);
                # cudaFree(0) makes the current device's primary one current, as CuPy's launch
                # does before every launch
                cupy.cuda.runtime.free(0)
            for step in self.direct:
                step.launch(ptrs, stream_ptr)
            return
        for function, grid, block, smem, template, slots in self.steps:
            args = template.copy()
            for position, index, offset in slots:
                args[position] = address(ptrs[index] + offset)
            function(grid, block, tuple(args), shared_mem=smem, stream=stream)

    def run_buffers(self, buffers, stream):
        """:meth:`run` with the buffers themselves (slot order; each slot's argument made by
        :func:`buffer_arg`)."""
        if self.direct is not None:
            self.run([0 if b is None else b.data.ptr for b in buffers], stream)
            return
        for (function, grid, block, smem, template, _), slots in zip(self.steps, self.slots):
            args = template.copy()
            for position, slot in slots:
                args[position] = buffer_arg(buffers[slot.index], slot)
            function(grid, block, tuple(args), shared_mem=smem, stream=stream)


def bind(schedule) -> BoundLaunch:
    return BoundLaunch(schedule)


def _device_context(device_id):
    return cupy.cuda.Device(device_id)


def _bind_on(device_id, schedule) -> BoundLaunch:
    """:func:`bind` for device ``device_id`` (its compiled functions are that device's)."""
    if _current_device() == device_id:
        return bind(schedule)
    with _device_context(device_id):
        return bind(schedule)


def _kept(plan, key, build):
    """``build()``'s value for ``key``, made once per plan (``_memo``)."""
    memo = _memo(plan)
    try:
        return memo[key]
    except KeyError:
        value = memo[key] = build()
        return value


def forward_launch(plan, dtype, layout, present, param_in_t, device_id) -> BoundLaunch:
    """The forward schedule of this signature on device ``device_id``, computed and bound
    once (kept in ``plan.memo``)."""
    return _kept(plan, ("forward-launch", layout, frozenset(present), param_in_t, device_id),
                 lambda: _bind_on(device_id, _schedule.schedule_forward(
                     plan, dtype, layout, present, param_in_t, device_info(device_id))))


def backward_launch(plan, dtype, layout, present, param_in_t, grad_in_t, device_id) -> BoundLaunch:
    """The backward schedule of this signature, computed and bound once (``plan.memo``)."""
    return _kept(plan, ("backward-launch", layout, frozenset(present), param_in_t, grad_in_t, device_id),
                 lambda: _bind_on(device_id, _schedule.schedule_backward(
                     plan, dtype, layout, present, param_in_t, device_info(device_id), grad_in_t)))


def forward_present(plan, residual, weight, bias, stats) -> set:
    """The forward slot names a call fills: ``stats`` False: no statistics written."""
    present = {name for name, a in (("res", residual), ("h", residual), ("w", weight),
                                    ("b", bias)) if a is not None}
    if stats:
        present |= {"rstd", "mean"} if plan.center else {"rstd"}
    return present


def backward_present(plan, weight, has_stats, param_grads) -> set:
    """The backward slot names a call fills (no statistics given: recomputed)."""
    present = {"w"} if weight is not None else set()
    if has_stats:
        present |= {"rstd", "mean"} if plan.center else {"rstd"}
    if param_grads:
        present |= {"dw", "db"}
    return present


def dense_forward(plan, dtype, x_strides, res_strides, present, param_in_t, device_id):
    """The bound forward for an x (and residual) of these element strides, or None where
    x's memory is not the layout's dense buffer (:func:`forward` copies then); kept in
    ``plan.memo``."""
    def build():
        layout = plan_layout(plan, x_strides)
        if layout.copy or not (res_strides is None or strides_are_buffer(plan, layout, res_strides)):
            return None
        return forward_launch(plan, dtype, layout, present, param_in_t, device_id)

    return _kept(plan, ("dense-forward", x_strides, res_strides, frozenset(present), param_in_t,
                        device_id), build)


def dense_backward(plan, dtype, x_strides, dy_strides, present, param_in_t, grad_in_t, device_id):
    """The bound backward for an x and dy of these element strides, or None (copies needed:
    :func:`backward`); kept in ``plan.memo``."""
    def build():
        layout = plan_layout(plan, x_strides, plan.has_weight or "dw" in present)
        if layout.copy or not strides_are_buffer(plan, layout, dy_strides):
            return None
        return backward_launch(plan, dtype, layout, present, param_in_t, grad_in_t, device_id)

    return _kept(plan, ("dense-backward", x_strides, dy_strides, frozenset(present), param_in_t,
                        grad_in_t, device_id), build)


def copied_forward(plan, dtype, x_strides, res_strides, present, param_in_t, device_id):
    """For an x and residual that :func:`dense_forward` refuses: ``(bound, layout, strides)``,
    the bound forward of the dense buffer the inputs not laid out so are to be copied into
    (``_layout.shared_layout``: x's layout, else the residual's, else the canonical order) and
    that buffer's element strides in x's axes; kept in ``plan.memo``."""
    def build():
        layout = shared_layout(plan, x_strides, res_strides)
        return (forward_launch(plan, dtype, layout, present, param_in_t, device_id), layout,
                array_strides(plan, layout))

    return _kept(plan, ("copied-forward", x_strides, res_strides, frozenset(present), param_in_t,
                        device_id), build)


def copied_backward(plan, dtype, x_strides, dy_strides, present, param_in_t, grad_in_t, device_id):
    """:func:`copied_forward` for a backward: x's layout, else dy's, else the canonical order."""
    def build():
        layout = shared_layout(plan, x_strides, dy_strides, plan.has_weight or "dw" in present)
        return (backward_launch(plan, dtype, layout, present, param_in_t, grad_in_t, device_id),
                layout, array_strides(plan, layout))

    return _kept(plan, ("copied-backward", x_strides, dy_strides, frozenset(present), param_in_t,
                        grad_in_t, device_id), build)


def kernel_params(x_dtype, acc, as_dtype, weight, bias=None):
    """``(weight, bias, param_in_t)`` as the kernels read them: each in x's dtype where it
    holds that (``_schedule.param_in_t``), else in ``acc``; ``as_dtype(array, dtype)`` makes
    an array contiguous in a dtype (a no-op where it already is)."""
    flags = _schedule.param_in_t(x_dtype, acc, weight, bias)
    return (as_dtype(weight, x_dtype if flags & 1 else acc), as_dtype(bias, x_dtype if flags & 2 else acc),
            flags)


# ---- buffers ---------------------------------------------------------------------------------

def buffer_arg(buf, slot):
    """The kernel argument for ``slot`` of the buffer ``buf`` (a CuPy array or None)."""
    if buf is None:
        return NULL
    return address(buf.data.ptr + slot.offset)


def _scratch(nbytes):
    return cupy.empty(nbytes, dtype=cupy.uint8) if nbytes else None


def element_strides(arr) -> tuple:
    return tuple(s // arr.itemsize for s in arr.strides)


def _view(plan, arr):
    """``arr`` (shape ``plan.shape``) as ``plan.view_shape``, always a view."""
    strides = view_strides(plan, element_strides(arr))
    return as_strided(arr, shape=plan.view_shape, strides=tuple(s * arr.itemsize for s in strides))


def is_buffer(plan, layout, arr) -> bool:
    """True when ``arr``'s memory is laid out exactly as the kernel buffer (worked out once
    per plan, layout and strides)."""
    return strides_are_buffer(plan, layout, element_strides(arr))


def strides_are_buffer(plan, layout, strides) -> bool:
    """:func:`is_buffer` for an array of these element strides."""
    key = ("is_buffer", layout, strides)
    answer = plan.memo.get(key)
    if answer is None:
        want = buffer_strides(plan, layout)
        have = view_strides(plan, strides)
        answer = plan.memo[key] = all(n == 1 or w == h for n, w, h in zip(plan.view_shape, want, have))
    return answer


def _ordered(plan, layout, arr):
    return cupy.transpose(_view(plan, arr), layout.order)


def input_buffer(plan, layout, arr):
    """``arr`` itself when it is laid out as the buffer, else a dense copy in layout order."""
    if arr is None or is_buffer(plan, layout, arr):
        return arr
    return cupy.ascontiguousarray(_ordered(plan, layout, arr))


def output_buffer(plan, layout, out):
    """Where the kernels should write ``out``: ``out`` itself, or a scratch buffer."""
    if out is None or is_buffer(plan, layout, out):
        return out
    return cupy.empty(layout.total, dtype=out.dtype)


def store(plan, layout, buf, out) -> None:
    """Copy a scratch buffer back into ``out`` (no-op when the kernels wrote ``out``)."""
    if buf is out:
        return
    ordered = _ordered(plan, layout, out)
    ordered[...] = buf.reshape(ordered.shape)


def _present(names, buffers):
    return {name for name, buf in zip(names, buffers) if buf is not None}


# ---- any layout: copies around a bound schedule ------------------------------------------------

def forward(plan, dtype, x, weight, bias, residual, y, h, mean, rstd, param_in_t=0):
    """y = (v - mean) * rstd * weight + bias with v = x (+ residual -> h) into the outputs
    given, on CuPy's current stream and device; ``mean``/``rstd`` None: not written.
    ``param_in_t``: bit 0 / bit 1 when weight / bias hold x's dtype."""
    layout = plan_layout(plan, element_strides(x))
    xb, rb = input_buffer(plan, layout, x), input_buffer(plan, layout, residual)
    hb, yb = output_buffer(plan, layout, h), output_buffer(plan, layout, y)
    buffers = [xb, rb, hb, yb, weight, bias, mean, rstd]
    bound = forward_launch(plan, dtype, layout, _present(FORWARD_SLOTS, buffers), param_in_t,
                           _current_device())
    bound.run_buffers(buffers + [_scratch(bound.scratch_bytes)], _current_stream())
    store(plan, layout, yb, y)
    if h is not None:
        store(plan, layout, hb, h)


def backward(plan, dtype, dy, x, weight, mean, rstd, dx, dweight, dbias, param_in_t=0,
             grad_in_t=0):
    """dx (and dweight/dbias unless None) on CuPy's current stream and device;
    ``mean``/``rstd`` None to recompute them; ``param_in_t`` 1 when ``weight`` holds x's
    dtype; ``grad_in_t`` bit 0 / bit 1 when ``dweight`` / ``dbias`` do (else they hold the
    accumulation dtype)."""
    layout = plan_layout(plan, element_strides(x), plan.has_weight or dweight is not None)
    xb, dyb = input_buffer(plan, layout, x), input_buffer(plan, layout, dy)
    dxb = output_buffer(plan, layout, dx)
    if rstd is None:
        mean = None
    buffers = [dyb, xb, weight, mean, rstd, dxb, dweight, dbias]
    bound = backward_launch(plan, dtype, layout, _present(BACKWARD_SLOTS, buffers), param_in_t,
                            grad_in_t, _current_device())
    bound.run_buffers(buffers + [_scratch(bound.scratch_bytes)], _current_stream())
    store(plan, layout, dxb, dx)
