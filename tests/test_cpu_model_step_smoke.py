"""``asv_bench/cpu_model_step.py`` runs (a tiny model, one round) and prints its lines: the
outputs of both sides agree and both modes report a ratio, with and without channels_last."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "asv_bench"))
import cpu_model_step  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--channels-last"]], ids=["nchw", "channels-last"])
def test_cpu_model_step_prints_both_modes(extra, capsys):
    cpu_model_step.main(["--rounds", "1", "--batch", "2", "--size", "32", "--dims", "8,16,24,32",
                         "--depth", "1", *extra])
    out = capsys.readouterr().out
    diff = float(re.search(r"max \|y_anynorm - y_torch\| (\S+)", out).group(1))
    assert diff < 1e-4
    for mode in ("train step", "inference"):
        assert re.search(rf"^{mode}: anynorm [\d.]+ ms, torch [\d.]+ ms, anynorm / torch [\d.]+ \(", out, re.M), out
