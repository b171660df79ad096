"""``python -m anynorm [--plot FILE.png]``: show anynorm working on every installed library.

For each array library found it prints the executor that serves it, the largest error of
each operation against a float64 NumPy evaluation of the formula, and a quick timing of
layer norm next to ``torch.nn.functional.layer_norm`` and a naive NumPy version.
"""

from __future__ import annotations

import argparse
import importlib
import time

import numpy as np

import anynorm
from anynorm._backend import choose
from anynorm._plan import make_plan

SHAPE = (8, 32, 12, 10)  # N, C, H, W
GROUPS = 8


def _formula(x, reduce_axes, center=True, eps=1e-5):
    """Float64 statistics and output of the normalization formula (no weight)."""
    x = x.astype(np.float64)
    mean = x.mean(axis=reduce_axes, keepdims=True) if center else 0.0
    var = ((x - mean) ** 2).mean(axis=reduce_axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


def _expected(name, x):
    n, c = x.shape[:2]
    if name == "group_norm":
        grouped = x.reshape(n, GROUPS, -1)
        return _formula(grouped, (2,)).reshape(x.shape)
    if name == "instance_norm":
        return _formula(x, (2, 3))
    if name == "rms_norm":
        return _formula(x, (-1,), center=False, eps=float(np.finfo(x.dtype).eps))
    return _formula(x, (1,))  # layer norm over the channels (ConvNeXt channels-first)


CASES = {
    "layer_norm(axis=1)": ("layer_norm", lambda a, x: a.layer_norm(x, axis=1)),
    "rms_norm(axis=-1)": ("rms_norm", lambda a, x: a.rms_norm(x)),
    "instance_norm": ("instance_norm", lambda a, x: a.instance_norm(x)),
    f"group_norm({GROUPS})": ("group_norm", lambda a, x: a.group_norm(x, GROUPS)),
}


def _libraries():
    """(label, to_library, to_numpy) for every installed array library anynorm serves."""
    found = [("numpy", lambda a: a, np.asarray)]
    try:
        import torch
        found.append(("torch (cpu)", torch.from_numpy, lambda t: t.detach().numpy()))
        if torch.cuda.is_available():
            found.append(("torch (cuda)", lambda a: torch.from_numpy(a).cuda(), lambda t: t.detach().cpu().numpy()))
    except ImportError:
        pass
    for label, module in (("array-api-strict", "array_api_strict"), ("dask", "dask.array"), ("jax", "jax.numpy")):
        try:
            lib = importlib.import_module(module)
        except ImportError:
            continue
        found.append((label, lib.asarray, np.asarray))
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            found.append(("cupy", cupy.asarray, cupy.asnumpy))
    except Exception:  # CuPy missing, or no usable GPU/driver
        pass
    return found


def _time(fn, repeat=20):
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _naive_numpy_layer_norm(x, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


def report_parity(rng):
    x_np = rng.standard_normal(SHAPE).astype(np.float32) * 3 + 1
    for label, to_lib, to_np in _libraries():
        x = to_lib(x_np)
        executor = choose(make_plan("layer_norm", x, axis=-1), x).__name__.rsplit(".", 1)[-1].lstrip("_")
        errors = []
        for case, (name, call) in CASES.items():
            y = call(anynorm, x)
            errors.append(f"{case} {np.max(np.abs(to_np(y) - _expected(name, x_np))):.1e}")
        print(f"{label:<17} executor={executor:<10} max |error| vs float64: " + ", ".join(errors))


def report_speed(rng):
    x = rng.standard_normal((4096, 1024)).astype(np.float32)
    ours = _time(lambda: anynorm.layer_norm(x))
    naive = _time(lambda: _naive_numpy_layer_norm(x))
    line = (f"layer_norm float32 {x.shape}, time ours/peer: numpy {ours * 1e3:.2f} ms / "
            f"naive numpy {naive * 1e3:.2f} ms = {ours / naive:.2f}")
    try:
        import torch
        import torch.nn.functional as F
        t = torch.from_numpy(x)
        ours_t = _time(lambda: anynorm.layer_norm(t))
        peer = _time(lambda: F.layer_norm(t, (x.shape[-1],)))
        line += f"; torch {ours_t * 1e3:.2f} ms / F.layer_norm {peer * 1e3:.2f} ms = {ours_t / peer:.2f}"
    except ImportError:
        pass
    print(line)


def plot(path, rng):
    """Histograms of a batch before and after layer norm, as in the tutorials' figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = rng.gamma(2.0, 3.0, size=(4, 512)) + np.arange(4)[:, None] * 5
    y = anynorm.layer_norm(x)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for row in range(x.shape[0]):
        axes[0].hist(x[row], bins=40, alpha=0.5, label=f"sample {row}")
        axes[1].hist(y[row], bins=40, alpha=0.5, label=f"sample {row}")
    axes[0].set_title("before: each sample its own mean and scale")
    axes[1].set_title("after anynorm.layer_norm: mean 0, variance 1")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m anynorm", description=__doc__.splitlines()[0])
    parser.add_argument("--plot", metavar="FILE.png", help="draw histograms before/after layer norm")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"anynorm {anynorm.__version__}, backend={anynorm.get_backend()!r}, x: float32 {SHAPE}")
    report_parity(rng)
    report_speed(rng)
    if args.plot:
        plot(args.plot, rng)


if __name__ == "__main__":
    main()
