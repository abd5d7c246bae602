"""`prep shards`, the local runner: parquet measurements → ArrayRecord shards + manifest.json.

Two passes, both spread over a process pool, memory bounded by a batch and by a bucket:

1. Read + route. The inputs are cut into units of whole parquet row groups (at most
   ``prep.build.dataset.UNIT_ROWS`` rows each). A worker validates a unit in batches and appends
   each batch's rows to per-bucket Arrow IPC spill files (bucket = splitmix64 of the probe key
   mod ``n_buckets``), under ``DIR/.tmp-shards-<pid>-<token>/spill/``. No pickle: pool
   tasks and results are plain tuples and dicts, the data crosses processes as files.
   With a time split (``--split time|time+probe``) and no ``--test-from``, each unit also
   returns a per-minute histogram of its accepted measurements' times; the driver sums
   them and resolves the default cutoff (prep.schema.splits.default_cutoff) into the config.
2. Buckets. A worker loads one bucket's spill files and calls
   ``prep.build.bucket.process_bucket``, which writes that bucket's finished shards into the
   staging folder ``DIR/.tmp-shards-<pid>-<token>/``.

Then ``prep.build.dataset.finish`` writes the manifest into the staging folder and prep.jobs.outdir
swaps the new dataset in (the Beam runner ends the same way). prep.jobs.outdir owns ``DIR``: the lock
against a second run, the refusals, ``--overwrite``, what a kill leaves at each step.
Output bytes depend on (inputs, the resolved ShardsConfig) only: spill order does not
matter because ``plan_contexts`` sorts, and shard names come from the bucket id.

The pool is prep.jobs.pool's: a worker that dies (e.g. to the OOM killer) is an error naming
the file or bucket it was on, the workers stop with the run and die with the driver.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import resource
import shutil
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from prep.build.bucket import ShardsConfig, bucket_of, process_bucket, resolve_buckets
from prep.build.dataset import (
    add_read_counts,
    config_from_dict,
    config_to_json,
    file_info,
    finish,
    needs_cutoff,
    new_read_counts,
    read_units,
)
from prep.jobs import outdir
from prep.jobs.pool import Pool, WorkerDied
from prep.jobs.signals import signals_blocked
from prep.schema.errors import InputError
from prep.schema.measurements import ARROW_SCHEMA, FIELDS, Measurements, from_arrow
from prep.schema.splits import MinuteHistogram, default_cutoff, format_time, minute_histogram
from prep.schema.validate import list_inputs, validated_batches

# LZ4 halves the spill's CPU in the kernel (page-cache writes are dear on small VMs) and
# shrinks it 2.8x, for +0.3 s of user time per 10M rows.
_SPILL_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def run_shards(inputs: list[str], out: str, cfg: ShardsConfig, *, workers: int = 1,
               progress: bool = True, overwrite: bool = False) -> dict:
    """Build the dataset in ``out``; return the closing summary (also in the manifest).
    A dataset already in ``out`` is replaced only with ``overwrite`` (prep.jobs.outdir)."""
    t0 = time.perf_counter()
    out_dir = Path(out)
    paths = list_inputs(inputs)
    with outdir.claim(out_dir, overwrite=overwrite, runner="shards") as od:
        stage = od.stage
        pool, hasher, stop_hashing = None, None, threading.Event()
        failed = True
        try:
            # Workers and the hashing thread start before Arrow starts threads of its own,
            # with SIGINT/SIGTERM blocked: they reach the driver, which stops the workers.
            with signals_blocked():
                pool = Pool(workers, preload=(__name__,)) if workers > 1 else None
                hasher = concurrent.futures.ThreadPoolExecutor(1)
                inputs_info = hasher.submit(lambda: [file_info(p, stop_hashing) for p in paths])
            units, rows_total = read_units(paths)
            cfg = resolve_buckets(cfg, rows_total)
            print(f"prep shards: {len(paths)} input files, {rows_total:,} rows, {workers} "
                  f"workers; config {config_to_json(cfg)}", file=sys.stderr)
            def imap(fn, tasks, labels):
                return pool.imap_unordered(fn, tasks, labels) if pool else map(fn, tasks)

            read = new_read_counts()
            want_cutoff = needs_cutoff(cfg)
            minutes = MinuteHistogram()
            tasks = [(i, parts, str(stage), cfg.n_buckets, want_cutoff)
                     for i, parts in enumerate(units)]
            rss_read = [_own_rss_mb()]
            with tqdm(total=rows_total, unit="meas", unit_scale=True, desc="read + route",
                      disable=not progress, file=sys.stderr) as bar:
                labels = [", ".join(p for p, _ in parts) for parts in units]
                for r in map(_raise_error, imap(_spill_unit, tasks, labels)):
                    rss_read.append(r["peak_rss_mb"])
                    add_read_counts(read, r)
                    if want_cutoff:
                        minutes.add(*r["minutes"])
                    bar.update(r["rows_in"])
            t_read = time.perf_counter() - t0
            if want_cutoff:
                cfg = replace(cfg, test_from=default_cutoff(*minutes.result(), cfg.test_fraction))
                print(f"prep shards: test from {format_time(cfg.test_from)} ({cfg.test_from}), "
                      f"the earliest whole minute with at most {100 * cfg.test_fraction:g} % of "
                      "the accepted measurements at or after it", file=sys.stderr)

            results = []
            cfg_json = config_to_json(cfg)
            tasks = [(b, cfg_json, str(stage)) for b in range(cfg.n_buckets)]
            with tqdm(total=cfg.n_buckets, unit="bucket", desc="buckets", disable=not progress,
                      file=sys.stderr) as bar:
                labels = [f"bucket {b}" for b in range(cfg.n_buckets)]
                for r in map(_raise_error, imap(_bucket_task, tasks, labels)):
                    results.append(r)
                    bar.update(1)
            rss = [r.pop("peak_rss_mb") for r in results]
            results.sort(key=lambda r: r["bucket"])
            infos = inputs_info.result()
            failed = False
        except WorkerDied as e:
            fix = ("use more --buckets (less memory per worker) or fewer --workers" if e.oom
                   else "run again")
            raise InputError(f"{out_dir}: {e.what}; the run stopped and nothing was published; "
                             f"{fix}") from None
        finally:
            if hasher:
                stop_hashing.set()
                hasher.shutdown(wait=not failed, cancel_futures=True)
            if pool:
                pool.close(failed)

        # Per process (the largest), as each pass ended; each worker process serves both
        # passes, so the second includes the first.
        timing = {"workers": workers, "read_s": round(t_read, 3),
                  "peak_rss_mb": {"main": _own_rss_mb(), "read": max(rss_read),
                                  "buckets": max(rss, default=0.0)}}
        return finish(od, cfg, infos, read, results, t0, timing)


# Pass 1: read, validate, route to bucket spill files.


def _reporting_errors(fn):
    """Pool tasks return ``{"error": message}`` for bad input instead of raising across processes."""
    def task(args):
        try:
            return fn(args)
        except InputError as e:
            return {"error": str(e)}
    task.__name__ = task.__qualname__ = fn.__name__
    return task


def _raise_error(result: dict) -> dict:
    if "error" in result:
        raise InputError(result["error"])
    return result


@_reporting_errors
def _spill_unit(task) -> dict:
    unit, parts, stage, n_buckets, want_minutes = task
    read = new_read_counts()
    minutes = MinuteHistogram()
    writers: dict[int, pa.ipc.RecordBatchStreamWriter] = {}
    try:
        for path, row_groups in parts:
            for batch in validated_batches(path, row_groups):
                m = batch.measurements
                add_read_counts(read, batch.counts())
                if want_minutes:
                    minutes.add(*minute_histogram(m.time))
                b = bucket_of(m.probe, n_buckets).astype(np.uint16)
                order = np.argsort(b, kind="stable")  # a radix sort on uint16
                bounds = np.searchsorted(b[order], np.arange(n_buckets + 1))
                cols = [getattr(m, k)[order] for k in FIELDS]
                for bucket in np.flatnonzero(np.diff(bounds)):
                    w = writers.get(bucket)
                    if w is None:
                        d = Path(stage) / "spill" / f"b{bucket:05d}"
                        d.mkdir(parents=True, exist_ok=True)
                        w = pa.ipc.new_stream(str(d / f"u{unit:05d}.arrow"), ARROW_SCHEMA,
                                             options=_SPILL_OPTIONS)
                        writers[bucket] = w
                    lo, hi = bounds[bucket], bounds[bucket + 1]
                    w.write_batch(pa.record_batch([c[lo:hi] for c in cols], schema=ARROW_SCHEMA))
    finally:
        for w in writers.values():
            w.close()
    result = read | {"peak_rss_mb": _own_rss_mb()}
    if want_minutes:  # plain lists: pool results stay plain data
        result["minutes"] = [a.tolist() for a in minutes.result()]
    return result


# Pass 2: one bucket.

def load_bucket(stage: Path, bucket: int) -> Measurements:
    """A bucket's measurements from its spill files (in any order: plan_contexts sorts)."""
    d = stage / "spill" / f"b{bucket:05d}"
    files = sorted(d.glob("*.arrow")) if d.is_dir() else []
    tables = []
    for f in files:
        with pa.ipc.open_stream(str(f)) as r:
            tables.append(r.read_all())
    return from_arrow(pa.concat_tables(tables) if tables else None)


@_reporting_errors
def _bucket_task(task) -> dict:
    bucket, cfg_json, stage = task
    cfg = config_from_dict(json.loads(cfg_json))
    m = load_bucket(Path(stage), bucket)
    shutil.rmtree(Path(stage) / "spill" / f"b{bucket:05d}", ignore_errors=True)
    result = process_bucket(bucket, m, cfg, stage)
    return result | {"peak_rss_mb": _own_rss_mb()}


def _own_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the
    parent across exec, so a big parent (a benchmark harness) would show up as ours."""
    with contextlib.suppress(OSError):  # not Linux: fall back to getrusage below
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
