"""One bucket of probes → finished shard files: the pure unit of work of `prep shards`.

``process_bucket(bucket, m, cfg, out_dir)``, which both runners call, depends only on
(bucket, the multiset of measurements, cfg): measurements are sorted inside, file names
come from the bucket id, split and epoch, and nothing reads the clock, the worker id or the
input order. So any runner, number of workers and file order write byte-identical shards.
For one bucket:

1. Split the measurements by the config's rule (``split_masks``; prep.schema.splits): ``probe``
   (default) by a salted stable hash of the probe key (``is_test_probe``), a probe's whole
   history to train or to test, never both; ``time`` by the cutoff ``test_from``;
   ``time+probe`` by both, the measurements that fit neither split counted as excluded.
   Contexts are planned per split, so none straddles the cutoff.
2. For each split and each epoch k (seed ``epoch_seed(cfg.seed, k)``: every pass has its
   own field orders, timestamp modes and cut points): plan contexts → pack pieces into
   rows → encode pieces (Numba) → assemble rows (vectorized: a row's pieces are contiguous
   in the token stream) → record bytes (prep.schema.rows) →
   ``<split>/shard-b<bucket>-e<k>.array_record``, written under a temp name and renamed. A
   split with no measurements writes no file.
3. Return a plain, JSON-serializable dict (see ``process_bucket``).

Bucketing and splitting hash the probe key with different salts (splitmix64), so a bucket
holds train and test probes in the configured proportion.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from prep.base.atomic import replacing
from prep.pack.contexts import epoch_seed, plan_contexts
from prep.pack.packing import pack
from prep.schema import rows
from prep.schema.hashing import splitmix64
from prep.schema.manifest import SPLITS
from prep.schema.measurements import Measurements
from prep.shards.config import ShardsConfig
from prep.tokens.kernel import encode_pieces

_BUCKET_SALT = np.uint64(0x5EED_B0C4_E7B1_0001)
_SPLIT_SALT = np.uint64(0x5EED_5B11_7000_0002)

BUCKET_ROWS = 250_000  # input rows per bucket with n_buckets 0: memory per worker stays flat


def resolve_buckets(cfg: ShardsConfig, rows_total: int) -> ShardsConfig:
    """``cfg`` with n_buckets 0 replaced by one bucket per BUCKET_ROWS input rows (at least
    one). Every bucket ends in part-filled rows (one per split and epoch), so fewer buckets
    pack tighter; more bound the memory of a worker, which holds one bucket at a time."""
    if cfg.n_buckets:
        return cfg
    return replace(cfg, n_buckets=max(1, -(-rows_total // BUCKET_ROWS)))


def bucket_of(probe: np.ndarray, n_buckets: int) -> np.ndarray:
    """Bucket id (int64) of each probe key."""
    return (splitmix64(np.asarray(probe, np.uint64) ^ _BUCKET_SALT)
            % np.uint64(n_buckets)).astype(np.int64)


def is_test_probe(probe: np.ndarray, test_fraction: float) -> np.ndarray:
    """True for probe keys in the test split: the top 53 hash bits as a uniform [0, 1)."""
    h = splitmix64(np.asarray(probe, np.uint64) ^ _SPLIT_SALT) >> np.uint64(11)
    return h.astype(np.float64) * 2.0**-53 < test_fraction


def split_masks(m: Measurements, cfg: ShardsConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train, test) boolean masks over ``m`` by the config's split rule; a measurement in
    neither is excluded by the rule (``time+probe`` only)."""
    if cfg.split == "probe":
        test = is_test_probe(m.probe, cfg.test_fraction)
        return ~test, test
    if cfg.test_from is None:
        raise ValueError(f"split {cfg.split!r} needs test_from (the cutoff) resolved")
    late = m.time >= np.int64(cfg.test_from)
    if cfg.split == "time":
        return ~late, late
    held = is_test_probe(m.probe, cfg.test_fraction)
    return ~held & ~late, held & late


def shard_name(split: str, bucket: int, epoch: int) -> str:
    return f"{split}/shard-b{bucket:05d}-e{epoch}.array_record"


def assemble_rows(tokens: np.ndarray, offsets: np.ndarray, piece_row: np.ndarray,
                  n_rows: int, row_len: int) -> np.ndarray:
    """The rows' record bytes, uint8[n_rows, record_size] (see prep.schema.rows.new_block).

    Pieces come ordered by (row, slot), so row r's real tokens are one contiguous run of
    ``tokens``, and a boolean mask of "real" cells in row-major order places every token
    at once, straight into the record block. Segment id = slot + 1; padding (token 0,
    segment 0) fills each row's tail.
    """
    lens = np.diff(offsets)
    piece_row = np.asarray(piece_row, np.int64)
    if len(piece_row) and np.any(np.diff(piece_row) < 0):
        raise ValueError("pieces are not ordered by row")
    row_ntok = np.bincount(piece_row, weights=lens, minlength=n_rows).astype(np.int64)
    if len(row_ntok) != n_rows or (n_rows and (row_ntok.max() > row_len or row_ntok.min() < 1)):
        raise ValueError("packing has an empty row, a row past row_len, or a piece past n_rows")
    n_seg = np.bincount(piece_row, minlength=n_rows)
    first = np.cumsum(n_seg) - n_seg
    slot = np.arange(len(piece_row)) - first[piece_row]
    real = np.arange(row_len)[None, :] < row_ntok[:, None]
    block, tok, seg = rows.new_block(n_seg, row_len)
    tok[real] = tokens
    seg[real] = np.repeat((slot + 1).astype(np.uint8), lens)
    return block


def write_shard(path: Path, block: np.ndarray, compression: str) -> str:
    """Write one record per row of ``block`` under a temp name, rename; return the sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        writer = ArrayRecordWriter(str(tmp), f"group_size:1,{compression}")
        for r in range(len(block)):
            writer.write(block[r].tobytes())
        writer.close()
        digest = hashlib.sha256()
        with open(tmp, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _histogram(values: np.ndarray) -> dict[str, int]:
    counts = np.bincount(values) if len(values) else np.zeros(0, np.int64)
    return {str(i): int(c) for i, c in enumerate(counts) if c}


def process_bucket(bucket: int, m: Measurements, cfg: ShardsConfig, out_dir: str, *,
                   clock=None) -> dict:
    """Write bucket ``bucket``'s shards under ``out_dir``; return what the manifest needs.

    Result (plain dict)::

        {"bucket": 17, "measurements": n, "excluded": e (in neither split),
         "probes": {"train": p, "test": q},
         "shards": [{"path": "train/shard-b00017-e0.array_record", "split": "train",
                     "epoch": 0, "records": rows, "sha256": "…", "measurements": n,
                     "contexts": c, "segments": pieces, "tokens": real tokens,
                     "context_tokens": tokens of the uncut contexts}, …],
         "segments_per_row": {"1": rows with one segment, …}}

    ``shards`` is ordered by (split train/test, epoch); empty splits write no shard.
    ``clock``: times the stages (prep.shards.stages.StageClock); the result is the same.
    """
    clock = clock or _no_clock
    with clock("split"):
        masks = split_masks(m, cfg)
    excluded = len(m) - int(masks[0].sum()) - int(masks[1].sum())
    shards, seg_counts, probes = [], [], {}
    for split, mask in zip(SPLITS, masks):
        with clock("split"):
            rows = np.flatnonzero(mask)
        probes[split] = 0
        for epoch in range(cfg.epochs) if len(rows) else ():
            shard, per_row, probes[split] = _write_pass(m, rows, split, bucket, epoch, cfg,
                                                        out_dir, clock)
            shards.append(shard)
            seg_counts.append(per_row)
    per_row = np.concatenate(seg_counts) if seg_counts else np.zeros(0, np.uint8)
    return {"bucket": int(bucket), "measurements": int(len(m)), "excluded": excluded,
            "probes": probes, "shards": shards, "segments_per_row": _histogram(per_row)}


def _write_pass(m: Measurements, rows: np.ndarray, split: str, bucket: int, epoch: int,
                cfg: ShardsConfig, out_dir: str, clock) -> tuple[dict, np.ndarray, int]:
    """The shard of ``m[rows]`` (one split) of one epoch (process_bucket's step 2): its entry
    in ``shards``, its rows' segment counts and the split's probes (counted in the plan's
    copy, sorted by probe first). What each step no longer needs is let go
    before the next allocates (the split's copy once planned, the plan's sorted copy
    before the rows' block): a worker's peak memory."""
    seed = epoch_seed(cfg.seed, epoch)
    with clock("split"):
        part = m.take(rows)
    with clock("plan"):
        plan = plan_contexts(part, cfg.context_config(), seed)
    del part
    with clock("pack"):
        packing = pack(plan.ctx_start, plan.ctx_end, plan.cost, plan.has_ts, plan.abs_extra,
                       row_len=cfg.row_len, max_segments=cfg.max_segments)
    with clock("encode"):
        tokens, offsets = encode_pieces(plan.sorted, plan, packing.piece_start,
                                        packing.piece_end, seed)
    contexts, context_tokens = len(plan.ctx_start), int(plan.ctx_len.sum(dtype=np.int64))
    probes = int(np.count_nonzero(np.diff(plan.sorted.probe))) + 1
    del plan
    with clock("assemble"):
        block = assemble_rows(tokens, offsets, packing.piece_row, packing.n_rows, cfg.row_len)
    del tokens
    name = shard_name(split, bucket, epoch)
    with clock("write"):
        sha = write_shard(Path(out_dir) / name, block, cfg.compression)
    shard = {"path": name, "split": split, "epoch": epoch, "records": int(packing.n_rows),
             "sha256": sha, "measurements": len(rows), "contexts": contexts,
             "segments": len(packing.piece_start), "tokens": int(offsets[-1]),
             "context_tokens": context_tokens}
    return shard, np.bincount(packing.piece_row, minlength=packing.n_rows), probes


def _no_clock(stage: str):
    return contextlib.nullcontext()
