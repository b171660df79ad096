"""``asv_bench/host_overhead.py`` runs on CPU (CuPy importable, no GPU) and prints its table:
the host-cost measurement of the CUDA torch path does not rot between sessions."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("cupy", exc_type=ImportError)

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "asv_bench" / "host_overhead.py"


def test_prints_both_routes_for_inference_and_training():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rows", "4", "--hidden", "8", "--number", "20"],
                          capture_output=True, text=True, timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| inference", "| training"))]
    assert len(rows) == 2, done.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        values = [float(c) for c in cells[1:5]]
        assert len(values) == 4 and all(v > 0 and re.fullmatch(r"[\d.]+", c) for v, c in zip(values, cells[1:5]))
    # the stand-in says what it stubbed: one launch for a short row's inference, 3 for training
    assert "inference {'launches': 1," in done.stdout, done.stdout
    assert "training {'launches': 3," in done.stdout, done.stdout
    assert re.search(r"^host ratio: inference \d+\.\d\dx, training \d+\.\d\dx$", done.stdout, re.M), done.stdout


_SITE_SCRIPT = """
import sys
sys.argv = ["host_overhead"]
sys.path.insert(0, "asv_bench")
import host_overhead, torch, anynorm
ops = host_overhead._stub_cuda()
looked_up = []
find = ops._bound_forward
ops._bound_forward = lambda *args: looked_up.append(args[1].dtype) or find(*args)
backward_looked_up = []
find_backward = ops._bound_backward
ops._bound_backward = lambda *args: backward_looked_up.append(1) or find_backward(*args)
x = torch.randn(4, 8)
for weight in (torch.ones(8), torch.ones(8, dtype=torch.float64)):
    for _ in range(3):
        anynorm.layer_norm(x, weight)
    print(len(looked_up))
weight = torch.ones(8, requires_grad=True)
for _ in range(3):
    anynorm.layer_norm(x.requires_grad_(), weight).backward(torch.ones(4, 8))
print(len(looked_up), len(backward_looked_up))
"""


def test_a_signature_keeps_its_bound_launch_unless_parameters_convert():
    """A repeat call of a signature launches what its first call bound (the schedule lookup
    runs once per route and ``stats``); a weight the kernels cannot read as it is (float64
    next to float32 x, converted every call) is looked up every call."""
    done = subprocess.run([sys.executable, "-c", _SITE_SCRIPT], capture_output=True, text=True,
                          timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # float32 weight: looked up by the first of three calls; float64: by each of three more;
    # three training calls (another signature: statistics written): one forward lookup,
    # one backward lookup
    assert done.stdout.split() == ["1", "4", "5", "1"], done.stdout + done.stderr[-3000:]
