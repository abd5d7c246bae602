"""`prep import-atlas`: RIPE Atlas ping results to parquet in the DESIGN section 1 schema.

Inputs: JSON array files (as the results API returns them), JSON lines, and either
compressed with bzip2 (the daily dumps) or gzip; folders are searched recursively. The
format is sniffed from the content, not the name. Everything streams: JSON arrays are
decoded one object at a time, and rows go to parquet in bounded batches.

Rows. Default: one per result; ``rtt`` is the mean of the replies that are not
duplicates, the result's ``avg`` when it has no ``result`` list, ``-1`` when nothing came
back (timeouts only, or local errors). ``--per-packet``: one per packet; a timeout
``{"x": "*"}`` is ``-1``, an ``{"error": ...}`` entry and a duplicate reply are rejected.
``prb_id``, ``msm_id``, ``size`` are kept. Firmware variants (RIPE's result format
documentation): ``addr``/``name`` for ``dst_addr``/``dst_name`` (fw 1), numbers written as
strings and no ``result`` list (fw 0), no ``af`` or ``src_addr`` before fw 4460 (the family
then comes from the address; the source falls back to ``from``).

Rejection reasons of the importer, on top of prep.validate's (which every row passes
through, so the output holds only rows `prep shards` accepts):

    malformed_json      a JSON line that does not parse (logged with its line number)
    not_a_result        a JSON value that is not an object
    not_ping            an object whose ``type`` is not "ping"
    bad_result          ``result`` is neither a list nor absent, or ``avg`` is missing/not a number
    packet_error        (per packet) an ``{"error": ...}`` entry
    duplicate_reply     (per packet) a reply marked ``dup``
    no_packets          (per packet) an empty ``result`` list

Accounting: rows_in (results, or packet rows plus result-level rejects with --per-packet)
== rows_written + sum(rejected.values()).
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from prep.errors import InputError
from prep.validate import find_files, validate_rows

SCHEMA = pa.schema([("event_time", pa.timestamp("s", tz="UTC")), ("prb_id", pa.int64()),
                    ("src_addr", pa.string()), ("dst_addr", pa.string()), ("ip_version", pa.int8()),
                    ("rtt", pa.float64()), ("msm_id", pa.int64()), ("size", pa.int64())])
BATCH = 65_536  # rows per parquet write: bounds memory however large the input
SUFFIXES = (".json", ".jsonl", ".ndjson", ".bz2", ".gz")
MAX_LOGGED = 20  # malformed lines logged one by one; the rest only counted
CHUNK = 1 << 20  # characters per read of a JSON array file


@dataclass(frozen=True)
class AtlasConfig:
    inputs: tuple[Path, ...]  # files or folders
    out: Path  # output folder: one parquet file per input file
    per_packet: bool = False  # one row per packet instead of one per result
    strict: bool = False  # a malformed JSON line is an InputError, not a rejected row


def list_atlas_inputs(paths) -> list[Path]:
    """Result files (JSON, JSON lines, .bz2/.gz dumps) named directly or found under folders."""
    return find_files(paths, SUFFIXES, f"no RIPE Atlas result files ({', '.join(SUFFIXES)}) found")


def _open_text(path: Path):
    with open(path, "rb") as f:
        magic = f.read(3)
    if magic == b"BZh":
        return io.TextIOWrapper(bz2.open(path, "rb"), encoding="utf-8")
    if magic[:2] == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _json_array(f, path: Path) -> Iterator[tuple[int, object]]:
    """Objects of a top-level JSON array, decoded one at a time from CHUNK-sized reads."""
    dec, buf, pos, n, eof = json.JSONDecoder(), f.read(CHUNK), 0, 0, False
    pos = buf.index("[") + 1
    while True:
        while True:  # skip whitespace and separators, reading more as needed
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or eof:
                break
            buf, pos = f.read(CHUNK), 0
            eof = not buf
        if pos >= len(buf):
            raise InputError(f"{path}: truncated JSON array (no closing ']' after {n:,} results); "
                             "download the file again")
        if buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except json.JSONDecodeError:
            more = "" if eof else f.read(CHUNK)
            if not more:
                raise InputError(f"{path}: malformed or truncated JSON array after {n:,} results; "
                                 "download the file again") from None
            buf, pos = buf[pos:] + more, 0
            continue
        n += 1
        yield n, obj
        pos = end


def _results(path: Path, strict: bool, log: list) -> Iterator[tuple[int, object]]:
    """(line or index, decoded value or None for a malformed JSON line) of one file."""
    with _open_text(path) as f:
        head = ""
        while not head:
            ch = f.read(1)
            if not ch:
                return
            head = ch.strip()
        if head == "[":
            f = _rewind(f, path)
            yield from _json_array(f, path)
            return
        first = head + f.readline()
        for lineno, line in enumerate(_chain(first, f), 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError as e:
                if strict:
                    raise InputError(f"{path}:{lineno}: malformed JSON line ({e.msg}); "
                                     "fix or drop the line, or run without --strict") from None
                log.append(f"{path}:{lineno}: malformed JSON ({e.msg}), rejected")
                yield lineno, None


def _chain(first: str, f):
    yield first
    yield from f


def _rewind(f, path: Path):
    f.close()
    return _open_text(path)


def _num(v, cast=float):
    """A number that firmware 0 may have written as a string; None when absent or not a number."""
    if v is None or isinstance(v, bool):
        return None
    try:
        return cast(v) if cast is float else int(float(v)) if isinstance(v, str) else int(v)
    except (TypeError, ValueError, OverflowError):
        return None


def _family(r: dict, dst) -> int | None:
    af = _num(r.get("af"), int)
    if af is not None:
        return af
    for a in (dst, r.get("src_addr"), r.get("from")):
        if isinstance(a, str) and a:
            return 6 if ":" in a else 4 if "." in a else None
    return None


class _Rows:
    """Column lists of one output batch."""

    def __init__(self):
        self.cols = {name: [] for name in SCHEMA.names}

    def add(self, t, prb, src, dst, af, rtt, msm, size):
        for name, v in zip(SCHEMA.names, (t, prb, src, dst, af, rtt, msm, size)):
            self.cols[name].append(v)

    def __len__(self):
        return len(self.cols["rtt"])

    def table(self) -> pa.Table:
        def col(name, typ):
            v = self.cols[name]
            if name in ("src_addr", "dst_addr"):
                v = [x if isinstance(x, str) else None for x in v]
            if name == "ip_version":  # out-of-range values must reach validation as "not 4/6"
                v = [x if x is None or -128 <= x < 128 else 0 for x in v]
            return pa.array(v, typ)
        return pa.table({f.name: col(f.name, f.type) for f in SCHEMA})


def _convert(r, per_packet: bool, rows: _Rows, rejected: dict) -> None:
    """Append the row(s) of one decoded result, or count why it has none."""
    def reject(reason, k=1):
        rejected[reason] = rejected.get(reason, 0) + k

    if not isinstance(r, dict):
        return reject("not_a_result")
    if r.get("type", "ping") != "ping":
        return reject("not_ping")
    dst = r.get("dst_addr", r.get("addr"))
    src = r.get("src_addr", r.get("from"))
    t, prb = _num(r.get("timestamp"), int), _num(r.get("prb_id"), int)
    msm, size, af = _num(r.get("msm_id"), int), _num(r.get("size"), int), _family(r, dst)
    if t is not None and not -2**62 < t < 2**62:
        t = None
    packets = r.get("result")
    if packets is None:  # firmware 0: only the summary
        avg = _num(r.get("avg"))
        if avg is None:
            return reject("bad_result")
        return rows.add(t, prb, src, dst, af, -1.0 if avg < 0 else avg, msm, size)
    if not isinstance(packets, list):
        return reject("bad_result")
    if not per_packet:
        replies = [_num(p.get("rtt")) for p in packets
                   if isinstance(p, dict) and "rtt" in p and not p.get("dup")]
        if any(x is None for x in replies):
            return reject("bad_result")
        rtt = sum(replies) / len(replies) if replies else -1.0
        return rows.add(t, prb, src, dst, af, rtt, msm, size)
    if not packets:
        return reject("no_packets")
    for p in packets:
        if not isinstance(p, dict):
            reject("bad_result")
        elif "error" in p:
            reject("packet_error")
        elif p.get("dup"):
            reject("duplicate_reply")
        elif "rtt" in p:
            rtt = _num(p["rtt"])
            rows.add(t, prb, src, dst, af, float("nan") if rtt is None else rtt, msm, size)
        else:  # {"x": "*"}: nothing came back
            rows.add(t, prb, src, dst, af, -1.0, msm, size)


def _output_names(files: list[Path]) -> list[str]:
    names, seen = [], set()
    for f in files:
        stem = f.name
        for suffix in (".bz2", ".gz", ".jsonl", ".ndjson", ".json"):
            stem = stem.removesuffix(suffix)
        name, i = f"{stem}.parquet", 2
        while name in seen:
            name, i = f"{stem}-{i}.parquet", i + 1
        seen.add(name)
        names.append(name)
    return names


def import_atlas(cfg: AtlasConfig) -> dict:
    """Convert every input; all output files appear together at the end, or none do."""
    t0 = time.perf_counter()
    files = list_atlas_inputs(cfg.inputs)
    names = _output_names(files)
    stage = Path(cfg.out) / ".import-tmp"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    results_read = rows_in = rows_written = 0
    rejected: dict[str, int] = {}
    log: list[str] = []
    try:
        with tqdm(unit=" results", unit_scale=True, desc="import-atlas", file=sys.stderr,
                  disable=None) as bar:
            for path, name in zip(files, names):
                with pq.ParquetWriter(stage / name, SCHEMA, compression="zstd") as writer:
                    rows = _Rows()

                    def flush():
                        nonlocal rows, rows_written, rows_in
                        table = rows.table()
                        keep, _, why = validate_rows(table, source=str(path))
                        writer.write_table(table.filter(pa.array(keep)))
                        rows_in += len(table)
                        rows_written += int(keep.sum())
                        for k, v in why.items():
                            rejected[k] = rejected.get(k, 0) + v
                        rows = _Rows()

                    try:
                        for _, r in _results(path, cfg.strict, log):
                            results_read += 1
                            before = sum(rejected.values())
                            if r is None:
                                rejected["malformed_json"] = rejected.get("malformed_json", 0) + 1
                            else:
                                _convert(r, cfg.per_packet, rows, rejected)
                            rows_in += sum(rejected.values()) - before
                            if len(rows) >= BATCH:
                                flush()
                                bar.update(BATCH)
                    except (OSError, EOFError, UnicodeDecodeError) as e:
                        raise InputError(f"{path}: unreadable or truncated ({e}); "
                                         "download the file again") from None
                    flush()
                bar.n = results_read
                bar.refresh()
        for line in log[:MAX_LOGGED]:
            print(line, file=sys.stderr)
        if len(log) > MAX_LOGGED:
            print(f"... and {len(log) - MAX_LOGGED:,} more malformed JSON lines", file=sys.stderr)
        for name in names:
            (stage / name).replace(Path(cfg.out) / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    summary = {"files": len(files), "results_read": results_read, "rows_in": rows_in,
               "rows_written": rows_written, "rejected": dict(sorted(rejected.items())),
               "per_packet": cfg.per_packet, "elapsed_s": round(elapsed, 3),
               "results_per_s": round(results_read / max(elapsed, 1e-9), 1)}
    why = ", ".join(f"{k} {v:,}" for k, v in summary["rejected"].items()) or "none"
    print(f"import-atlas: {results_read:,} results from {len(files)} files -> "
          f"{rows_written:,} rows in {cfg.out} | rejected {sum(rejected.values()):,} ({why}) | "
          f"{elapsed:.1f}s, {summary['results_per_s']:,.0f} results/s", file=sys.stderr)
    return summary
