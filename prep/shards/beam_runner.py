"""`prep shards --runner beam`: the same ETL on Apache Beam, for inputs past one machine.

The pipeline is the local runner's two passes with Beam doing the shuffle:

1. ``Create(units)``: units of whole parquet row groups (prep.shards.dataset.read_units).
2. ``FlatMap(read_unit)``: validate a unit batch by batch, write its rows into the stage,
   one spill file per bucket, and emit ``(bucket, spill name)``; the unit's read counts go
   to ``<stage>/read/``. Elements are ints and names with Beam's own coders: no pickle.
3. ``GroupByKey``: a bucket's spill names meet on one worker (memory bounded by the bucket).
4. ``ParDo(BucketFn)``: the very ``prep.shards.bucket.process_bucket`` the local pool calls,
   shards named from the bucket, its result in ``<stage>/results/``. Beam's file sinks are
   not used: their shard assignment is random.
A time split without ``--test-from`` also emits each unit's per-minute histogram;
``resolve_cutoff`` sums them into the cutoff by the local runner's rule and ``BucketFn``
takes it as a side input. This module is the driver's side (``BeamPasses``); what runs on
the workers is prep.shards.beam_worker (with ``--out s3://…`` they stage straight into the
bucket). The frame around the pipeline is the local runner's (prep.shards.dataset.build),
so both give byte-identical shards and manifests.

Failures are one line (``pipeline_error``). With worker processes here (multi_processing)
the pipeline runs on a helper thread (``run_watched``), since Beam's local runner would wait
for ever for a worker that died; the workers' stderr goes to a log file the error names.
The default runner is ``FnApiRunner``, in this process (Beam's default, Prism, would fetch a
binary at run time); ``--beam-option runner=...`` picks another (README, "Beam on a cluster").
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from prep.base.errors import InputError
from prep.base.signals import signals_blocked
from prep.base.words import count
from prep.jobs.remote_out import RemoteDataset
from prep.schema.measurements import empty
from prep.shards.bucket import ShardsConfig, process_bucket
from prep.shards.dataset import (
    Passes,
    add_read_counts,
    build,
    config_to_json,
    needs_cutoff,
    new_read_counts,
    own_rss_mb,
)


def _import_beam():
    try:
        with _without_root_warning("apitools not found"):  # Beam's GCP extras, unused here
            import apache_beam as beam
    except ImportError:
        raise InputError("--runner beam needs Apache Beam: pip install 'ping-pack[beam]' "
                         "(or use the default --runner local)") from None
    return beam


@contextlib.contextmanager
def _without_root_warning(prefix: str):
    """Drop the root logger's messages starting with ``prefix`` within the block, without
    the side effect of ``logging.warning`` on a root logger with no handler (basicConfig:
    "WARNING:root:" lines for everything after)."""
    root, hold = logging.getLogger(), logging.NullHandler()

    def keep(record) -> bool:
        return not str(record.msg).startswith(prefix)

    root.addHandler(hold)
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)
        root.removeHandler(hold)


def beam_options(pairs: list[str]):
    """PipelineOptions and runner from KEY=VALUE pairs (``runner`` picks the runner)."""
    beam = _import_beam()
    from apache_beam.options.pipeline_options import PipelineOptions

    flags, runner, keys = [], None, set()
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise InputError(f"--beam-option {p!r}: expected KEY=VALUE, e.g. runner=DataflowRunner")
        keys.add(key)
        if key == "runner":
            runner = value
        else:
            flags.append(f"--{key}={value}")
    if runner is None and "default_sdk_harness_log_level" not in keys:
        # worker processes (multi_processing) would log a dozen INFO lines each, and a
        # failure as a traceback, which the run says in one line (pipeline_error)
        flags.append("--default_sdk_harness_log_level=CRITICAL")
    options = PipelineOptions(flags)
    if runner is None:
        runner = _local_runner(options)
    return beam, options, runner


def _local_runner(options):
    """Beam's FnApiRunner, pinned: the default DirectRunner may pick the Prism runner, which
    downloads a binary. Its worker processes (multi_processing) get the harness log level,
    which the FnApiRunner by itself does not hand them (they get no pipeline options)."""
    from apache_beam.options.pipeline_options import WorkerOptions
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.runners.portability.fn_api_runner.fn_runner import ExtendedProvisionInfo
    from google.protobuf import struct_pb2

    given = struct_pb2.Struct()  # strings only: a Struct holds every number as a float
    given.update({"default_sdk_harness_log_level":
                  options.view_as(WorkerOptions).default_sdk_harness_log_level})
    return FnApiRunner(provision_info=ExtendedProvisionInfo(beam_provision_api_pb2.ProvisionInfo(
        retrieval_token="unused-retrieval-token", pipeline_options=given)))


def run_beam(inputs: list[str], out: str, cfg: ShardsConfig, *, beam_options_kv=(),
             progress: bool = True, overwrite: bool = False) -> dict:
    """Build the dataset in ``out`` (prep.shards.dataset.build) with Beam; return the
    closing summary."""
    beam, options, runner = beam_options(list(beam_options_kv))
    return build(inputs, out, cfg, BeamPasses(beam, options, runner), overwrite=overwrite)


class BeamPasses(Passes):
    """The two passes as one Beam pipeline (the module docstring), then its JSON files read
    back into the read counts and the per-bucket results."""

    runner = "beam"
    says = "prep shards (beam)"
    reads_buckets = True  # a worker reads an s3:// input's row groups itself

    def __init__(self, beam, options, beam_runner):
        self.beam, self.options, self.beam_runner = beam, options, beam_runner
        self.workers: set[str] = set()  # host:pid of every process that read a unit or a bucket
        self.rss_read, self.rss_buckets = [], []
        self.phases: dict = {}

    def local_mode(self) -> str | None:
        """Beam's local runner's mode (in_memory, multi_threading, multi_processing), or
        None for another runner."""
        from apache_beam.options.pipeline_options import DirectOptions

        if isinstance(self.beam_runner, str):
            return None
        return self.options.view_as(DirectOptions).direct_running_mode or "in_memory"

    def runner_name(self) -> str:
        """The runner, and for Beam's local runner its mode and workers."""
        from apache_beam.options.pipeline_options import DirectOptions

        mode = self.local_mode()
        if mode is None:
            return self.beam_runner
        n = self.options.view_as(DirectOptions).direct_num_workers or os.cpu_count()  # 0: all
        return f"{type(self.beam_runner).__name__}, {mode}" + (
            f", {count(n, 'worker')}" if mode != "in_memory" else "")

    def describe(self, n_files: int, rows: int) -> str:
        return (f"prep shards (beam, {self.runner_name()}): "
                f"{count(n_files, 'input file')}, {count(rows, 'row')}")

    def timing(self) -> dict:
        # the passes overlap in a pipeline: no read_s; per worker process, the largest
        return {"runner": "beam", "beam_runner": self.runner_name(),
                "workers": len(self.workers), "read_s": None, "phases_s": self.phases,
                "peak_rss_mb": {"main": own_rss_mb(), "read": max(self.rss_read, default=0.0),
                                "buckets": max(self.rss_buckets, default=0.0)}}

    def run(self, od, units: list, rows_total: int, cfg: ShardsConfig,
            t0: float) -> tuple[ShardsConfig, dict, list[dict]]:
        from apache_beam.options.pipeline_options import WorkerOptions

        from prep.shards.beam_worker import Stage

        # --out on a bucket: the workers stage straight into the run's new generation there
        stage = Stage.at(od.stage_in_bucket() if isinstance(od, RemoteDataset)
                         else str(od.stage))
        pipeline = functools.partial(self._pipeline, units, cfg, stage.location)
        log = None
        if self.local_mode() == "multi_processing" and self.options.view_as(
                WorkerOptions).default_sdk_harness_log_level == "CRITICAL":  # not asked for
            log = Path(tempfile.gettempdir()) / f"prep-beam-workers-{os.getpid()}.log"
        started = time.time()
        try:
            run_watched(pipeline, log) if self.local_mode() == "multi_processing" else pipeline()
        except InputError as e:
            raise InputError(f"{e}{_see(log)}") from None
        except Exception as e:  # a worker's error reaches here as text, with its traceback
            raise InputError(pipeline_error(e, od.path) + _see(log)) from None
        except BaseException:
            _remove(log)
            raise
        _remove(log)
        ended = time.time()
        if needs_cutoff(cfg):
            cfg = self.found_cutoff(cfg, stage.read_json("cutoff.json")["test_from"])

        read = new_read_counts()
        units_read = stage.read_jsons("read", "unit-*.json")
        for r in units_read:
            add_read_counts(read, r)
            self.workers.add(r["worker"])
            self.rss_read.append(r["peak_rss_mb"])
        results, spans = {}, []
        for r in stage.read_jsons("results", "bucket-*.json"):
            self.workers.add(r.pop("worker"))
            self.rss_buckets.append(r.pop("peak_rss_mb"))
            spans.append((r.pop("started"), r.pop("ended"), r.pop("setup_s")))
            results[r["bucket"]] = r
        self.phases = phases(started, ended, [(r["started"], r["ended"]) for r in units_read],
                             spans)
        for b in range(cfg.n_buckets):  # a bucket no row hashed to never reached a worker
            if b not in results:
                with stage.shard_dir() as d:  # writes no file: no measurements
                    results[b] = process_bucket(b, empty(), cfg, d)
        if read["rows_in"] != rows_total:
            raise InputError(f"{od.path}: the pipeline read {read['rows_in']:,} of {rows_total:,} "
                             "rows; re-run `prep shards`")
        stage.clear_records()
        return cfg, read, [results[b] for b in sorted(results)]

    def _pipeline(self, units: list, cfg: ShardsConfig, stage: str) -> None:
        """The pipeline of the module docstring, run to its end."""
        from prep.shards.beam_worker import BucketFn, read_unit, resolve_cutoff

        beam = self.beam
        tasks = [json.dumps([i, parts]) for i, parts in enumerate(units)]
        want_cutoff = needs_cutoff(cfg)
        with beam.Pipeline(runner=self.beam_runner, options=self.options) as p:
            routed = (p
                      | "units" >> beam.Create(tasks)
                      | "read+route" >> beam.FlatMap(read_unit, stage, cfg.n_buckets, want_cutoff)
                          .with_output_types(tuple[int, str])  # the main output's coders
                          .with_outputs("minutes", main="rows"))
            side = []
            if want_cutoff:
                cutoff = (routed.minutes
                          | "minutes" >> beam.CombinePerKey(sum)
                          | "all minutes" >> beam.combiners.ToList()
                          | "cutoff" >> beam.Map(resolve_cutoff, cfg.test_fraction, stage))
                side = [beam.pvalue.AsSingleton(cutoff)]
            _ = (routed.rows
                 | "by bucket" >> beam.GroupByKey()
                 | "bucket" >> beam.ParDo(BucketFn(config_to_json(cfg), stage), *side))


def phases(started: float, ended: float, units: list[tuple], buckets: list[tuple]) -> dict:
    """Where the pipeline's time went, in seconds, from the workers' records (wall clocks:
    one machine's here, a cluster's synchronised ones there): ``start`` (the pipeline's
    start to the first unit read: workers started, Beam and prep imported), ``read`` (first
    unit's start to last unit's end), ``shuffle`` (to the first bucket's start: the
    GroupByKey and the bucket step's start, its ``setup`` included), ``setup`` (the longest
    of the workers' kernel loads), ``buckets`` (first bucket's start to last's end),
    ``teardown`` (to the pipeline's end)."""
    if not units or not buckets:
        return {"pipeline": round(ended - started, 3)}
    u0, u1 = min(u[0] for u in units), max(u[1] for u in units)
    b0, b1 = min(b[0] for b in buckets), max(b[1] for b in buckets)
    return {k: round(v, 3) for k, v in {
        "pipeline": ended - started, "start": u0 - started, "read": u1 - u0,
        "shuffle": b0 - u1, "setup": max(b[2] for b in buckets), "buckets": b1 - b0,
        "teardown": ended - b1}.items()}


def pipeline_error(e: Exception, out) -> str:
    """One line for a failed pipeline: a worker's own InputError as it said it (it names the
    file and the fix), else the last line of what the worker raised."""
    text = str(e)
    said = re.findall(r"InputError: (.+?)(?: \[while running '[^']*'\])?$", text, re.MULTILINE)
    if said:
        return f"{said[-1]} (on a Beam worker; nothing was published)"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()] or [type(e).__name__]
    return (f"{out}: the Beam pipeline failed: {lines[-1]}; nothing was published; fix that "
            "and re-run `prep shards`")


class WorkerDied(InputError):
    """A worker process of Beam's local runner (multi_processing) exited mid-run."""


def _see(log: Path | None) -> str:
    return f"; the workers' log: {log}" if log is not None and log.exists() else ""


def _remove(log: Path | None) -> None:
    if log is not None:
        log.unlink(missing_ok=True)


def run_watched(pipeline, log: Path | None = None) -> None:
    """Run ``pipeline()`` on a helper thread while this (main) thread waits in short steps;
    with ``log``, what the worker processes (and Beam here) write on stderr goes to that
    file: a worker prints each failure as a traceback, which the run says in one line.

    Beam's FnApiRunner waits without end for a worker process that died (killed by the OOM
    killer, say): its bundle's reply never comes, and the only trace is an exception in
    the thread that started the process. Here that exception ends the run (``WorkerDied``),
    and SIGINT/SIGTERM reach the main thread whatever Beam waits on (the helper thread and
    the threads it starts block them). Either way the worker processes this process
    started are stopped before the error goes up, so none writes into a folder being
    removed."""
    died: list[str] = []
    stopping = threading.Event()
    old_hook = threading.excepthook

    def hook(args):
        if "Worker subprocess exited with return code" in str(args.exc_value):
            died.append(str(args.exc_value))
        elif not stopping.is_set() and args.exc_type.__name__ != "RpcError":
            old_hook(args)
        # a gRPC stream closed under Beam's threads: a worker's death, said once by the above

    # the same echo, as a log line of the runner's data plane
    quiet = logging.getLogger("apache_beam.runners.worker.data_plane")
    quiet_level = quiet.level

    box: dict = {}

    def target():
        try:
            pipeline()
        except BaseException as e:  # handed to the main thread, which raises it
            box["error"] = e

    threading.excepthook = hook
    quiet.setLevel(logging.CRITICAL)
    saved = None
    if log is not None:  # workers started meanwhile inherit this stderr
        sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        saved = os.dup(2)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        with signals_blocked():
            t = threading.Thread(target=target, name="beam-pipeline", daemon=True)
            t.start()
        while t.is_alive():
            t.join(0.2)
            if died:
                code = int(died[0].rsplit(" ", 1)[-1])
                raise WorkerDied(
                    f"a Beam worker process exited mid-run ({_exit_cause(code)}); nothing "
                    "was published; re-run `prep shards`, with more --buckets if it ran "
                    "out of memory")
    except BaseException:
        stopping.set()
        logging.getLogger("apache_beam").setLevel(logging.CRITICAL)
        _stop_worker_processes()
        raise
    finally:
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        if not stopping.is_set():  # else Beam's threads still have errors to echo
            threading.excepthook = old_hook
            quiet.setLevel(quiet_level)
    if "error" in box:
        raise box["error"]


def _exit_cause(code: int) -> str:
    if code < 0 or code > 128:
        n = -code if code < 0 else code - 128
        with_name = signal.Signals(n).name if n in signal.Signals._value2member_map_ else n
        return f"killed by signal {with_name}" + (", e.g. by the OOM killer" if n == 9 else "")
    return f"exit code {code}"


def _stop_worker_processes(timeout: float = 5.0) -> None:
    """SIGKILL the SDK worker processes this process started (Beam starts each as
    ``/bin/sh -c python -m apache_beam.runners.worker.sdk_worker_main``), and their children;
    wait until they are gone. Linux (/proc); elsewhere nothing is found."""
    pids = _children(os.getpid(), "sdk_worker_main")
    pids += [c for p in pids for c in _children(p)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(_alive(p) for p in pids):
        time.sleep(0.05)


def _children(parent: int, marker: str = "") -> list[int]:
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent and marker.encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has stopped; its parent reaps it
