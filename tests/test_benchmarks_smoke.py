"""Every asv benchmark body runs once on tiny shapes, so none rots between benchmark runs.

The modules under ``asv_bench/benchmarks`` read ``ANYNORM_BENCH_TINY`` when imported; each
benchmark class is set up for every parameter combination and each ``time_``/``peakmem_``/
``track_`` method called once.  Setups that raise NotImplementedError (asv's skip: no GPU,
no torch) are skipped here too.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
import os
import pathlib
import sys

import pytest

BENCH_ROOT = pathlib.Path(__file__).resolve().parent.parent / "asv_bench"
PREFIXES = ("time_", "peakmem_", "track_", "mem_")


def _modules():
    """Import every benchmark module with tiny shapes (they read the variable on import)."""
    before = os.environ.get("ANYNORM_BENCH_TINY")
    os.environ["ANYNORM_BENCH_TINY"] = "1"
    sys.path.insert(0, str(BENCH_ROOT))
    try:
        names = sorted(p.stem for p in (BENCH_ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")
        return [importlib.import_module(f"benchmarks.{name}") for name in names]
    finally:
        sys.path.remove(str(BENCH_ROOT))
        if before is None:
            del os.environ["ANYNORM_BENCH_TINY"]
        else:
            os.environ["ANYNORM_BENCH_TINY"] = before


def _benchmark_classes():
    for module in _modules():
        for name, cls in vars(module).items():
            if (inspect.isclass(cls) and not name.startswith("_") and cls.__module__ == module.__name__
                    and any(attr.startswith(PREFIXES) for attr in dir(cls))):
                yield pytest.param(cls, id=f"{module.__name__.rsplit('.', 1)[-1]}.{name}")


@pytest.mark.parametrize("cls", list(_benchmark_classes()))
def test_every_benchmark_body_runs(cls):
    from benchmarks import common

    assert common.TINY, "benchmarks must have been imported with ANYNORM_BENCH_TINY=1"
    params = getattr(cls, "params", [])
    if params and not isinstance(params[0], (list, tuple)):
        params = [params]
    methods = [m for m in dir(cls) if m.startswith(PREFIXES)]
    ran = skipped = 0
    for combo in itertools.product(*params):
        bench = cls()
        try:
            if hasattr(bench, "setup"):
                bench.setup(*combo)
        except NotImplementedError:
            skipped += 1
            if hasattr(bench, "teardown"):  # asv tears down after a skipped setup too
                bench.teardown(*combo)
            continue
        try:
            for name in methods:
                result = getattr(bench, name)(*combo)
                if name.startswith("track_"):
                    assert isinstance(result, (int, float)) and math.isfinite(result), (name, combo, result)
        finally:
            if hasattr(bench, "teardown"):
                bench.teardown(*combo)
        ran += 1
    if not ran:
        pytest.skip(f"every setup of {cls.__name__} skipped (no GPU or library)")
    assert ran + skipped == math.prod(len(p) for p in params)
