"""GPU suite fixtures: every test here is marked ``gpu`` and skips cleanly without a CUDA GPU."""

from __future__ import annotations

import functools
import pathlib

import pytest

HERE = pathlib.Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def gpu_problem():
    """Why the CUDA kernels cannot run here, or None."""
    try:
        import cupy
    except Exception as exc:
        return f"CuPy is not usable: {exc}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as exc:
        return f"no usable CUDA device: {exc}"
    try:
        import anynorm._cuda._executor  # noqa: F401
    except ImportError as exc:
        return f"anynorm._cuda._executor cannot be imported: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_problem()
    for item in items:
        if HERE in pathlib.Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {reason}"))


@pytest.fixture
def cp():
    import cupy

    return cupy
