"""`prep shards --runner beam` beside the local runner on the same 2M measurements: what the
engine costs.

Two pairs, each the same data, config and worker count, timed from call to return:

- Beam's FnApiRunner in this process vs the local runner with one worker (``beam.*``);
- Beam's FnApiRunner with 2 worker processes (``direct_running_mode=multi_processing``,
  what a cluster runner does, on this machine) vs the local runner with 2 processes
  (``beam.mp2_*``), on 2M and 10M measurements (``beam.mp2_10m_*``): at 2M Beam's fixed
  start-up, paid once per run on a cluster, is most of its run; ``beam.mp2_marginal_vs_local``
  (the 10M run less the 2M one, each runner) is the per-measurement cost. The pipeline split
  by the workers' records (beam_runner.phases): ``beam.mp2_<phase>_s`` (start, read, ...);
  ``beam.mp2_startup_s`` is a whole Beam run on 2,000 measurements; ``beam.mp2_empty_s`` a
  pipeline of the same shape doing nothing (Beam's own cost: its workers started, its
  stages run, its workers stopped), and ``beam.mp2_empty_over_local_2workers`` that over the
  local runner's 2M run (Beam's cost alone is that much of 1.2x's 0.2 budget).

- with a local S3-compatible server (moto's on 127.0.0.1, prep/tools/s3_server.py; skipped
  without it), the second pair again with ``--out s3://…`` (``beam.*_to_bucket_*``): the
  local runner stages on this disk and uploads at the end; Beam's worker processes write
  their shards into the bucket themselves (prep.shards.beam_worker.BucketStage).
  ``beam.mp2_to_bucket_vs_folder``: what writing into the bucket costs Beam.

``beam.cpu_ratio_vs_local``: the first pair in CPU seconds (both in this process), which
other programs on a shared machine disturb far less than the wall time (not the second
pair: the local pool's workers are a fork server's children, uncounted here).
``*_identical_shards`` is 1.0 when every shard file and the manifest (timing fields aside;
for a bucket, the generation prefix of the shard paths too) equal the local runner's.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROWS = 2_000_000
BIG = 10_000_000  # where start-up no longer dominates: the per-measurement cost
TWO_PROCESSES = ("direct_running_mode=multi_processing", "direct_num_workers=2")


def _phases(timing: dict, prefix: str) -> dict[str, float]:
    return {f"{prefix}_{k}_s": v for k, v in timing["phases_s"].items() if k != "pipeline"}


def _timing(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())["timing"]


def _same(a: Path, b: Path) -> float:
    """1.0 when both datasets hold the same shard bytes and the same manifest records."""
    def files(d):
        return {p.relative_to(d): p.read_bytes() for p in d.rglob("*.array_record")}

    def manifest(d):
        m = json.loads((d / "manifest.json").read_text())
        return {k: v for k, v in m.items() if k not in ("elapsed_s", "timing")}

    return float(files(a) == files(b) and manifest(a) == manifest(b))


def _same_in_bucket(folder: Path, uri: str) -> float:
    """``_same`` for the dataset at ``uri``: its shards read from the bucket."""
    from prep.base import storage
    from prep.base.storage import Remote

    loc = Remote.parse(uri)
    m = json.loads(storage.read_bytes(loc.child("manifest.json")))
    want = json.loads((folder / "manifest.json").read_text())
    paths = [e["path"] for sp in m["splits"].values() for e in sp["shards"]]
    for sp in m["splits"].values():
        for e in sp["shards"]:
            e["path"] = e["path"].split("/", 1)[1]  # g<time>-<token>/train/… -> train/…
    same = all(storage.read_bytes(loc.child(p)) == (folder / p.split("/", 1)[1]).read_bytes()
               for p in paths)
    drop = ("elapsed_s", "timing")
    return float(same and len(paths) == len(list(folder.rglob("*.array_record")))
                 and {k: v for k, v in m.items() if k not in drop}
                 == {k: v for k, v in want.items() if k not in drop})


def _to_bucket(raw: str, cfg, d: Path) -> dict[str, float]:
    """The 2-process pair with ``--out`` on a bucket of a local S3 server."""
    from prep.base import storage
    from prep.base.storage import Remote
    from prep.shards.beam_runner import run_beam
    from prep.shards.local_runner import run_shards
    from prep.tools import s3_server

    if s3_server.available() is not None:
        print(f"[bench] beam to a bucket skipped: {s3_server.available()}", file=sys.stderr)
        return {}
    saved = dict(os.environ)
    with s3_server.S3Server() as s3:
        s3.make_bucket("bench")
        os.environ.update(s3.env())
        try:
            local, _ = _timed(run_shards, [raw], "s3://bench/local2", cfg, workers=2,
                              progress=False)
            mp2, _ = _timed(run_beam, [raw], "s3://bench/mp2", cfg,
                            beam_options_kv=TWO_PROCESSES, progress=False)
            same = _same_in_bucket(d / "local2", "s3://bench/mp2")
            timing = json.loads(storage.read_bytes(
                Remote.parse("s3://bench/mp2/manifest.json")))["timing"]
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return {"beam.local_2workers_to_bucket_measurements_per_s": ROWS / local,
            "beam.mp2_to_bucket_measurements_per_s": ROWS / mp2,
            "beam.mp2_to_bucket_slowdown_vs_local_to_bucket": mp2 / local,
            "beam.mp2_to_bucket_identical_shards": same} | _phases(timing, "beam.mp2_to_bucket")


def _pairs(x: int) -> list[tuple[int, str]]:
    return [(x % 4, "name")]


def _nothing(kv) -> int:
    return kv[0]


def _empty_pipeline_s() -> float:
    """Wall seconds of a pipeline of the same shape as `prep shards`' (Create, FlatMap,
    GroupByKey, a step after it) on the same runner and 2 worker processes, doing nothing:
    Beam's own cost (workers started, stages run, workers stopped); the best of two."""
    from prep.shards.beam_runner import beam_options, run_watched

    def pipeline():
        with beam.Pipeline(runner=runner, options=options) as p:
            _ = (p | beam.Create(list(range(8))) | beam.FlatMap(_pairs) | beam.GroupByKey()
                 | beam.Map(_nothing))

    best = float("inf")
    with tempfile.TemporaryDirectory() as d:
        for _ in range(2):
            beam, options, runner = beam_options(list(TWO_PROCESSES))
            t = time.perf_counter()
            run_watched(pipeline, Path(d) / "workers.log")  # as run_beam runs it, quiet
            best = min(best, time.perf_counter() - t)
    return best


def _cpu_s() -> float:
    """CPU seconds of this process and its ended children."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def _timed(fn, *args, **kw) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn(*args, **kw)``."""
    t, c = time.perf_counter(), _cpu_s()
    fn(*args, **kw)
    return time.perf_counter() - t, _cpu_s() - c


def run() -> dict[str, float]:
    try:
        import apache_beam  # noqa: F401
    except ImportError:
        return {}
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.beam_runner import run_beam
    from prep.shards.bucket import ShardsConfig
    from prep.shards.kernels import warm_kernels
    from prep.shards.local_runner import run_shards

    cfg = ShardsConfig()
    with tempfile.TemporaryDirectory() as t:
        d = Path(t)
        raw, small, big = str(d / "raw"), str(d / "small"), str(d / "big")
        synth(SynthConfig(out=raw, rows=ROWS, probes=2000, days=1, seed=2))
        synth(SynthConfig(out=big, rows=BIG, probes=10_000, days=1, seed=2))
        synth(SynthConfig(out=small, rows=2_000, probes=20, days=1, seed=2))
        warm_kernels(str(d))  # the Numba cache, so no run below compiles
        local1, local1_cpu = _timed(run_shards, [raw], str(d / "local1"), cfg, workers=1,
                                    progress=False)
        beam1, beam1_cpu = _timed(run_beam, [raw], str(d / "beam1"), cfg, progress=False)
        local2, _ = _timed(run_shards, [raw], str(d / "local2"), cfg, workers=2,
                                    progress=False)
        mp2, _ = _timed(run_beam, [raw], str(d / "mp2"), cfg,
                              beam_options_kv=TWO_PROCESSES, progress=False)
        startup, _ = _timed(run_beam, [small], str(d / "mp2-small"), cfg,
                            beam_options_kv=TWO_PROCESSES, progress=False)
        local10, _ = _timed(run_shards, [big], str(d / "local10"), cfg, workers=2,
                            progress=False)
        mp10, _ = _timed(run_beam, [big], str(d / "mp10"), cfg,
                         beam_options_kv=TWO_PROCESSES, progress=False)
        same1, same2 = _same(d / "local1", d / "beam1"), _same(d / "local2", d / "mp2")
        same10 = _same(d / "local10", d / "mp10")
        phases = _phases(_timing(d / "mp2"), "beam.mp2") | _phases(_timing(d / "mp10"),
                                                                   "beam.mp2_10m")
        empty = _empty_pipeline_s()
        bucket = _to_bucket(raw, cfg, d)
    if bucket:
        bucket["beam.mp2_to_bucket_vs_folder"] = (
            ROWS / bucket["beam.mp2_to_bucket_measurements_per_s"]) / mp2
    return bucket | {"beam.measurements_per_s": ROWS / beam1,
            "beam.local_1worker_measurements_per_s": ROWS / local1,
            "beam.slowdown_vs_local": beam1 / local1,
            "beam.cpu_ratio_vs_local": beam1_cpu / local1_cpu,
            "beam.identical_shards": same1,
            "beam.mp2_measurements_per_s": ROWS / mp2,
            "beam.local_2workers_measurements_per_s": ROWS / local2,
            "beam.mp2_slowdown_vs_local_2workers": mp2 / local2,
            "beam.mp2_startup_s": startup,
            "beam.mp2_empty_s": empty,
            "beam.mp2_empty_over_local_2workers": empty / local2,
            "beam.mp2_identical_shards": same2,
            "beam.mp2_10m_measurements_per_s": BIG / mp10,
            "beam.local_2workers_10m_measurements_per_s": BIG / local10,
            "beam.mp2_10m_slowdown_vs_local_2workers": mp10 / local10,
            "beam.mp2_marginal_vs_local": (mp10 - mp2) / (local10 - local2),
            "beam.mp2_10m_identical_shards": same10} | phases
