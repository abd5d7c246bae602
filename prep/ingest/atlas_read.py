"""The values of one RIPE Atlas result file for `prep import-atlas`, streaming: ``read_results``.

A file is a sequence of JSON values, one per line, where a top-level array stands for
its elements. It is opened by its magic bytes (bzip2 by indexed_bzip2 when installed, on
``threads`` threads, DECOMPRESS bytes at a time; gzip; else plain) and read in blocks of
whole lines of about CHUNK bytes (in the common case read into one reused buffer and
decoded there, never copied: ``_Source.lines``), each decoded by prep.ingest.atlas_json. An
array over several lines, or on a line longer than WHOLE_LINE chunks, streams:
``_array_fast`` finds its values by a vectorised scan of about a chunk at a time and
decodes them by msgspec; from the first value it cannot take ``_json_array`` (the stdlib,
one element at a time) reads on. One it cannot read to its ']' is an InputError for the file.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from prep.base.errors import InputError
from prep.ingest.atlas_json import (
    DECODER,
    MALFORMED,
    SKIP,
    WS,
    Fast,
    decode_line,
    decode_lines,
    decode_result,
    decode_result_list,
    is_utf8,
    opens_array,
    typed,
)

try:  # parallel bzip2 decompression; optional: stdlib bz2 otherwise
    import indexed_bzip2
except ImportError:  # pragma: no cover
    indexed_bzip2 = None

CHUNK = 1 << 20  # bytes per read
# bytes decompressed at a time (bzip2): the decompressor run a CHUNK at a time between the
# parser's blocks costs more CPU than the two apart (each evicts the other's data from the caches)
DECOMPRESS = 16 << 20
WHOLE_LINE = 32  # chunks: a line that opens an array and is longer streams, element by element
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as "surrogateescape" keeps them


def open_binary(path: Path, threads: int = 1):
    with open(path, "rb") as f:
        magic = f.read(3)
    if magic == b"BZh":
        if indexed_bzip2 is not None:  # faster than libbz2 on one thread, and can use several
            raw = indexed_bzip2.IndexedBzip2FileRaw(str(path), parallelization=threads)
            return io.BufferedReader(raw, buffer_size=DECOMPRESS)
        return bz2.open(path, "rb")
    if magic[:2] == b"\x1f\x8b":
        return gzip.open(path, "rb")
    return open(path, "rb")


class _Source:
    """A binary stream read in ``chunk``-sized reads, with unread bytes put back in front."""

    def __init__(self, f, chunk: int):
        self.f, self.chunk, self.head = f, chunk, b""
        self._buf = self._view = None

    def lines(self) -> np.ndarray | None:
        """What ``block`` would give in the common case (the bytes left, then a read, up to
        its last newline), with no copy: a uint8 view of a buffer reused by the next call.
        None where that is not the case (no newline in it, or a long line put back), the
        bytes then back in front for ``block``."""
        h = len(self.head)
        if h >= self.chunk:
            return None
        if self._buf is None:
            self._buf = bytearray(2 * self.chunk)
            self._view = memoryview(self._buf)
        buf, view = self._buf, self._view
        buf[:h] = self.head
        k = h + self.f.readinto(view[h:h + self.chunk])
        i = buf.rfind(b"\n", 0, k) + 1
        self.head = bytes(view[i:k])
        return np.frombuffer(self._buf, np.uint8, i) if i else None

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
                    array = opens_array(b"".join(parts)[:4096])
                if array:
                    return b"".join(parts), True
            buf = self.f.read(self.chunk)
            if not buf:
                return b"".join(parts), False


def _lines(block: bytes) -> int:
    """The lines of ``block``, the last one with or without its newline (numpy counts the
    newlines several times faster than ``bytes.count``, a byte at a time)."""
    return int(np.count_nonzero(np.frombuffer(block, np.uint8) == _NEWLINE)) + (block[-1:] != b"\n")


def read_results(path: Path, strict: bool, log: list, *, chunk: int = CHUNK, fast: bool = True,
             threads: int = 1) -> Iterator[object]:
    """Every result of one file, in order; MALFORMED for a value that could not be read;
    runs of results the fast path decoded come as one ``Fast`` list of structs.

    The file is a sequence of JSON values, one per line, where a top-level array stands
    for its elements: an API download, JSON lines, arrays concatenated (``[...][...]``),
    an array followed by lines, a UTF-8 byte-order mark in front. A line that is not JSON
    (bad syntax, bytes that are not UTF-8, nesting too deep) is one MALFORMED value; an
    array streams, and one it cannot read to its ']' is an InputError for the file.
    """
    with open_binary(path, threads) as f:
        src = _Source(f, chunk)
        done = 0  # lines before the block
        while True:
            a = src.lines() if fast else None
            if a is not None:  # the common case: ASCII, every line a result the struct takes
                ascii_block = a.max() < 0x80
                if ascii_block:
                    run = typed(decode_lines, a)
                    if run is not None and len(run) == np.count_nonzero(a == _NEWLINE):
                        yield Fast(run)  # (and no blank line)
                        done += len(run)
                        continue
                block, partial, tried = a.tobytes(), False, ascii_block
            else:
                block, partial = src.block()
                tried = False
            if not block:
                return
            if partial:  # a line over WHOLE_LINE chunks that opens an array: it streams
                src.unread(block)
                done += (yield from _array(src, path, strict, log, done + 1, fast))
                continue
            ascii_block = block.isascii()
            if fast and ascii_block and not tried:  # as above, for a block ``lines`` left
                run = typed(decode_lines, block)
                if run is not None and len(run) == _lines(block):
                    yield Fast(run)
                    done += len(run)
                    continue
            lines = block.split(b"\n")
            if not lines[-1]:  # the block ends with a newline
                lines.pop()
            run, pos = Fast(), 0
            for i, line in enumerate(lines):
                utf8 = ascii_block or line.isascii() or is_utf8(line)
                r = typed(decode_result, line) if fast and utf8 else None
                if r is not None:
                    run.append(r)
                    pos += len(line) + 1
                    continue
                if run:
                    yield run
                    run = Fast()
                lineno = done + i + 1
                whole = block[pos:pos + len(line) + 1]  # the line with its newline, if any
                if (yield from decode_line(whole, path, strict, log, lineno, fast and utf8)):
                    src.unread(block[pos:])  # an array to stream: it and the rest go back
                    done = lineno + (yield from _array(src, path, strict, log, lineno, fast)) - 1
                    break
                pos += len(line) + 1
            else:
                if run:
                    yield run
                done += len(lines)


def _array(src: _Source, path: Path, strict: bool, log: list, lineno: int, fast: bool):
    """The JSON array at the front of ``src`` (see _json_array); returns the newlines read."""
    if fast:
        return (yield from _array_fast(src, path, strict, log, lineno))
    return (yield from _json_array(src, path, strict, log, lineno))


_NEWLINE, _QUOTE, _BSLASH, _COMMA = ord("\n"), ord('"'), ord("\\"), ord(",")
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
    body = head.lstrip(WS)
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
        k, bad = yield from _window(part, stop, starts, stops)
        n += k
        if bad >= 0:
            return (yield from rest(off + bad))
        if end >= 0:
            if part[end] != _RBRACKET:  # a '}' closes the array: _json_array says what is wrong
                return (yield from rest(off + end))
            src.unread(buf[off + end + 1:])
            return newlines + buf.count(b"\n", off, off + end)
        newlines += part.count(b"\n", 0, stop)
        off += stop + 1


def _window(part: bytes, stop: int, starts: list, stops: list):
    """Yield the values of one window of an array, ``part[:stop]``: the value ``i`` is
    ``part[starts[i]:stops[i]]``. Returns (the values read, the offset in ``part`` of the
    first value to leave to _json_array (not UTF-8, not JSON), or -1)."""
    ascii_part = part.isascii()
    # the common case: every value a result the struct takes as is
    values = typed(decode_result_list, b"[" + part[:stop] + b"]") if ascii_part else None
    if values is not None:
        if values:
            yield Fast(values)
        return len(values), -1
    run, n, bad = Fast(), 0, -1
    for i, j in zip(starts, stops):
        v = part[i:j]
        if not v.strip(WS):
            continue  # commas in a row: _json_array skips them
        if not (ascii_part or v.isascii() or is_utf8(v)):
            bad = i  # _json_array tells a value that is not UTF-8
            break
        r = typed(decode_result, v)
        if r is not None:
            run.append(r)
            n += 1
            continue
        try:
            v = json.loads(v.decode())
        except (ValueError, RecursionError):  # not one JSON value
            bad = i
            break
        if run:
            yield run
            run = Fast()
        n += 1
        yield v
    if run:
        yield run
    return n, bad


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
    pos = SKIP(buf).end() + 1  # past '[' (the caller saw it)
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
            obj, end = DECODER.raw_decode(buf, pos)
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
