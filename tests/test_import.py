"""What ``import anynorm`` loads: no array library it does not need, and the torch custom
ops as soon as torch is there (CuPy importable), before any anynorm call."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_import_loads_no_torch_dask_or_cupy():
    out = _run("import sys, anynorm, numpy as np; anynorm.layer_norm(np.ones((2, 3)));"
               "print(sorted(m for m in ('torch', 'dask', 'cupy', 'jax') if m in sys.modules))")
    assert out == "[]"


def test_torch_ops_exist_right_after_import():
    pytest.importorskip("torch")
    pytest.importorskip("cupy", exc_type=ImportError)
    # torch first, then anynorm: registered at import
    assert _run("import torch, anynorm; print(torch.ops.anynorm.forward, torch.ops.anynorm.backward)") \
        == "anynorm.forward anynorm.backward"
    # anynorm first: registered by the first call on a tensor
    assert _run("import anynorm, torch; anynorm.layer_norm(torch.ones(2, 3));"
                "print(torch.ops.anynorm.forward)") == "anynorm.forward"
