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
   rows → encode each piece (Numba) straight into its row's record (prep.schema.rows'
   layout; ``encode_rows``), then the segment ids and padding →
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
from prep.base.jit import kernel
from prep.pack.contexts import epoch_seed, plan_contexts
from prep.pack.packing import pack
from prep.schema import rows
from prep.schema.hashing import splitmix64
from prep.schema.manifest import SPLITS
from prep.schema.measurements import Measurements
from prep.shards.config import ShardsConfig, writer_options
from prep.tokens.kernel import SLACK, encode_pieces

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
    """The rows' record bytes, uint8[n_rows, record_size] (see prep.schema.rows.new_block),
    of pieces encoded end to end (``tokens``, piece j at ``offsets[j]:offsets[j + 1]``).

    Pieces come ordered by (row, slot), so row r's real tokens are one contiguous run of
    ``tokens``: ``_place_rows`` copies each run into its row's token field, writes the
    segment ids (slot + 1) beside it and the padding (token 0, segment 0) in each row's
    tail, every cell once (the checks here make its writes stay in the block).
    """
    offsets, piece_row = _checked(offsets, piece_row, n_rows, row_len)
    if len(tokens) < offsets[-1]:
        raise ValueError("tokens run short of the pieces' offsets")
    block, cells, words = _record_block(np.bincount(piece_row, minlength=n_rows), row_len)
    _place_rows(words, cells, block.shape[1], row_len, np.ascontiguousarray(tokens, np.uint16),
                offsets, piece_row, False)
    return block


def encode_rows(plan, packing, seed: int, row_len: int, clock=None) -> tuple[np.ndarray, int]:
    """(the rows' record bytes as ``assemble_rows`` gives them, the real tokens) of a
    packing of ``plan``'s contexts, encoded straight into the records: each piece's tokens
    go to its place in its row's token field (prep.tokens.kernel.encode_pieces ``at``),
    then ``_place_rows`` writes the segment ids and the tails, over any garbage the
    encoder left past a row's last piece. An odd ``row_len`` (its tokens not aligned as
    uint16) encodes end to end and assembles. ``clock``: the "encode" and "assemble" stages."""
    clock = clock or _no_clock
    ps, pe, n_rows = packing.piece_start, packing.piece_end, packing.n_rows
    size = rows.record_size(row_len)
    if size % 2:
        with clock("encode"):
            tokens, offsets = encode_pieces(plan.sorted, plan, ps, pe, seed)
        with clock("assemble"):
            return assemble_rows(tokens, offsets, packing.piece_row, n_rows, row_len), int(
                offsets[-1])
    with clock("assemble"):
        offsets = np.zeros(len(ps) + 1, np.int64)
        np.cumsum(packing.piece_len, out=offsets[1:])
        offsets, piece_row = _checked(offsets, packing.piece_row, n_rows, row_len)
        buffer = np.empty(n_rows * size + 2 * SLACK, np.uint8)  # SLACK tokens for the encoder
        n_seg = np.bincount(piece_row, minlength=n_rows)
        block, cells, words = _record_block(n_seg, row_len, buffer)
        first = offsets[np.cumsum(n_seg) - n_seg]  # each row's first token in the stream
        at = np.empty(len(ps) + 1, np.int64)
        at[:-1] = piece_row * (size // 2) + _HEADER // 2 + offsets[:-1] - first[piece_row]
        at[-1] = n_rows * size // 2
    with clock("encode"):
        encode_pieces(plan.sorted, plan, ps, pe, seed, out=buffer.view(np.uint16), at=at)
    with clock("assemble"):
        _place_rows(words, cells, size, row_len, np.zeros(0, np.uint16), offsets, piece_row,
                    True)
    return block, int(offsets[-1])


def _checked(offsets, piece_row, n_rows: int, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, piece_row) as int64, once they fit a block of ``n_rows`` rows of
    ``row_len`` (every row some tokens, none past row_len) in (row, slot) order."""
    offsets = np.ascontiguousarray(offsets, np.int64)
    piece_row = np.ascontiguousarray(piece_row, np.int64)
    lens = np.diff(offsets)
    if len(piece_row) != len(lens):
        raise ValueError("offsets and piece_row disagree on the pieces")
    if len(piece_row) and (np.any(np.diff(piece_row) < 0) or piece_row[0] < 0):
        raise ValueError("pieces are not ordered by row")
    row_ntok = np.bincount(piece_row, weights=lens, minlength=n_rows).astype(np.int64)
    if len(row_ntok) != n_rows or (n_rows and (row_ntok.max() > row_len or row_ntok.min() < 1)):
        raise ValueError("packing has an empty row, a row past row_len, or a piece past n_rows")
    return offsets, piece_row


def _record_block(n_seg: np.ndarray, row_len: int, buffer=None):
    """(block, its bytes flat, the same as uint16 where a record's size keeps them aligned,
    else empty) for rows of ``n_seg`` segments: headers written, the fields left to
    ``_place_rows``."""
    block, _, _ = rows.new_block(n_seg, row_len, zeroed=False, buffer=buffer)
    cells = block.reshape(-1)
    return block, cells, cells.view(np.uint16) if block.shape[1] % 2 == 0 else np.zeros(
        0, np.uint16)


_HEADER = rows.HEADER_SIZE


@kernel
def _place_rows(words, cells, size, row_len, tokens, offsets, piece_row, in_place):
    """Each row's fields in a record block (``cells``, its bytes; ``size`` bytes a record;
    ``words``, the same memory as uint16, or empty for an odd ``size``): its pieces'
    tokens (little-endian, from ``tokens``; ``in_place``: already there) in slot order,
    segment id slot + 1 on each, then 0 in both to the row's end. Flat indices: no 2D views."""
    j, k = 0, len(piece_row)
    n_rows = len(cells) // size
    aligned = len(words) > 0
    for r in range(n_rows):
        tok = r * size + _HEADER  # the row's first token byte
        seg = tok + 2 * row_len  # its first segment id
        c, slot = 0, 0
        while j < k and piece_row[j] == r:
            a, n = offsets[j], offsets[j + 1] - offsets[j]
            slot += 1
            if aligned and not in_place:
                for x in range(n):
                    words[tok // 2 + c + x] = tokens[a + x]
            elif not in_place:
                for x in range(n):
                    cells[tok + 2 * (c + x)] = tokens[a + x] & 0xFF
                    cells[tok + 2 * (c + x) + 1] = tokens[a + x] >> 8
            for x in range(n):
                cells[seg + c + x] = slot
            c += n
            j += 1
        for x in range(2 * c, 2 * row_len):
            cells[tok + x] = 0
        for x in range(c, row_len):
            cells[seg + x] = 0


def write_shard(path: Path, block: np.ndarray, compression: str) -> str:
    """Write one record per row of ``block`` under a temp name, rename; return the sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        writer = ArrayRecordWriter(str(tmp), writer_options(compression))
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
    copy, sorted by probe first). For a worker's peak memory, the split's rows are copied
    once (the plan takes them in sorted order), and the encoder writes into the rows'
    block itself, with no token stream beside it."""
    seed = epoch_seed(cfg.seed, epoch)
    with clock("plan"):
        plan = plan_contexts(m, cfg.context_config(), seed, rows)
    with clock("pack"):
        packing = pack(plan.ctx_start, plan.ctx_end, plan.cost, plan.has_ts, plan.abs_extra,
                       row_len=cfg.row_len, max_segments=cfg.max_segments)
    contexts, context_tokens = len(plan.ctx_start), int(plan.ctx_len.sum(dtype=np.int64))
    probes = int(np.count_nonzero(np.diff(plan.sorted.probe))) + 1
    block, n_tokens = encode_rows(plan, packing, seed, cfg.row_len, clock)
    del plan
    name = shard_name(split, bucket, epoch)
    with clock("write"):
        sha = write_shard(Path(out_dir) / name, block, cfg.compression)
    shard = {"path": name, "split": split, "epoch": epoch, "records": int(packing.n_rows),
             "sha256": sha, "measurements": len(rows), "contexts": contexts,
             "segments": len(packing.piece_start), "tokens": n_tokens,
             "context_tokens": context_tokens}
    return shard, np.bincount(packing.piece_row, minlength=packing.n_rows), probes


def _no_clock(stage: str):
    return contextlib.nullcontext()
