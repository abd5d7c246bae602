"""`make bench` part "reader": the Grain reader beside plain ArrayRecord reads of the same records.

- ``reader.tokens_per_s``: train.fit.reader.batches (global shuffle, per-process slice, batch,
  batched read, decode to uint16/uint8 arrays) in one process, tokens (padding included)
  per second of host time. Target: >= 20M.
- ``reader.raw_tokens_per_s``: the same records in the same shuffled order and batches,
  read with bare ``ArrayRecordReader.read(positions)`` per shard, no Grain, no decode.
- ``reader.ratio``: the first over the second. Target: >= 0.7.

The shards are synthetic 1024-token rows written like `prep shards` writes them
(group_size:1, zstd:1) with random tokens (no easier to decompress than real rows).
The first epoch warms the page cache and is not timed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from prep.schema import vocab
from prep.tools import synthetic_shards as synthetic
from train.fit import reader

ROWS, ROW_LEN, SHARDS, BATCH, EPOCHS = 16_384, 1024, 4, 64, 2


def _shards(d: Path) -> dict:
    tokens, segs = synthetic.counting_rows(ROWS, ROW_LEN, seed=0, max_segments=12, pad=2)
    rng = np.random.default_rng(0)
    tokens = np.where(segs > 0, rng.integers(0, vocab.VOCAB_SIZE, tokens.shape), 0)
    return synthetic.write_shards(d, {"train": (tokens.astype(np.uint16), segs)},
                                  rows_per_shard=ROWS // SHARDS)


def _time_grain(d: Path, n_batches: int) -> float:
    it = iter(reader.batches(d, "train", batch_size=BATCH, seed=0))
    for _ in range(n_batches):  # warm-up epoch
        next(it)
    t0 = time.perf_counter()
    n = 0
    for _ in range(n_batches * (EPOCHS - 1)):
        n += next(it)["tokens"].size
    return n / (time.perf_counter() - t0)


def _time_raw(d: Path, manifest: dict, n_batches: int) -> float:
    """Bare reads of the keys the reader's shuffle yields, grouped per shard."""
    order = reader.key_batches(ROWS, batch_size=BATCH, seed=0, process_index=0, process_count=1)
    keys = np.concatenate([order[i] for i in range(n_batches * EPOCHS)])
    paths = [d / s["path"] for s in manifest["splits"]["train"]["shards"]]
    per = ROWS // SHARDS
    readers = [ArrayRecordReader(str(p), "readahead_buffer_size:0") for p in paths]

    def epoch(batches):
        n = 0
        for b in batches:
            shard = b // per
            for s in np.unique(shard):
                n += sum(map(len, readers[s].read((b[shard == s] % per).tolist())))
        return n

    batches = keys.reshape(-1, BATCH)
    epoch(batches[:n_batches])  # warm-up
    t0 = time.perf_counter()
    nbytes = epoch(batches[n_batches:])
    dt = time.perf_counter() - t0
    assert nbytes == (len(batches) - n_batches) * BATCH * (16 + 3 * ROW_LEN)
    return (len(batches) - n_batches) * BATCH * ROW_LEN / dt


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "shards"
        manifest = _shards(d)
        n_batches = ROWS // BATCH
        ours = _time_grain(d, n_batches)
        raw = _time_raw(d, manifest, n_batches)
    print(f"[bench] reader {ours / 1e6:,.1f}M tokens/s, raw ArrayRecord {raw / 1e6:,.1f}M "
          f"tokens/s, ratio {ours / raw:.2f}", file=sys.stderr)
    return {"reader.tokens_per_s": float(ours), "reader.raw_tokens_per_s": float(raw),
            "reader.ratio": float(ours / raw)}


if __name__ == "__main__":
    print(run())
