"""`prep shards`, the local runner: parquet measurements → ArrayRecord shards + manifest.json.

Two passes, both spread over a process pool, memory bounded by a batch and by a bucket:

1. Read + route. The inputs are cut into units of whole parquet row groups (at most
   ``prep.shards.dataset.UNIT_ROWS`` rows each). A worker validates a unit in batches and appends
   each batch's rows to per-bucket Arrow IPC spill files (bucket = splitmix64 of the probe key
   mod ``n_buckets``), under ``DIR/.tmp-shards-<pid>-<token>/spill/``. No pickle: pool
   tasks and results are plain tuples and dicts, the data crosses processes as files.
   With a time split (``--split time|time+probe``) and no ``--test-from``, each unit also
   returns a per-minute histogram of its accepted measurements' times; the driver sums
   them and resolves the default cutoff (prep.schema.splits.default_cutoff) into the config.
2. Buckets. A worker loads one bucket's spill files and calls
   ``prep.shards.bucket.process_bucket``, which writes that bucket's finished shards into the
   staging folder ``DIR/.tmp-shards-<pid>-<token>/``.

This module holds only these passes (``LocalPasses``); the frame around them, the Beam
runner's too, is ``prep.shards.dataset.build`` (inputs listed and hashed, ``DIR`` claimed
through prep.jobs.claim, the manifest written and the dataset published). Output bytes
depend on (inputs, the resolved ShardsConfig) only: spill order does not matter because
``plan_contexts`` sorts, and shard names come from the bucket id.

The pool is prep.jobs.pool's: a worker that dies (e.g. to the OOM killer) is an error naming
the file or bucket it was on, the workers stop with the run and die with the driver.
"""

from __future__ import annotations

import ctypes
import functools
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from prep.base.errors import InputError
from prep.base.jit import no_blas_in_worker
from prep.base.words import count
from prep.jobs.owned import Claim
from prep.jobs.pool import Pool, WorkerDied
from prep.schema.measurements import ARROW_SCHEMA, FIELDS, Measurements, from_arrow
from prep.schema.splits import MinuteHistogram, default_cutoff, minute_histogram
from prep.schema.validate import validated_batches
from prep.shards.bucket import ShardsConfig, bucket_of, process_bucket
from prep.shards.dataset import (
    Passes,
    add_read_counts,
    build,
    config_from_dict,
    config_to_json,
    needs_cutoff,
    new_read_counts,
    own_rss_mb,
)
from prep.shards.stages import StageClock

# Uncompressed: the spill lives seconds in the page cache, and LZ4 cost more CPU to write
# and read back than the smaller writes saved (docs/measurements.md).
_SPILL_OPTIONS = pa.ipc.IpcWriteOptions(compression=None)


def run_shards(inputs: list[str], out: str, cfg: ShardsConfig, *, workers: int = 1,
               progress: bool = True, overwrite: bool = False) -> dict:
    """Build the dataset in ``out`` (prep.shards.dataset.build) with ``workers`` processes;
    return the closing summary (also in the manifest). A dataset already in ``out`` is
    replaced only with ``overwrite`` (prep.jobs.claim)."""
    return build(inputs, out, cfg, LocalPasses(workers, progress), overwrite=overwrite)


class LocalPasses(Passes):
    """The two passes on prep.jobs.pool's process pool (in this process for one worker)."""

    def __init__(self, workers: int, progress: bool):
        self.workers, self.progress = workers, progress
        self.pool: Pool | None = None
        self.read_s, self.rss_read, self.rss_buckets = 0.0, [], []
        self.clock = StageClock()  # the workers' stages, added up over their tasks

    def start(self) -> None:
        self.pool = Pool(self.workers, preload=(__name__,)) if self.workers > 1 else None

    def describe(self, n_files: int, rows: int) -> str:
        return f"{super().describe(n_files, rows)}, {count(self.workers, 'worker')}"

    def stop(self, failed: bool) -> None:
        if self.pool:
            self.pool.close(failed)

    def timing(self) -> dict:
        # Per process (the largest), as each pass ended; each worker process serves both
        # passes, so the second includes the first.
        return {"workers": self.workers, "read_s": round(self.read_s, 3),
                **self.clock.report(),
                "peak_rss_mb": {"main": own_rss_mb(), "read": max(self.rss_read),
                                "buckets": max(self.rss_buckets, default=0.0)}}

    def run(self, od: Claim, units: list, rows_total: int, cfg: ShardsConfig,
            t0: float) -> tuple[ShardsConfig, dict, list[dict]]:
        try:
            return self._passes(od.stage, units, rows_total, cfg, t0)
        except WorkerDied as e:
            fix = ("use more --buckets (less memory per worker) or fewer --workers" if e.oom
                   else "run again")
            raise InputError(f"{od.path}: {e.what}; the run stopped and nothing was published; "
                             f"{fix}") from None

    def _imap(self, fn, tasks, labels):
        return self.pool.imap_unordered(fn, tasks, labels) if self.pool else map(fn, tasks)

    def _passes(self, stage: Path, units: list, rows_total: int, cfg: ShardsConfig, t0: float):
        read = new_read_counts()
        want_cutoff = needs_cutoff(cfg)
        minutes = MinuteHistogram()
        tasks = [(i, parts, str(stage), cfg.n_buckets, want_cutoff)
                 for i, parts in enumerate(units)]
        self.rss_read = [own_rss_mb()]
        with tqdm(total=rows_total, unit="meas", unit_scale=True, desc="read + route",
                  disable=not self.progress, file=sys.stderr) as bar:
            labels = [", ".join(p for p, _ in parts) for parts in units]
            for r in map(_raise_error, self._imap(_spill_unit, tasks, labels)):
                self.rss_read.append(r["peak_rss_mb"])
                self.clock.add(r["stages"])
                add_read_counts(read, r)
                if want_cutoff:
                    minutes.add(*r["minutes"])
                bar.update(r["rows_in"])
        self.read_s = time.perf_counter() - t0
        if want_cutoff:
            cfg = self.found_cutoff(cfg, default_cutoff(*minutes.result(), cfg.test_fraction))

        results = []
        cfg_json = config_to_json(cfg)
        tasks = [(b, cfg_json, str(stage)) for b in range(cfg.n_buckets)]
        with tqdm(total=cfg.n_buckets, unit="bucket", desc="buckets",
                  disable=not self.progress, file=sys.stderr) as bar:
            labels = [f"bucket {b}" for b in range(cfg.n_buckets)]
            for r in map(_raise_error, self._imap(_bucket_task, tasks, labels)):
                results.append(r)
                bar.update(1)
        self.rss_buckets = [r.pop("peak_rss_mb") for r in results]
        for r in results:
            self.clock.add(r.pop("stages"))
        results.sort(key=lambda r: r["bucket"])
        return cfg, read, results


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
    clock = StageClock()
    with clock.task():
        try:
            for path, row_groups in parts:
                for batch in validated_batches(path, row_groups, clock=clock):
                    _route(batch.measurements, unit, stage, n_buckets, writers, clock)
                    add_read_counts(read, batch.counts())
                    if want_minutes:
                        minutes.add(*minute_histogram(batch.measurements.time))
        finally:
            with clock("spill"):
                for w in writers.values():
                    w.close()
    result = read | {"peak_rss_mb": own_rss_mb(), "stages": clock.state()}
    if want_minutes:  # plain lists: pool results stay plain data
        result["minutes"] = [a.tolist() for a in minutes.result()]
    return result


def _route(m: Measurements, unit: int, stage: str, n_buckets: int, writers: dict,
           clock: StageClock) -> None:
    """Append each bucket's rows of ``m`` to that bucket's spill file of this unit."""
    with clock("route"):
        b = bucket_of(m.probe, n_buckets).astype(np.uint16)
        order = np.argsort(b, kind="stable")  # a radix sort on uint16
        bounds = np.searchsorted(b[order], np.arange(n_buckets + 1))
        cols = [getattr(m, k)[order] for k in FIELDS]
    with clock("spill"):
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


# Pass 2: one bucket.

@functools.cache
def _heap_gives_back() -> None:
    """glibc's malloc raises its mmap threshold to the largest block freed (up to 32 MiB),
    so a bucket's freed arrays stay in the heap and a worker's RSS keeps the high-water
    mark of every bucket it ran; fixed thresholds (blocks of 4 MiB and up mapped, 16 MiB
    of free heap top trimmed) give them back, for no CPU seen (docs/measurements.md; a
    256 KiB threshold cost 15 % more CPU in page faults). Not glibc: nothing to do."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 4 << 20)
    libc.mallopt(m_trim_threshold, 16 << 20)


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
    _heap_gives_back()
    no_blas_in_worker()
    clock = StageClock()
    with clock.task():
        cfg = config_from_dict(json.loads(cfg_json))
        with clock("load"):
            m = load_bucket(Path(stage), bucket)
            shutil.rmtree(Path(stage) / "spill" / f"b{bucket:05d}", ignore_errors=True)
        result = process_bucket(bucket, m, cfg, stage, clock=clock)
    return result | {"peak_rss_mb": own_rss_mb(), "stages": clock.state()}
