"""Tokens back to measurements: the inverse of the tokenizer, for tests and inspection.

``decode_context`` reads one context (or piece) and returns its measurements in token
order. What comes back exactly: family, both addresses, failure; the timestamp of every
measurement that carried one (the first is absolute, each later one adds its delta to
the previous timestamped measurement). What comes back approximately: the RTT, as the
centre of its 11-bit-mantissa bin (``rtt_ms``), and never below 1 µs. In ``partial`` and
``none`` contexts the token order is shuffled, so measurements come back in that order.

``render`` prints tokens by name, one measurement a line, for eyeballing a row.
"""

from __future__ import annotations

from typing import NamedTuple

from prep import vocab as V


class Decoded(NamedTuple):
    family: int  # 4 or 6
    src_hi: int
    src_lo: int
    dst_hi: int
    dst_lo: int
    failed: bool
    rtt: float  # milliseconds; -1.0 when failed
    time: int | None  # Unix seconds, None where the measurement carried no timestamp


class DecodeError(ValueError):
    """Tokens that the tokenizer could not have written: ``kind`` names the rule broken
    (one of KINDS; prep.grammar maps it to its code), ``pos`` the token where it broke."""

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


def _bytes(tokens, pos: int, n: int) -> int:
    if pos + n > len(tokens):
        raise DecodeError("bad_bytes", pos, f"expected {n} bytes, the context ends")
    value = 0
    for t in tokens[pos:pos + n]:
        b = int(t) - V.BYTE_OFFSET
        if not 0 <= b < 256:
            raise DecodeError("bad_bytes", pos, f"expected a byte, got {V.token_name(int(t))}")
        value = (value << 8) | b
    return value


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
        fields: dict = {}
        while pos < n and int(tokens[pos]) != V.MEASUREMENT_START:
            tok = int(tokens[pos])
            pos += 1
            if tok in (V.SRC_IPV4, V.SRC_IPV6, V.DST_IPV4, V.DST_IPV6):
                family = 4 if tok in (V.SRC_IPV4, V.DST_IPV4) else 6
                value = _bytes(tokens, pos, 4 if family == 4 else 16)
                pos += 4 if family == 4 else 16
                name = "src" if tok in (V.SRC_IPV4, V.SRC_IPV6) else "dst"
                fields[name] = (family, value >> 64, value & 0xFFFF_FFFF_FFFF_FFFF)
            elif tok == V.RTT_START:
                code = _bytes(tokens, pos, 2)
                pos += 2
                fields["result"] = (False, rtt_ms(code >> 11, code & 0x7FF))
            elif tok == V.FAILED:
                fields["result"] = (True, -1.0)
            elif tok == V.TIMESTAMP_ABS:
                u = _bytes(tokens, pos, 8)
                pos += 8
                fields["time"] = u - (1 << 64) if u >= 1 << 63 else u
            elif tok in (V.TIMESTAMP_DELTA1, V.TIMESTAMP_DELTA4):
                if prev is None:
                    raise DecodeError("delta_first", pos - 1,
                                      "a delta timestamp with no absolute one before it")
                width = 1 if tok == V.TIMESTAMP_DELTA1 else 4
                fields["time"] = prev + _bytes(tokens, pos, width)
                pos += width
            else:
                raise DecodeError("unexpected", pos - 1, f"unexpected {V.token_name(tok)}")
        missing = {"src", "dst", "result"} - fields.keys()
        if missing:
            raise DecodeError("incomplete", pos, f"measurement without {', '.join(sorted(missing))}")
        if fields["src"][0] != fields["dst"][0]:
            raise DecodeError("families_differ", pos, "source and destination families differ")
        t = fields.get("time")
        if t is not None:
            prev = t
        (family, src_hi, src_lo), (_, dst_hi, dst_lo) = fields["src"], fields["dst"]
        out.append(Decoded(family, src_hi, src_lo, dst_hi, dst_lo, *fields["result"], t))
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
