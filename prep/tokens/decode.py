"""Tokens back to measurements: the inverse of the tokenizer, for tests and inspection.

``decode_context`` reads one context (or piece) and returns its measurements in token
order. What comes back exactly: family, both addresses, failure; the timestamp of every
measurement that carried one (the first is absolute, each later one adds its delta to
the previous timestamped measurement). What comes back approximately: the RTT, as the
centre of its 11-bit-mantissa bin (``rtt_ms``), and never below 1 µs; the value fields
(prep.schema.vocab.VALUE_FIELDS) exactly, as ``values``. In ``partial`` and ``none`` contexts the
token order is shuffled, so measurements come back in that order.

The grammar comes from prep.schema.vocab (``BLOCK_OF``, ``WIDTH_OF``, ``REQUIRED_BLOCKS``): a
header token opens its block and announces its bytes, so a new value field is read here
with no edit. ``push_byte`` (a block's bytes into two 64-bit words) is plain Python that
prep.tokens.rowdecode compiles as it stands: one copy of the byte order for both readers.

``render`` prints tokens by name, one measurement a line, for eyeballing a row.
"""

from __future__ import annotations

from typing import NamedTuple

from prep.schema import vocab as V


class Decoded(NamedTuple):
    family: int  # 4 or 6
    src_hi: int
    src_lo: int
    dst_hi: int
    dst_lo: int
    failed: bool
    rtt: float  # milliseconds; -1.0 when failed
    time: int | None  # Unix seconds, None where the measurement carried no timestamp
    values: tuple = ()  # the value fields' integers, in prep.schema.vocab.VALUE_FIELDS order


class DecodeError(ValueError):
    """Tokens that the tokenizer could not have written: ``kind`` names the rule broken
    (one of KINDS; prep.tokens.grammar maps it to its code), ``pos`` the token where it broke."""

    def __init__(self, kind: str, pos: int, message: str):
        if kind not in KINDS:
            raise ValueError(f"unknown DecodeError kind {kind!r}")
        super().__init__(f"token {pos}: {message}")
        self.kind, self.pos, self.message = kind, pos, message

    def __reduce__(self):  # picklable, so it can cross a process pool
        return DecodeError, (self.kind, self.pos, self.message)


KINDS = ("bad_bytes", "no_start", "delta_first", "unexpected", "incomplete", "families_differ")


def rtt_ms(exponent: int, mantissa: int) -> float:
    return mantissa * 2.0 ** exponent / 1000.0


def push_byte(hi, lo, b):
    """(hi, lo), the high and low 64-bit words of a big-endian number of up to 16 bytes,
    with the byte ``b`` appended. Plain Python, also compiled by prep.tokens.rowdecode, where the
    words are int64 holding their bits: one copy of the byte order for both readers."""
    return (hi << 8) | ((lo >> 56) & 0xFF), ((lo & 0xFF_FFFF_FFFF_FFFF) << 8) | b


def _block_words(tokens, pos: int, n: int) -> tuple[int, int]:
    """(hi, lo) of the ``n`` byte tokens at ``pos`` (see push_byte)."""
    if pos + n > len(tokens):
        raise DecodeError("bad_bytes", pos, f"expected {n} bytes, the context ends")
    hi = lo = 0
    for t in tokens[pos:pos + n]:
        b = int(t) - V.BYTE_OFFSET
        if not 0 <= b < 256:
            raise DecodeError("bad_bytes", pos, f"expected a byte, got {V.token_name(int(t))}")
        hi, lo = push_byte(hi, lo, b)
    return hi, lo


_BLOCK_OF, _WIDTH_OF = V.BLOCK_OF.tolist(), V.WIDTH_OF.tolist()
_BLOCK_NAMES = ("src", "dst", "result", "time") + tuple(f.name for f in V.VALUE_FIELDS)
_REQUIRED = tuple(b for b in range(V.N_BLOCKS) if V.REQUIRED_BLOCKS >> b & 1)


def _value(tok: int, block: int, width: int, hi: int, lo: int, prev: int | None):
    """What the block that header ``tok`` opens says (its bytes read as ``hi``, ``lo``):
    (family, hi, lo) of an address, (failed, rtt ms) of a result, the time, or the value."""
    if block == V.BLOCK_SRC or block == V.BLOCK_DST:
        return (4 if width == 4 else 6), hi, lo
    if block == V.BLOCK_RESULT:
        return (True, -1.0) if tok == V.FAILED else (False, rtt_ms(lo >> 11, lo & 0x7FF))
    if tok == V.TIMESTAMP_ABS:
        return lo - (1 << 64) if lo >= 1 << 63 else lo
    if block == V.BLOCK_TIME:  # a delta: decode_context has checked there is a previous time
        return prev + lo
    return lo


def decode_context(tokens) -> list[Decoded]:
    """Measurements of one context's tokens, in token order."""
    out: list[Decoded] = []
    prev: int | None = None
    pos = 0
    n = len(tokens)
    while pos < n:
        if int(tokens[pos]) != V.MEASUREMENT_START:
            raise DecodeError("no_start", pos,
                              f"expected MEASUREMENT_START, got {V.token_name(int(tokens[pos]))}")
        pos += 1
        blocks: dict = {}  # block → _value
        while pos < n and int(tokens[pos]) != V.MEASUREMENT_START:
            tok = int(tokens[pos])
            pos += 1
            block = _BLOCK_OF[tok] if 0 <= tok < V.VOCAB_SIZE else -1
            if block < 0:
                raise DecodeError("unexpected", pos - 1, f"unexpected {V.token_name(tok)}")
            if block == V.BLOCK_TIME and tok != V.TIMESTAMP_ABS and prev is None:
                raise DecodeError("delta_first", pos - 1,
                                  "a delta timestamp with no absolute one before it")
            width = _WIDTH_OF[tok]
            blocks[block] = _value(tok, block, width, *_block_words(tokens, pos, width), prev)
            pos += width
        missing = [_BLOCK_NAMES[b] for b in _REQUIRED if b not in blocks]
        if missing:
            raise DecodeError("incomplete", pos, f"measurement without {', '.join(sorted(missing))}")
        family, src_hi, src_lo = blocks[V.BLOCK_SRC]
        dst_family, dst_hi, dst_lo = blocks[V.BLOCK_DST]
        if family != dst_family:
            raise DecodeError("families_differ", pos, "source and destination families differ")
        t = blocks.get(V.BLOCK_TIME)
        if t is not None:
            prev = t
        values = tuple(blocks[b] for b in range(V.BLOCK_VALUE, V.N_BLOCKS))
        out.append(Decoded(family, src_hi, src_lo, dst_hi, dst_lo, *blocks[V.BLOCK_RESULT], t,
                           values))
    return out


def render(tokens) -> str:
    """Token names, one measurement a line (bytes shown as numbers)."""
    lines: list[str] = []
    for t in (int(x) for x in tokens):
        if t == V.MEASUREMENT_START or not lines:
            lines.append("")
        name = str(t - V.BYTE_OFFSET) if t >= V.BYTE_OFFSET else V.token_name(t)
        lines[-1] += (" " if lines[-1] else "") + name
    return "\n".join(lines)
