"""Token costs: what a measurement costs in tokens, which the tokenizer writes and the
planner and the packer count on. The one place these sizes live.

A measurement is MEASUREMENT_START, then four blocks in a seeded order:

    block          tokens
    source         ADDR[4] = 5 (family token + 4 bytes) or ADDR[6] = 17 (+ 16 bytes)
    destination    the same, of the same family
    result         RESULT_OK = 3 (header + 2 RTT tokens) or RESULT_FAILED = 1
    timestamp      TS_LEN[kind]: none 0, DELTA1 2, DELTA4 5, absolute 9 (``TS_ABS``)

so its body (no timestamp) is 14 (IPv4 reply), 12 (IPv4 failed), 38 and 36 (IPv6).

The piece length rule, which the planner (prep.contexts) states and the packer relies on
exactly: ``cost[i]`` counts measurement i's tokens as encoded inside its whole context
(its timestamp 0, DELTA1, DELTA4 or, for the context's first timestamped one, absolute),
and ``abs_extra[i] = TS_ABS - its timestamp's tokens`` where it has one. A piece [s, e)
of one context, encoded as a context of its own, has ``cost[s:e].sum() + abs_extra[f]``
tokens, f its first timestamped measurement (no term if none): that one is written
absolute.

The planner ends a context up to BACKOFF measurements early when that leaves its row a gap
the packer can fill (``fillable``, from the bodies above); the packer fills gaps of at
least SMALLEST_BODY tokens.

The Numba kernels (prep.kernel, prep.planner_kernels, prep.packing_fill and through it
prep.packing) compile these numbers in as constants. Numba's cache only notices edits to
the file that holds a function, so prep/__init__.py keys the cache folder on a hash of
every module of prep/: after an edit anywhere in prep/ the kernels compile afresh.
"""

from __future__ import annotations

from numba import njit

START = 1  # MEASUREMENT_START
ADDR4, ADDR6 = 5, 17  # an address block of each family
RESULT_OK, RESULT_FAILED = 3, 1
TS_NONE, TS_DELTA1, TS_DELTA4, TS_ABS = 0, 2, 5, 9
TS_LEN = (TS_NONE, TS_DELTA1, TS_DELTA4, TS_ABS)  # by timestamp kind: 0 none .. 3 absolute
BASE4, BASE6 = START + 2 * ADDR4, START + 2 * ADDR6  # a measurement without its result


def body(family: int, failed: bool) -> int:
    """Tokens of a measurement without a timestamp."""
    return (BASE4 if family == 4 else BASE6) + (RESULT_FAILED if failed else RESULT_OK)


OK_BODIES = (body(4, False), body(6, False))  # 14, 38: successful pings
FAILED_BODIES = (body(4, True), body(6, True))  # 12, 36: about 1 in 6
SMALLEST_BODY = min(FAILED_BODIES)  # the smallest piece there is: a gap below it stays empty
MAX_MEASUREMENT = BASE6 + RESULT_OK + TS_ABS  # 47: IPv6, a reply, an absolute timestamp

BACKOFF = 3  # the planner may end a context up to this many measurements early (fillable)
FILLABLE_FROM = 102  # every even gap from here on is a sum of the bodies


def _unfillable() -> int:
    """Bit h set: the even gap 2h (< FILLABLE_FROM) is no sum of successful bodies plus at
    most one failed body. Checked at import: from FILLABLE_FROM on, every even gap is."""
    a, b = OK_BODIES

    def makeable(t: int) -> bool:
        return any((t - e - a * i) % b == 0 for e in (0, *FAILED_BODIES)
                   for i in range(t // a + 1) if t - e - a * i >= 0)

    if not all(makeable(t) for t in range(FILLABLE_FROM, FILLABLE_FROM + 2 * a * b, 2)):
        raise AssertionError("FILLABLE_FROM is too small for these body sizes")
    return sum(1 << (t // 2) for t in range(0, FILLABLE_FROM, 2) if not makeable(t))


UNFILLABLE = _unfillable()  # 0x40810e1c39f3e for bodies 14, 38, 12, 36


@njit(cache=True, inline="always")
def fillable(gap):
    """Whether untimestamped pieces of the common sizes can fill ``gap`` tokens to at most 1
    (an odd gap ends at 1: bodies are even)."""
    h = (gap & ~1) >> 1
    return h >= FILLABLE_FROM // 2 or ((UNFILLABLE >> h) & 1) == 0
