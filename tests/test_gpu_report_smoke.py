"""``asv_bench/gpu_report.py`` runs end to end on CPU with tiny shapes, so the one command a GPU
session runs does not rot between sessions: every case checks out against torch and is timed."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "asv_bench" / "gpu_report.py"
# on CPU: 6 hidden sizes x 2 dtypes x (layer/RMS norm x forward/backward) + 3 NCHW group norm
# shapes x 2 dtypes x 2 passes; 8 strided workloads x 2 dtypes x 2 passes; 2 shapes x
# (no_grad, requires_grad)
EXPECTED_ROWS = {"rows": 60, "strided": 32, "overhead": 4}
CASE_KEYS = {"section", "name", "shape", "dtype", "pass", "lib", "error", "errors", "max_err", "check_ok"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_report")
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=SCRIPT.parent.parent)
    return done, out


def test_exit_status_and_files(report):
    done, out = report
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (out / "gpu_report.md").read_text() == done.stdout.split("wrote ")[0].rstrip("\n") + "\n"


def test_json_has_every_case_without_errors(report):
    _, out = report
    data = json.loads((out / "gpu_report.json").read_text())
    assert {"meta", "targets", "cases"} <= set(data)
    assert data["meta"]["device"] == "cpu" and data["meta"]["elapsed_s"] > 0
    cases = data["cases"]
    counts = {section: sum(c["section"] == section for c in cases) for section in EXPECTED_ROWS}
    assert counts == EXPECTED_ROWS
    for case in cases:
        assert CASE_KEYS <= set(case), case
        assert case["error"] is None, (case["name"], case["error"], case.get("traceback"))
        assert case["check_ok"] is True and math.isfinite(case["max_err"]), case


def test_timed_cases_have_times_and_ratios(report):
    _, out = report
    for case in json.loads((out / "gpu_report.json").read_text())["cases"]:
        if case["section"] == "overhead":
            assert set(case["times_us"]) == {"ours", "torch"}
            assert case["times_us"]["ours"]["min_us"] > 0 and case["ratio_torch"] > 0
            continue
        peers = {"ours", "torch", "copy"} | ({"torch_contig"} if case["name"].startswith("convnext") else set())
        assert set(case["times"]) == peers and not case["variant_errors"], case
        assert all(t["min_ms"] > 0 and t["repeats"] == 3 for t in case["times"].values())
        assert case["copy_fraction"] > 0 and case["ratio_torch"] > 0 and case["target_met"] in (True, False)
        if case["pass"] == "bwd":
            assert {"dx", "dweight"} <= set(case["errors"])


def test_markdown_has_a_row_per_case(report):
    _, out = report
    markdown = (out / "gpu_report.md").read_text()
    table_rows = [line for line in markdown.splitlines()
                  if line.startswith("| ") and not line.startswith("| case ")]
    cases = json.loads((out / "gpu_report.json").read_text())["cases"]
    assert len(table_rows) == len(cases)
    for line, case in zip(table_rows, cases):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert cells[0] == case["name"] and "ok" in cells and "WRONG" not in cells, line
        assert "ERROR" not in line, line
    assert "elapsed" in markdown.splitlines()[-1]
