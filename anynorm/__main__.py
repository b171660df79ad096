"""``python -m anynorm [--plot FILE.png]``: show anynorm working on every installed library.

For each array library found it prints the executor that serves it and the largest error of
each operation against a float64 NumPy evaluation of the formula; it says which libraries are
missing or unusable (CuPy without a GPU, say); then it times layer norm next to a naive NumPy
version and ``torch.nn.functional.layer_norm`` in interleaved rounds and prints the median
time ratio with its spread.  ``--plot FILE.png`` (needs matplotlib: ``pip install
"anynorm[plot]"``) draws a batch's histograms before and after layer norm.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

import numpy as np

import anynorm
from anynorm._backend import choose
from anynorm._plan import make_plan

SHAPE = (8, 32, 12, 10)  # N, C, H, W
GROUPS = 8
ROUNDS = 15  # interleaved timing rounds
PLOT_INSTALL = 'pip install "anynorm[plot]"'


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

# library label -> the extra that installs it
EXTRAS = {"torch": "torch", "dask": "dask", "jax": "jax", "cupy": "cupy", "array-api-strict": "test"}


def _nvidia_driver_visible():
    """False where no NVIDIA driver is visible (Linux only; elsewhere assume there is one)."""
    if not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"))


def _libraries():
    """``(found, absent)``: ``found`` is ``(label, to_library, to_numpy)`` for every installed
    array library anynorm serves; ``absent`` is ``(label, why)`` for those that are missing or
    installed but unusable (CuPy without a GPU or with too old a driver)."""
    found, absent = [("numpy", lambda a: a, np.asarray)], []
    try:
        import torch
        found.append(("torch (cpu)", torch.from_numpy, lambda t: t.detach().numpy()))
        if torch.cuda.is_available():
            found.append(("torch (cuda)", lambda a: torch.from_numpy(a).cuda(), lambda t: t.detach().cpu().numpy()))
    except ImportError:
        absent.append(("torch", "not installed"))
    for label, module in (("array-api-strict", "array_api_strict"), ("dask", "dask.array"), ("jax", "jax.numpy")):
        try:
            lib = importlib.import_module(module)
        except ImportError:
            absent.append((label, "not installed"))
            continue
        found.append((label, lib.asarray, np.asarray))
    try:
        import cupy
    except ImportError:
        absent.append(("cupy", "not installed (anynorm's CUDA kernels run through it)"))
    else:
        try:
            count = cupy.cuda.runtime.getDeviceCount()
            why = None if count > 0 else "no CUDA GPU found"
        except Exception as exc:  # no driver, driver too old for this CuPy's CUDA, ...
            why = f"{type(exc).__name__}: {exc}".strip()
            if not _nvidia_driver_visible():
                why = f"no NVIDIA GPU driver found; CUDA says {why}"
        if why is None:
            found.append(("cupy", cupy.asarray, cupy.asnumpy))
        else:
            absent.append(("cupy", f"installed but unusable here ({why}); the CUDA kernels need "
                                   "an NVIDIA GPU and a driver as new as CuPy's CUDA"))
    return found, absent


def _naive_numpy_layer_norm(x, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps)


def cpu_kernels():
    """What became of the compiled CPU kernels: loaded from where, or why not (the NumPy
    executor then runs its NumPy passes)."""
    from anynorm import _native

    _native.rows_kernel(np.float32)  # builds or loads them on first use
    if _native.status.startswith("loaded"):
        return _native.status
    return f"not used ({_native.status}); NumPy arrays take the slower NumPy passes"


def report_parity(rng):
    x_np = rng.standard_normal(SHAPE).astype(np.float32) * 3 + 1
    found, absent = _libraries()
    for label, to_lib, to_np in found:
        x = to_lib(x_np)
        executor = choose(make_plan("layer_norm", x, axis=-1), x).__name__.rsplit(".", 1)[-1].lstrip("_")
        errors = []
        for case, (name, call) in CASES.items():
            y = call(anynorm, x)
            errors.append(f"{case} {np.max(np.abs(to_np(y) - _expected(name, x_np))):.1e}")
        print(f"{label:<17} executor={executor:<10} max |error| vs float64: " + ", ".join(errors))
    for label, why in absent:
        extra = EXTRAS.get(label)
        hint = f' (pip install "anynorm[{extra}]")' if extra and why.startswith("not installed") else ""
        print(f"{label:<17} skipped: {why}{hint}")


def interleaved_times(fns, rounds=ROUNDS):
    """Wall times of each function in ``fns`` (name -> callable), one call of each per round,
    the order rotating every round, so that a busy machine slows all of them alike.  Returns
    name -> list of ``rounds`` times in seconds (after one warm-up call each)."""
    names = list(fns)
    for name in names:
        fns[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratio_summary(ours, peer):
    """``(median ours, median peer, median ratio, lowest ratio, highest ratio)`` of two lists of
    times taken in the same rounds; the ratio of each round is ours/peer."""
    ratios = [a / b for a, b in zip(ours, peer)]
    return (statistics.median(ours), statistics.median(peer), statistics.median(ratios),
            min(ratios), max(ratios))


def report_speed(rng, rounds=ROUNDS):
    x = rng.standard_normal((4096, 1024)).astype(np.float32)
    groups = [{"ours numpy": lambda: anynorm.layer_norm(x),
               "naive numpy": lambda: _naive_numpy_layer_norm(x)}]
    pairs = [("numpy", "ours numpy", "naive numpy")]
    try:
        import torch
        import torch.nn.functional as F
        t = torch.from_numpy(x)
        groups.append({"ours torch": lambda: anynorm.layer_norm(t),
                       "F.layer_norm": lambda: F.layer_norm(t, (x.shape[-1],))})
        pairs.append(("torch", "ours torch", "F.layer_norm"))
    except ImportError:
        pass
    # each library's pair timed on its own: OpenBLAS's threads keep spinning for a while after
    # a NumPy BLAS call and would slow whichever torch call came next (up to 2.5x seen)
    times = {}
    for fns in groups:
        times.update(interleaved_times(fns, rounds))
    print(f"layer_norm float32 {x.shape}, {rounds} interleaved rounds; time ours / peer as the "
          f"median, and the lowest-highest ratio of one round:")
    wide = False
    for label, ours, peer in pairs:
        t_ours, t_peer, ratio, lo, hi = ratio_summary(times[ours], times[peer])
        wide |= hi > 1.5 * lo
        print(f"  {label:<6} anynorm {t_ours * 1e3:6.2f} ms / {peer} {t_peer * 1e3:6.2f} ms = "
              f"{ratio:.2f}  (rounds: {lo:.2f}-{hi:.2f})")
    if wide:
        print("  (the rounds disagree by more than 1.5x: the machine is busy; trust the median)")


def _plot_check(path):
    """Before any work: matplotlib importable and the output directory there, else the message."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return (f"python -m anynorm: --plot needs matplotlib, which cannot be imported here ({exc}).\n"
                f"Install it with:  {PLOT_INSTALL}\n"
                f"(from a source checkout: pip install \".[plot]\"; or just: pip install matplotlib)\n")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"python -m anynorm: --plot {path}: the folder {folder} does not exist\n"
    return None


def plot(path, rng):
    """Histograms of a batch before and after layer norm, as in the tutorials' figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = rng.gamma(2.0, 3.0, size=(4, 512)) + np.arange(4)[:, None] * 5
    y = anynorm.layer_norm(x)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, data in ((axes[0], x), (axes[1], y)):
        bins = np.linspace(data.min(), data.max(), 41)  # one set of bins per panel
        for row in range(data.shape[0]):
            color = colors[row % len(colors)]
            ax.hist(data[row], bins=bins, histtype="stepfilled", alpha=0.15, color=color)
            ax.hist(data[row], bins=bins, histtype="step", linewidth=1.6, color=color,
                    label=f"sample {row}: mean {round(data[row].mean(), 2) + 0.0:.2f}, "
                          f"std {data[row].std():.2f}")
        ax.set_ylabel("count (of 512 values per sample)")
        ax.legend(fontsize=8)
    axes[0].set_xlabel("value x")
    axes[1].set_xlabel("normalized value y = (x - mean) / sqrt(var + eps)")
    axes[0].set_title("before: each sample its own mean and scale")
    axes[1].set_title("after anynorm.layer_norm (axis=-1): the samples coincide")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m anynorm",
        description="Show anynorm working on every installed array library: the executor that serves "
                    "it, the largest error against float64, and a timing against NumPy and torch.")
    parser.add_argument("--plot", metavar="FILE.png",
                        help=f"draw histograms before/after layer norm (needs matplotlib: {PLOT_INSTALL})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"timing rounds (default {ROUNDS})")
    args = parser.parse_args(argv)
    if args.plot:
        problem = _plot_check(args.plot)
        if problem:
            parser.exit(2, problem)
    rng = np.random.default_rng(0)
    print(f"anynorm {anynorm.__version__}, backend={anynorm.get_backend()!r}, x: float32 {SHAPE}")
    print(f"CPU kernels (kernels/cpu.cpp): {cpu_kernels()}")
    report_parity(rng)
    report_speed(rng, max(1, args.rounds))
    if args.plot:
        plot(args.plot, rng)


if __name__ == "__main__":
    main()
