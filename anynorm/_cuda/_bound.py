"""A call's launch schedule, worked out once and replayed per call with new pointers.

``_launch`` decides, from a plan, a layout and the device, which kernels run with which
grid, block, shared memory, sizes and workspaces. None of that depends on the data, so it
is worked out once per call signature: :func:`schedule_forward` / :func:`schedule_backward`
run ``_launch``'s schedule code with :class:`Slot` placeholders for the buffers and note each
launch instead of running it (``_launch._recording``). A :class:`Schedule` is plain data
(kernel names, grids, blocks, shared memory, argument templates whose constants are CuPy
holders already), computed for the current device or for a ``_launch.DeviceInfo``, so tests
check schedules without a GPU. :class:`BoundLaunch` binds one to the current device's
compiled functions; a call fills in only the pointers (``ptrs[slot] + offset``) and the
stream:

    forward slots:  x, res, h, y, w, b, mean, rstd, scratch
    backward slots: dy, x, w, mean, rstd, dx, dw, db, scratch

Workspaces of all steps share one scratch allocation of ``scratch_bytes`` (each part
256-byte aligned), which the caller allocates from its own allocator (torch's caching
allocator for tensors: CUDA graphs capture it). Layouts that need copies (``Layout.copy``)
are not scheduled; they take ``_launch.forward``/``backward`` as before.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from . import _launch
from ._args import address

__all__ = ["Slot", "Schedule", "BoundLaunch", "schedule_forward", "schedule_backward",
           "record_forward", "record_backward", "FORWARD_SLOTS", "BACKWARD_SLOTS", "ALIGN"]

FORWARD_SLOTS = ("x", "res", "h", "y", "w", "b", "mean", "rstd", "scratch")
BACKWARD_SLOTS = ("dy", "x", "w", "mean", "rstd", "dx", "dw", "db", "scratch")
ALIGN = 256  # bytes: every workspace starts on a 256-byte boundary of the scratch buffer


class Slot:
    """A buffer of the call (``index`` into its pointer list) at a byte ``offset``."""

    __slots__ = ("index", "offset", "row_bytes")

    def __init__(self, index, offset=0, row_bytes=0):
        self.index, self.offset, self.row_bytes = index, offset, row_bytes

    def __getitem__(self, row):
        """Row ``row`` of a 2-D workspace (``ws[0]``, ``part[1]`` in ``_launch``)."""
        return Slot(self.index, self.offset + row * self.row_bytes)

    def __repr__(self):
        return f"Slot({self.index}, +{self.offset})"


class _Recorder:
    """Collects the steps and workspaces of one schedule (see ``_launch._recording``);
    ``device``: the DeviceInfo the schedule is for (None: the current device)."""

    def __init__(self, scratch_index, device=None):
        self.scratch_index = scratch_index
        self.device = device
        self.scratch_bytes = 0
        self.steps = []

    def workspace(self, shape, dtype):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = np.dtype(dtype).itemsize
        offset = self.scratch_bytes
        self.scratch_bytes += -(-math.prod(shape) * itemsize // ALIGN) * ALIGN
        row_bytes = shape[-1] * itemsize if len(shape) == 2 else 0
        return Slot(self.scratch_index, offset, row_bytes)

    def launch(self, name, dtype, items, grid, block, args, smem):
        template, slots = [], []
        for position, arg in enumerate(args):
            if type(arg) is Slot:
                slots.append((position, arg.index, arg.offset))
                template.append(None)
            else:
                template.append(arg)
        self.steps.append(Step(name, dtype, items, tuple(grid), tuple(block), smem, template,
                               tuple(slots)))


class Step:
    """One kernel launch of a schedule: which instantiation, its launch configuration, its
    argument template (constants as CuPy holders, None where ``slots`` put a pointer)."""

    __slots__ = ("name", "dtype", "items", "grid", "block", "smem", "template", "slots")

    def __init__(self, name, dtype, items, grid, block, smem, template, slots):
        self.name, self.dtype, self.items, self.grid, self.block = name, dtype, items, grid, block
        self.smem, self.template, self.slots = smem, template, slots

    def __repr__(self):
        return f"Step({self.name}, grid={self.grid}, block={self.block}, smem={self.smem})"


class Schedule:
    """The launches of one call signature, as data (no compiled code, no device needed)."""

    __slots__ = ("steps", "scratch_bytes")

    def __init__(self, steps, scratch_bytes):
        self.steps, self.scratch_bytes = tuple(steps), scratch_bytes

    @property
    def names(self) -> tuple:
        return tuple(step.name for step in self.steps)


class BoundLaunch:
    """A schedule bound to the current device's compiled functions; :meth:`run` launches it
    on new buffers."""

    __slots__ = ("steps", "scratch_bytes", "names")

    def __init__(self, schedule):
        self.scratch_bytes, self.names = schedule.scratch_bytes, schedule.names
        steps = []
        for step in schedule.steps:
            function = _launch.get_kernel(step.name, step.dtype, step.items)
            _launch.opt_in(function, step.smem)
            if isinstance(function, cupy.RawKernel):
                # the current device's CUDA function behind it (what RawKernel.__call__
                # calls), which also takes the stream
                function = function.kernel
            steps.append((function, step.grid, step.block, step.smem, step.template, step.slots))
        self.steps = tuple(steps)

    def run(self, ptrs, stream):
        """Launch every step on ``stream`` (an object with ``.ptr``, as CuPy's functions
        take it) with the buffers at the integer addresses ``ptrs`` (slot order)."""
        for function, grid, block, smem, template, slots in self.steps:
            args = template.copy()
            for position, index, offset in slots:
                args[position] = address(ptrs[index] + offset)
            function(grid, block, tuple(args), shared_mem=smem, stream=stream)


def _record(scratch_index, schedule, device):
    recorder = _Recorder(scratch_index, device)
    _launch._recording.recorder = recorder
    try:
        schedule()
    finally:
        _launch._recording.recorder = None
    return Schedule(recorder.steps, recorder.scratch_bytes)


def _slots(names, present):
    """A Slot per name in ``present``, None for the others."""
    return [Slot(i) if name in present else None for i, name in enumerate(names)]


def schedule_forward(plan, dtype, layout, present, param_in_t=0, device=None) -> Schedule:
    """The forward of ``plan`` on buffers laid out as ``layout`` (no copies); ``present``:
    the forward slot names the call has (``mean``/``rstd`` absent: statistics not written);
    ``param_in_t``: bit 0 / bit 1 when weight / bias hold x's dtype (``_launch._stats``);
    ``device``: a ``_launch.DeviceInfo`` to plan for (default: the current device)."""
    assert not layout.copy
    x, res, h, y, w, b, mean, rstd, _ = _slots(FORWARD_SLOTS, set(present) | {"x", "y"})
    return _record(FORWARD_SLOTS.index("scratch"), lambda: _launch._stats(
        plan, layout, dtype, x, res, h, y, w, b, mean, rstd, param_in_t), device)


def schedule_backward(plan, dtype, layout, present, param_in_t=0, device=None,
                      grad_in_t=0) -> Schedule:
    """The backward of ``plan`` (``_launch.backward``'s schedule, no copies); ``present``:
    the backward slot names the call has (no ``rstd``: statistics recomputed; no ``dw``:
    no parameter gradients; ``db`` only with ``dw``); ``param_in_t`` 1 when the weight holds
    x's dtype; ``grad_in_t`` bit 0 / bit 1 when dweight / dbias are written in x's dtype;
    ``device`` as in :func:`schedule_forward`."""
    assert not layout.copy
    dy, x, w, mean, rstd, dx, dw, db, _ = _slots(BACKWARD_SLOTS, set(present) | {"dy", "x", "dx"})

    def schedule():
        nonlocal mean, rstd
        if rstd is None:
            acc = _launch.acc_dtype(dtype)
            mean = _launch._workspace(layout.slices, acc) if plan.center else None
            rstd = _launch._workspace(layout.slices, acc)
            _launch._stats(plan, layout, dtype, x, None, None, None, None, None, mean, rstd)
        fused = _launch._dx(plan, layout, dtype, dy, x, w, mean, rstd, dx,
                            None if dw is None else db is not None, param_in_t)
        if fused is not None:
            _launch._finish_param_grads(*fused, layout.p_len, dtype, dw, db, grad_in_t)
        elif dw is not None:
            _launch._param_grads(plan, layout, dtype, dy, x, mean, rstd, dw, db, grad_in_t)

    return _record(BACKWARD_SLOTS.index("scratch"), schedule, device)


def record_forward(plan, dtype, layout, present, param_in_t=0) -> BoundLaunch:
    """:func:`schedule_forward` for the current device, bound to its compiled kernels."""
    return BoundLaunch(schedule_forward(plan, dtype, layout, present, param_in_t))


def record_backward(plan, dtype, layout, present, param_in_t=0, grad_in_t=0) -> BoundLaunch:
    """:func:`schedule_backward` for the current device, bound to its compiled kernels."""
    return BoundLaunch(schedule_backward(plan, dtype, layout, present, param_in_t,
                                         grad_in_t=grad_in_t))
