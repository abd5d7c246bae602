"""What the Beam pipeline of `prep shards --runner beam` runs on its workers.

A worker gets nothing from the driver's memory: the steps are module-level functions and
one DoFn, which Beam pickles by reference, so a worker runs its own installed ``prep`` (the
driver's wheel: README, "Beam on a cluster"). What travels is JSON text, ints and names:
a read task ``'[unit, [[path, [row group, …]], …]]'`` (a path may be ``s3://…``, read in
place by ranged reads), ``ShardsConfig`` as JSON, the staging location (``Stage.at``), a
time split's cutoff as a side input, and ``(bucket, spill name)``: the rows themselves go
through the stage, one Arrow IPC file per unit and bucket (``spill/b<b>/u<unit>.arrow``), as
the local runner's do (through Beam's own shuffle they made the run 2.3x slower);
uncompressed in a folder, as the local runner's, and LZ4 in a bucket (``Stage.spill_options``).

``Stage`` is the one place the workers (and the driver, reading back) touch the run's
output: the shards (``shard_dir``), the spill, each unit's read counts, each bucket's
result and the cutoff (``write_bytes``, ``write_json``, ``read_jsons``). Two kinds:

- ``FolderStage``: a local ``--out``'s staging folder (on a cluster, a shared mount);
- ``BucketStage``: with ``--out s3://…`` (or ``gs://``), the run's new generation prefix in
  the bucket (prep.jobs.remote_out, ``stage_in_bucket``: made by the driver, marker first).
  ``shard_dir`` hands out a local temporary folder and uploads what ``process_bucket``
  wrote there; the spill and JSON results lie beside the shards until the driver reads and
  removes them. A worker reaches the bucket with its own settings (prep.base.storage).

Each worker puts its ``host:pid``, peak RSS and wall-clock span in its JSON (the
manifest's ``timing``). This module imports Apache Beam at the top: beam_runner imports it
only once Beam is known to be installed.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import fnmatch
import gc
import json
import os
import shutil
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow as pa

from prep.base import storage
from prep.base.atomic import write_atomic
from prep.base.errors import InputError
from prep.base.jit import no_blas_in_worker
from prep.schema.measurements import ARROW_SCHEMA, DTYPES, FIELDS, Measurements, from_arrow
from prep.schema.splits import default_cutoff, merge_histograms, minute_histogram
from prep.schema.validate import validated_batches
from prep.shards.bucket import ShardsConfig, bucket_of, process_bucket
from prep.shards.dataset import add_read_counts, config_from_dict, new_read_counts, own_rss_mb


class Stage(abc.ABC):
    """The run's staging location, as workers and the driver reach it (the module
    docstring): a folder (``FolderStage``) or a bucket prefix (``BucketStage``), picked by
    ``Stage.at`` from the location's text, on whichever process opens it."""

    RECORDS = ("read", "results", "spill")  # what the workers leave for the driver
    spill_options: pa.ipc.IpcWriteOptions  # how the spill files are written

    def __init__(self, location: str):
        self.location = location

    @staticmethod
    def at(location: str) -> Stage:
        return BucketStage(location) if storage.is_remote(location) else FolderStage(location)

    @abc.abstractmethod
    def write_bytes(self, name: str, data: bytes) -> None:
        """``name`` (e.g. ``results/bucket-00003.json``) written whole, so a retried bundle
        rewrites the same file and a reader never sees half of one."""
        ...

    @abc.abstractmethod
    def read_bytes(self, name: str) -> bytes:
        ...

    def write_many(self, files: list[tuple[str, bytes]]) -> None:
        for name, data in files:
            self.write_bytes(name, data)

    def read_many(self, names: list[str]) -> list[bytes]:
        return [self.read_bytes(n) for n in names]

    def write_json(self, name: str, obj: dict) -> None:
        self.write_bytes(name, json.dumps(obj, sort_keys=True).encode())

    def read_json(self, name: str) -> dict:
        return json.loads(self.read_bytes(name))

    @abc.abstractmethod
    def read_jsons(self, folder: str, pattern: str) -> list[dict]:
        """Every ``folder/pattern`` file, by name."""
        ...

    @abc.abstractmethod
    def shard_dir(self):
        """A context manager: the local folder ``process_bucket`` writes its ``train/`` and
        ``test/`` shards under, in their place once the block ends without an error."""
        ...

    @abc.abstractmethod
    def clear_records(self) -> None:
        """Remove the spill and the JSON results (the driver, once it has read them)."""


class FolderStage(Stage):
    """A folder: the staging folder of prep.jobs.outdir, on a disk every worker and the
    driver see (this machine, or a shared mount). The spill is uncompressed, as the local
    runner's: it lives seconds in the page cache, and LZ4 cost a 10M-row run more CPU to
    compress and read back than the bytes it saved (docs/measurements.md)."""

    spill_options = pa.ipc.IpcWriteOptions(compression=None)

    def __init__(self, location: str):
        super().__init__(location)
        self.path = Path(location)

    def write_bytes(self, name: str, data: bytes) -> None:
        path = self.path / name  # temp, then rename
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, data)

    def read_bytes(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def read_jsons(self, folder: str, pattern: str) -> list[dict]:
        return [json.loads(f.read_text()) for f in sorted((self.path / folder).glob(pattern))]

    @contextlib.contextmanager
    def shard_dir(self):
        yield str(self.path)  # the staging folder itself: shards are written temp, renamed

    def clear_records(self) -> None:  # the rest goes with the staging folder
        shutil.rmtree(self.path / "spill", ignore_errors=True)


class BucketStage(Stage):
    """A bucket prefix: the run's generation prefix (prep.jobs.remote_out, ``stage_in_bucket``),
    reached through prep.base.storage with this process's own settings (AWS_ENDPOINT_URL,
    the credentials' chain), so a worker needs no disk shared with the driver.

    A JSON result is one PUT (an object is visible only once whole); shards are written
    into a local temporary folder on the worker and uploaded to ``<prefix>/train/…``,
    ``<prefix>/test/…`` when ``process_bucket`` has returned; the folder is removed either
    way. A retried bundle writes the same names again, with the same bytes. The spill is
    LZ4: a third of the bytes to upload and read back."""

    spill_options = pa.ipc.IpcWriteOptions(compression="lz4")

    def __init__(self, location: str):
        super().__init__(location)
        self.loc = storage.Remote.parse(location)

    def write_bytes(self, name: str, data: bytes) -> None:
        storage.write_bytes(self.loc.child(name), data)

    def read_bytes(self, name: str) -> bytes:
        data = storage.read_bytes(self.loc.child(name))
        if data is None:
            raise InputError(f"{self.loc.child(name)}: missing; a Beam worker did not write "
                             "it (or it was removed meanwhile); re-run `prep shards`")
        return data

    def write_many(self, files: list[tuple[str, bytes]]) -> None:  # several PUTs at once
        with concurrent.futures.ThreadPoolExecutor(storage.THREADS) as pool:
            list(pool.map(lambda f: self.write_bytes(*f), files))

    def read_many(self, names: list[str]) -> list[bytes]:
        with concurrent.futures.ThreadPoolExecutor(storage.THREADS) as pool:
            return list(pool.map(self.read_bytes, names))

    def read_jsons(self, folder: str, pattern: str) -> list[dict]:
        names = sorted(r for r in storage.list_files(self.loc.child(folder))
                       if "/" not in r and fnmatch.fnmatchcase(r, pattern))
        return [json.loads(b) for b in self.read_many([f"{folder}/{n}" for n in names])]

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


def in_sdk_worker() -> bool:
    """Whether this process is an SDK worker process that Beam started for its work (as
    sdk_worker_main, which reads its control endpoint from this variable), not a driver
    running the pipeline in itself."""
    return "CONTROL_API_SERVICE_DESCRIPTOR" in os.environ


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def spill_name(bucket: int, unit: int) -> str:
    return f"spill/b{bucket:05d}/u{unit:06d}.arrow"


def read_unit(task: str, stage: str, n_buckets: int, with_minutes: bool = False):
    """Validate one unit; write its rows into the stage, one spill file per bucket it holds
    (``spill_name``), and yield ``(bucket, spill name)`` for each; record its counts and
    its start and end in ``read/unit-<n>.json``. With ``with_minutes``, also its per-minute
    histogram on the tagged output ``minutes``."""
    started = time.time()
    unit, parts = json.loads(task)
    counts = new_read_counts()
    hists = []
    sinks: dict[int, tuple] = {}  # bucket -> (buffer, IPC stream writer)
    st = Stage.at(stage)
    for path, row_groups in parts:
        for batch in validated_batches(path, row_groups):
            m = batch.measurements
            add_read_counts(counts, batch.counts())
            if with_minutes:
                hists.append(minute_histogram(m.time))
            b = bucket_of(m.probe, n_buckets)
            if n_buckets <= 1 << 16:  # a radix sort on uint16, 3x quicker than on int64
                b = b.astype(np.uint16)
            order = np.argsort(b, kind="stable")
            bounds = np.searchsorted(b[order], np.arange(n_buckets + 1))
            cols = [getattr(m, k)[order] for k in FIELDS]
            for bucket in np.flatnonzero(np.diff(bounds)).tolist():
                if bucket not in sinks:
                    sink = pa.BufferOutputStream()
                    sinks[bucket] = sink, pa.ipc.new_stream(sink, ARROW_SCHEMA,
                                                            options=st.spill_options)
                lo, hi = bounds[bucket], bounds[bucket + 1]
                sinks[bucket][1].write_batch(
                    pa.record_batch([c[lo:hi] for c in cols], schema=ARROW_SCHEMA))
    files = []
    for bucket, (sink, w) in sorted(sinks.items()):
        w.close()
        files.append((spill_name(bucket, unit), sink.getvalue().to_pybytes()))
    st.write_many(files)
    for bucket, (name, _) in zip(sorted(sinks), files):
        yield bucket, name
    if with_minutes:
        for minute, n in zip(*(a.tolist() for a in merge_histograms(hists))):
            yield beam.pvalue.TaggedOutput("minutes", (minute, n))
    st.write_json(f"read/unit-{unit:06d}.json", counts | {
        "worker": worker_id(), "peak_rss_mb": own_rss_mb(),
        "started": started, "ended": time.time()})


def read_spill(stage: Stage, names) -> Measurements:
    """A bucket's measurements from its spill files (in any order: plan_contexts sorts)."""
    tables = [pa.ipc.open_stream(pa.py_buffer(b)).read_all()
              for b in stage.read_many(sorted(names))]
    return from_arrow(pa.concat_tables(tables) if tables else None)


def resolve_cutoff(pairs, test_fraction: float, stage: str) -> int:
    """The default cutoff from all units' (minute, count) pairs; recorded for the driver."""
    pairs = sorted(pairs)
    cutoff = default_cutoff([p[0] for p in pairs], [p[1] for p in pairs], test_fraction)
    Stage.at(stage).write_json("cutoff.json", {"test_from": cutoff})
    return cutoff


class BucketFn(beam.DoFn):
    """One bucket's spill files → prep.shards.bucket.process_bucket → its shards and its
    result in ``results/bucket-<b>.json`` (with its start and end, and how long this
    worker's ``setup`` took: the kernels loaded from Numba's cache).

    A bucket's shards go into place (``shard_dir``'s end: on a bucket, the upload) and its
    result is written on a thread of their own, while the next bucket is computed; the
    bundle ends (``finish_bundle``) only once every one of its buckets is in place, and the
    first failure fails it."""

    def __init__(self, cfg_json: str, stage: str):
        self.cfg_json, self.stage = cfg_json, stage

    def setup(self):
        t = time.time()
        self.cfg = config_from_dict(json.loads(self.cfg_json))
        no_blas_in_worker(in_sdk_worker())
        warm_up(self.cfg)
        self.setup_s = time.time() - t
        self.placing = concurrent.futures.ThreadPoolExecutor(1, "place-shards")
        self.pending: list[concurrent.futures.Future] = []

    def finish_bundle(self):
        pending, self.pending = self.pending, []
        for f in pending:
            f.result()

    def teardown(self):
        self.placing.shutdown(wait=True, cancel_futures=True)  # nothing writes on after
        # In an SDK worker process (sdk_worker_main reads its control endpoint from this
        # variable; a driver running the pipeline in itself has none), which is about to
        # exit: Beam's runner here closes its workers one after another, each waiting for
        # the previous one's exit, and Python's last garbage collection over Beam, Numba and
        # Arrow took half of a worker's ~0.6 s exit. Frozen objects are left to the exit.
        if in_sdk_worker():
            gc.freeze()

    def process(self, element, cutoff=None):
        started = time.time()
        bucket, names = element
        cfg = self.cfg if cutoff is None else replace(self.cfg, test_from=int(cutoff))
        for f in self.pending:  # an earlier bucket's failure ends the bundle now
            if f.done():
                f.result()
        stage = Stage.at(self.stage)
        with contextlib.ExitStack() as stack:  # on an error: no upload, the folder removed
            d = stack.enter_context(stage.shard_dir())
            result = process_bucket(bucket, read_spill(stage, names), cfg, d)
            place = stack.pop_all()
        result |= {"worker": worker_id(), "peak_rss_mb": own_rss_mb(), "setup_s": self.setup_s,
                   "started": started}
        self.pending.append(self.placing.submit(self._place, stage, place, bucket, result))
        yield bucket

    @staticmethod
    def _place(stage: Stage, place: contextlib.ExitStack, bucket: int, result: dict) -> None:
        place.close()  # shard_dir's end
        stage.write_json(f"results/bucket-{bucket:05d}.json", result | {"ended": time.time()})


def warm_up(cfg: ShardsConfig) -> None:
    """Compile (or load from Numba's cache) the kernels once per worker, not per bundle."""
    cfg = replace(cfg, split="probe", test_from=None)  # the kernels do not depend on the split
    m = Measurements(**{k: np.zeros(2, dt) for k, dt in DTYPES.items()} | {
        "probe": np.ones(2, np.uint64), "time": np.array([0, 60], np.int64),
        "family": np.full(2, 4, np.uint8), "src_lo": np.ones(2, np.uint64),
        "dst_lo": np.full(2, 2, np.uint64), "rtt": np.array([1.0, -1.0])})
    with tempfile.TemporaryDirectory() as d:
        process_bucket(0, m, cfg, d)
