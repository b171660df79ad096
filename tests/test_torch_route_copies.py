"""The CUDA torch route with inputs not laid out as the kernels' buffer, run on CPU.

A transposed x (``nn.MultiheadAttention``'s output with ``batch_first=True``), a residual or
dy in another memory order, a non-dense view: the runner copies what is off into the other
input's buffer with one torch copy (x and a residual off each other: torch adds them into
it, and the kernels normalize h), launches the dense schedule, and (eager calls) returns y,
h and dx in that buffer's layout; through the custom op, in x's (its fake kernel's promise).

``asv_bench/host_overhead.py``'s stand-in runs the route on CPU tensors with the GPU steps
stubbed; here the stubbed launch computes what the row kernels compute (float32 layer norm
over the last axis, forward and backward) at the addresses it is given, with NumPy, reading
each buffer as dense rows. A pointer to memory not laid out that way gives wrong values, so
the results against ``torch.nn.functional`` (autograd) check the copies and the layouts.
In a subprocess: the stand-in patches anynorm's modules for the whole process.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("cupy", exc_type=ImportError)

REPO = pathlib.Path(__file__).resolve().parent.parent

_SCRIPT = r'''
import ctypes, sys
sys.argv = ["host_overhead"]
sys.path.insert(0, "asv_bench")
import numpy as np
import host_overhead, torch, anynorm
from anynorm._cuda import _interop, _launcher

ops = host_overhead._stub_cuda()
F = torch.nn.functional
launched = []
fused = []  # per forward launch: whether the kernel added a residual itself


def rows(ptr, n, count=None):
    """``count`` float32 values at ``ptr`` (default: x's) as dense rows of n (the row kernels'
    buffer)."""
    count = int(np.prod(SHAPE)) if count is None else count
    array = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(count,))
    return array.reshape(-1, n)


def run_rows(bound, ptrs, device):
    """What the row kernels compute, at the addresses given (float32, eps 1e-5)."""
    n = SHAPE[-1]
    m = int(np.prod(SHAPE)) // n
    launched.append(bound.names)
    if bound.names[0].startswith("rows_fwd"):
        x, res, h, y, w, b, mean, rstd, _ = ptrs
        v = rows(x, n).astype(np.float64)
        fused.append(bool(res))
        if res:
            v = v + rows(res, n)
            rows(h, n)[...] = v
        mu = v.mean(1, keepdims=True)
        r = 1 / np.sqrt(((v - mu) ** 2).mean(1, keepdims=True) + 1e-5)
        out = (v - mu) * r
        if w:
            out = out * rows(w, n, n) + rows(b, n, n)
        rows(y, n)[...] = out
        if rstd:
            rows(mean, 1, m)[...] = mu
            rows(rstd, 1, m)[...] = r
        return
    dy, x, w, mean, rstd, dx, dw, db, _ = ptrs
    v, g = rows(x, n).astype(np.float64), rows(dy, n).astype(np.float64)
    mu, r = rows(mean, 1, m), rows(rstd, 1, m)
    xhat = (v - mu) * r
    if dw:
        rows(dw, n, n)[...] = (g * xhat).sum(0)
        rows(db, n, n)[...] = g.sum(0)
    gw = g * rows(w, n, n) if w else g
    rows(dx, n)[...] = r * (gw - gw.mean(1, keepdims=True) - xhat * (gw * xhat).mean(1, keepdims=True))


_interop.run_on_torch_stream = run_rows
_launcher.forward = _launcher.backward = None  # the CuPy copy path must not be taken
SHAPE = (3, 5, 8)
torch.manual_seed(0)


def memory(order):
    """A float32 tensor of SHAPE whose memory runs in axis ``order`` (outermost first)."""
    t = torch.randn([SHAPE[a] for a in order])
    return t.permute(*np.argsort(order).tolist())


def check(name, x, res, dy, via_op=False):
    """anynorm's layer norm of x (+ res) and its gradients for dy against F.layer_norm's."""
    x = x.detach().requires_grad_()  # a leaf with x's strides
    res = None if res is None else res.detach().requires_grad_()
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    inputs = [t for t in (x, w, b, res) if t is not None]
    fused.clear()
    route = ops._route
    if via_op:
        ops._route = lambda *tensors: ops.OP
    try:
        out = anynorm.layer_norm(x, w, b, residual=res)
    finally:
        ops._route = route
    y, h = out if res is not None else (out, None)
    v = x if res is None else x + res
    want = F.layer_norm(v, (8,), w, b)
    errors = [(y - want).abs().max().item()]
    if h is not None:
        errors.append((h - v).abs().max().item())
    grads = torch.autograd.grad((y * dy).sum(), inputs)
    wanted = torch.autograd.grad((want * dy).sum(), inputs)
    errors += [(g - gt).abs().max().item() for g, gt in zip(grads, wanted)]
    like_x = y.stride() == x.stride() and (h is None or h.stride() == x.stride())
    print(name, "err %.1e" % max(errors), "like_x", like_x, "dense", y.is_contiguous(),
          "kernel_adds", any(fused))


contiguous, transposed = (0, 1, 2), (1, 0, 2)
check("transposed-x residual", memory(transposed), memory(contiguous), memory(contiguous))
check("x transposed-residual", memory(contiguous), memory(transposed), memory(contiguous))
check("both-transposed", memory(transposed), memory(transposed), memory(contiguous))
check("transposed-x", memory(transposed), None, memory(contiguous))
check("transposed-dy", memory(contiguous), None, memory(transposed))
check("strided-x", torch.randn(3, 5, 16)[..., ::2], None, memory(transposed))
check("op transposed-x residual", memory(transposed), memory(contiguous), memory(transposed), via_op=True)
print("launched", " ".join(sorted({names[0] for names in launched})))
'''


def test_inputs_off_the_buffer_are_copied_by_torch_into_the_other_ones():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.findall(r"^(.+) err (\S+) like_x (True|False) dense (True|False) kernel_adds (True|False)$",
                       done.stdout, re.M)
    lines = {name: (float(err), like_x == "True", dense == "True") for name, err, like_x, dense, _ in found}
    # a residual off the buffer: torch adds it into the buffer (3 transfers), the kernels
    # normalize h without one (a copy and the fused kernel took 6)
    assert all(adds == "False" for *_, adds in found), done.stdout
    assert len(lines) == 7, done.stdout
    for name, (err, _, _) in lines.items():
        assert err < 1e-5, (name, done.stdout)
    # eager calls: y and h in the buffer's layout (the residual's, dense here), not x's
    assert lines["transposed-x residual"][1:] == (False, True), done.stdout
    assert lines["x transposed-residual"][1:] == (True, True), done.stdout
    assert lines["both-transposed"][1:] == (False, True), done.stdout  # the canonical order
    assert lines["transposed-x"][2] and lines["strided-x"][2], done.stdout
    # through the custom op the outputs keep x's strides, as its fake kernel says
    assert lines["op transposed-x residual"][1:] == (True, False), done.stdout
    launched = done.stdout.split("launched ", 1)[1]
    assert "rows_fwd" in launched and "rows_bwd" in launched, done.stdout  # what the stand-in computes
