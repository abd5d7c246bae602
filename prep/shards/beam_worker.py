"""What the Beam pipeline of `prep shards --runner beam` runs on its workers.

A worker gets nothing from the driver's memory: the steps are module-level functions and
one DoFn, which Beam pickles by reference, so a worker runs its own installed ``prep`` (the
driver's wheel: README, "Beam on a cluster"). What travels is JSON text, ints and Arrow IPC
bytes: a read task ``'[unit, [[path, [row group, …]], …]]'`` (a path may be ``s3://…``,
read in place by ranged reads), ``ShardsConfig`` as JSON, the staging location as a string
(``Stage.at``) and a time split's cutoff as a side input.

``Stage`` is the one place the workers (and the driver, reading back) touch the run's
output: the shards (``shard_dir``), each unit's read counts, each bucket's result and the
cutoff (``write_json``, ``read_jsons``). Two kinds, picked by the location:

- ``FolderStage``: a local ``--out``'s staging folder (on a cluster, a shared mount);
- ``BucketStage``: with ``--out s3://…`` (or ``gs://``), the run's new generation prefix in
  the bucket (prep.jobs.remote_out, ``stage_in_bucket``: made by the driver, marker first).
  ``shard_dir`` hands out a local temporary folder and uploads what ``process_bucket``
  wrote there; the JSON results lie beside the shards until the driver reads and removes
  them. A worker reaches the bucket with its own settings (prep.base.storage), so it
  needs no disk shared with the driver.

Each worker puts its ``host:pid`` and peak RSS in its JSON (the manifest's ``timing``).
This module imports Apache Beam at the top: beam_runner imports it only once Beam is known
to be installed.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import fnmatch
import json
import os
import socket
import tempfile
from dataclasses import replace
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa

from prep.base import storage
from prep.base.atomic import write_atomic
from prep.base.errors import InputError
from prep.schema.measurements import ARROW_SCHEMA, DTYPES, Measurements, from_arrow, to_arrow
from prep.schema.splits import default_cutoff, merge_histograms, minute_histogram
from prep.schema.validate import validated_batches
from prep.shards.bucket import ShardsConfig, bucket_of, process_bucket
from prep.shards.dataset import add_read_counts, config_from_dict, new_read_counts, own_rss_mb


class Stage(abc.ABC):
    """The run's staging location, as workers and the driver reach it (the module
    docstring): a folder (``FolderStage``) or a bucket prefix (``BucketStage``), picked by
    ``Stage.at`` from the location's text, on whichever process opens it."""

    RECORDS = ("read", "results")  # the folders of the workers' JSON results

    def __init__(self, location: str):
        self.location = location

    @staticmethod
    def at(location: str) -> Stage:
        return BucketStage(location) if storage.is_remote(location) else FolderStage(location)

    @abc.abstractmethod
    def write_json(self, name: str, obj: dict) -> None:
        """``name`` (e.g. ``results/bucket-00003.json``) written whole, so a retried bundle
        rewrites the same file and a reader never sees half of one."""
        ...

    @abc.abstractmethod
    def read_json(self, name: str) -> dict:
        ...

    @abc.abstractmethod
    def read_jsons(self, folder: str, pattern: str) -> list[dict]:
        """Every ``folder/pattern`` file, by name."""
        ...

    @abc.abstractmethod
    def shard_dir(self):
        """A context manager: the local folder ``process_bucket`` writes its ``train/`` and
        ``test/`` shards under, in their place once the block ends without an error."""
        ...

    def clear_records(self) -> None:
        """Remove the JSON results (the driver, once it has read them)."""


class FolderStage(Stage):
    """A folder: the staging folder of prep.jobs.outdir, on a disk every worker and the
    driver see (this machine, or a shared mount)."""

    def __init__(self, location: str):
        super().__init__(location)
        self.path = Path(location)

    def write_json(self, name: str, obj: dict) -> None:
        path = self.path / name  # temp, then rename
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(obj, sort_keys=True))

    def read_json(self, name: str) -> dict:
        return json.loads((self.path / name).read_text())

    def read_jsons(self, folder: str, pattern: str) -> list[dict]:
        return [json.loads(f.read_text()) for f in sorted((self.path / folder).glob(pattern))]

    @contextlib.contextmanager
    def shard_dir(self):
        yield str(self.path)  # the staging folder itself: shards are written temp, renamed

    # clear_records: nothing to do; the staging folder goes as a whole


class BucketStage(Stage):
    """A bucket prefix: the run's generation prefix (prep.jobs.remote_out, ``stage_in_bucket``),
    reached through prep.base.storage with this process's own settings (AWS_ENDPOINT_URL,
    the credentials' chain), so a worker needs no disk shared with the driver.

    A JSON result is one PUT (an object is visible only once whole); shards are written
    into a local temporary folder on the worker and uploaded to ``<prefix>/train/…``,
    ``<prefix>/test/…`` when ``process_bucket`` has returned; the folder is removed either
    way. A retried bundle writes the same names again, with the same bytes."""

    def __init__(self, location: str):
        super().__init__(location)
        self.loc = storage.Remote.parse(location)

    def write_json(self, name: str, obj: dict) -> None:
        storage.write_bytes(self.loc.child(name), json.dumps(obj, sort_keys=True).encode())

    def read_json(self, name: str) -> dict:
        data = storage.read_bytes(self.loc.child(name))
        if data is None:
            raise InputError(f"{self.loc.child(name)}: missing; a Beam worker did not write "
                             "it (or it was removed meanwhile); re-run `prep shards`")
        return json.loads(data)

    def read_jsons(self, folder: str, pattern: str) -> list[dict]:
        names = sorted(r for r in storage.list_files(self.loc.child(folder))
                       if "/" not in r and fnmatch.fnmatchcase(r, pattern))
        with concurrent.futures.ThreadPoolExecutor(storage.THREADS) as pool:
            return list(pool.map(lambda n: self.read_json(f"{folder}/{n}"), names))

    @contextlib.contextmanager
    def shard_dir(self):
        with tempfile.TemporaryDirectory(prefix="prep-beam-shards-") as d:
            yield d
            files = sorted(p for p in Path(d).rglob("*") if p.is_file())
            storage.transfer([(p, self.loc.child(p.relative_to(d).as_posix())) for p in files],
                             storage.upload, total=sum(p.stat().st_size for p in files),
                             desc="upload", progress=False)

    def clear_records(self) -> None:
        for folder in self.RECORDS:
            storage.delete_tree(self.loc.child(folder))
        storage.delete([self.loc.child("cutoff.json")])


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def to_ipc(m: Measurements) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ARROW_SCHEMA) as w:
        w.write_batch(to_arrow(m))
    return sink.getvalue().to_pybytes()


def from_ipc(blobs) -> Measurements:
    tables = [pa.ipc.open_stream(pa.py_buffer(b)).read_all() for b in blobs]
    return from_arrow(pa.concat_tables(tables) if tables else None)


def read_unit(task: str, stage: str, n_buckets: int, with_minutes: bool = False):
    """Validate one unit; yield (bucket, IPC bytes) per batch and bucket; record its counts
    in ``read/unit-<n>.json``. With ``with_minutes``, also its per-minute histogram on the
    tagged output ``minutes``."""
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
                yield int(bucket), to_ipc(m.take(np.flatnonzero(b == bucket)))
    if with_minutes:
        for minute, n in zip(*(a.tolist() for a in merge_histograms(hists))):
            yield beam.pvalue.TaggedOutput("minutes", (minute, n))
    Stage.at(stage).write_json(f"read/unit-{unit:06d}.json", counts | {
        "worker": worker_id(), "peak_rss_mb": own_rss_mb()})


def resolve_cutoff(pairs, test_fraction: float, stage: str) -> int:
    """The default cutoff from all units' (minute, count) pairs; recorded for the driver."""
    pairs = sorted(pairs)
    cutoff = default_cutoff([p[0] for p in pairs], [p[1] for p in pairs], test_fraction)
    Stage.at(stage).write_json("cutoff.json", {"test_from": cutoff})
    return cutoff


class BucketFn(beam.DoFn):
    """One bucket's pieces → prep.shards.bucket.process_bucket → its shards and its result
    in ``results/bucket-<b>.json``."""

    def __init__(self, cfg_json: str, stage: str):
        self.cfg_json, self.stage = cfg_json, stage

    def setup(self):
        self.cfg = config_from_dict(json.loads(self.cfg_json))
        warm_up(self.cfg)

    def process(self, element, cutoff=None):
        bucket, blobs = element
        cfg = self.cfg if cutoff is None else replace(self.cfg, test_from=int(cutoff))
        stage = Stage.at(self.stage)
        with stage.shard_dir() as d:
            result = process_bucket(bucket, from_ipc(blobs), cfg, d)
        stage.write_json(f"results/bucket-{bucket:05d}.json", result | {
            "worker": worker_id(), "peak_rss_mb": own_rss_mb()})
        yield bucket


def warm_up(cfg: ShardsConfig) -> None:
    """Compile (or load from Numba's cache) the kernels once per worker, not per bundle."""
    cfg = replace(cfg, split="probe", test_from=None)  # the kernels do not depend on the split
    m = Measurements(**{k: np.zeros(2, dt) for k, dt in DTYPES.items()} | {
        "probe": np.ones(2, np.uint64), "time": np.array([0, 60], np.int64),
        "family": np.full(2, 4, np.uint8), "src_lo": np.ones(2, np.uint64),
        "dst_lo": np.full(2, 2, np.uint64), "rtt": np.array([1.0, -1.0])})
    with tempfile.TemporaryDirectory() as d:
        process_bucket(0, m, cfg, d)
