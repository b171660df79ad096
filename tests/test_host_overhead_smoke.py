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
