"""Shared fixtures: the array backends, a clean anynorm backend setting, hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import anynorm
from support import BACKEND_DTYPES, BACKEND_NAMES, CASES, SLOW_BACKENDS, get_backend

# "ci" (the default): reproducible and quick.  "thorough": for a long local run.
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", params=BACKEND_NAMES)
def backend(request):
    """Each array library under test: numpy, numpy-readonly (write-protected inputs), torch,
    torch-autograd (float inputs require grad), array-api-strict, dask (two chunks per axis),
    jax (x64 on), cupy and torch-cuda; skipped when not installed or, for the last two, no GPU."""
    return get_backend(request.param)


@pytest.fixture(autouse=True)
def _restore_backend():
    """A test that calls ``set_backend`` leaves the setting as it found it."""
    before = anynorm.get_backend()
    yield
    anynorm.set_backend(before)


# The tests marked ``slow``: most of the suite's time on a CPU-only machine, spent checking the
# CUDA kernels and the GPU tools without a GPU, which matters to whoever edits kernels/*.cu.  ``python -m pytest
# -m "not slow"`` leaves them out (the quick subset the README gives); CI and a plain
# ``python -m pytest`` run everything.
SLOW_FILES = {
    # every kernel instantiation through NVRTC (with CuPy installed), in worker processes
    "test_kernels_compile.py",
    # the CUDA kernels run on the CPU under tests/emulation/ (a host compiler build per
    # variant, a thread per CUDA thread)
    "test_kernels_emulated.py",
    "test_kernels_launch_emulated.py",
    # the row kernels far from zero and with NaN/Inf on the emulator; their ptxas occupancy
    # and SASS through nvcc
    "test_kernels_offset_emulated.py",
    "test_kernels_nan_emulated.py",
    "test_kernels_occupancy.py",
    "test_kernels_sass.py",
    # the columns kernels far from zero on the emulator; their ptxas/SASS proxies through NVRTC
    "test_tiles_accuracy.py",
    "test_tiles_proxies.py",
    "test_tiles_vectors.py",  # the tile kernels' vector widths on the emulator
    # asv_bench/gpu_report.py, a tool for GPU machines, run end to end on the CPU
    "test_gpu_report_smoke.py",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "matrix: a backend x case x dtype matrix, thinned on slow backends")


def pytest_collection_modifyitems(config, items):
    """Mark the tests of SLOW_FILES ``slow``.  Drop (backend, dtype) pairs the library cannot
    hold; on Dask and JAX keep a matrix test's float32 column whole and a third of the cases in
    the other dtypes (each call there compiles)."""
    slow = pytest.mark.slow
    keep, drop = [], []
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(slow)
        params = getattr(getattr(item, "callspec", None), "params", {})
        name, dtype = params.get("backend"), params.get("dtype")
        unsupported = name in BACKEND_DTYPES and dtype is not None and dtype not in BACKEND_DTYPES[name]
        thinned = (item.get_closest_marker("matrix") is not None and name in SLOW_BACKENDS
                   and dtype != "float32" and params.get("c") in CASES and CASES.index(params["c"]) % 3)
        (drop if unsupported or thinned else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
