"""`prep import-atlas`: RIPE Atlas ping results to parquet in the DESIGN section 1 schema.

Inputs: JSON array files (as the results API returns them), JSON lines, and either
compressed with bzip2 (the daily dumps) or gzip; folders are searched recursively. The
format is sniffed from the content, not the name: a file is JSON values one per line,
where a top-level array stands for its elements, so arrays concatenated (``[...][...]``),
an array followed by lines, and a UTF-8 byte-order mark in front all read in full.
Everything streams: an array is decoded one element at a time, and rows go to parquet in
bounded batches.

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

    malformed_json      a JSON line that does not parse: bad syntax, bytes that are not
                        UTF-8, nesting too deep (logged with its line number); in an array,
                        an element with bytes that are not UTF-8
    not_a_result        a JSON value that is not an object
    not_ping            an object whose ``type`` is not "ping"
    bad_result          ``result`` is neither a list nor absent, or ``avg`` is missing/not a number
    packet_error        (per packet) an ``{"error": ...}`` entry
    duplicate_reply     (per packet) a reply marked ``dup``
    no_packets          (per packet) an empty ``result`` list

Accounting: rows_in (results, or packet rows plus result-level rejects with --per-packet)
== rows_written + sum(rejected.values()). A number the output column cannot hold (a
``timestamp`` or ``prb_id`` past int64) reaches validation as one it rejects
(``time_out_of_range``, ``bad_prb_id``); the carried ``msm_id`` and ``size`` become null.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import json
import math
import re
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from functools import partial
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
CHUNK = 1 << 20  # bytes per read of a JSON array, and the longest line read before it streams
MALFORMED = object()  # a value that could not be read (JSON's null is a value: None is taken)
_BOM = b"\xef\xbb\xbf"
_WS = b" \t\r\n"  # JSON's whitespace
_DECODER = json.JSONDecoder()
_SKIP = re.compile("[ \t\r\n\ufeff]*").match  # JSON whitespace, and a byte-order mark
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as "surrogateescape" keeps them


@dataclass(frozen=True)
class AtlasConfig:
    inputs: tuple[Path, ...]  # files or folders
    out: Path  # output folder: one parquet file per input file
    per_packet: bool = False  # one row per packet instead of one per result
    strict: bool = False  # a malformed JSON line is an InputError, not a rejected row


def list_atlas_inputs(paths) -> list[Path]:
    """Result files (JSON, JSON lines, .bz2/.gz dumps) named directly or found under folders."""
    return find_files(paths, SUFFIXES, f"no RIPE Atlas result files ({', '.join(SUFFIXES)}) found")


def _open_binary(path: Path):
    with open(path, "rb") as f:
        magic = f.read(3)
    if magic == b"BZh":
        return bz2.open(path, "rb")
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


class _Source:
    """A binary stream read by lines or by CHUNK-sized reads, with unread bytes put back in front."""

    def __init__(self, f):
        self.f, self.head = f, b""

    def read(self) -> bytes:
        if self.head:
            b, self.head = self.head, b""
            return b
        return self.f.read(CHUNK)

    def unread(self, b: bytes) -> None:
        self.head = b + self.head

    def lines(self) -> Iterator[bytes]:
        """Lines; one longer than CHUNK that opens an array comes as its first CHUNK bytes only
        (the array then streams through ``read``)."""
        readline = partial(self.f.readline, CHUNK)
        while True:
            if self.head:
                i = self.head.find(b"\n") + 1
                if i:
                    line, self.head = self.head[:i], self.head[i:]
                else:
                    line, self.head = self.head + readline(), b""
                    if line[-1:] != b"\n" and len(line) >= CHUNK and not _opens_array(line):
                        line += self.f.readline()
                yield line
                continue
            for line in iter(readline, b""):
                if len(line) >= CHUNK and line[-1] != 10 and not _opens_array(line):
                    line += self.f.readline()
                yield line
                if self.head:  # the consumer put bytes back: they come first
                    break
            else:
                return


def _results(path: Path, strict: bool, log: list) -> Iterator[object]:
    """Every result of one file, in order; MALFORMED for a value that could not be read.

    The file is a sequence of JSON values, one per line, where a top-level array stands
    for its elements: an API download, JSON lines, arrays concatenated (``[...][...]``),
    an array followed by lines, a UTF-8 byte-order mark in front. A line that is not JSON
    (bad syntax, bytes that are not UTF-8, nesting too deep) is one MALFORMED value; an
    array streams, and one it cannot read to its ']' is an InputError for the file.
    """
    loads = json.loads
    with _open_binary(path) as f:
        src = _Source(f)
        lineno = 0
        for line in src.lines():
            lineno += 1
            try:
                v = loads(line.decode())
            except (ValueError, RecursionError):  # the slow path: all but plain lines
                if not line.strip():
                    continue
                if _opens_array(line):
                    src.unread(line)
                    lineno += (yield from _json_array(src, path, strict, log, lineno)) - 1
                    continue
                values = _values(line)
                if values is None:
                    why = _why(line)
                    if strict:
                        raise InputError(f"{path}:{lineno}: malformed JSON line ({why}); "
                                         "fix or drop the line, or run without --strict") from None
                    log.append(f"{path}:{lineno}: malformed JSON ({why}), rejected")
                    yield MALFORMED
                    continue
                for v in values:
                    if type(v) is list:
                        yield from v
                    else:
                        yield v
                continue
            if type(v) is list:
                yield from v
            else:
                yield v


def _opens_array(line: bytes) -> bool:
    s = line.lstrip(_WS)
    if s.startswith(_BOM):
        s = s[len(_BOM):].lstrip(_WS)
    return s[:1] == b"["


def _values(line: bytes) -> list | None:
    """The JSON values of one line (a BOM in front, several values in a row); None if not JSON."""
    try:
        text = line.decode()
    except UnicodeDecodeError:
        return None
    values, pos = [], 0
    while True:
        pos = _SKIP(text, pos).end()
        if pos == len(text):
            return values
        try:
            v, pos = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        values.append(v)


def _why(line: bytes) -> str:
    """Why a line is not JSON, for the log."""
    try:
        json.loads(line.decode().lstrip("\ufeff"))
    except UnicodeDecodeError as e:
        return f"not UTF-8: {e.reason} 0x{e.object[e.start]:02x} at column {e.start + 1}"
    except json.JSONDecodeError as e:
        return e.msg
    except RecursionError:
        return "nested too deeply"
    return "several values, not all JSON"


def _json_array(src: _Source, path: Path, strict: bool, log: list, lineno: int):
    """Elements of the JSON array at the front of ``src``, decoded one at a time from
    CHUNK-sized reads; what follows its ']' goes back to ``src``. Returns the newlines read.

    Bytes that are not UTF-8 inside an element make that element MALFORMED (found without
    a scan while the bytes are ASCII, as RIPE's are); an element that does not parse, or
    the end of the file before ']', is an InputError: nothing tells where the next one starts.
    """
    dec = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    raw = src.read()
    eof = not raw
    buf = dec.decode(raw, final=eof)
    dirty = not raw.isascii() and _NOT_UTF8.search(buf) is not None
    pos = _SKIP(buf).end() + 1  # past '[' (the caller saw it)
    n = newlines = 0
    while True:
        while True:  # skip whitespace and separators, reading more as needed
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or eof:
                break
            newlines += buf.count("\n")
            raw = src.read()
            eof = not raw
            buf, pos = dec.decode(raw, final=eof), 0
            dirty = dirty or (not raw.isascii() and _NOT_UTF8.search(buf) is not None)
        if pos >= len(buf):
            raise InputError(f"{path}: truncated JSON array (no closing ']' after {n:,} results); "
                             "download the file again")
        if buf[pos] == "]":
            src.unread(buf[pos + 1:].encode("utf-8", "surrogateescape") + dec.getstate()[0])
            return newlines + buf.count("\n", 0, pos)
        try:
            obj, end = _DECODER.raw_decode(buf, pos)
        except json.JSONDecodeError:
            raw = b"" if eof else src.read()
            if not raw:
                raise InputError(f"{path}: malformed or truncated JSON array after {n:,} results; "
                                 "download the file again") from None
            more = dec.decode(raw)
            dirty = dirty or (not raw.isascii() and _NOT_UTF8.search(more) is not None)
            newlines += buf.count("\n", 0, pos)
            buf, pos = buf[pos:] + more, 0
            continue
        except RecursionError:
            raise InputError(f"{path}:{lineno + newlines + buf.count(chr(10), 0, pos)}: result "
                             f"{n + 1:,} of a JSON array is nested too deeply to decode; these are "
                             "not RIPE Atlas results: fix or remove the file") from None
        n += 1
        if dirty and _NOT_UTF8.search(buf, pos, end):
            where = f"{path}:{lineno + newlines + buf.count(chr(10), 0, pos)}"
            if strict:
                raise InputError(f"{where}: result {n:,} of a JSON array is not UTF-8 text; "
                                 "fix or drop it, or run without --strict")
            log.append(f"{where}: malformed JSON (result {n:,} of an array is not UTF-8 text), rejected")
            obj = MALFORMED
        yield obj
        pos = end


def _num(v, cast=float):
    """A number that firmware 0 may have written as a string; None when absent or not a number.

    An integer too large for a float is infinite, as JSON's 1e400 already is (``bad_rtt``).
    """
    if v is None or isinstance(v, bool):
        return None
    try:
        return cast(v) if cast is float else int(float(v)) if isinstance(v, str) else int(v)
    except OverflowError:
        return (math.inf if v > 0 else -math.inf) if cast is float and isinstance(v, int) else None
    except (TypeError, ValueError):
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
            try:
                return pa.array(v, typ)
            except (OverflowError, UnicodeEncodeError, pa.ArrowException):  # rare: a value the column cannot hold
                return pa.array([_FIT[name](x) for x in v], typ)
        return pa.table({f.name: col(f.name, f.type) for f in SCHEMA})


_I64 = 2**63


def _text(x):
    """An address as text: a number or an object is no address, nor is "\\ud800" (not UTF-8)."""
    if x is None or (isinstance(x, str) and x.isascii()):
        return x
    return x.encode("utf-8", "replace").decode() if isinstance(x, str) else "?"


# What a value the output column cannot hold becomes: one that validation rejects for the
# right reason (a number past int64 is out of range as a time, not 4/6 as ip_version, a
# bad prb_id; an address that is not text is invalid), and the carried msm_id and size are null.
_FIT = {
    "event_time": lambda x: x if x is None or -_I64 <= x < _I64 else _I64 - 1 if x > 0 else -_I64,
    "prb_id": lambda x: x if x is None or -_I64 <= x < _I64 else -1,
    "src_addr": _text,
    "dst_addr": _text,
    "ip_version": lambda x: x if x is None or -128 <= x < 128 else 0,
    "rtt": lambda x: x,
    "msm_id": lambda x: x if x is None or -_I64 <= x < _I64 else None,
    "size": lambda x: x if x is None or -_I64 <= x < _I64 else None,
}


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
        if rtt == math.inf:  # finite replies whose sum overflows: as far out of range as the largest
            rtt = max(replies)
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
                        for r in _results(path, cfg.strict, log):
                            results_read += 1
                            before = sum(rejected.values())
                            if r is MALFORMED:
                                rejected["malformed_json"] = rejected.get("malformed_json", 0) + 1
                            else:
                                _convert(r, cfg.per_packet, rows, rejected)
                            rows_in += sum(rejected.values()) - before
                            if len(rows) >= BATCH:
                                flush()
                                bar.update(BATCH)
                    except (OSError, EOFError, zlib.error) as e:
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
