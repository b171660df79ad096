"""Dispatch: set_backend / use_backend / ANYNORM_BACKEND, "kernels" without a GPU, and how each
library's results come back (Dask lazy and chunked, JAX traceable)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import anynorm
import reference
from support import assert_close, dask_chunks, get_backend

ROOT = Path(__file__).resolve().parents[1]


def test_set_and_get_backend():
    for name in ("reference", "kernels", "auto"):
        anynorm.set_backend(name)
        assert anynorm.get_backend() == name


@pytest.mark.parametrize("bad", ["cuda", "", "Reference", None])
def test_unknown_backend_names_are_rejected(bad):
    with pytest.raises(ValueError, match=r"backend must be one of .*'auto'.*got"):
        anynorm.set_backend(bad)
    with pytest.raises(ValueError, match="backend"):
        with anynorm.use_backend(bad):
            pass
    assert anynorm.get_backend() == "auto"


def test_use_backend_nests_and_restores():
    anynorm.set_backend("auto")
    with anynorm.use_backend("reference"):
        assert anynorm.get_backend() == "reference"
        with anynorm.use_backend("kernels"):
            assert anynorm.get_backend() == "kernels"
        assert anynorm.get_backend() == "reference"
    assert anynorm.get_backend() == "auto"
    with pytest.raises(RuntimeError):
        with anynorm.use_backend("reference"):
            raise RuntimeError
    assert anynorm.get_backend() == "auto"


def test_use_backend_is_local_to_its_context():
    """Another thread keeps the process-wide setting while this one is inside use_backend."""
    seen = []
    with anynorm.use_backend("reference"):
        thread = threading.Thread(target=lambda: seen.append(anynorm.get_backend()))
        thread.start()
        thread.join()
    assert seen == ["auto"]


def test_kernels_on_a_cpu_input_raises(backend):
    if backend.name in ("cupy", "torch-cuda"):
        pytest.skip("the kernels take these inputs")
    x = backend.asarray(np.ones((2, 3)), "float32")
    with anynorm.use_backend("kernels"), pytest.raises(ValueError, match="kernels"):
        anynorm.layer_norm(x)
    anynorm.set_backend("kernels")
    with pytest.raises(ValueError, match="kernels"):
        anynorm.group_norm_backward(x, x, 3)


def test_reference_backend_gives_a_differentiable_torch_graph():
    """Under "reference" torch runs the array-API core (no fused native op) and autograd still works."""
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    with anynorm.use_backend("reference"):
        y = anynorm.layer_norm(x)
    assert "Native" not in type(y.grad_fn).__name__
    y.sum().backward()
    assert torch.allclose(x.grad, torch.zeros_like(x), atol=1e-12)  # sum of a normalized row is constant


def _run_python(code, **env):
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value, expected", [("reference", "reference"), (" Kernels ", "kernels")])
def test_environment_variable_chooses_the_start_up_backend(value, expected):
    code = ("import anynorm, numpy as np\n"
            "print(anynorm.get_backend())\n"
            "try:\n    anynorm.layer_norm(np.ones((2, 3)))\n    print('ran')\n"
            "except ValueError as e:\n    print('ValueError', e)\n")
    result = _run_python(code, ANYNORM_BACKEND=value)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == expected
    assert lines[1] == "ran" if expected != "kernels" else lines[1].startswith("ValueError")


def test_environment_variable_rejects_unknown_names():
    result = _run_python("import anynorm", ANYNORM_BACKEND="gpu")
    assert result.returncode != 0
    assert "ValueError" in result.stderr and "ANYNORM_BACKEND" in result.stderr and "'gpu'" in result.stderr


# --- Dask stays lazy and chunked -------------------------------------------------------------

def test_dask_result_is_lazy_and_keeps_its_chunks():
    """Nothing is computed at call time; a normalized axis spanning several chunks is handled."""
    da = pytest.importorskip("dask.array")
    computed = []

    def counting(block):
        computed.append(block.shape)
        return block

    x64 = np.random.default_rng(9).standard_normal((6, 8, 10))
    x = da.from_array(x64, chunks=dask_chunks(x64.shape)).map_blocks(counting, dtype=x64.dtype, meta=np.empty((0,) * 3))
    y, mean, rstd = anynorm.layer_norm(x, axis=(1, 2), return_stats=True)
    dx = anynorm.layer_norm_backward(y, x, axis=(1, 2))[0]
    assert computed == []
    assert all(isinstance(a, da.Array) for a in (y, mean, rstd, dx))
    assert y.chunks == x.chunks and dx.chunks == x.chunks
    assert_close(y.compute(), reference.forward("layer_norm", x64, axis=(1, 2))[0], "float64")
    assert computed  # computing it ran the graph


# --- JAX: traceable ---------------------------------------------------------------------------

@pytest.mark.parametrize("op, kw", [("layer_norm", {"axis": (0, 2)}), ("rms_norm", {}),
                                    ("group_norm", {"num_groups": 2}), ("instance_norm", {"channel_axis": -1})])
def test_jax_jit_and_grad(op, kw):
    jax = pytest.importorskip("jax")
    jb = get_backend("jax")
    x64 = np.random.default_rng(10).standard_normal((2, 4, 6))
    dy64 = np.random.default_rng(11).standard_normal((2, 4, 6))
    fn = getattr(anynorm, op)
    f = (lambda x: fn(x, kw["num_groups"])) if op == "group_norm" else (lambda x: fn(x, **kw))
    y = jax.jit(f)(jb.asarray(x64))
    eps = 2.0**-52 if op == "rms_norm" else 1e-5
    assert_close(jb.to_numpy(y), reference.forward(op, x64, eps=eps, **kw)[0], "float64")
    grad = jax.grad(lambda x: (f(x) * jb.asarray(dy64)).sum())(jb.asarray(x64))
    assert_close(jb.to_numpy(grad), reference.backward(op, dy64, x64, eps=eps, **kw)[0], "float64", scale=10)


@pytest.mark.parametrize("op, kw", [("layer_norm", {"axis": (0, 2)}), ("rms_norm", {}),
                                    ("group_norm", {"num_groups": 2}), ("instance_norm", {"channel_axis": -1})])
def test_jax_jit_and_grad_with_parameters(op, kw):
    """Weights closed over (concrete) or traced, gradients to the parameters with concrete
    data (JAX's training pattern): a tracer's device is unknown while tracing, which must
    not read as a device mismatch."""
    jax = pytest.importorskip("jax")
    jb = get_backend("jax")
    rng = np.random.default_rng(12)
    x64, dy64 = rng.standard_normal((2, 4, 6)), rng.standard_normal((2, 4, 6))
    pshape = {"layer_norm": (2, 6), "rms_norm": (6,), "group_norm": (4,), "instance_norm": (6,)}[op]
    w64, b64 = rng.random(pshape) + 0.5, rng.random(pshape) - 0.5
    fn = getattr(anynorm, op)
    args = (kw["num_groups"],) if op == "group_norm" else ()
    kwargs = {k: v for k, v in kw.items() if k != "num_groups"}
    eps = 2.0**-52 if op == "rms_norm" else 1e-5

    def f(x, w, b):
        return fn(x, *args, w, **kwargs) if op == "rms_norm" else fn(x, *args, w, b, **kwargs)

    x, w, b, dy = (jb.asarray(a) for a in (x64, w64, b64, dy64))
    ref_kw = dict(kw, eps=eps)
    bias = None if op == "rms_norm" else b64
    y_ref = reference.forward(op, x64, w64, bias, **ref_kw)[0]
    assert_close(jb.to_numpy(jax.jit(lambda x: f(x, w, b))(x)), y_ref, "float64")
    assert_close(jb.to_numpy(jax.jit(f)(x, w, b)), y_ref, "float64")
    grads_ref = reference.backward(op, dy64, x64, w64, **ref_kw)
    dw = jax.jit(jax.grad(lambda w: (f(x, w, b) * dy).sum()))(w)
    assert_close(jb.to_numpy(dw), grads_ref[1], "float64", scale=10)
    dx = jax.grad(lambda x: (f(x, w, b) * dy).sum())(x)
    assert_close(jb.to_numpy(dx), grads_ref[0], "float64", scale=10)


def test_calls_with_the_same_arguments_share_one_plan():
    """Planning runs once per distinct call (per-call overhead is what a GPU launch waits on);
    the arrays are still checked every time."""
    from anynorm._plan import make_plan

    x = np.ones((3, 5), np.float32)
    first = make_plan("layer_norm", x, np.ones(5, np.float32), axis=-1)
    assert make_plan("layer_norm", x.copy(), np.zeros(5, np.float32), axis=-1) is first
    assert make_plan("layer_norm", x, axis=-1) is not first  # no weight: another plan
    with pytest.raises(TypeError, match="weight"):
        make_plan("layer_norm", x, np.ones(5, np.int32), axis=-1)
