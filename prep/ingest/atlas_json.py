"""JSON values for `prep import-atlas`, one line or one array element at a time.

Two paths with one result. The fast one: msgspec decodes a whole line, a block of lines
or an array, in one call, straight into ``_Result`` structs of the fields the rows use (the
others are skipped, not built); runs of them come as one ``Fast`` list. What that struct
does not take as is (old firmware, numbers written as strings, nulls, odd types, anything
but one object, bytes that are not UTF-8) fails the decode and takes the stdlib ``json``
path, value by value: the values as ``json.loads`` gives them, MALFORMED for a line that
is not JSON (logged, or an InputError with --strict). tests/test_atlas_source.py holds the
two to the same output. Reading the file, in blocks and streamed arrays: prep.ingest.atlas_read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import msgspec

from prep.base.errors import InputError

MALFORMED = object()  # a value that could not be read (JSON's null is a value: None is taken)
_BOM = b"\xef\xbb\xbf"
WS = b" \t\r\n"  # JSON's whitespace
DECODER = json.JSONDecoder()
SKIP = re.compile("[ \t\r\n\ufeff]*").match  # JSON whitespace, and a byte-order mark
_UNSET = msgspec.UNSET


# The fields a result is read into on the fast path, with the types that path takes as
# is; anything else (a field of another type, a string number, a missing field, another
# "type") fails the decode and the line takes the stdlib path. The fields are in the order
# of RIPE's keys (a key is looked for from the field after the last one found: one compare
# each), hence kw_only.
class _Packet(msgspec.Struct, gc=False):
    rtt: float = None  # absent: None (JSON null is refused: the stdlib path rejects it)
    dup: int = 0
    error: Any = _UNSET


class _Result(msgspec.Struct, gc=False, kw_only=True):
    af: Literal[4, 6]
    dst_addr: str
    src_addr: str = None
    size: int = None
    result: list[_Packet]
    msm_id: int = None
    prb_id: int
    timestamp: int
    from_: str = msgspec.field(default=None, name="from")
    type: Literal["ping"] = "ping"


decode_result = msgspec.json.Decoder(_Result).decode
decode_lines = msgspec.json.Decoder(_Result).decode_lines
decode_result_list = msgspec.json.Decoder(list[_Result]).decode
_decode_raw_list = msgspec.json.Decoder(list[msgspec.Raw]).decode
_FAST_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def typed(decode, data):
    """``decode(data)`` on the typed path, or None where that path does not take ``data``
    (the caller then goes the stdlib way)."""
    try:
        return decode(data)
    except _FAST_ERRORS:
        return None


class Fast(list):
    """_Result structs of consecutive values of a file."""


def is_utf8(b: bytes) -> bool:
    try:
        b.decode()
    except UnicodeDecodeError:
        return False
    return True


def decode_line(line: bytes, path: Path, strict: bool, log: list, lineno: int, fast: bool):
    """Yield the values of one whole line that is not a result the struct takes; returns
    True, having yielded nothing, when the line opens an array that must stream."""
    if fast and opens_array(line):
        items = _array_line(line)
        if items is not None:
            yield from items
            return False
    try:
        v = json.loads(line.decode())
    except (ValueError, RecursionError):  # the slow path: all but plain lines
        if not line.strip():
            return False
        if opens_array(line):
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
    results = typed(decode_result_list, line)  # the common case: all results the struct takes
    if results is not None:
        return [Fast(results)]
    raws = typed(_decode_raw_list, line)
    if raws is None:
        return None
    items, run = [], Fast()
    for raw in raws:
        r = typed(decode_result, raw)
        if r is not None:
            run.append(r)
            continue
        try:
            v = json.loads(bytes(raw).decode())
        except (ValueError, RecursionError):
            return None
        if run:
            items.append(run)
            run = Fast()
        items.append(v)
    if run:
        items.append(run)
    return items


def opens_array(line: bytes) -> bool:
    s = line.lstrip(WS)
    if s.startswith(_BOM):
        s = s[len(_BOM):].lstrip(WS)
    return s[:1] == b"["


def _values(line: bytes) -> list | None:
    """The JSON values of one line (a BOM in front, several values in a row); None if not JSON."""
    try:
        text = line.decode()
    except UnicodeDecodeError:
        return None
    values, pos = [], 0
    while True:
        pos = SKIP(text, pos).end()
        if pos == len(text):
            return values
        try:
            v, pos = DECODER.raw_decode(text, pos)
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
