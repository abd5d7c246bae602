"""`prep shards --runner beam`: the same ETL on Apache Beam, for inputs past one machine.

The pipeline is the local runner's two passes with Beam doing the shuffle:

1. ``Create(units)``: the inputs cut into units of whole parquet row groups
   (``prep.shards.dataset.read_units``), so workers read in parallel and in bounded pieces.
2. ``FlatMap(read_unit)``: validate a unit batch by batch and emit, per batch and bucket,
   ``(bucket, Arrow IPC bytes of that bucket's rows)``; the unit's read counts go to
   ``<stage>/read/unit-<n>.json``. Elements are ints and bytes with Beam's own coders: no pickle
   of data.
3. ``GroupByKey``: a bucket's pieces meet on one worker (memory bounded by the bucket).
4. ``ParDo(BucketFn)``: the very ``prep.shards.bucket.process_bucket`` the local pool calls, writing
   that bucket's shards under names derived from the bucket (temp, then rename) and its
   result to ``<stage>/results/bucket-<b>.json``. ``setup`` warms the Numba kernels once
   per worker. Beam's file sinks are not used: their shard assignment is random.

A time split without ``--test-from`` (``--split time|time+probe``) needs its cutoff before
any bucket is written: ``read_unit`` then also emits, on the tagged output ``minutes``, each
unit's per-minute histogram as ``(minute, count)`` pairs; ``CombinePerKey(sum)`` and
``ToList`` gather them into one list, ``resolve_cutoff`` turns it into the cutoff (the
local runner's very rule, ``prep.schema.splits.default_cutoff``) and records it in
``<stage>/cutoff.json`` for the manifest (a shared folder, as for the shards), and ``BucketFn`` takes it as a singleton side
input, so every bucket uses the same resolved config as the local runner would.

This module holds only that pipeline and the reading back of its JSON files
(``BeamPasses``); the frame around it is the local runner's very one
(``prep.shards.dataset.build``: the inputs listed and hashed, the start line, the manifest
built and the staging folder published by prep.jobs.outdir: lock, ``--overwrite``, the
swap), so both give byte-identical shards and the same manifest (timing fields aside).
A failed pipeline publishes nothing: its staging folder
``<out>/.tmp-beam-<pid>-<token>`` is removed (or, if the driver was killed, by the next
run), and a dataset already in ``<out>`` stays as it was.

Runners: the default is Beam's in-process ``FnApiRunner`` (pinned: Beam's default local
runner would try to download a binary at run time). ``--beam-option runner=...`` picks
another (Dataflow, Flink, Spark); then ``--out`` must be a folder every worker can write,
e.g. a shared filesystem mount, since ArrayRecord writes local paths.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from prep.shards.bucket import ShardsConfig, bucket_of, process_bucket
from prep.shards.dataset import (
    Passes,
    add_read_counts,
    build,
    config_to_json,
    needs_cutoff,
    new_read_counts,
)
from prep.schema.errors import InputError
from prep.schema.measurements import ARROW_SCHEMA, DTYPES, Measurements, empty, from_arrow, to_arrow
from prep.schema.splits import default_cutoff, merge_histograms, minute_histogram
from prep.schema.validate import validated_batches
from prep.schema.words import count


def _import_beam():
    try:
        import apache_beam as beam
    except ImportError:
        raise InputError("--runner beam needs Apache Beam: pip install 'ping-pack[beam]' "
                         "(or use the default --runner local)") from None
    return beam


def _to_ipc(m: Measurements) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ARROW_SCHEMA) as w:
        w.write_batch(to_arrow(m))
    return sink.getvalue().to_pybytes()


def _from_ipc(blobs) -> Measurements:
    tables = [pa.ipc.open_stream(pa.py_buffer(b)).read_all() for b in blobs]
    return from_arrow(pa.concat_tables(tables) if tables else None)


def _write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    os.replace(tmp, path)  # a retried bundle rewrites the same file: idempotent


def read_unit(task: str, stage: str, n_buckets: int, with_minutes: bool = False):
    """Validate one unit; yield (bucket, IPC bytes) per batch and bucket; record its counts.
    With ``with_minutes``, also its per-minute histogram on the tagged output ``minutes``."""
    unit, parts = json.loads(task)
    counts = new_read_counts()
    hists = []
    for path, row_groups in parts:
        for batch in validated_batches(path, row_groups):
            m = batch.measurements
            add_read_counts(counts, batch.counts())
            if with_minutes:
                hists.append(minute_histogram(m.time))
            b = bucket_of(m.probe, n_buckets)
            for bucket in np.unique(b):
                yield int(bucket), _to_ipc(m.take(np.flatnonzero(b == bucket)))
    if with_minutes:
        beam = _import_beam()
        for minute, n in zip(*(a.tolist() for a in merge_histograms(hists))):
            yield beam.pvalue.TaggedOutput("minutes", (minute, n))
    _write_json(Path(stage) / "read" / f"unit-{unit:06d}.json", counts)


def resolve_cutoff(pairs, test_fraction: float, stage: str) -> int:
    """The default cutoff from all units' (minute, count) pairs; recorded for the driver."""
    pairs = sorted(pairs)
    cutoff = default_cutoff([p[0] for p in pairs], [p[1] for p in pairs], test_fraction)
    _write_json(Path(stage) / "cutoff.json", {"test_from": cutoff})
    return cutoff


def _bucket_fn(beam):
    class BucketFn(beam.DoFn):
        def __init__(self, cfg_json: str, stage: str):
            self.cfg_json, self.stage = cfg_json, stage

        def setup(self):
            from prep.shards.dataset import config_from_dict

            self.cfg = config_from_dict(json.loads(self.cfg_json))
            _warm_up(self.cfg)

        def process(self, element, cutoff=None):
            bucket, blobs = element
            cfg = self.cfg if cutoff is None else replace(self.cfg, test_from=int(cutoff))
            result = process_bucket(bucket, _from_ipc(blobs), cfg, self.stage)
            _write_json(Path(self.stage) / "results" / f"bucket-{bucket:05d}.json", result)
            yield bucket

    return BucketFn


def _warm_up(cfg: ShardsConfig) -> None:
    """Compile (or load from cache) the Numba kernels once per worker, not per bundle."""
    import tempfile

    cfg = replace(cfg, split="probe", test_from=None)  # the kernels do not depend on the split
    m = Measurements(**{k: np.zeros(2, dt) for k, dt in DTYPES.items()} | {
        "probe": np.ones(2, np.uint64), "time": np.array([0, 60], np.int64),
        "family": np.full(2, 4, np.uint8), "src_lo": np.ones(2, np.uint64),
        "dst_lo": np.full(2, 2, np.uint64), "rtt": np.array([1.0, -1.0])})
    with tempfile.TemporaryDirectory() as d:
        process_bucket(0, m, cfg, d)


def beam_options(pairs: list[str]):
    """PipelineOptions and runner from KEY=VALUE pairs (``runner`` picks the runner)."""
    beam = _import_beam()
    from apache_beam.options.pipeline_options import PipelineOptions

    flags, runner = [], None
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise InputError(f"--beam-option {p!r}: expected KEY=VALUE, e.g. runner=DataflowRunner")
        if key == "runner":
            runner = value
        else:
            flags.append(f"--{key}={value}")
    if runner is None:
        # Pinned: the default DirectRunner may pick the Prism runner, which downloads a binary.
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        runner = FnApiRunner()
    return beam, PipelineOptions(flags), runner


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

    def __init__(self, beam, options, beam_runner):
        self.beam, self.options, self.beam_runner = beam, options, beam_runner

    def describe(self, n_files: int, rows: int) -> str:
        r = self.beam_runner
        return (f"prep shards (beam, {type(r).__name__ if not isinstance(r, str) else r}): "
                f"{count(n_files, 'input file')}, {count(rows, 'row')}")

    def timing(self) -> dict:
        return {"runner": "beam", "workers": None, "read_s": None, "peak_rss_mb": None}

    def run(self, od, units: list, rows_total: int, cfg: ShardsConfig,
            t0: float) -> tuple[ShardsConfig, dict, list[dict]]:
        beam, stage = self.beam, od.stage
        tasks = [json.dumps([i, parts]) for i, parts in enumerate(units)]
        BucketFn = _bucket_fn(beam)
        want_cutoff = needs_cutoff(cfg)
        with beam.Pipeline(runner=self.beam_runner, options=self.options) as p:
            routed = (p
                      | "units" >> beam.Create(tasks)
                      | "read+route" >> beam.FlatMap(read_unit, str(stage), cfg.n_buckets,
                                                     want_cutoff)
                          .with_output_types(tuple[int, bytes])  # the main output's coders
                          .with_outputs("minutes", main="rows"))
            side = []
            if want_cutoff:
                cutoff = (routed.minutes
                          | "minutes" >> beam.CombinePerKey(sum)
                          | "all minutes" >> beam.combiners.ToList()
                          | "cutoff" >> beam.Map(resolve_cutoff, cfg.test_fraction, str(stage)))
                side = [beam.pvalue.AsSingleton(cutoff)]
            _ = (routed.rows
                 | "by bucket" >> beam.GroupByKey()
                 | "bucket" >> beam.ParDo(BucketFn(config_to_json(cfg), str(stage)), *side))
        if want_cutoff:
            cutoff = json.loads((stage / "cutoff.json").read_text())["test_from"]
            cfg = self.found_cutoff(cfg, cutoff)

        read = new_read_counts()
        for f in sorted((stage / "read").glob("unit-*.json")):
            add_read_counts(read, json.loads(f.read_text()))
        results = {}
        for f in sorted((stage / "results").glob("bucket-*.json")):
            r = json.loads(f.read_text())
            results[r["bucket"]] = r
        for b in range(cfg.n_buckets):  # a bucket no row hashed to never reached a worker
            if b not in results:
                results[b] = process_bucket(b, empty(), cfg, str(stage))
        if read["rows_in"] != rows_total:
            raise InputError(f"{od.path}: the pipeline read {read['rows_in']:,} of {rows_total:,} "
                             "rows; re-run `prep shards`")
        return cfg, read, [results[b] for b in sorted(results)]
