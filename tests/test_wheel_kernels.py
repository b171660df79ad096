"""The built wheel carries the CUDA and CPU kernel sources, and the installed package's loaders
find them (the CPU kernel also builds from there where the host has a C++ compiler)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

from support import build_wheel

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted(p.name for p in (REPO / "kernels").iterdir() if p.suffix in (".cu", ".cuh", ".cpp"))

# Runs in a fresh interpreter whose sys.path holds only the unpacked wheel (plus the
# standard library and site-packages), from a directory outside the repository.
_PROBE = r"""
import importlib.util, os, sys
import anynorm
root = os.path.dirname(anynorm.__file__)
spec = importlib.util.spec_from_file_location("probe_sources", os.path.join(root, "_cuda", "_sources.py"))
sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sources)
print(anynorm.__file__)
print(sources.kernel_dir())
for name in sources.SOURCE_FILES:
    text = sources.read_source(name)
    assert "__global__" in text and '#include "common.cuh"' not in text, name
from anynorm import _native
assert _native.rows_kernel("float32") is not None or _native._compiler() is None, _native.status
print("ok")
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    build = build_wheel(REPO, out)
    if build.returncode:
        pytest.fail(f"building the wheel failed:\n{build.stdout}\n{build.stderr}")
    (path,) = out.glob("anynorm-*.whl")
    return path


def test_wheel_contains_kernel_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert KERNEL_FILES, "no kernel sources in the repository"
    missing = [f for f in KERNEL_FILES if f"anynorm/kernels/{f}" not in names]
    assert not missing, f"kernel sources missing from {wheel.name}: {missing}"
    assert "anynorm/_cuda/__init__.py" in names


def test_installed_package_finds_kernel_sources(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    env["ANYNORM_CACHE_DIR"] = str(tmp_path / "cache")
    run = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    module_file, kernel_dir, status = run.stdout.split()
    assert pathlib.Path(module_file).is_relative_to(site), module_file
    assert pathlib.Path(kernel_dir) == site / "anynorm" / "kernels"
    assert status == "ok"
