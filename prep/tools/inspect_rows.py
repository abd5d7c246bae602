"""`prep inspect DIR`: rows of a finished dataset, decoded for people (or as JSON lines).

Rows are numbered per split in manifest order (shard by shard), which is what
``--rows A:B`` selects. Human output, one block per row::

    train row 0 (train/shard-b00000-e0.array_record #0): 2 segments, 62 tokens, 2 padding
      segment 1: 2 measurements, 39 tokens
        2026-01-01 00:00:00  192.0.2.1 -> 193.0.14.129  12.345 ms
        +60 s                192.0.2.1 -> 193.0.14.129  FAILED

Each timestamp is shown as decoded (``-`` where the measurement carried none; a segment
whose context was written without timestamps says so in its line). With
``--json`` each row is one object: split, shard, record, row, tokens, segment_ids and
segments (each a list of measurements with time, family, src, dst, rtt_ms, failed).
(The module is not named ``inspect``: run as a script from prep/, that would shadow
the standard library's ``inspect``, which click imports.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from prep.base.errors import InputError, first_line
from prep.base.words import count
from prep.schema import manifest as mf
from prep.schema import rows
from prep.schema.manifest import SPLITS
from prep.schema.measurements import addr_text
from prep.schema.splits import more_test_rows
from prep.schema.vocab import VALUE_FIELDS
from prep.tokens.decode import DecodeError, decode_context


def parse_range(text: str | None) -> tuple[int, int | None]:
    """``"A:B"`` → (A, B); either side may be empty; None → everything."""
    if not text:
        return 0, None
    a, sep, b = text.partition(":")
    try:
        start, stop = int(a or 0), (int(b) if b else None)
        if not sep or start < 0 or (stop is not None and stop < start):
            raise ValueError
    except ValueError:
        raise InputError(f"--rows {text}: expected A:B with 0 <= A <= B, e.g. --rows 0:10") from None
    return start, stop


def iter_rows(shards_dir: str | Path, *, split: str | None = None, start: int = 0,
              stop: int | None = None, sha256: bool = False) -> Iterator[dict]:
    """Rows [start, stop) of each chosen split, reading only the shards they lie in.

    Each shard read is first held to its manifest entry (prep.schema.manifest.check_shard: there,
    its size if listed, its record count; its sha256 too with ``sha256``, for callers that
    read every row anyway); a difference is InputError naming the shard."""
    d = Path(shards_dir)
    m = mf.load_manifest(d)
    chosen = [split] if split else [x for x in SPLITS if x in m["splits"]]
    check_range(m, d, chosen, start, stop)
    for s in chosen:
        first = 0  # the split's row number of the shard's first record
        for entry in mf.split_entries(m, d, s):
            n = entry["records"]
            lo, hi = max(start, first), min(first + n, stop if stop is not None else first + n)
            if lo < hi:
                path = mf.check_shard(d, entry, sha256=sha256)
                try:
                    reader = ArrayRecordReader(str(path))
                    records = reader.read(lo - first, hi - first)
                    reader.close()
                except Exception as e:  # array_record raises plain RuntimeError on damage
                    raise InputError(f"{path}: unreadable ({first_line(e)}); "
                                     "run `prep verify`, then `prep shards` to rebuild") from None
                for i, rec in enumerate(records, lo - first):
                    where = f"{path}#{i}"
                    try:
                        tokens, seg = rows.decode_row(rec, where=where)
                    except rows.RowFormatError as e:
                        raise InputError(str(e)) from None
                    yield {"split": s, "shard": entry["path"], "record": i, "row": first + i,
                           "tokens": tokens, "segment_ids": seg}
            first += n
            if stop is not None and first >= stop:
                break


def check_range(m: dict, d: Path, chosen: list[str], start: int, stop: int | None) -> None:
    """InputError naming each split's rows when none of the ``chosen`` splits holds a row
    from ``start`` on: a range past the end, or a split without rows, is not a silent
    nothing. The lines say "the dataset", not ``d``: for a bucket, that is its local copy."""
    n = {s: sum(e["records"] for e in mf.split_entries(m, d, s)) for s in chosen}
    if any(start < k for k in n.values()):
        return
    if not any(n.values()):  # only a test split can be empty (a dataset has train rows)
        raise InputError(f"the dataset's {' and '.join(n)} split holds no rows; "
                         f"{more_test_rows(m.get('config', {}))}")
    ranges = ", ".join(f"{s} {f'0:{k}' if k else 'none'}" for s, k in n.items())
    raise InputError(f"--rows {start}:{'' if stop is None else stop} is past the end of the "
                     f"dataset: its rows are {ranges}")


def segments(row: dict) -> list[tuple[list[int], list | str]]:
    """(tokens, decoded measurements or the decode error) of each segment of a row."""
    seg = row["segment_ids"]
    toks = row["tokens"].tolist()
    out = []
    for sid in range(1, int(seg.max(initial=0)) + 1):
        idx = np.flatnonzero(seg == sid)
        t = toks[idx[0]:idx[-1] + 1] if len(idx) else []
        try:
            out.append((t, decode_context(t)))
        except DecodeError as e:
            out.append((t, f"undecodable: {e}"))
    return out


def _measurement_dict(x) -> dict:
    return {"time": x.time, "family": x.family, "src": addr_text(x.family, x.src_hi, x.src_lo),
            "dst": addr_text(x.family, x.dst_hi, x.dst_lo), "rtt_ms": x.rtt, "failed": x.failed,
            **_values(x)}


def _values(x) -> dict:
    """The value fields (prep.schema.vocab.VALUE_FIELDS) of a decoded measurement, by name."""
    return {f.name: v for f, v in zip(VALUE_FIELDS, x.values)}


def row_json(row: dict) -> str:
    segs = [ms if isinstance(ms, str) else [_measurement_dict(x) for x in ms]
            for _, ms in segments(row)]
    return json.dumps({"split": row["split"], "shard": row["shard"], "record": row["record"],
                       "row": row["row"], "tokens": row["tokens"].tolist(),
                       "segment_ids": row["segment_ids"].tolist(), "segments": segs})


def format_row(row: dict) -> str:
    n_real = int((row["segment_ids"] > 0).sum())
    segs = segments(row)
    lines = [f"{row['split']} row {row['row']} ({row['shard']} #{row['record']}): "
             f"{count(len(segs), 'segment')}, {count(n_real, 'token')}, "
             f"{len(row['tokens']) - n_real} padding"]
    for sid, (toks, ms) in enumerate(segs, 1):
        if isinstance(ms, str):
            lines.append(f"  segment {sid}: {count(len(toks), 'token')}, {ms}")
            continue
        untimed = ", no timestamps (its timestamp mode)" if all(x.time is None for x in ms) else ""
        lines.append(f"  segment {sid}: {count(len(ms), 'measurement')}, "
                     f"{count(len(toks), 'token')}{untimed}")
        prev = None
        for x in ms:
            if x.time is None:
                when = "-"
            elif prev is None:
                when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(x.time))
            else:
                when = f"{x.time - prev:+d} s"
            prev = x.time if x.time is not None else prev
            result = "FAILED" if x.failed else f"{x.rtt:.3f} ms"
            values = "".join(f"  {k} {v}" for k, v in _values(x).items())
            lines.append(f"    {when:<20} {addr_text(x.family, x.src_hi, x.src_lo)} -> "
                         f"{addr_text(x.family, x.dst_hi, x.dst_lo)}  {result}{values}")
    return "\n".join(lines)
