"""`prep import-atlas`: RIPE Atlas ping results to parquet, in the input schema of `prep shards`.

Inputs: JSON array files (as the results API returns them), JSON lines, and either
compressed with bzip2 (the daily dumps) or gzip; folders are searched recursively. The
format is sniffed from the content, not the name: a file is JSON values one per line,
where a top-level array stands for its elements, so arrays concatenated (``[...][...]``),
an array followed by lines, and a UTF-8 byte-order mark in front all read in full.
Everything streams: lines are read in blocks of about CHUNK bytes, an array on a line
longer than WHOLE_LINE chunks (or over several lines) is decoded one element at a time,
and rows go to parquet in batches of BATCH rows.

Rows. Default: one per result; ``rtt`` is the mean of the replies that are not
duplicates, the result's ``avg`` when it has no ``result`` list, ``-1`` when nothing came
back. ``--per-packet``: one per packet; a timeout ``{"x": "*"}`` is ``-1``, an
``{"error": ...}`` entry and a duplicate reply are rejected. ``prb_id``, ``msm_id``,
``size`` are kept. Firmware variants (RIPE's result format documentation): ``addr``/``name``
for ``dst_addr``/``dst_name`` (fw 1), numbers written as strings and no ``result`` list
(fw 0), no ``af`` or ``src_addr`` before fw 4460 (the family then comes from the address).

Source address (``--source``, AtlasConfig.source):

    public (default)    the probe's public address, ``from``, when that is a non-empty
                        string, else the result's ``src_addr``. When ``from`` is of another
                        family than ``dst_addr`` (an IPv6 ``from`` on an IPv4 measurement;
                        an address with a ':' is IPv6) and ``src_addr`` is of the
                        destination's family, ``src_addr`` is taken; when neither matches,
                        ``from`` stays and validation rejects the row as ``family_mismatch``.
                        ``ip_version`` is ``af`` (else the destination's family) either way.
    local               the probe's interface address, ``src_addr`` (often private:
                        192.168.x, 10.x), else ``from`` (the behaviour before --source).

Either way the result's own ``src_addr`` is kept as ``src_addr_local`` (null when the
result has none); `prep shards` reads only the columns it needs and ignores it.

Local errors (``--errors``, AtlasConfig.errors; one row per result only): a result with
no reply whose packets are local errors (``{"error": "connect failed: Network is
unreachable"}``: the probe could not send) and no timeout (``{"x": "*"}``) says nothing
about the path, so by default (``skip``) it is rejected as ``local_error``; ``failed``
makes it an rtt ``-1`` row like a timeout (the behaviour before --errors). A result with
a timeout or a reply besides its errors is a row either way. ``--per-packet`` rejects each
error entry as ``packet_error`` whatever --errors says.

Rejection reasons of the importer, on top of prep.validate's (which every row passes
through, so the output holds only rows `prep shards` accepts):

    malformed_json      a JSON line that does not parse: bad syntax, bytes that are not
                        UTF-8, nesting too deep (logged with its line number); in an array,
                        an element with bytes that are not UTF-8
    not_a_result        a JSON value that is not an object
    not_ping            an object whose ``type`` is not "ping"
    bad_result          ``result`` is neither a list nor absent, or ``avg`` is missing/not a number
    local_error         (per result, --errors skip) only ``{"error": ...}`` packets: no reply, no timeout
    packet_error        (per packet) an ``{"error": ...}`` entry
    duplicate_reply     (per packet) a reply marked ``dup``
    no_packets          (per packet) an empty ``result`` list

Accounting: rows_in (results, or packet rows plus result-level rejects with --per-packet)
== rows_written + sum(rejected.values()). A number the output column cannot hold (a
``timestamp`` or ``prb_id`` past int64) reaches validation as one it rejects
(``time_out_of_range``, ``bad_prb_id``); the carried ``msm_id`` and ``size`` become null.

Speed. Files are converted in parallel, one task per file (the biggest first), on
``workers`` processes (0: one per core); each writes its own parquet file, in row groups
cut every BATCH rows, so the output bytes and the summary's counts do not depend on
``workers``. A block of lines (or an array line) is decoded by msgspec in one call
straight into typed structs of the fields used (the others are skipped, not built), and
becomes columns in one pass; a line that struct does not take as is (old firmware,
numbers as strings, nulls, odd types, anything but one object, bytes that are not UTF-8)
goes through the stdlib ``json`` path above, value by value, with the same result (held
to it by tests/test_atlas_source.py). .bz2 files are decompressed by indexed_bzip2 (a
faster decoder than libbz2), on several threads when there are fewer files than workers.
The garbage collector is off while a file converts: the rows hold no cycles.
"""

from __future__ import annotations

import bz2
import codecs
import concurrent.futures
import contextlib
import gc
import gzip
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
import zlib
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import compress
from pathlib import Path
from typing import Any, Iterator, Literal

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from prep.errors import InputError
from prep.validate import find_files, validate_rows

try:  # parallel bzip2 decompression; optional: stdlib bz2 otherwise
    import indexed_bzip2
except ImportError:  # pragma: no cover
    indexed_bzip2 = None

SCHEMA = pa.schema([("event_time", pa.timestamp("s", tz="UTC")), ("prb_id", pa.int64()),
                    ("src_addr", pa.string()), ("dst_addr", pa.string()), ("ip_version", pa.int8()),
                    ("rtt", pa.float64()), ("msm_id", pa.int64()), ("size", pa.int64()),
                    ("src_addr_local", pa.string())])
BATCH = 65_536  # rows per parquet write (a row group: rows BATCH*i .. BATCH*(i+1)-1 before validation)
SUFFIXES = (".json", ".jsonl", ".ndjson", ".bz2", ".gz")
SOURCES = ("public", "local")
ERRORS = ("skip", "failed")
MAX_LOGGED = 20  # malformed lines logged one by one; the rest only counted
CHUNK = 1 << 20  # bytes per read
WHOLE_LINE = 32  # chunks: a line that opens an array and is longer streams, element by element
MALFORMED = object()  # a value that could not be read (JSON's null is a value: None is taken)
_BOM = b"\xef\xbb\xbf"
_WS = b" \t\r\n"  # JSON's whitespace
_DECODER = json.JSONDecoder()
_SKIP = re.compile("[ \t\r\n\ufeff]*").match  # JSON whitespace, and a byte-order mark
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as "surrogateescape" keeps them
_FAST = True  # the msgspec path (tests turn it off to compare with the stdlib path)
_UNSET = msgspec.UNSET


@dataclass(frozen=True)
class AtlasConfig:
    inputs: tuple[Path, ...]  # files or folders
    out: Path  # output folder: one parquet file per input file
    per_packet: bool = False  # one row per packet instead of one per result
    strict: bool = False  # a malformed JSON line is an InputError, not a rejected row
    source: str = "public"  # src_addr: "public" (from, else src_addr) or "local" (src_addr, else from)
    errors: str = "skip"  # a result with only local errors: "skip" (local_error) or "failed" (rtt -1)
    workers: int = 0  # processes, one file each; 0: one per core


def list_atlas_inputs(paths) -> list[Path]:
    """Result files (JSON, JSON lines, .bz2/.gz dumps) named directly or found under folders."""
    return find_files(paths, SUFFIXES, f"no RIPE Atlas result files ({', '.join(SUFFIXES)}) found",
                      # a file of no known kind goes to the importer, which counts its
                      # lines as malformed_json (and fails if nothing is left)
                      command="prep import-atlas", kinds=("atlas", "unknown", "empty"))


def _open_binary(path: Path, threads: int = 1):
    with open(path, "rb") as f:
        magic = f.read(3)
    if magic == b"BZh":
        if indexed_bzip2 is not None:  # faster than libbz2 on one thread, and can use several
            return indexed_bzip2.open(str(path), parallelization=threads)
        return bz2.open(path, "rb")
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


class _Source:
    """A binary stream read in ``chunk``-sized reads, with unread bytes put back in front."""

    def __init__(self, f, chunk: int):
        self.f, self.chunk, self.head = f, chunk, b""

    def read(self) -> bytes:
        if self.head:
            b, self.head = self.head, b""
            return b
        return self.f.read(self.chunk)

    def unread(self, b: bytes) -> None:
        self.head = b + self.head

    def block(self) -> tuple[bytes, bool]:
        """(whole lines, False): what comes next up to its last newline, at least one line
        (at the end of the file, the rest); b"" at the end. A line that opens an array and
        is longer than WHOLE_LINE chunks comes as (its first bytes, True): the array then
        streams via ``read``."""
        buf = self.read()
        parts, size, array = [], 0, None
        while True:
            i = buf.rfind(b"\n") + 1
            if i:
                self.head = buf[i:]
                parts.append(buf[:i])
                return b"".join(parts), False
            parts.append(buf)
            size += len(buf)
            if size >= self.chunk * WHOLE_LINE:
                if array is None:
                    array = _opens_array(b"".join(parts)[:4096])
                if array:
                    return b"".join(parts), True
            buf = self.f.read(self.chunk)
            if not buf:
                return b"".join(parts), False


# The fields a result is read into on the fast path, with the types that path takes as
# is; anything else (a field of another type, a string number, a missing field, another
# "type") fails the decode and the line takes the stdlib path.
class _Packet(msgspec.Struct, gc=False):
    rtt: float = None  # absent: None (JSON null is refused: the stdlib path rejects it)
    dup: int = 0
    error: Any = _UNSET


class _Result(msgspec.Struct, gc=False):
    timestamp: int
    prb_id: int
    dst_addr: str
    af: Literal[4, 6]
    result: list[_Packet]
    type: Literal["ping"] = "ping"
    src_addr: str = None
    from_: str = msgspec.field(default=None, name="from")
    msm_id: int = None
    size: int = None


_decode_result = msgspec.json.Decoder(_Result).decode
_decode_lines = msgspec.json.Decoder(_Result).decode_lines
_decode_result_list = msgspec.json.Decoder(list[_Result]).decode
_decode_raw_list = msgspec.json.Decoder(list[msgspec.Raw]).decode
_FAST_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


class _Fast(list):
    """_Result structs of consecutive values of a file."""


def _results(path: Path, strict: bool, log: list, *, chunk: int = CHUNK, fast: bool = True,
             threads: int = 1) -> Iterator[object]:
    """Every result of one file, in order; MALFORMED for a value that could not be read;
    runs of results the fast path decoded come as one ``_Fast`` list of structs.

    The file is a sequence of JSON values, one per line, where a top-level array stands
    for its elements: an API download, JSON lines, arrays concatenated (``[...][...]``),
    an array followed by lines, a UTF-8 byte-order mark in front. A line that is not JSON
    (bad syntax, bytes that are not UTF-8, nesting too deep) is one MALFORMED value; an
    array streams, and one it cannot read to its ']' is an InputError for the file.
    """
    with _open_binary(path, threads) as f:
        src = _Source(f, chunk)
        done = 0  # lines before the block
        while True:
            block, partial = src.block()
            if not block:
                return
            if partial:  # a line over WHOLE_LINE chunks that opens an array: it streams
                src.unread(block)
                done += (yield from _array(src, path, strict, log, done + 1, fast))
                continue
            ascii_block = block.isascii()
            if fast and ascii_block:
                try:  # the common case: every line a result the struct takes as is
                    run = _Fast(_decode_lines(block))
                    if len(run) == block.count(b"\n") + (block[-1:] != b"\n"):  # no blank line
                        yield run
                        done += len(run)
                        continue
                except _FAST_ERRORS:
                    pass
            lines = block.split(b"\n")
            if not lines[-1]:  # the block ends with a newline
                lines.pop()
            run, pos = _Fast(), 0
            for i, line in enumerate(lines):
                utf8 = ascii_block or line.isascii() or _is_utf8(line)
                if fast and utf8:
                    try:
                        run.append(_decode_result(line))
                        pos += len(line) + 1
                        continue
                    except _FAST_ERRORS:
                        pass
                if run:
                    yield run
                    run = _Fast()
                lineno = done + i + 1
                whole = block[pos:pos + len(line) + 1]  # the line with its newline, if any
                if (yield from _line(whole, path, strict, log, lineno, fast and utf8)):
                    src.unread(block[pos:])  # an array to stream: it and the rest go back
                    done = lineno + (yield from _array(src, path, strict, log, lineno, fast)) - 1
                    break
                pos += len(line) + 1
            else:
                if run:
                    yield run
                done += len(lines)


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def _line(line: bytes, path: Path, strict: bool, log: list, lineno: int, fast: bool):
    """Yield the values of one whole line that is not a result the struct takes; returns
    True, having yielded nothing, when the line opens an array that must stream."""
    if fast and _opens_array(line):
        items = _array_line(line)
        if items is not None:
            yield from items
            return False
    try:
        v = json.loads(line.decode())
    except (ValueError, RecursionError):  # the slow path: all but plain lines
        if not line.strip():
            return False
        if _opens_array(line):
            return True
        values = _values(line)
        if values is None:
            why = _why(line)
            if strict:
                raise InputError(f"{path}:{lineno}: malformed JSON line ({why}); "
                                 "fix or drop the line, or run without --strict") from None
            log.append(f"{path}:{lineno}: malformed JSON ({why}), rejected")
            yield MALFORMED
            return False
        for v in values:
            if type(v) is list:
                yield from v
            else:
                yield v
        return False
    if type(v) is list:
        yield from v
    else:
        yield v
    return False


def _array_line(line: bytes) -> list | None:
    """The elements of a line that is one JSON array (UTF-8), the struct's as runs of
    structs and the others as the stdlib decodes them; None when the line is anything else."""
    try:  # the common case: every element a result the struct takes as is
        return [_Fast(_decode_result_list(line))]
    except _FAST_ERRORS:
        pass
    try:
        raws = _decode_raw_list(line)
    except _FAST_ERRORS:
        return None
    items, run = [], _Fast()
    for raw in raws:
        try:
            run.append(_decode_result(raw))
            continue
        except _FAST_ERRORS:
            pass
        try:
            v = json.loads(bytes(raw).decode())
        except (ValueError, RecursionError):
            return None
        if run:
            items.append(run)
            run = _Fast()
        items.append(v)
    if run:
        items.append(run)
    return items


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


def _array(src: _Source, path: Path, strict: bool, log: list, lineno: int, fast: bool):
    """The JSON array at the front of ``src`` (see _json_array); returns the newlines read."""
    if fast:
        return (yield from _array_fast(src, path, strict, log, lineno))
    return (yield from _json_array(src, path, strict, log, lineno))


_QUOTE, _BSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = ord("{"), ord("}"), ord("["), ord("]")


def _scan(buf: bytes) -> tuple[np.ndarray, int]:
    """(offsets of the commas between the values at the front of ``buf``, the offset of the
    bracket that closes their array or -1): ``buf`` starts between two values of an array.
    Only the quotes, brackets and commas are looked at (a quote escaped by an odd run of
    backslashes ends no string)."""
    a = np.frombuffer(buf, np.uint8)
    quote = a == _QUOTE
    if _BSLASH in buf:
        idx = np.arange(len(a))
        last_plain = np.maximum.accumulate(np.where(a == _BSLASH, -1, idx))  # last non-backslash <= i
        q = np.flatnonzero(quote[1:]) + 1
        quote[q[((q - 1) - last_plain[q - 1]) % 2 == 1]] = False
    pos = np.flatnonzero(quote | (a == _LBRACE) | (a == _RBRACE) | (a == _LBRACKET)
                         | (a == _RBRACKET) | (a == _COMMA))
    c = a[pos]
    outside = (np.cumsum(quote[pos], dtype=np.int32) & 1) == 0  # a closing quote: outside, no bracket
    step = ((c == _LBRACE) | (c == _LBRACKET)).astype(np.int8) - ((c == _RBRACE) | (c == _RBRACKET))
    depth = np.cumsum(step * outside, dtype=np.int32)
    below = np.flatnonzero(depth < 0)
    end = int(pos[below[0]]) if len(below) else -1
    seps = pos[(c == _COMMA) & outside & (depth == 0)]
    return (seps[seps < end] if end >= 0 else seps), end


def _array_fast(src: _Source, path: Path, strict: bool, log: list, lineno: int):
    """_json_array, faster: values found by a vectorised scan of about a chunk at a time,
    decoded by msgspec (into structs, else by the stdlib json as _json_array does); from the
    first value it would treat otherwise (not UTF-8, not JSON, no closing bracket before the
    end, one value longer than 4 chunks), _json_array reads the rest of the array, told the
    values read so far."""
    head = src.read()
    body = head.lstrip(_WS)
    if body[:1] != b"[":  # a byte-order mark in front
        src.unread(head)
        return (yield from _json_array(src, path, strict, log, lineno))
    newlines = head.count(b"\n", 0, len(head) - len(body))
    buf, off, n, eof = body, 1, 0, False  # buf[off:] is unread, between two values

    def rest(k: int):  # _json_array reads on from buf[k:]
        nl = newlines + buf.count(b"\n", off, k)
        src.unread(b"[" + buf[k:])
        return nl + (yield from _json_array(src, path, strict, log, lineno + nl, n0=n))

    while True:
        if len(buf) - off < src.chunk and not eof:  # a chunk ahead at least
            more = src.read()
            eof = not more
            buf, off = buf[off:] + more, 0
        w = src.chunk
        while True:
            part = buf[off:off + w]
            seps, end = _scan(part)
            if end >= 0 or len(seps) or off + w >= len(buf):
                break
            w *= 2  # a value longer than the window
        if end < 0 and not len(seps):  # not one whole value in what was read
            if eof or len(buf) - off > 4 * src.chunk:
                return (yield from rest(off))
            more = src.read()
            eof = not more
            buf, off = buf[off:] + more, 0
            continue
        stop = end if end >= 0 else int(seps[-1])
        starts = [0, *(seps + 1).tolist()]
        stops = [*seps.tolist(), stop]
        if end < 0:  # the value after the last comma may go on past the window
            starts.pop(), stops.pop()
        values, ok, ascii_part = None, True, part.isascii()
        if ascii_part:
            try:  # the common case: every value a result the struct takes as is
                values = _Fast(_decode_result_list(b"[" + part[:stop] + b"]"))
            except _FAST_ERRORS:
                pass
        if values is not None:
            n += len(values)
            if values:
                yield values
        else:
            run = _Fast()
            for i, j in zip(starts, stops):
                v = part[i:j]
                if not v.strip(_WS):
                    continue  # commas in a row: _json_array skips them
                if not (ascii_part or v.isascii() or _is_utf8(v)):
                    ok = False  # _json_array tells a value that is not UTF-8
                    break
                try:
                    run.append(_decode_result(v))
                    n += 1
                    continue
                except _FAST_ERRORS:
                    pass
                try:
                    v = json.loads(v.decode())
                except (ValueError, RecursionError):  # not one JSON value
                    ok = False
                    break
                if run:
                    yield run
                    run = _Fast()
                n += 1
                yield v
            if run:
                yield run
            if not ok:
                return (yield from rest(off + i))
        if end >= 0:
            if part[end] != _RBRACKET:  # a '}' closes the array: _json_array says what is wrong
                return (yield from rest(off + end))
            src.unread(buf[off + end + 1:])
            return newlines + buf.count(b"\n", off, off + end)
        newlines += part.count(b"\n", 0, stop)
        off += stop + 1


def _json_array(src: _Source, path: Path, strict: bool, log: list, lineno: int, n0: int = 0):
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
    n, newlines = n0, 0  # n0: elements read before (by _array_fast)
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


def _public(frm, loc, dst):
    """The source address with --source public: ``from`` when it is a non-empty string,
    unless it and ``dst_addr`` differ in family (an IPv6 address has a ':') while the local
    ``src_addr`` matches ``dst_addr``; else ``src_addr``."""
    if not (isinstance(frm, str) and frm):
        return loc
    if (isinstance(dst, str) and dst and (":" in frm) != (":" in dst)
            and isinstance(loc, str) and loc and (":" in loc) == (":" in dst)):
        return loc
    return frm


class _Rows:
    """Column lists of the rows not yet written, in SCHEMA order."""

    def __init__(self, cols=None):
        self.cols = cols or [[] for _ in SCHEMA.names]

    def add(self, t, prb, src, dst, af, rtt, msm, size, loc):
        for c, v in zip(self.cols, (t, prb, src, dst, af, rtt, msm, size, loc)):
            c.append(v)

    def __len__(self):
        return len(self.cols[5])

    def take(self, k: int) -> pa.Table:
        """A table of the first ``k`` rows, which leave."""
        def col(name, typ, v):
            try:
                return pa.array(v, typ)
            except (OverflowError, UnicodeEncodeError, pa.ArrowException):  # rare: a value the column cannot hold
                return pa.array([_FIT[name](x) for x in v], typ)
        head = [c[:k] for c in self.cols]
        self.cols = [c[k:] for c in self.cols]
        return pa.table({f.name: col(f.name, f.type, v) for f, v in zip(SCHEMA, head)})


_I64 = 2**63
_INF = math.inf


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
    "src_addr_local": _text,
}


@dataclass(frozen=True)
class _Mode:
    per_packet: bool
    public: bool  # --source public
    skip_errors: bool  # --errors skip


def _convert(r, mode: _Mode, rows: _Rows, rejected: dict) -> None:
    """Append the row(s) of one decoded result (any JSON value), or count why it has none."""
    def reject(reason, k=1):
        rejected[reason] = rejected.get(reason, 0) + k

    if not isinstance(r, dict):
        return reject("not_a_result")
    if r.get("type", "ping") != "ping":
        return reject("not_ping")
    dst = r.get("dst_addr", r.get("addr"))
    loc = r.get("src_addr")
    src = _public(r.get("from"), loc, dst) if mode.public else r.get("src_addr", r.get("from"))
    t, prb = _num(r.get("timestamp"), int), _num(r.get("prb_id"), int)
    msm, size, af = _num(r.get("msm_id"), int), _num(r.get("size"), int), _family(r, dst)
    packets = r.get("result")
    if packets is None:  # firmware 0: only the summary
        avg = _num(r.get("avg"))
        if avg is None:
            return reject("bad_result")
        return rows.add(t, prb, src, dst, af, -1.0 if avg < 0 else avg, msm, size, loc)
    if not isinstance(packets, list):
        return reject("bad_result")
    if not mode.per_packet:
        replies = [_num(p.get("rtt")) for p in packets
                   if isinstance(p, dict) and "rtt" in p and not p.get("dup")]
        if any(x is None for x in replies):
            return reject("bad_result")
        if replies:
            rtt = _mean(replies)
        elif mode.skip_errors and _only_errors(packets):
            return reject("local_error")
        else:
            rtt = -1.0
        return rows.add(t, prb, src, dst, af, rtt, msm, size, loc)
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
            rows.add(t, prb, src, dst, af, float("nan") if rtt is None else rtt, msm, size, loc)
        else:  # {"x": "*"}: nothing came back
            rows.add(t, prb, src, dst, af, -1.0, msm, size, loc)


def _only_errors(packets: list) -> bool:
    """Local errors and no reply or timeout: the packet objects (other entries do not
    count) are all ``{"error": ...}`` entries without an ``rtt``, and there is one at least."""
    dicts = [p for p in packets if isinstance(p, dict)]
    return bool(dicts) and all("error" in p and "rtt" not in p for p in dicts)


def _mean(replies: list) -> float:
    """The mean, summed left to right (as ``np.bincount`` sums, in ``_convert_fast``; not
    ``sum``, which compensates from Python 3.12); when finite replies overflow the sum, the
    largest (as far out of range)."""
    s = 0.0
    for x in replies:
        s += x
    return max(replies) if s == _INF else s / len(replies)


def _convert_fast(rs: list, mode: _Mode, rows: _Rows, rejected: dict) -> None:
    """What ``_convert`` does, for results decoded into ``_Result`` structs: the same rows
    and counts. One row per result: column by column, the packets' means by ``np.bincount``."""
    if not mode.per_packet:
        return _results_fast(rs, mode, rows, rejected)
    _packets_fast(rs, mode, rows, rejected)


def _results_fast(rs: list, mode: _Mode, rows: _Rows, rejected: dict) -> None:
    n = len(rs)
    pks = [r.result for r in rs]
    counts = np.fromiter(map(len, pks), np.int64, n)
    flat = [p for pk in pks for p in pk]
    row = np.repeat(np.arange(n), counts)
    rtt = np.array([None if p.dup else p.rtt for p in flat], np.float64)  # nan: no reply, or a dup
    reply = ~np.isnan(rtt)
    got = np.bincount(row, reply, minlength=n)
    mean = np.bincount(row, np.where(reply, rtt, 0.0), minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = mean / got  # (int64 both when no packet at all)
    mean[got == 0] = -1.0
    over = np.flatnonzero(mean == np.inf)  # finite replies whose sum overflows (rare)
    if len(over):
        start = np.cumsum(counts) - counts
        for i in over.tolist():
            mean[i] = _mean(rtt[start[i]:start[i] + counts[i]][reply[start[i]:start[i] + counts[i]]].tolist())
    if mode.skip_errors:  # among the results with packets but no reply: only local errors?
        unset = _UNSET
        local = [i for i in np.flatnonzero((got == 0) & (counts > 0)).tolist()
                 if all(p.error is not unset and p.rtt is None for p in pks[i])]
        if local:
            rejected["local_error"] = rejected.get("local_error", 0) + len(local)
            keep = np.ones(n, bool)
            keep[local] = False
            rs = list(compress(rs, keep.tolist()))
            mean = mean[keep]
    t_, prb_, src_, dst_, af_, rtt_, msm_, size_, loc_ = rows.cols
    loc, dst = [r.src_addr for r in rs], [r.dst_addr for r in rs]
    if mode.public:
        src = [f if f and (":" in f) == (":" in d) else _public(f, l, d)
               for f, l, d in zip([r.from_ for r in rs], loc, dst)]
    else:
        src = [l if l is not None else r.from_ for l, r in zip(loc, rs)]
    t_ += [r.timestamp for r in rs]
    prb_ += [r.prb_id for r in rs]
    src_ += src
    dst_ += dst
    af_ += [r.af for r in rs]
    rtt_ += mean.tolist()
    msm_ += [r.msm_id for r in rs]
    size_ += [r.size for r in rs]
    loc_ += loc


def _packets_fast(rs: list, mode: _Mode, rows: _Rows, rejected: dict) -> None:
    t_, prb_, src_, dst_, af_, rtt_, msm_, size_, loc_ = (c.append for c in rows.cols)
    public, unset = mode.public, _UNSET
    empty = err = dup = 0
    for r in rs:
        pk = r.result
        if not pk:
            empty += 1
            continue
        loc, dst = r.src_addr, r.dst_addr
        if public:
            src = _public(r.from_, loc, dst)
        else:
            src = loc if loc is not None else r.from_
        t, prb, af, msm, size = r.timestamp, r.prb_id, r.af, r.msm_id, r.size
        for p in pk:
            if p.error is not unset:
                err += 1
            elif p.dup:
                dup += 1
            else:
                t_(t), prb_(prb), src_(src), dst_(dst), af_(af), msm_(msm), size_(size), loc_(loc)
                rtt_(-1.0 if p.rtt is None else p.rtt)
    for reason, k in (("no_packets", empty), ("packet_error", err), ("duplicate_reply", dup)):
        if k:
            rejected[reason] = rejected.get(reason, 0) + k


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


_ADDR_CACHE: dict = {}  # per process, across files: each distinct address text parsed once


def _import_file(task) -> dict:
    """Convert one file into ``out_file``; its counts, and its first MAX_LOGGED log lines.

    The cyclic garbage collector is off meanwhile: the rows make no cycles, and its passes
    over the many young objects (a list per result) cost as much as the decoding.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _import_one(*task)
    finally:
        if enabled:
            gc.enable()


def _import_one(path: Path, out_file: Path, cfg: AtlasConfig, chunk: int, fast: bool,
                threads: int) -> dict:
    mode = _Mode(cfg.per_packet, cfg.source == "public", cfg.errors == "skip")
    results_read, rows_in, rows_written = 0, 0, 0
    mine: dict[str, int] = {}  # the importer's rejections
    checked: Counter = Counter()  # validation's
    log: list[str] = []
    rows = _Rows()
    with pq.ParquetWriter(out_file, SCHEMA, compression="zstd") as writer:
        def write(k):
            nonlocal rows_in, rows_written
            for _ in range(k // BATCH + (k % BATCH > 0)):
                table = rows.take(min(BATCH, k))
                k -= len(table)
                keep, _, why = validate_rows(table, source=str(path), _cache=_ADDR_CACHE)
                writer.write_table(table.filter(pa.array(keep)))
                rows_in += len(table)
                rows_written += int(keep.sum())
                checked.update(why)

        try:
            for v in _results(path, cfg.strict, log, chunk=chunk, fast=fast, threads=threads):
                if type(v) is _Fast:
                    results_read += len(v)
                    _convert_fast(v, mode, rows, mine)
                else:
                    results_read += 1
                    if v is MALFORMED:
                        mine["malformed_json"] = mine.get("malformed_json", 0) + 1
                    else:
                        _convert(v, mode, rows, mine)
                if len(rows) >= BATCH:
                    n = len(rows)
                    write(n - n % BATCH)
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(f"{path}: unreadable or truncated ({e}); "
                             "download the file again") from None
        except RuntimeError as e:  # indexed_bzip2's, often just "std::exception"
            if isinstance(e, RecursionError):
                raise
            why = "damaged or incomplete bzip2 data" if str(e) == "std::exception" else f"bzip2: {e}"
            raise InputError(f"{path}: unreadable or truncated ({why}); "
                             "download the file again") from None
        if len(rows):
            write(len(rows))
    rejected = dict(checked + Counter(mine))
    return {"results_read": results_read, "rows_in": rows_in + sum(mine.values()),
            "rows_written": rows_written, "rejected": rejected, "log": log[:MAX_LOGGED],
            "logged": len(log)}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the driver decides


def _mp_context():
    """Fork (cheap: inherits the imports) unless this process runs other threads or has
    imported JAX (locks held at fork time would deadlock the child); then a fork server."""
    if threading.active_count() == 1 and "jax" not in sys.modules:
        return multiprocessing.get_context("fork")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["prep.atlas"])
    return ctx


def _work(path: Path) -> int:
    """About how much work a file is: its size, a compressed one's times its usual ratio."""
    try:
        with open(path, "rb") as f:
            magic = f.read(3)
        return path.stat().st_size * (10 if magic == b"BZh" or magic[:2] == b"\x1f\x8b" else 1)
    except OSError:
        return 0


@contextlib.contextmanager
def _tasks_run(procs: int, tasks: list):
    """The results of ``_import_file`` over ``tasks``, in order, on ``procs`` processes
    (in this one for 1); a worker's InputError is raised here, and the pool stops with it."""
    if procs <= 1:
        yield map(_import_file, tasks)
        return
    ex = concurrent.futures.ProcessPoolExecutor(procs, mp_context=_mp_context(),
                                                initializer=_worker_init)
    # The biggest files first, so that no big one is left running alone at the end;
    # the results still come in file order.
    futures = [None] * len(tasks)
    for i in sorted(range(len(tasks)), key=lambda i: -_work(tasks[i][0])):
        futures[i] = ex.submit(_import_file, tasks[i])

    def results():
        for f in futures:
            while True:
                try:
                    yield f.result(timeout=0.5)  # a timeout: SIGINT is handled promptly
                    break
                except concurrent.futures.TimeoutError:
                    continue
                except BrokenProcessPool:
                    raise InputError("import-atlas: a worker process stopped unexpectedly (killed, "
                                     "perhaps by the out-of-memory killer); run again, with fewer "
                                     "--workers") from None

    ok = False
    try:
        yield results()
        ok = True
    finally:
        if ok:
            ex.shutdown(wait=True)
        else:
            procs = list(getattr(ex, "_processes", {}).values())
            ex.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                with contextlib.suppress(Exception):
                    p.terminate()
            for p in procs:
                with contextlib.suppress(Exception):
                    p.join(5)


def _nothing_written(files: list[Path], results: int, rejected: dict, out: Path) -> str:
    where = f"{files[0]}" if len(files) == 1 else f"{len(files)} files"
    if not results:
        why = f"{where} hold{'s' if len(files) == 1 else ''} no JSON values"
    else:
        top = ", ".join(f"{k} {v:,}" for k, v in sorted(rejected.items(), key=lambda kv: -kv[1])[:3])
        why = (f"all {results:,} values" if results > 1 else "the one value") + f" read from {where} were rejected ({top})"
        if rejected.get("malformed_json", 0) + rejected.get("not_a_result", 0) >= sum(rejected.values()) / 2:
            why += "; are these RIPE Atlas ping results (JSON from the results API or a daily dump)?"
        elif rejected.get("not_ping"):
            why += "; only ping measurements are imported"
    return f"import-atlas: no rows written: {why}; nothing was written to {out}"


def import_atlas(cfg: AtlasConfig) -> dict:
    """Convert every input; all output files appear together at the end, or none do."""
    if cfg.source not in SOURCES or cfg.errors not in ERRORS:
        raise ValueError(f"source must be one of {SOURCES} and errors one of {ERRORS}")
    t0 = time.perf_counter()
    files = list_atlas_inputs(cfg.inputs)
    names = _output_names(files)
    stage = Path(cfg.out) / ".import-tmp"
    made = not Path(cfg.out).exists()
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    workers = cfg.workers if cfg.workers > 0 else _cores()
    procs = min(workers, len(files))
    threads = max(1, workers // procs)  # decompression threads of a .bz2 file
    tasks = [(path, stage / name, cfg, CHUNK, _FAST, threads) for path, name in zip(files, names)]
    results_read = rows_in = rows_written = logged = 0
    rejected: Counter = Counter()
    log: list[str] = []
    try:
        with _tasks_run(procs, tasks) as results, contextlib.ExitStack() as stack:
            # a bar only on a terminal: tqdm starts a thread even when disabled, and a
            # later run in this process would then start its workers by a fork server
            bar = stack.enter_context(tqdm(total=len(files), unit=" files", desc="import-atlas",
                                           file=sys.stderr)) if sys.stderr.isatty() else None
            for res in results:
                results_read += res["results_read"]
                rows_in += res["rows_in"]
                rows_written += res["rows_written"]
                rejected.update(res["rejected"])
                log += res["log"][:MAX_LOGGED - len(log)]
                logged += res["logged"]
                if bar is not None:
                    bar.update(1)
        for line in log:
            print(line, file=sys.stderr)
        if logged > MAX_LOGGED:
            print(f"... and {logged - MAX_LOGGED:,} more malformed JSON lines", file=sys.stderr)
        if not rows_written:  # a finished-looking empty dataset is worse than an error
            raise InputError(_nothing_written(files, results_read, rejected, Path(cfg.out)))
        for name in names:
            (stage / name).replace(Path(cfg.out) / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if made:  # an empty folder left behind would look like output
            with contextlib.suppress(OSError):
                Path(cfg.out).rmdir()
    elapsed = time.perf_counter() - t0
    summary = {"files": len(files), "results_read": results_read, "rows_in": rows_in,
               "rows_written": rows_written, "rejected": dict(sorted(rejected.items())),
               "per_packet": cfg.per_packet, "source": cfg.source, "errors": cfg.errors,
               "elapsed_s": round(elapsed, 3),
               "results_per_s": round(results_read / max(elapsed, 1e-9), 1)}
    why = ", ".join(f"{k} {v:,}" for k, v in summary["rejected"].items()) or "none"
    print(f"import-atlas: {results_read:,} results from {len(files)} files -> "
          f"{rows_written:,} rows in {cfg.out} | rejected {sum(rejected.values()):,} ({why}) | "
          f"{elapsed:.1f}s, {summary['results_per_s']:,.0f} results/s on {procs} "
          f"process{'es' if procs > 1 else ''}", file=sys.stderr)
    return summary
