"""Small shards folders with predictable rows, for tests, benchmarks and CPU demos.

The real writer is ``prep shards``; this one skips measurements and tokenizing and
writes rows straight from arrays, through the same row format (prep.schema.rows) and manifest
(prep.schema.manifest), so the trainer can be tested without the ETL.

``counting_rows`` makes rows whose content is easy to predict: segment k of row r holds
``(r * 7 + k + arange(len)) % vocab`` - a next-token rule a model learns in a few steps,
so "the loss falls" is a sharp test.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from prep.schema import manifest as manifest_lib
from prep.schema import rows as rows_lib
from prep.schema import vocab


def counting_rows(n_rows: int, row_len: int, *, seed: int = 0, max_segments: int = 4,
                  pad: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """(tokens uint16[n, L], segment_ids uint8[n, L]): 1..max_segments segments, then `pad` zeros."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((n_rows, row_len), np.uint16)
    segs = np.zeros((n_rows, row_len), np.uint8)
    for r in range(n_rows):
        n_seg = int(rng.integers(1, max_segments + 1))
        used = row_len - pad
        # cut points strictly inside [0, used) so no segment is empty
        cuts = np.sort(rng.choice(np.arange(1, used), n_seg - 1, replace=False))
        bounds = np.concatenate([[0], cuts, [used]])
        for k in range(n_seg):
            s, e = bounds[k], bounds[k + 1]
            tokens[r, s:e] = (r * 7 + k + np.arange(e - s)) % vocab.VOCAB_SIZE
            segs[r, s:e] = k + 1
    return tokens, segs


def write_shard(path: Path, tokens: np.ndarray, segment_ids: np.ndarray, *,
                compression: str = "zstd:1") -> dict:
    """One ArrayRecord shard: group_size:1 (what Grain needs for random access) and zstd
    level 1 (harder on the reader than the snappy `prep shards` writes by default, so the
    reader benchmark errs on the slow side)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = ArrayRecordWriter(str(path), f"group_size:1,{compression}")
    for record in rows_lib.encode_rows(tokens, segment_ids):
        writer.write(record)
    writer.close()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"records": int(len(tokens)), "sha256": digest}


def write_shards(out_dir: str | Path, splits: dict[str, tuple[np.ndarray, np.ndarray]], *,
                 rows_per_shard: int = 1 << 30, compression: str = "zstd:1") -> dict:
    """Write each split's rows as shards plus a finished manifest; returns the manifest."""
    out = Path(out_dir)
    row_len = next(iter(splits.values()))[0].shape[1]
    seg_hist: dict[str, int] = {}
    manifest = {**manifest_lib.header(row_len), "splits": {}, "config": {"synthetic": True},
                "seed": 0}
    for split, (tokens, segs) in splits.items():
        shards = []
        for i, start in enumerate(range(0, len(tokens), rows_per_shard)):
            rel = f"{split}/synthetic-{i:05d}.array_record"
            sl = slice(start, start + rows_per_shard)
            shards.append({"path": rel, **write_shard(out / rel, tokens[sl], segs[sl],
                                                          compression=compression)})
        manifest["splits"][split] = {"rows": int(len(tokens)), "shards": shards}
        for n in segs.max(axis=1):
            seg_hist[str(int(n))] = seg_hist.get(str(int(n)), 0) + 1
    real = sum(int((s > 0).sum()) for _, s in splits.values())
    total = sum(s.size for _, s in splits.values())
    manifest["segments_per_row"] = seg_hist
    manifest["padding_fraction"] = 1 - real / total
    manifest_lib.write_manifest(out, manifest)
    return manifest
