"""Scale measurement for issue 17: layer norm over a Dask axis that spans every chunk, on an
array larger than this machine's memory, on the threaded scheduler and on a LocalCluster.

    python asv_bench/dask_scale.py --gb 24 --workdir /tmp/anynorm_scale [--modes threads,cluster]

The input (float32, ``(rows, 1024)``, ``--chunk-rows`` rows per chunk, 128 MiB chunks by
default) is generated chunk by chunk from the element index (a cheap integer hash), so it is
never stored and each pass regenerates it.  ``layer_norm(x, axis=0)`` (statistics per column,
over all rows, i.e. over every chunk) is written to an uncompressed Zarr store on disk; three
whole columns of ``y`` come back in the same run and are checked against a float64 reference
computed from the same float32 values.

Per mode it reports the wall time of the normalization next to a baseline of two full reads
and one write of the data (``sum(x)``: one read; ``store(x)``: one read and one write), and
the peak memory: the process RSS (threaded scheduler, sampled every 20 ms) or each worker
process's RSS (a LocalCluster of ``--workers`` processes with ``--memory-limit`` each; a
worker killed for memory would show up as a changed worker set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dask  # noqa: E402
import dask.array as da  # noqa: E402
import psutil  # noqa: E402

import anynorm  # noqa: E402

COLS = 1024
EPS = 1e-5
OFFSET = 1e4  # every column sits near 1e4 (float32 spacing 1e-3), with a spread of about 3


def _values(rows, cols):
    """float32 x at the outer product of integer row and column indices (uint32 hash)."""
    h = (rows.astype(np.uint32)[:, None] * np.uint32(2654435761)) ^ (cols.astype(np.uint32)[None, :] * np.uint32(40503))
    h *= np.uint32(2246822519)
    h ^= h >> np.uint32(13)
    out = h.astype(np.float32)
    del h
    out *= np.float32(10.0 / 2**32)  # uniform on [0, 10)
    out += (OFFSET + (cols % 7)).astype(np.float32)[None, :]
    return out


def _chunk(block_info=None):
    (r0, r1), (c0, c1) = block_info[None]["array-location"]
    return _values(np.arange(r0, r1), np.arange(c0, c1))


def source(rows, chunk_rows):
    """The generated input: ``rows`` (a multiple of ``chunk_rows``) x 1024 float32."""
    return da.map_blocks(_chunk, chunks=((chunk_rows,) * (rows // chunk_rows), (COLS,)),
                         dtype=np.float32, meta=np.empty((0, 0), np.float32))


def reference_columns(rows, cols):
    """float64 layer norm over axis 0 of the float32 columns ``cols``."""
    out = []
    for c in cols:
        x = np.concatenate([_values(np.arange(r, min(r + (1 << 22), rows)), np.array([c]))[:, 0]
                            for r in range(0, rows, 1 << 22)]).astype(np.float64)
        out.append((x - x.mean()) / np.sqrt(x.var() + EPS))
    return np.stack(out, axis=1)


class RssSampler:
    """Peak RSS of a set of processes, sampled every ``period`` seconds in a thread."""

    def __init__(self, pids_fn, period=0.02):
        self.pids_fn, self.period = pids_fn, period
        self.peak = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for pid in self.pids_fn():
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                self.peak[pid] = max(self.peak.get(pid, 0), rss)
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def zarr_target(path, rows, chunk_rows):
    import zarr
    if os.path.exists(path):
        shutil.rmtree(path)
    return zarr.create_array(store=path, shape=(rows, COLS), chunks=(chunk_rows, COLS),
                             dtype="float32", compressors=None, filters=None, fill_value=0.0)


def run_mode(mode, args, rows, compute, pids_fn):
    x = source(rows, args.chunk_rows)
    nbytes = x.nbytes
    target_path = os.path.join(args.workdir, "y.zarr")
    cols = [0, COLS // 2 + 3, COLS - 1]
    result = {"mode": mode, "rows": rows, "gb": nbytes / 1e9, "chunks": x.npartitions,
              "chunk_mb": args.chunk_rows * COLS * 4 / 1e6}

    t = time.perf_counter()
    compute(da.sum(x, dtype=np.float64))
    result["read_s"] = time.perf_counter() - t
    t = time.perf_counter()
    compute(da.store(x, zarr_target(target_path, rows, args.chunk_rows), lock=False, compute=False))
    result["read_write_s"] = time.perf_counter() - t
    shutil.rmtree(target_path)
    result["two_reads_one_write_s"] = result["read_s"] + result["read_write_s"]

    y, mean, rstd = anynorm.layer_norm(x, axis=0, eps=EPS, return_stats=True)
    store = da.store(y, zarr_target(target_path, rows, args.chunk_rows), lock=False, compute=False)
    with RssSampler(pids_fn) as sampler:
        t = time.perf_counter()
        _, ycols, mean_v, rstd_v = compute(store, y[:, cols], mean, rstd)
        result["normalize_s"] = time.perf_counter() - t
    result["peak_rss_gb"] = {str(k): v / 1e9 for k, v in sampler.peak.items()}
    result["time_vs_estimate"] = result["normalize_s"] / result["two_reads_one_write_s"]

    ref = reference_columns(rows, cols)
    result["max_abs_err_sampled_cols"] = float(np.max(np.abs(np.asarray(ycols, np.float64) - ref)))
    import zarr
    stored = zarr.open_array(target_path, mode="r")
    first = np.asarray(stored[: args.chunk_rows, cols[0]], np.float64)
    result["stored_matches_returned"] = bool(np.array_equal(first, np.asarray(ycols)[: args.chunk_rows, 0]))
    shutil.rmtree(target_path)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=48.0, help="input size in GB (float32)")
    p.add_argument("--chunk-rows", type=int, default=32768, help="rows per chunk (x 1024 float32)")
    p.add_argument("--workdir", default="/tmp/anynorm_scale")
    p.add_argument("--modes", default="threads,cluster")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-limit", default="3GB")
    p.add_argument("--out", default=None, help="also write the results here as JSON")
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    rows = int(args.gb * 1e9 / (COLS * 4)) // args.chunk_rows * args.chunk_rows
    results = []
    me = os.getpid()
    for mode in args.modes.split(","):
        if mode == "threads":
            with dask.config.set(scheduler="threads", num_workers=args.threads):
                results.append(run_mode(mode, args, rows, lambda *a: dask.compute(*a), lambda: [me]))
        else:
            import distributed
            with distributed.LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                                          memory_limit=args.memory_limit, dashboard_address=None) as cluster, \
                    distributed.Client(cluster) as client:
                before = sorted(client.scheduler_info()["workers"])
                pids = list(client.run(os.getpid).values())
                res = run_mode(mode, args, rows, lambda *a: client.compute(list(a), sync=True),
                               lambda: pids)
                after = sorted(client.scheduler_info()["workers"])
                res["workers_unchanged"] = before == after and sorted(client.run(os.getpid).values()) == sorted(pids)
                res["memory_limit"] = args.memory_limit
                results.append(res)
        print(json.dumps(results[-1], indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
