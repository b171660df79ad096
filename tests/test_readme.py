"""The README's Python examples run as written (the CuPy one needs a GPU)."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples_for_numpy_torch_cupy():
    """The API tour's first three blocks: NumPy, torch, CuPy (later sections may add more)."""
    assert len(BLOCKS) >= 3
    assert [("numpy" in b, "torch" in b, "cupy" in b) for b in BLOCKS[:3]] == [
        (True, False, False), (False, True, False), (False, False, True)]


@pytest.mark.parametrize("index", [0, 1], ids=["numpy", "torch"])
def test_readme_example_runs(index):
    if index == 1:
        pytest.importorskip("torch")
    namespace = {}
    exec(compile(BLOCKS[index], f"README block {index}", "exec"), namespace)
    assert "y" in namespace


@pytest.mark.gpu
def test_readme_cupy_example_runs():
    cupy = pytest.importorskip("cupy")
    try:
        has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        has_gpu = False
    if not has_gpu:
        pytest.skip("no CUDA GPU")
    namespace = {}
    exec(compile(BLOCKS[2], "README block 2", "exec"), namespace)
    assert namespace["y"].dtype == cupy.float16 and namespace["mean"].dtype == cupy.float32
