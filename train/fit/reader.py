"""Packed rows from a shards folder into device batches: a thin Grain pipeline.

    MapDataset.range(batches per epoch)
      .repeat()                               (train only) epochs without end
      .map_with_index(EpochKeys)              int64[B] record keys: a seeded global shuffle
                                              per epoch, this process's slice of each
                                              global batch
      .map(RowReader)                         one batched ArrayRecordDataSource read per
                                              shard + one np.frombuffer
      .to_iter_dataset() [.mp_prefetch(k)]    optional worker processes
      -> to_device(sharding)                  thread prefetch on host and on device

Grain sees one element per batch, not per row: its per-element cost through a shuffle
would otherwise equal the read itself (docs/measurements.md). So the shuffle is a numpy
permutation per epoch, and each batch is one C++ read per shard followed by one
``np.frombuffer`` over the joined bytes. Batches are ``{"tokens": uint16[B, L], "segment_ids": uint8[B, L]}``;
positions and targets are derived on the device (train.model.model), so 3 bytes per token cross
to the device. The iterator's state (a few ints) is saved with each checkpoint, so a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import grain
import jax
import numpy as np
from absl import flags as absl_flags
from array_record.python.array_record_data_source import ArrayRecordDataSource
from array_record.python.array_record_module import ArrayRecordReader

from prep.base.errors import InputError, first_line
from prep.base.lifetime import die_with_parent
from prep.schema import cache
from prep.schema import manifest as manifest_lib
from prep.schema import rows as rows_lib


def local_copy(data: str | os.PathLike, splits=None) -> Path:
    """The folder to read ``data`` from: itself, or for a bucket path (``s3://``, ``gs://``)
    its local copy of the shards of ``splits``, each checked by the manifest's sha256
    (prep.schema.cache: where it is, how big, when it is reused)."""
    return cache.local_dataset(os.fspath(data), splits=splits)


def open_shards(shards_dir: str | os.PathLike) -> dict:
    """The finished manifest of ``shards_dir``; InputError (one line naming the fix) if not."""
    return manifest_lib.load_manifest(shards_dir)


# shards totalling at most this many bytes are hashed at the start of `train` (check="auto")
HASH_LIMIT_BYTES = 2 << 30


def require_rows(shards_dir: str | os.PathLike, manifest: dict, split: str, fix: str) -> None:
    """InputError (one line, ``fix`` the way out) when the manifest lists no rows in ``split``."""
    entries = manifest_lib.split_entries(manifest, shards_dir, split)
    if not sum(e.get("records", 0) for e in entries):
        raise InputError(f"{shards_dir}: no {split} rows (its manifest.json lists none); {fix}")


def check_data(shards_dir: str | os.PathLike, manifest: dict, splits, *,
               check: str = "auto") -> bool:
    """Hold the shards of ``splits`` to the manifest; InputError naming the first that
    differs. ``check``: "counts" (present, size if listed, record count: a stat and the
    footer per shard), "sha256" (that and every file's digest: reads them all), "auto"
    (sha256 when they total at most HASH_LIMIT_BYTES, else counts). True if hashed."""
    if check not in ("auto", "counts", "sha256"):
        raise InputError(f"--check-data {check}: one of auto, counts, sha256")
    entries = [e for s in splits for e in manifest_lib.split_entries(manifest, shards_dir, s)]
    if check == "auto":
        total = 0
        for e in entries:
            p = manifest_lib.shard_path(shards_dir, e["path"])
            total += p.stat().st_size if p.is_file() else 0
        check = "sha256" if total <= HASH_LIMIT_BYTES else "counts"
    manifest_lib.check_shards(manifest, shards_dir, splits, sha256=check == "sha256",
                              workers=min(4, os.cpu_count() or 1))
    return check == "sha256"


def max_segments(manifest: dict) -> int:
    """Most segments in any row (from the manifest's histogram), at least 1."""
    hist = manifest.get("segments_per_row") or {}
    return max([int(k) for k, v in hist.items() if v] or [rows_lib.MAX_SEGMENTS])


_FIX = "run `prep verify` on the dataset to see what is wrong, `prep shards` to rebuild it"


class SerialArrayRecordSource(ArrayRecordDataSource):
    """ArrayRecordDataSource whose batched read runs in the calling thread.

    The stock ``__getitems__`` starts a thread pool on every call, which at ~1,000 batches
    a second costs more than the reads (bench/bench_reader.py). Here each shard's records
    of a batch are one ``ArrayRecordReader.read(positions)`` call, in C++. It relies on
    the base class's reader bookkeeping of array_record 0.8.x (bounded in pyproject.toml).
    """

    def __getitems__(self, record_keys):
        keys = np.asarray(record_keys)
        bounds = np.asarray(self._prefix_sums)  # cumulative records per shard
        shards = np.searchsorted(bounds, keys, side="right")
        out = [b""] * len(keys)
        for shard in np.unique(shards).tolist():
            slots = np.flatnonzero(shards == shard)
            first = bounds[shard - 1] if shard else 0
            positions = (keys[slots] - first + self._read_instructions[shard].start).tolist()
            self._ensure_reader_exists(shard)
            for slot, record in zip(slots.tolist(), self._readers[shard].read(positions)):
                out[slot] = record
        return out


class RowReader:
    """Record keys -> one decoded batch. Picklable, so it can run in mp_prefetch workers."""

    def __init__(self, paths: list[Path], row_len: int):
        self.paths = [str(p) for p in paths]
        self.row_len = row_len
        try:
            self.source = SerialArrayRecordSource(self.paths)
        except Exception as e:  # array_record raises plain RuntimeError on damage
            for p in self.paths:  # name the file (the check at open usually did already)
                manifest_lib.record_count(p)
            raise InputError(f"{self.paths[0] if len(self.paths) == 1 else 'one of the shards'}"
                             f": unreadable ({first_line(e)}); {_FIX}") from None

    def __len__(self) -> int:
        return len(self.source)

    def __call__(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        try:
            records = self.source.__getitems__(keys)
        except Exception as e:  # a damaged chunk: array_record's RuntimeError, no file name
            self._raise_unreadable(keys, e)
        return self.decode(records, keys)

    def _raise_unreadable(self, keys, error: Exception):
        """InputError naming the shard and record that cannot be read."""
        bounds = np.cumsum([0] + [len(ArrayRecordDataSource([p])) for p in self.paths])
        for key in np.asarray(keys).tolist():
            shard = int(np.searchsorted(bounds, key, side="right")) - 1
            where = f"{self.paths[shard]}#{int(key) - bounds[shard]}"
            try:
                ArrayRecordDataSource([self.paths[shard]])[int(key) - int(bounds[shard])]
            except Exception as e:
                raise InputError(f"{where}: unreadable record ({first_line(e)}); "
                                 f"{_FIX}") from None
        raise InputError(f"{', '.join(self.paths)}: a batch failed to read "
                         f"({first_line(error)}); {_FIX}") from None

    def decode(self, records, keys) -> dict[str, np.ndarray]:
        block = rows_lib.decode_block(records, self.row_len)
        if not block.sound:
            self._raise_first_bad(records, keys)
        return {"tokens": block.tokens.astype(np.uint16),
                "segment_ids": np.ascontiguousarray(block.segment_ids)}

    def _raise_first_bad(self, records, keys):
        """Let prep.schema.rows word the error, naming the shard and the record in it."""
        bounds = np.cumsum([0] + [len(ArrayRecordDataSource([p])) for p in self.paths])
        for rec, key in zip(records, keys):
            shard = int(np.searchsorted(bounds, key, side="right")) - 1
            where = f"{self.paths[shard]}#{int(key) - bounds[shard]}"
            rows_lib.check_record(rec, self.row_len, where=where)
        raise AssertionError("unreachable: a bad record was detected but not found")


def batches(shards_dir: str | os.PathLike, split: str, *, batch_size: int, seed: int,
            train: bool = True, process_index: int | None = None,
            process_count: int | None = None, num_workers: int = 0,
            manifest: dict | None = None) -> grain.IterDataset:
    """Host batches of ``split`` for this process: ``batch_size`` rows each (per process).

    ``train``: shuffle globally and repeat forever; otherwise read once in file order.
    """
    manifest = manifest or open_shards(shards_dir)
    paths = manifest_lib.check_shards(manifest, shards_dir, [split])  # counts: cheap
    reader = RowReader(paths, manifest["row_len"])
    ds = key_batches(len(reader), batch_size=batch_size, seed=seed, train=train,
                     process_index=process_index, process_count=process_count).map(reader)
    # two threads overlap reading with the train step; more did not help (bench_reader)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
    if num_workers > 0:
        # Grain's worker processes read absl flags; outside an absl app nobody parsed them
        if not absl_flags.FLAGS.is_parsed():
            absl_flags.FLAGS.mark_as_parsed()
        # workers that end with this process, however it ends (SIGKILL runs no cleanup)
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers),
                            worker_init_fn=functools.partial(_worker_init, os.getpid()))
    return it


def _worker_init(trainer: int, _worker: int, _workers: int) -> None:
    """A Grain worker ends with its trainer (``trainer``: its pid). Grain starts workers
    from a pool of threads, so they are watched by pid, not PR_SET_PDEATHSIG."""
    die_with_parent(trainer, any_thread=True)


class EpochKeys:
    """Batch number -> its record keys (int64[batch_size]) for one process.

    Batch i is batch ``i % per_epoch`` of epoch ``i // per_epoch``; an epoch is a seeded
    permutation of all rows (``shuffle``) or file order, cut into global batches of
    ``batch_size * process_count`` rows, of which process p takes the p-th contiguous
    ``batch_size``. That is the slice of the global batch its devices hold in the mesh
    (devices are ordered by process), so the global batches, and the run, do not depend
    on how many processes read them: 2 processes of 1 device see what 1 process of 2
    devices sees. A permutation is computed once per epoch in numpy (4-8 bytes a row)
    because Grain's per-element shuffle costs as much as the read.
    """

    def __init__(self, n_rows: int, *, batch_size: int, seed: int, shuffle: bool,
                 process_index: int, process_count: int):
        self.n_rows, self.batch_size, self.seed, self.shuffle = n_rows, batch_size, seed, shuffle
        self.pi, self.pc = process_index, process_count
        self.per_epoch = n_rows // (batch_size * process_count)

    def __call__(self, i: int, _=None) -> np.ndarray:
        epoch, b = divmod(int(i), self.per_epoch)
        first = (b * self.pc + self.pi) * self.batch_size
        return self._order(epoch)[first:first + self.batch_size]

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)


def key_batches(n_rows: int, *, batch_size: int, seed: int, train: bool = True,
                process_index: int | None = None,
                process_count: int | None = None) -> grain.MapDataset:
    """Record keys per batch, in the order `batches` reads them: endless epochs if ``train``."""
    keys = EpochKeys(n_rows, batch_size=batch_size, seed=seed, shuffle=train,
                     process_index=jax.process_index() if process_index is None else process_index,
                     process_count=jax.process_count() if process_count is None else process_count)
    ds = grain.MapDataset.range(keys.per_epoch)
    if train:
        if keys.per_epoch == 0:
            raise InputError(f"{n_rows} rows make no batch of {batch_size * keys.pc} rows; "
                             "use a smaller --batch-size or more data")
        ds = ds.repeat()
    # map_with_index: the index after repeat() counts epochs, the element does not
    return ds.map_with_index(keys)


def to_device(ds: grain.IterDataset, sharding: jax.sharding.Sharding, *,
              host_buffer: int = 4, device_buffer: int = 2,
              segments: bool = False) -> grain.IterDataset:
    """Prefetch on the host, then put each batch on the devices (global arrays) ahead of use.
    ``segments``: each item is (batch, the most segments a row of it holds), the count read
    on the host before the transfer (the trainer sizes cuDNN's tables by it)."""
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=host_buffer)
    put = lambda b: {k: jax.make_array_from_process_local_data(sharding, v) for k, v in b.items()}
    ds = ds.map((lambda b: (put(b), int(b["segment_ids"].max(initial=0)))) if segments else put)
    return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=device_buffer)


def dataset_fingerprint(manifest: dict) -> str:
    """A digest of the dataset's shard files: equal for rebuilds with the same bytes."""
    shas = sorted(e["sha256"] for s in manifest["splits"].values() for e in s["shards"])
    return hashlib.sha256("\n".join(shas).encode()).hexdigest()[:16]


def read_split(shards_dir, manifest: dict, split: str, *, epoch: int = 0,
               sha256: bool = True):
    """(tokens uint16[R, L], segment_ids uint8[R, L]) of a split's shards of one epoch, all
    in memory (evaluation: the test split, or the train split for the baselines). Each
    shard is held to its manifest entry first (prep.schema.manifest.check_shard), its sha256 too
    unless ``sha256`` is False: the whole file is read anyway."""
    L = manifest["row_len"]
    toks, segs = [], []
    for e in manifest_lib.split_entries(manifest, shards_dir, split):
        if e.get("epoch", 0) != epoch:
            continue
        path = manifest_lib.check_shard(shards_dir, e, sha256=sha256)
        try:
            reader = ArrayRecordReader(str(path))
            records = reader.read_all()
            reader.close()
        except Exception as err:  # array_record raises plain RuntimeError on damage
            raise InputError(f"{path}: unreadable ({first_line(err)}); "
                             f"{_FIX}") from None
        block = rows_lib.decode_block(records, L)
        if not block.sound:
            bad = block.first_bad()
            rows_lib.check_record(records[bad], L, where=f"{path}#{bad}")  # raises, naming it
        toks.append(block.tokens)
        segs.append(block.segment_ids)
    if not toks:
        return np.zeros((0, L), np.uint16), np.zeros((0, L), np.uint8)
    return np.concatenate(toks), np.concatenate(segs)
