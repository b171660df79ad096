"""Issue 18, "the first hour": what a new user following the README trips over stays fixed.

- ``python -m anynorm --plot`` without matplotlib stops at once with the install command;
- the demo times in interleaved rounds (median and spread) and says why CuPy is left out;
- every public function and module documents its formula, an example on NumPy and torch,
  its arguments and the errors it raises, and those examples run;
- the LICENSE ships in the wheel;
- asv leaves the GPU benchmarks out on a machine without a GPU driver;
- the README names every extra, the test suite's time and its quick subset.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tomllib
import zipfile

import numpy as np
import pytest

import anynorm
from anynorm import __main__ as demo
from support import build_wheel

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

FUNCTIONS = ["layer_norm", "rms_norm", "instance_norm", "group_norm",
             "layer_norm_backward", "rms_norm_backward", "instance_norm_backward", "group_norm_backward"]
MODULES = ["LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm"]


def _env():
    """This process's environment with the repository (only) on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    return env


# --- 1. --plot without matplotlib ------------------------------------------------------------


def test_plot_without_matplotlib_says_how_to_install_it_before_the_demo(tmp_path):
    """A ``matplotlib`` that cannot be imported (a stand-in first on sys.path) ends the command
    at once with exit status 2 and ``pip install "anynorm[plot]"``, before any output."""
    fake = tmp_path / "no_matplotlib"
    fake.mkdir()
    (fake / "matplotlib.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(REPO)])
    run = subprocess.run([sys.executable, "-m", "anynorm", "--plot", str(tmp_path / "hist.png")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert 'pip install "anynorm[plot]"' in run.stderr
    assert "Traceback" not in run.stderr
    assert "executor=" not in run.stdout, "the demo ran before the check"
    assert not (tmp_path / "hist.png").exists()


def test_plot_into_a_missing_folder_fails_before_the_demo(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as info:
        demo.main(["--plot", str(tmp_path / "nowhere" / "hist.png")])
    assert info.value.code == 2
    out = capsys.readouterr()
    assert "does not exist" in out.err and "executor=" not in out.out


def test_plot_draws_labelled_outlined_histograms(tmp_path, monkeypatch):
    """The figure: axes labelled, each sample drawn as an outline (histtype step) over a
    translucent fill, so coinciding samples stay visible."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    path = tmp_path / "hist.png"
    demo.plot(str(path), np.random.default_rng(0))
    assert path.stat().st_size > 10_000
    (fig,) = figures
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel()
        outlines = [p for p in ax.patches if not p.get_fill()]
        fills = [p for p in ax.patches if p.get_fill()]
        assert len(outlines) == 4 and len(fills) == 4
        assert all(p.get_alpha() is not None and p.get_alpha() <= 0.5 for p in fills)
        assert len(ax.get_legend().get_texts()) == 4


# --- 3. the demo's timing and the libraries it leaves out --------------------------------------


def test_interleaved_times_rotate_and_summarise():
    order = []
    times = demo.interleaved_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, rounds=4)
    assert [len(t) for t in times.values()] == [4, 4]
    assert order == ["a", "b"] + ["a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then rotating
    t_ours, t_peer, ratio, lo, hi = demo.ratio_summary([1.0, 2.0, 9.0], [1.0, 1.0, 1.0])
    assert (t_ours, t_peer, ratio, lo, hi) == (2.0, 1.0, 2.0, 1.0, 9.0)


def test_demo_prints_median_and_spread_and_why_libraries_are_missing(capsys):
    demo.main(["--rounds", "3"])
    out = capsys.readouterr().out
    assert re.search(r"numpy +anynorm +[\d.]+ ms / naive numpy +[\d.]+ ms = [\d.]+ +\(rounds: [\d.]+-[\d.]+\)", out), out
    assert "3 interleaved rounds" in out and "median" in out
    assert re.search(r"^CPU kernels \(kernels/cpu.cpp\): (loaded /|not used \()", out, re.M), out
    _, absent = demo._libraries()
    for label, why in absent:
        assert re.search(rf"^{re.escape(label)} +skipped: ", out, re.M), (label, out)


def test_cupy_without_a_usable_gpu_is_named(monkeypatch):
    """CuPy installed but failing its device probe (no driver, driver too old) is reported, not dropped."""
    import types

    class CUDARuntimeError(RuntimeError):
        pass

    def no_device():
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    found, absent = demo._libraries()
    assert "cupy" not in [f[0] for f in found]
    (why,) = [w for label, w in absent if label == "cupy"]
    assert "installed but unusable" in why and "cudaErrorInsufficientDriver" in why


# --- 5. docstrings ---------------------------------------------------------------------------


def _public_objects():
    objs = [(f"anynorm.{n}", getattr(anynorm, n)) for n in FUNCTIONS + MODULES]
    try:
        nn = importlib.import_module("anynorm.nn")
    except ImportError:  # no torch
        return objs
    return objs + [(f"anynorm.nn.{n}", getattr(nn, n)) for n in nn.__all__]


@pytest.mark.parametrize("name, obj", _public_objects(), ids=[n for n, _ in _public_objects()])
def test_public_docstrings_have_formula_example_arguments_and_errors(name, obj):
    doc = inspect.getdoc(obj) or ""
    for section in ("Args:", "Example", "Raises:"):
        assert section in doc, f"{name}: no {section!r} section"
    assert "sqrt" in doc or ("rstd" in doc and "dx " in doc), f"{name}: no formula"
    assert ">>>" in doc and "np." in doc and "torch" in doc, f"{name}: the example must show NumPy and torch"
    raises = doc.split("Raises:", 1)[1]
    assert "ValueError" in raises, f"{name}: Raises must list ValueError"
    assert "TypeError" in raises, f"{name}: Raises must list TypeError"
    if inspect.isclass(obj):
        assert "axis" in doc, f"{name}: axis=/channel_axis= undocumented"


def test_nn_modules_document_their_own_init_and_forward():
    """help(anynorm.nn.LayerNorm) explains axis= and residual=, not torch's boilerplate."""
    nn = pytest.importorskip("anynorm.nn")
    import pydoc

    for name in nn.__all__:
        cls = getattr(nn, name)
        for method in ("__init__", "forward"):
            assert method in vars(cls), (name, method)
            doc = inspect.getdoc(vars(cls)[method]) or ""
            assert doc and "Module state" not in doc and "Define the computation" not in doc, (name, method, doc)
    text = pydoc.render_doc(nn.LayerNorm, renderer=pydoc.plaintext)
    assert "residual" in text and "axis=" in text


@pytest.mark.parametrize("name, obj", _public_objects(), ids=[n for n, _ in _public_objects()])
def test_docstring_examples_run(name, obj):
    """The examples are doctests: they run, and print what they say."""
    pytest.importorskip("torch")
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(obj, name, globs={})
    assert tests and tests[0].examples, name
    for test in tests:
        result = runner.run(test, out=lambda s: None)
        assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


# --- 6. LICENSE ------------------------------------------------------------------------------


def test_license_file_is_bsd3_and_in_the_wheel(tmp_path):
    text = (REPO / "LICENSE").read_text()
    assert "BSD 3-Clause" in text and "the anynorm developers" in text and "2026" in text
    assert PYPROJECT["project"]["license"] == "BSD-3-Clause"
    assert "LICENSE" in PYPROJECT["project"]["license-files"]
    build = build_wheel(REPO, tmp_path)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("anynorm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        licenses = [n for n in zf.namelist() if ".dist-info/" in n and n.endswith("LICENSE")]
        assert licenses, f"no LICENSE in {wheel.name}'s .dist-info"
        assert zf.read(licenses[0]).decode() == text


# --- 7. asv on a machine without a GPU -------------------------------------------------------

_DISCOVER = r"""
import sys
sys.path.insert(0, ".")
from asv_runner.discovery import disc_benchmarks
for b in disc_benchmarks("benchmarks"):
    print(b.name)
"""


def test_asv_leaves_gpu_benchmarks_out_without_a_gpu():
    """With every device hidden, asv discovers no cuda.* benchmark (no tables of n/a) and
    still every CPU one, torch's included (the CUDA classes inherit their methods)."""
    pytest.importorskip("asv_runner")
    found = {}
    for hidden in ("", None):
        env = _env()
        if hidden is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = hidden
        run = subprocess.run([sys.executable, "-c", _DISCOVER], cwd=REPO / "asv_bench", env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        found[hidden] = run.stdout.split()
    names = found[""]
    assert not [n for n in names if n.startswith("cuda.")], names
    assert "numpy_cpu.NumpyForward.time_anynorm" in names
    assert "torch_cpu.TorchCPUForward.time_anynorm" in names
    assert "torch_cpu.TorchCPUBackward.track_peer_ratio" in names
    driver = any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"))
    gpu_names = [n for n in found[None] if n.startswith("cuda.")]
    assert bool(gpu_names) == driver, gpu_names
    assert set(found[None]) - set(gpu_names) == set(names)


# --- 2 and the README --------------------------------------------------------------------------


def test_readme_install_names_every_extra():
    install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in PYPROJECT["project"]["optional-dependencies"]:
        assert f"[{extra}]" in install or f",{extra}" in install or f"{extra}," in install, extra
    assert 'pip install "anynorm[plot]"' in README or '".[plot]"' in install


def test_readme_test_command_is_what_ci_runs_with_time_and_quick_subset():
    ci = (REPO / ".ci" / "run").read_text()
    assert "python -m pytest -p no:cacheprovider" in ci
    commands = README.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "python -m pytest -p no:cacheprovider" in commands
    assert re.search(r"\d+ min", commands), "the README must say how long the suite takes"
    assert 'python -m pytest -m "not slow"' in commands
    markers = PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers)
    assert "-ra" not in PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"].split()


SLOW = {"test_kernels_compile.py", "test_kernels_emulated.py", "test_kernels_launch_emulated.py",
        "test_kernels_offset_emulated.py", "test_kernels_nan_emulated.py", "test_kernels_occupancy.py",
        "test_kernels_sass.py", "test_gpu_report_smoke.py", "test_tiles_accuracy.py",
        "test_tiles_proxies.py", "test_tiles_vectors.py"}


def test_slow_marker_covers_the_kernel_checks_without_a_gpu():
    """The quick subset (-m "not slow") leaves out the kernel checks without a GPU (NVRTC
    compile, CPU emulation) and the GPU report's smoke run, and only those files."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--co", "-q",
                          "-m", "slow", "tests"], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    files = {line.split("::")[0].rsplit("/", 1)[-1] for line in run.stdout.splitlines() if "::" in line}
    assert files, run.stdout + run.stderr
    assert files <= SLOW, files - SLOW
    assert {"test_kernels_emulated.py", "test_kernels_launch_emulated.py"} <= files


@pytest.mark.parametrize("name", ["set_backend", "get_backend", "use_backend"])
def test_backend_functions_are_documented_with_running_examples(name):
    obj = getattr(anynorm, name)
    doc = inspect.getdoc(obj) or ""
    assert "Example" in doc and ">>>" in doc and "reference" in doc, name
    if name != "get_backend":
        assert "ValueError" in doc.split("Raises:", 1)[-1], name
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(obj, name, globs={}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0, name
    assert anynorm.get_backend() == "auto"
