"""Dask: normalization over axes that span chunks runs in memory bounded by a few chunks.

The source arrays here are generated chunk by chunk (``da.map_blocks`` of a deterministic
function of the element index), and every generated chunk is counted while it is alive
(``weakref.finalize``): the hold-everything graph keeps all of them alive at once, the
two-pass graph a few, and it generates each chunk twice (the apply pass re-reads the source).
Results are compared with the in-memory NumPy path.  Distributed tests start their own
in-process LocalCluster and close it.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np
import pytest

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

import anynorm  # noqa: E402
from anynorm import _dask  # noqa: E402


class _Live:
    """Counts the generated chunks alive now, the most alive at once, and how many were made."""

    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        with self.lock:
            self.alive = self.peak = self.made = 0

    def add(self, arr):
        with self.lock:
            self.alive += 1
            self.made += 1
            self.peak = max(self.peak, self.alive)
        weakref.finalize(arr, self._gone)

    def _gone(self):
        with self.lock:
            self.alive -= 1


LIVE = _Live()  # module level: tasks that travel through pickle find the same counter
OFFSET = {"value": 0.0}


def _generate(seed, offset, dtype, delay=0.0, block_info=None):
    """A deterministic chunk: smooth in the index, different scale per trailing position;
    ``delay`` seconds to make it, as a read from storage takes."""
    if delay:
        time.sleep(delay)
    info = block_info[None]
    grids = np.meshgrid(*[np.arange(lo, hi, dtype=np.float64) for lo, hi in info["array-location"]],
                        indexing="ij")
    phase = sum(g * (0.37 + 0.61 * i + seed) for i, g in enumerate(grids))
    scale = 1.0 + (grids[-1] % 3)
    out = (np.sin(phase) * scale + 0.25 * np.cos(3.1 * phase) + offset).astype(dtype)
    LIVE.add(out)
    return out


def generated(shape, chunks, dtype=np.float32, seed=0.0, offset=0.0, delay=0.0):
    """A lazy Dask array made chunk by chunk, counted by ``LIVE``."""
    proto = da.empty(shape, chunks=chunks, dtype=dtype)
    return da.map_blocks(_generate, seed, offset, np.dtype(dtype), delay, chunks=proto.chunks,
                         dtype=dtype, meta=np.empty((0,) * len(shape), dtype))


def materialize(arr):
    """The generated data as NumPy, without touching the counter's peak."""
    out = np.asarray(arr.compute(scheduler="sync"))
    LIVE.reset()
    return out


def _close(ours, theirs, tol):
    ours = np.asarray(ours, dtype=np.float64)
    theirs = np.asarray(theirs, dtype=np.float64)
    assert ours.shape == theirs.shape
    scale = max(1.0, float(np.max(np.abs(theirs))))
    err = float(np.max(np.abs(ours - theirs))) / scale
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


# (name, shape, chunks, forward call, backward call, parameter shape); every case's normalized
# axes span several chunks of `chunks`
CASES = {
    "layer_axis0": ((2048, 24), (128, 24), lambda x, w, b, **k: anynorm.layer_norm(x, w, b, axis=0, **k),
                    lambda dy, x, w, **k: anynorm.layer_norm_backward(dy, x, w, axis=0, **k), (2048,)),
    "layer_2axes": ((16, 256, 6), (4, 32, 6), lambda x, w, b, **k: anynorm.layer_norm(x, w, b, axis=(0, 1), **k),
                    lambda dy, x, w, **k: anynorm.layer_norm_backward(dy, x, w, axis=(0, 1), **k), (16, 256)),
    "rms_axis0": ((2048, 24), (128, 12), lambda x, w, b, **k: anynorm.rms_norm(x, w, axis=0, **k),
                  lambda dy, x, w, **k: anynorm.rms_norm_backward(dy, x, w, axis=0, **k), (2048,)),
    "instance": ((3, 4, 64, 32), (2, 2, 8, 32), lambda x, w, b, **k: anynorm.instance_norm(x, w, b, **k),
                 lambda dy, x, w, **k: anynorm.instance_norm_backward(dy, x, w, **k), (4,)),
    # channels cut 5 + 1: groups of 2 straddle the chunk boundary
    "group_nhwc": ((2, 64, 32, 6), (1, 8, 16, 5),
                   lambda x, w, b, **k: anynorm.group_norm(x, 3, w, b, channel_axis=-1, **k),
                   lambda dy, x, w, **k: anynorm.group_norm_backward(dy, x, 3, w, channel_axis=-1, **k), (6,)),
}
BOUND = 4  # generated chunks alive at once, on 2 threads


def _params(name, dtype=np.float32, pshape=None):
    pshape = pshape or CASES[name][4]
    rng = np.random.default_rng(1)
    w = rng.uniform(0.5, 1.5, pshape).astype(dtype)
    b = rng.standard_normal(pshape).astype(dtype)
    return w, b


def _has_bias(name):
    return not name.startswith("rms")


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_keeps_few_chunks_alive_and_matches_memory(name):
    shape, chunks, fwd, _, _ = CASES[name]
    x = generated(shape, chunks, offset=3.0)
    nchunks = x.npartitions
    xn = materialize(x)
    w, b = _params(name)
    bb = b if _has_bias(name) else None
    out = fwd(x, da.from_array(w), None if bb is None else da.from_array(bb), return_stats=True)
    assert LIVE.made == 0, "the call computed something: the result must stay lazy"
    with dask.config.set(scheduler="threads", num_workers=2):
        got = dask.compute(da.sum(out[0] * out[0]), *out[1:], out[0][tuple(slice(0, 2) for _ in shape)])
    assert LIVE.peak <= BOUND, f"{LIVE.peak} of {nchunks} source chunks alive at once"
    assert LIVE.made == 2 * nchunks, "the apply pass must read every source chunk again"
    ref = fwd(xn, w, bb, return_stats=True)
    _close(got[0], np.sum(ref[0].astype(np.float64) ** 2), 1e-5)
    for g, r in zip(got[1:-1], ref[1:]):
        assert g.dtype == r.dtype and g.shape == r.shape
        _close(g, r, 2e-6)
    _close(got[-1], ref[0][tuple(slice(0, 2) for _ in shape)], 2e-6)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("with_stats", [False, True], ids=["recompute", "stats"])
def test_backward_keeps_few_chunks_alive_and_matches_memory(name, with_stats):
    shape, chunks, fwd, bwd, _ = CASES[name]
    x = generated(shape, chunks, offset=-2.0)
    dy = generated(shape, chunks, seed=0.3)
    xn, dyn = materialize(x), materialize(dy)
    w, b = _params(name)
    ref_stats = fwd(xn, w, b if _has_bias(name) else None, return_stats=True)[1:]
    kw = {"stats": tuple(da.from_array(s) for s in ref_stats)} if with_stats else {}
    out = bwd(dy, x, da.from_array(w), **kw)
    assert LIVE.made == 0
    with dask.config.set(scheduler="threads", num_workers=2):
        got = dask.compute(da.sum(out[0] * out[0]), out[0][tuple(slice(0, 2) for _ in shape)], *out[1:])
    # two sources (x, dy), each read twice
    assert LIVE.peak <= 2 * BOUND, f"{LIVE.peak} of {2 * x.npartitions} source chunks alive at once"
    assert LIVE.made == 4 * x.npartitions
    ref = bwd(dyn, xn, w, **({"stats": ref_stats} if with_stats else {}))
    _close(got[0], np.sum(ref[0].astype(np.float64) ** 2), 1e-5)
    _close(got[1], ref[0][tuple(slice(0, 2) for _ in shape)], 2e-6)
    for g, r in zip(got[2:], ref[1:]):
        assert g.dtype == r.dtype and g.shape == r.shape
        _close(g, r, 1e-5)


def test_hold_everything_graph_fails_the_bound():
    """The array-API core on the same Dask array keeps every chunk alive: the check can fail."""
    shape, chunks, fwd, _, _ = CASES["layer_axis0"]
    x = generated(shape, chunks)
    with anynorm.use_backend("reference"):
        y = fwd(x, None, None)
    with dask.config.set(scheduler="threads", num_workers=2):
        da.sum(y).compute()
    assert LIVE.peak == x.npartitions > BOUND


@pytest.mark.parametrize("name", ["layer_axis0", "rms_axis0"])
def test_residual_streams_and_returns_h(name):
    shape, chunks, fwd, _, _ = CASES[name]
    x = generated(shape, chunks, offset=1.0)
    r = generated(shape, chunks, seed=0.7)
    xn, rn = materialize(x), materialize(r)
    w, b = _params(name)
    bb = b if _has_bias(name) else None
    y, h, *stats = fwd(x, da.from_array(w), None if bb is None else da.from_array(bb),
                       residual=r, return_stats=True)
    with dask.config.set(scheduler="threads", num_workers=2):
        got = dask.compute(da.sum(y * y), da.sum(h), y[:3], h[:3], *stats)
    assert LIVE.peak <= 2 * BOUND
    ry, rh, *rstats = fwd(xn, w, bb, residual=rn, return_stats=True)
    _close(got[0], np.sum(ry.astype(np.float64) ** 2), 1e-5)
    _close(got[1], np.sum(rh.astype(np.float64)), 1e-5)
    _close(got[2], ry[:3], 2e-6)
    np.testing.assert_array_equal(got[3], rh[:3])
    for g, rr in zip(got[4:], rstats):
        _close(g, rr, 2e-6)


@pytest.mark.parametrize("op", ["layer", "rms", "instance", "group"])
def test_axes_inside_chunks_take_one_blockwise_pass(op):
    """Normalized axes inside single chunks: each source chunk is made once (no second pass)."""
    x = generated((64, 6, 40), (8, 6, 40))
    xn = materialize(x)
    w = np.linspace(0.5, 1.5, 6 if op in ("instance", "group") else 240).astype(np.float32)
    fn = {"layer": lambda a, w: anynorm.layer_norm(a, w.reshape(6, 40) if w.ndim == 1 else w, axis=(1, 2)),
          "rms": lambda a, w: anynorm.rms_norm(a, w.reshape(6, 40) if w.ndim == 1 else w, axis=(1, 2)),
          "instance": lambda a, w: anynorm.instance_norm(a, w),
          "group": lambda a, w: anynorm.group_norm(a, 2, w)}[op]
    assert not _dask.spans_chunks(anynorm._plan.make_plan("instance_norm", x), x)
    y = fn(x, da.from_array(w))
    with dask.config.set(scheduler="threads", num_workers=2):
        got = y.compute()
    assert LIVE.made == x.npartitions
    _close(got, fn(xn, w), 2e-6)


@pytest.mark.parametrize("offset", [1e4, 1e6])
@pytest.mark.parametrize("op", ["layer", "group"])
def test_offset_float32_keeps_fp32_rounding(offset, op):
    """float32 data far from zero: y and the mean as accurate as the in-memory path's."""
    shape, chunks = (4096, 8), (256, 4)
    x = generated(shape, chunks, offset=offset)
    xn = materialize(x)
    fn = (lambda a: anynorm.layer_norm(a, axis=0, return_stats=True)) if op == "layer" else \
         (lambda a: anynorm.group_norm(a.reshape(64, 64, 8).transpose(0, 2, 1), 2, return_stats=True))
    xin = x if op == "layer" else x.rechunk((256, 8))
    y, mean, rstd = dask.compute(*fn(xin))
    y64, mean64, rstd64 = fn(xn.astype(np.float64))
    y32, mean32, _ = fn(xn)  # the in-memory float32 path
    err = np.max(np.abs(y - y64))
    err_mem = np.max(np.abs(y32 - y64))
    assert err <= max(2 * err_mem, 4e-6), f"error {err:.3g} vs in-memory {err_mem:.3g}"
    spacing = np.spacing(np.float32(offset))
    assert np.max(np.abs(mean - mean64)) <= spacing
    _close(rstd, rstd64, 1e-6)


def test_float16_accumulates_in_float32():
    x = generated((1024, 8), (128, 8), dtype=np.float16, offset=2.0)
    xn = materialize(x)
    y, mean, rstd = dask.compute(*anynorm.layer_norm(x, axis=0, return_stats=True))
    ry, rmean, rrstd = anynorm.layer_norm(xn, axis=0, return_stats=True)
    assert y.dtype == np.float16 and mean.dtype == rstd.dtype == np.float32
    _close(y, ry, 2e-3)
    _close(mean, rmean, 1e-6)
    _close(rstd, rrstd, 1e-5)


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    # in-process workers: a memory limit would be measured on the whole test process (GBs
    # after the rest of a suite) and pause them for good; boundedness is counted per chunk
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                       dashboard_address=":0", memory_limit=0)
    cl = distributed.Client(cluster)
    try:
        yield cl
    finally:
        cl.close()
        cluster.close()


# On a cluster a chunk is released a message after its last use, so chunks that take
# microseconds to make would measure the scheduler's latency: these take 5 ms, as a read would.
DIST_CASES = {"layer_axis0": ((2048, 64), (128, 64)), "group_nhwc": ((2, 64, 32, 6), (1, 16, 32, 5)),
              "instance": ((2, 4, 64, 32), (1, 2, 16, 32))}
DELAY = 0.005
DIST_BOUND = 6  # 2 workers x 1 thread, with a task or two of slack for in-flight releases


@pytest.mark.parametrize("name", sorted(DIST_CASES))
def test_distributed_forward_and_backward(client, name):
    """The same graphs on a LocalCluster: bounded, and equal to the in-memory path."""
    _, _, fwd, bwd, _ = CASES[name]
    shape, chunks = DIST_CASES[name]
    x = generated(shape, chunks, offset=5.0, delay=DELAY)
    dy = generated(shape, chunks, seed=0.9, delay=DELAY)
    xn, dyn = materialize(x), materialize(dy)
    w, b = _params(name, pshape=(shape[0],) if name.startswith("layer") else None)
    y, mean, rstd = fwd(x, da.from_array(w), da.from_array(b), return_stats=True)
    dx, dw, db = bwd(dy, x, da.from_array(w))
    got = client.compute([da.sum(y * y), y[:2], mean, rstd], sync=True)
    assert LIVE.peak <= DIST_BOUND, f"{LIVE.peak} of {x.npartitions} chunks alive at once"
    assert LIVE.made == 2 * x.npartitions
    LIVE.reset()
    gotb = client.compute([da.sum(dx * dx), dx[:2], dw, db], sync=True)
    assert LIVE.peak <= 2 * DIST_BOUND, f"{LIVE.peak} of {2 * x.npartitions} chunks alive at once"
    assert LIVE.made == 4 * x.npartitions
    ry, rmean, rrstd = fwd(xn, w, b, return_stats=True)
    rdx, rdw, rdb = bwd(dyn, xn, w)
    _close(got[0], np.sum(ry.astype(np.float64) ** 2), 1e-5)
    _close(got[1], ry[:2], 2e-6)
    _close(got[2], rmean, 2e-6)
    _close(got[3], rrstd, 2e-6)
    _close(gotb[0], np.sum(rdx.astype(np.float64) ** 2), 1e-5)
    _close(gotb[1], rdx[:2], 2e-6)
    _close(gotb[2], rdw, 1e-5)
    _close(gotb[3], rdb, 1e-5)


def test_readme_zarr_cluster_example_runs(tmp_path, monkeypatch):
    """The README's "Larger than memory (Dask)" example, as written, on a small x.zarr."""
    import pathlib
    import re

    pytest.importorskip("distributed")
    zarr = pytest.importorskip("zarr")
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## Larger than memory (Dask)", 1)
    if len(section) < 2:
        pytest.skip("README has no 'Larger than memory (Dask)' section yet")
    block = re.search(r"```py\n(.*?)```", section[1], re.S).group(1)
    xn = np.random.default_rng(0).standard_normal((4096, 16)).astype(np.float32) * 3 + 1e4
    arr = zarr.create_array(store=str(tmp_path / "x.zarr"), shape=xn.shape, chunks=(256, 16), dtype="float32")
    arr[:] = xn
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(block, "README Dask block", "exec"), namespace)
    ref, rmean, rrstd = anynorm.layer_norm(xn, axis=0, return_stats=True)
    _close(zarr.open_array(str(tmp_path / "y.zarr"), mode="r")[:], ref, 2e-6)
    _close(namespace["mean"], rmean, 1e-7)
    _close(namespace["rstd"], rrstd, 1e-6)
