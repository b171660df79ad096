"""Every kernel instantiation compiles with NVRTC, with the options CuPy's RawModule uses.

Needs no GPU: NVRTC is a host library. It needs CuPy, NVRTC and the CUDA headers
(cuda_fp16.h, cuda_bf16.h); from pip: ``cupy-cuda13x nvidia-cuda-nvrtc nvidia-cuda-runtime``
(the last one ships the headers into ``site-packages/nvidia/cu13/include``, where CuPy
looks). Skips only when CuPy or NVRTC cannot be loaded at all.
"""

from __future__ import annotations

import pathlib
import re

import pytest

cupy = pytest.importorskip("cupy", exc_type=ImportError)
try:
    from anynorm._cuda import _compile
except ImportError as exc:  # CuPy present but unusable
    pytest.skip(f"anynorm._cuda cannot be imported: {exc}", allow_module_level=True)
try:
    NVRTC_VERSION = cupy.cuda.nvrtc.getVersion()
except Exception as exc:  # libnvrtc missing
    pytest.skip(f"NVRTC cannot be loaded: {exc}", allow_module_level=True)

from cupy.cuda.compiler import CompileException  # noqa: E402

ARCHES = ("80", "90")
LAUNCH_SOURCE = pathlib.Path(_compile.__file__).with_name("_launch.py").read_text()


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dtype", sorted(_compile.CTYPES))
@pytest.mark.parametrize("file", sorted(_compile.KERNELS))
def test_compiles_without_warnings(file, dtype, arch):
    try:
        log = _compile.nvrtc_check(file, dtype, arch)
    except CompileException as exc:
        hint = ""
        if "cannot open source file" in str(exc):
            hint = ("\nNVRTC found no CUDA headers: install nvidia-cuda-runtime (pip) or a CUDA "
                    "toolkit where CuPy looks for it")
        pytest.fail(f"{file} for {dtype} on sm_{arch} does not compile:\n{exc}{hint}")
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    assert not warnings, f"{file} for {dtype} on sm_{arch}:\n{log}"


def test_instantiation_list_is_complete():
    """Every kernel the launcher names, at every ITEMS it may pick, is in the compiled list."""
    listed = {expr for _, _, expr in _compile.instantiations()}
    launched = set(re.findall(r'_launch\(\s*"(\w+)"', LAUNCH_SOURCE))
    assert launched == {k for kernels in _compile.KERNELS.values() for k in kernels}
    for kernel in launched:
        for dtype in _compile.CTYPES:
            if kernel in ("rows_fwd_warp", "rows_bwd_warp"):
                exprs = [_compile.name_expression(kernel, dtype, k) for k in _compile.WARP_ITEMS]
            else:
                exprs = [_compile.name_expression(kernel, dtype)]
            assert set(exprs) <= listed
    assert len(listed) == 92


def test_every_kernel_is_defined_in_its_file():
    from anynorm._cuda._sources import read_source

    for file, kernels in _compile.KERNELS.items():
        text = read_source(file)
        for kernel in kernels:
            assert re.search(rf"__global__\s+void\s+{kernel}\s*\(", text), (file, kernel)
