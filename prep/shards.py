"""`prep shards`: parquet measurements → ArrayRecord shards + manifest.json (DESIGN 5, 7, 8).

Two passes, both spread over a process pool, memory bounded by a batch and by a bucket:

1. Read + route. The inputs are cut into units of whole parquet row groups (at most
   ``UNIT_ROWS`` rows each). A worker validates a unit in batches and appends each
   batch's rows to per-bucket Arrow IPC spill files (bucket = splitmix64 of the probe key
   mod ``n_buckets``), under ``DIR/.tmp-shards-<pid>-<token>/spill/``. No pickle: pool
   tasks and results are plain tuples and dicts, the data crosses processes as files.
   With a time split (``--split time|time+probe``) and no ``--test-from``, each unit also
   returns a per-minute histogram of its accepted measurements' times; the driver sums
   them and resolves the default cutoff (prep.splits.default_cutoff) into the config.
2. Buckets. A worker loads one bucket's spill files and calls
   ``prep.bucket.process_bucket``, which writes that bucket's finished shards into the
   staging folder ``DIR/.tmp-shards-<pid>-<token>/``.

Then ``finish`` writes the manifest into the staging folder and prep.outdir swaps the
new dataset in (the Beam runner ends the same way). prep.outdir owns ``DIR``: the lock
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
from collections import Counter
import contextlib
import ctypes
import hashlib
import json
import math
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
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from prep import manifest as mf
from prep import outdir
from prep.bucket import ShardsConfig, bucket_of, process_bucket, resolve_buckets
from prep.errors import InputError
from prep.manifest import SPLITS
from prep.measurements import ARROW_SCHEMA, FIELDS, Measurements, from_arrow
from prep.splits import (TIME_RULES, MinuteHistogram, default_cutoff, format_time,
                         minute_histogram)
from prep.validate import list_inputs, open_parquet, validated_batches

UNIT_ROWS = 1 << 20  # rows per read task (whole row groups; small files share one)
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
            with outdir.signals_blocked():
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


def finish(od: outdir.OutDir, cfg: ShardsConfig, inputs: list[dict], read: dict,
           results: list[dict], t0: float, timing: dict) -> dict:
    """Both runners' ending: the manifest from the read counts and the per-bucket results
    (ordered by bucket), written into the staging folder and published (prep.outdir)."""
    manifest = build_manifest(cfg, inputs, read, results)
    check_not_empty(od.path, manifest)
    elapsed = time.perf_counter() - t0
    manifest["elapsed_s"] = round(elapsed, 3)
    manifest["timing"] = timing | {
        "measurements_per_s": round(read["rows_in"] / max(elapsed, 1e-9))}
    od.publish(manifest)
    return summary(manifest)


def new_read_counts() -> dict:
    """Pass 1's counts, which both runners add up per unit (add_read_counts)."""
    return {"rows_in": 0, "accepted": 0, "rejected": Counter()}


def add_read_counts(read: dict, unit: dict) -> None:
    read["rows_in"] += unit["rows_in"]
    read["accepted"] += unit["accepted"]
    read["rejected"].update(unit["rejected"])


def check_not_empty(out: Path, manifest: dict) -> None:
    """InputError, before anything is published, when the dataset would have no train rows:
    a finished-looking empty dataset is worse than an error."""
    c, n = manifest["counts"], sum(manifest["counts"]["rows"].values())
    if c["rows"]["train"]:
        return
    if not c["rows_in"]:
        why = "the inputs hold no rows"
    elif not c["measurements_accepted"]:
        top = ", ".join(f"{k} {v:,}" for k, v in sorted(
            c["rows_rejected"].items(), key=lambda kv: -kv[1])[:3])
        why = (f"all {c['rows_in']:,} measurements were rejected ({top}); `prep import-atlas` "
               "writes only rows that pass these checks")
    elif n:
        cfg = manifest["config"]
        why = (f"all {n:,} rows went to the test split (--split {cfg['split']}, --test-fraction "
               f"{cfg['test_fraction']:g}); lower --test-fraction or give more probes")
    else:
        why = f"{c['measurements_accepted']:,} measurements were accepted but none was tokenized"
    raise InputError(f"{out}: no training rows written: {why}; nothing was published")


def needs_cutoff(cfg: ShardsConfig) -> bool:
    """A time split whose cutoff is to be found from the data (no --test-from)."""
    return cfg.split in TIME_RULES and cfg.test_from is None


def build_manifest(cfg: ShardsConfig, inputs: list[dict], read: dict, results: list[dict]) -> dict:
    """The manifest (without timing fields) from the read counts and the bucket results.
    ``cfg`` is the resolved config (a time split's cutoff an int)."""
    if needs_cutoff(cfg):
        raise ValueError(f"split {cfg.split!r}: the cutoff test_from is not resolved")
    splits = {s: {"rows": 0, "measurements": 0, "tokens": 0, "contexts": 0, "segments": 0,
                  "probes": 0, "shards": []} for s in SPLITS}
    hist: dict[str, int] = {}
    for r in results:
        for s in SPLITS:
            splits[s]["probes"] += r["probes"][s]
        for k, v in r["segments_per_row"].items():
            hist[k] = hist.get(k, 0) + v
    # Shards listed by (split, epoch, bucket): a reader taking one epoch takes a prefix.
    shards = sorted((s | {"bucket": r["bucket"]} for r in results for s in r["shards"]),
                    key=lambda s: (SPLITS.index(s["split"]), s["epoch"], s["bucket"]))
    tokens_by_pass: dict[tuple[str, int], int] = {}
    for s in shards:
        sp = splits[s["split"]]
        sp["rows"] += s["records"]
        for k in ("measurements", "tokens", "contexts", "segments"):
            sp[k] += s[k]
        sp["shards"].append(s)
        key = (s["split"], s["epoch"])
        # Lower bound: whole contexts, tokens added by cuts count against the packer.
        tokens_by_pass[key] = tokens_by_pass.get(key, 0) + s["context_tokens"]
    lower = sum(math.ceil(t / cfg.row_len) for t in tokens_by_pass.values())
    rows = sum(sp["rows"] for sp in splits.values())
    tokens = sum(sp["tokens"] for sp in splits.values())
    counts = {
        "rows_in": read["rows_in"],
        "rows_rejected": dict(sorted(read["rejected"].items())),
        "measurements_accepted": read["accepted"],
        # Accepted but in neither split (time+probe: held-out probes before the cutoff,
        # the other probes from it on); tokenized = (accepted - excluded) x epochs.
        "measurements_excluded_by_split": sum(r["excluded"] for r in results),
        "measurements_tokenized": sum(sp["measurements"] for sp in splits.values()),
        "contexts": sum(sp["contexts"] for sp in splits.values()),
        "segments": sum(sp["segments"] for sp in splits.values()),
        "rows": {s: splits[s]["rows"] for s in SPLITS},
        "tokens": tokens,
        "padding_tokens": rows * cfg.row_len - tokens,
    }
    return mf.header(cfg.row_len) | {
        "config": json.loads(config_to_json(cfg)), "seed": cfg.seed,
        "inputs": inputs, "counts": counts,
        "padding_fraction": (rows * cfg.row_len - tokens) / (rows * cfg.row_len) if rows else 0.0,
        "lower_bound_rows": lower,
        "rows_over_lower_bound": rows / lower if lower else 1.0,
        "segments_per_row": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "splits": splits,
    }


def summary(manifest: dict) -> dict:
    """The closing summary: what `prep shards --json` prints."""
    c, t, cfg = manifest["counts"], manifest.get("timing", {}), manifest["config"]
    test_from = cfg.get("test_from")
    split = {"rule": cfg.get("split", "probe"), "test_fraction": cfg["test_fraction"],
             "test_from": test_from,
             "test_from_iso": None if test_from is None else format_time(test_from)}
    return {"measurements_in": c["rows_in"], "measurements_rejected": sum(c["rows_rejected"].values()),
            "rejected_by_reason": c["rows_rejected"], "measurements_tokenized": c["measurements_tokenized"],
            "measurements_excluded_by_split": c.get("measurements_excluded_by_split", 0),
            "split": split,
            "contexts": c["contexts"], "segments": c["segments"], "rows": c["rows"],
            "tokens": c["tokens"], "padding_fraction": manifest["padding_fraction"],
            "lower_bound_rows": manifest["lower_bound_rows"],
            "rows_over_lower_bound": manifest["rows_over_lower_bound"],
            "elapsed_s": manifest.get("elapsed_s"),
            "measurements_per_s": t.get("measurements_per_s"), "workers": t.get("workers"),
            "peak_rss_mb": t.get("peak_rss_mb"), "buckets": cfg["n_buckets"]}


def format_summary(s: dict) -> str:
    rej = ", ".join(f"{k} {v:,}" for k, v in s["rejected_by_reason"].items()) or "none"
    rows = s["rows"]["train"] + s["rows"]["test"]
    sp = s["split"]
    if sp["test_from"] is None:
        split = f"{sp['rule']}, {100 * sp['test_fraction']:g} % of the probes in test"
    else:
        split = f"{sp['rule']}, test from {sp['test_from_iso']} ({sp['test_from']})"
        if sp["rule"] == "time+probe":
            split += (f", {100 * sp['test_fraction']:g} % of the probes held out; "
                      f"{s['measurements_excluded_by_split']:,} measurements in neither split")
    return "\n".join([
        f"prep shards: done in {s['elapsed_s']:.1f} s, "
        f"{s['measurements_per_s']:,} measurements/s on {s['workers']} workers",
        f"  measurements  {s['measurements_in']:,} in, {s['measurements_rejected']:,} rejected ({rej})",
        f"  split         {split}",
        f"  contexts      {s['contexts']:,} ({s['segments']:,} segments after cuts)",
        f"  rows          {rows:,} (train {s['rows']['train']:,}, test {s['rows']['test']:,}); "
        f"lower bound {s['lower_bound_rows']:,} (x{s['rows_over_lower_bound']:.4f})",
        f"  buckets       {s['buckets']}" + (
            f"; each ends in part-filled rows: {rows - s['lower_bound_rows']:,} rows over the "
            "lower bound (fewer --buckets pack tighter, with more memory per worker)"
            if s["buckets"] > 1 and rows - s["lower_bound_rows"] >= s["buckets"] else ""),
        f"  tokens        {s['tokens']:,}, padding {100 * s['padding_fraction']:.3f} %",
    ])


# --- pass 1: read, validate, route to bucket spill files ------------------------------

def read_units(paths: list[Path]) -> tuple[list[list[tuple[str, list[int]]]], int]:
    """Inputs cut into units of whole row groups, about UNIT_ROWS rows each.

    Small files (synth writes one per hour) share a unit; a big file spans several.
    """
    units, unit, n, total = [], [], 0, 0
    for p in paths:
        md = open_parquet(p).metadata
        groups = []
        for rg in range(md.num_row_groups):
            rows = md.row_group(rg).num_rows
            if n and n + rows > UNIT_ROWS:
                if groups:
                    unit.append((str(p), groups))
                units.append(unit)
                unit, groups, n = [], [], 0
            groups.append(rg)
            n += rows
        if groups:
            unit.append((str(p), groups))
        total += md.num_rows
    if unit:
        units.append(unit)
    return units, total


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


# --- pass 2: one bucket ------------------------------------------------------------------

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


def config_to_json(cfg: ShardsConfig) -> str:
    """The config as JSON: the start-up echo, pool tasks, the Beam pipeline."""
    return json.dumps(asdict(cfg))


def config_from_dict(d: dict) -> ShardsConfig:
    """ShardsConfig from its JSON form (the manifest's ``config``, a pool task)."""
    d = dict(d)
    d["mode_weights"] = tuple(d["mode_weights"])
    return ShardsConfig(**d)


# --- files ---------------------------------------------------------------------------

def file_info(p: Path, stop: threading.Event | None = None) -> dict:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 22):
            if stop is not None and stop.is_set():
                break  # the run failed: the caller no longer waits for this
            h.update(chunk)
    return {"name": str(p), "size": p.stat().st_size, "sha256": h.hexdigest()}


def _own_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the
    parent across exec, so a big parent (a benchmark harness) would show up as ours."""
    with contextlib.suppress(OSError):  # not Linux: fall back to getrusage below
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
