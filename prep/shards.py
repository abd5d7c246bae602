"""`prep shards`, the local runner: parquet measurements → ArrayRecord shards + manifest.json.

Two passes, both spread over a process pool, memory bounded by a batch and by a bucket:

1. Read + route. The inputs are cut into units of whole parquet row groups (at most
   ``prep.dataset.UNIT_ROWS`` rows each). A worker validates a unit in batches and appends
   each batch's rows to per-bucket Arrow IPC spill files (bucket = splitmix64 of the probe key
   mod ``n_buckets``), under ``DIR/.tmp-shards-<pid>-<token>/spill/``. No pickle: pool
   tasks and results are plain tuples and dicts, the data crosses processes as files.
   With a time split (``--split time|time+probe``) and no ``--test-from``, each unit also
   returns a per-minute histogram of its accepted measurements' times; the driver sums
   them and resolves the default cutoff (prep.splits.default_cutoff) into the config.
2. Buckets. A worker loads one bucket's spill files and calls
   ``prep.bucket.process_bucket``, which writes that bucket's finished shards into the
   staging folder ``DIR/.tmp-shards-<pid>-<token>/``.

Then ``prep.dataset.finish`` writes the manifest into the staging folder and prep.outdir
swaps the new dataset in (the Beam runner ends the same way). prep.outdir owns ``DIR``: the lock
against a second run, the refusals, ``--overwrite``, what a kill leaves at each step.
Output bytes depend on (inputs, the resolved ShardsConfig) only: spill order does not
matter because ``plan_contexts`` sorts, and shard names come from the bucket id.

The pool (``_Workers``, a ProcessPoolExecutor: unlike multiprocessing.Pool it notices a
worker that dies, e.g. to the OOM killer) stops with the run: workers ignore SIGINT
(Ctrl-C reaches the whole process group; the driver decides), are terminated by the
driver when the run stops, and die with it if it is killed (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.pool
import os
import resource
import shutil
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from prep import outdir
from prep.bucket import ShardsConfig, bucket_of, process_bucket, resolve_buckets
from prep.dataset import (add_read_counts, config_from_dict, config_to_json, file_info, finish,
                          needs_cutoff, new_read_counts, read_units)
from prep.errors import InputError
from prep.measurements import ARROW_SCHEMA, FIELDS, Measurements, from_arrow
from prep.signals import signals_blocked
from prep.splits import MinuteHistogram, default_cutoff, format_time, minute_histogram
from prep.validate import list_inputs, validated_batches

# LZ4 halves the spill's CPU in the kernel (page-cache writes are dear on small VMs) and
# shrinks it 2.8x, for +0.3 s of user time per 10M rows.
_SPILL_OPTIONS = pa.ipc.IpcWriteOptions(compression="lz4")


def run_shards(inputs: list[str], out: str, cfg: ShardsConfig, *, workers: int = 1,
               progress: bool = True, overwrite: bool = False) -> dict:
    """Build the dataset in ``out``; return the closing summary (also in the manifest).
    A dataset already in ``out`` is replaced only with ``overwrite`` (prep.outdir)."""
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
                pool = _Workers(workers) if workers > 1 else None
                hasher = concurrent.futures.ThreadPoolExecutor(1)
                inputs_info = hasher.submit(lambda: [file_info(p, stop_hashing) for p in paths])
            units, rows_total = read_units(paths)
            cfg = resolve_buckets(cfg, rows_total)
            print(f"prep shards: {len(paths)} input files, {rows_total:,} rows, {workers} "
                  f"workers; config {config_to_json(cfg)}", file=sys.stderr)
            imap = pool.imap_unordered if pool else map

            read = new_read_counts()
            want_cutoff = needs_cutoff(cfg)
            minutes = MinuteHistogram()
            tasks = [(i, parts, str(stage), cfg.n_buckets, want_cutoff)
                     for i, parts in enumerate(units)]
            rss_read = [_own_rss_mb()]
            with tqdm(total=rows_total, unit="meas", unit_scale=True, desc="read + route",
                      disable=not progress, file=sys.stderr) as bar:
                for r in map(_raise_error, imap(_spill_unit, tasks)):
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
                for r in map(_raise_error, imap(_bucket_task, tasks)):
                    results.append(r)
                    bar.update(1)
            rss = [r.pop("peak_rss_mb") for r in results]
            results.sort(key=lambda r: r["bucket"])
            infos = inputs_info.result()
            failed = False
        except BrokenProcessPool:
            what, fix = pool.death()
            raise InputError(f"{out_dir}: {what}; the run stopped and nothing was published; "
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


def _mp_context() -> multiprocessing.context.BaseContext:
    """Fork (cheap: inherits imports and loaded kernels) unless this process runs Python
    threads or has imported JAX, whose threads may hold locks at fork time (a deadlock);
    then a fork server."""
    if threading.active_count() == 1 and "jax" not in sys.modules:
        return multiprocessing.get_context("fork")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["prep.shards", "prep.verify"])
    return ctx


def process_pool(workers: int) -> multiprocessing.pool.Pool:
    """A multiprocessing pool of ``workers`` processes (prep.verify's), started as
    ``_mp_context`` says."""
    return _mp_context().Pool(workers)


class _Workers:
    """The run's process pool: ``imap_unordered`` like multiprocessing.Pool's, but a
    worker that dies (SIGKILL from the OOM killer, SIGTERM, a crash) raises
    BrokenProcessPool instead of leaving the driver waiting forever."""

    def __init__(self, workers: int):
        ctx = _mp_context()
        parent = os.getpid() if ctx.get_start_method() == "fork" else None
        self._ex = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=ctx, initializer=_worker_init, initargs=(parent,))
        self._procs: dict[int, multiprocessing.Process] = {}
        if parent is not None:  # fork every worker now, before any thread exists
            self._ex.submit(os.getpid)
            self._procs.update(self._ex._processes)

    def imap_unordered(self, fn, tasks):
        futures = [self._ex.submit(fn, t) for t in tasks]
        self._procs.update(self._ex._processes)  # a fork server starts them on demand
        pending = set(futures)
        while pending:
            # A timeout, so that SIGINT/SIGTERM are handled promptly in this thread.
            done, pending = concurrent.futures.wait(
                pending, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                yield f.result()

    def death(self) -> tuple[str, str]:
        """What happened to the worker that broke the pool, and the fix, for the error."""
        procs = list(self._procs.values())
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=5)
        deadline = time.monotonic() + 2
        while True:  # the executor's thread may be reaping them right now: None until then
            codes = [(p.pid, p.exitcode) for p in procs]
            if all(c is not None for _, c in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        # The executor terminates (SIGTERM) the others once one has died.
        dead = ([c for c in codes if c[1] not in (None, 0, -signal.SIGTERM)]
                or [c for c in codes if c[1] == -signal.SIGTERM])
        if not dead:
            return "a worker process stopped unexpectedly", "run again"
        pid, code = dead[0]
        if code > 0:
            return f"a worker process (pid {pid}) exited with code {code}", "run again"
        name = signal.Signals(-code).name
        if -code == signal.SIGKILL:
            return (f"a worker process (pid {pid}) was killed by {name}, most likely by the "
                    "kernel's out-of-memory killer",
                    "use more --buckets (less memory per worker) or fewer --workers")
        return f"a worker process (pid {pid}) was stopped by {name}", "run again"

    def close(self, failed: bool) -> None:
        if not failed:
            self._ex.shutdown(wait=True)
            return
        self._procs.update(self._ex._processes)
        procs = list(self._procs.values())
        self._ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:  # SIGTERM: a worker keeps its default action (_worker_init)
            with contextlib.suppress(Exception):
                p.terminate()
        # The staging folder is removed next: wait until no worker writes into it.
        alive = [p.sentinel for p in procs]
        multiprocessing.connection.wait(alive, timeout=5)
        for p in procs:
            with contextlib.suppress(Exception):
                if p.exitcode is None:
                    p.kill()
        multiprocessing.connection.wait(alive, timeout=5)


def _worker_init(parent: int | None) -> None:
    """A worker's signals: it starts with SIGINT and SIGTERM blocked (they were while the
    driver forked it) and with the driver's handlers; it ignores SIGINT, dies of SIGTERM,
    and dies with the driver (``parent`` is its pid when forked from it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent(parent)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG on Linux; elsewhere a
    thread watching the parent pid), so a killed driver leaves no worker writing."""
    ppid = os.getppid()
    watched = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            watched = ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) == 0
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the driver died before the line above
    if not watched:
        def watch():
            while os.getppid() == ppid:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()




def _own_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the
    parent across exec, so a big parent (a benchmark harness) would show up as ours."""
    with contextlib.suppress(OSError):  # not Linux: fall back to getrusage below
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
