"""Packed rows from a shards folder into device batches: a thin Grain pipeline.

    MapDataset.range(rows of the split)       record keys 0..n-1
      .shuffle(seed)                          global, a new order each epoch (seed + epoch)
      .repeat()                               (train only) epochs without end
      [process_index::process_count]          each JAX process reads its own slice
      .batch(batch_size)                      int64[B] record keys
      .map(RowReader)                         one batched ArrayRecord read + np.frombuffer
      .to_iter_dataset() [.mp_prefetch(k)]    optional worker processes
      -> to_device(sharding)                  thread prefetch on host and on device

Batching keys before reading is what keeps Grain's per-element cost off the hot path:
the shuffle touches ints, and each batch is one ``ArrayRecordDataSource.__getitems__``
call (records of a shard are read together in C++) followed by one ``np.frombuffer`` over
the joined bytes. Batches are ``{"tokens": uint16[B, L], "segment_ids": uint8[B, L]}``;
positions and targets are derived on the device (train.model), so 3 bytes per token cross
to the device. The iterator's state (a few ints) is saved with each checkpoint, so a
resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import os
from pathlib import Path

import grain
from absl import flags as absl_flags
import jax
import numpy as np
from array_record.python.array_record_data_source import ArrayRecordDataSource

from prep import manifest as manifest_lib
from prep import rows as rows_lib


def open_shards(shards_dir: str | os.PathLike) -> dict:
    """The finished manifest of ``shards_dir``; InputError (one line naming the fix) if not."""
    return manifest_lib.load_manifest(shards_dir)


def max_segments(manifest: dict) -> int:
    """Most segments in any row (from the manifest's histogram), at least 1."""
    hist = manifest.get("segments_per_row") or {}
    return max([int(k) for k, v in hist.items() if v] or [rows_lib.MAX_SEGMENTS])


class RowReader:
    """Record keys -> one decoded batch. Picklable, so it can run in mp_prefetch workers."""

    def __init__(self, paths: list[Path], row_len: int):
        self.paths = [str(p) for p in paths]
        self.row_len = row_len
        self.source = ArrayRecordDataSource(self.paths)
        header = rows_lib._HEADER.pack(rows_lib.MAGIC, rows_lib.ROW_FORMAT_VERSION, row_len, 0)
        self._prefix = np.frombuffer(header[:8], np.uint8)  # magic, version, row_len

    def __len__(self) -> int:
        return len(self.source)

    def __call__(self, keys: np.ndarray) -> dict[str, np.ndarray]:
        return self.decode(self.source.__getitems__(keys.tolist()), keys)

    def decode(self, records, keys) -> dict[str, np.ndarray]:
        L, size = self.row_len, rows_lib.record_size(self.row_len)
        if any(len(r) != size for r in records):
            self._raise_first_bad(records, keys)
        buf = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), size)
        if not (buf[:, :8] == self._prefix).all():
            self._raise_first_bad(records, keys)
        body = buf[:, rows_lib.HEADER_SIZE:]
        return {"tokens": body[:, :2 * L].view("<u2").astype(np.uint16),
                "segment_ids": np.ascontiguousarray(body[:, 2 * L:])}

    def _raise_first_bad(self, records, keys):
        """Let prep.rows word the error, naming the shard and the record in it."""
        bounds = np.cumsum([0] + [len(ArrayRecordDataSource([p])) for p in self.paths])
        for rec, key in zip(records, keys):
            shard = int(np.searchsorted(bounds, key, side="right")) - 1
            where = f"{self.paths[shard]}#{int(key) - bounds[shard]}"
            _, segs = rows_lib.decode_row(rec, where=where)
            if len(segs) != self.row_len:
                raise rows_lib.RowFormatError(
                    f"{where}: row_len {len(segs)}, the manifest says {self.row_len}; "
                    "re-run `prep shards` to rebuild the dataset")
        raise AssertionError("unreachable: a bad record was detected but not found")


def batches(shards_dir: str | os.PathLike, split: str, *, batch_size: int, seed: int,
            train: bool = True, process_index: int | None = None,
            process_count: int | None = None, num_workers: int = 0,
            manifest: dict | None = None) -> grain.IterDataset:
    """Host batches of ``split`` for this process: ``batch_size`` rows each (per process).

    ``train``: shuffle globally and repeat forever; otherwise read once in file order.
    """
    manifest = manifest or open_shards(shards_dir)
    paths = manifest_lib.shard_paths(manifest, shards_dir, split)
    reader = RowReader(paths, manifest["row_len"])
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    ds = grain.MapDataset.range(len(reader))
    if train:
        ds = ds.shuffle(seed=seed).repeat()
    ds = ds[pi::pc]
    ds = ds.batch(batch_size, drop_remainder=True).map(reader)
    it = ds.to_iter_dataset()
    if num_workers > 0:
        # Grain's worker processes read absl flags; outside an absl app nobody parsed them
        if not absl_flags.FLAGS.is_parsed():
            absl_flags.FLAGS.mark_as_parsed()
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    return it


def to_device(ds: grain.IterDataset, sharding: jax.sharding.Sharding, *,
              host_buffer: int = 4, device_buffer: int = 2) -> grain.IterDataset:
    """Prefetch on the host, then put each batch on the devices (global arrays) ahead of use."""
    ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=host_buffer)
    ds = ds.map(lambda b: {k: jax.make_array_from_process_local_data(sharding, v)
                           for k, v in b.items()})
    return grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=device_buffer)
