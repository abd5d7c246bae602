"""Token costs: what the tokenizer writes and the planner and packer count on, in one place.

A measurement is MEASUREMENT_START, then its blocks in a seeded order (prep.schema.vocab):

    block          tokens
    source         ADDR[4] = 5 (family token + 4 bytes) or ADDR[6] = 17 (+ 16 bytes)
    destination    the same, of the same family
    result         RESULT_OK = 3 (header + 2 RTT tokens) or RESULT_FAILED = 1
    timestamp      TS_LEN[kind]: none 0, DELTA1 2, DELTA4 5, absolute 9 (``TS_ABS``)
    value field k  1 + its width (``VALUE_TOKENS`` in all; none in this vocabulary)

so its body (no timestamp) is 14 (IPv4 reply), 12 (IPv4 failed), 38 and 36 (IPv6).

The piece length rule, which the planner and the packer rely on exactly: ``cost[i]`` counts
measurement i's tokens as encoded inside its whole context (its timestamp none, DELTA1,
DELTA4 or, for the context's first timestamped one, absolute), ``abs_extra[i] = TS_ABS -
its timestamp's tokens``. A piece [s, e) of one context, encoded as a context of its own,
has ``cost[s:e].sum() + abs_extra[f]`` tokens, f its first timestamped measurement (no term
if none), which is written absolute (worked example: prep.pack.contexts).

The planner ends a context up to BACKOFF measurements early when that leaves its row a gap
the packer can fill (``fillable``, from the bodies above; at least SMALLEST_BODY tokens).
The Numba kernels compile these numbers in as constants (prep/__init__.py: the cache).
"""

from __future__ import annotations

import numpy as np

from prep.base.jit import kernel
from prep.schema.vocab import VALUE_FIELDS

START = 1  # MEASUREMENT_START
ADDR4, ADDR6 = 5, 17  # an address block of each family
RESULT_OK, RESULT_FAILED = 3, 1
TS_NONE, TS_DELTA1, TS_DELTA4, TS_ABS = 0, 2, 5, 9
TS_LEN = (TS_NONE, TS_DELTA1, TS_DELTA4, TS_ABS)  # by timestamp kind: 0 none .. 3 absolute
DELTA4_LIMIT = 1 << 32  # a gap this large no longer fits DELTA4: written absolute
VALUE_TOKENS = sum(1 + f.width for f in VALUE_FIELDS)  # the value fields' blocks, together
# a measurement without its result and timestamp
BASE4, BASE6 = START + 2 * ADDR4 + VALUE_TOKENS, START + 2 * ADDR6 + VALUE_TOKENS


def body(family: int, failed: bool) -> int:
    """Tokens of a measurement without a timestamp."""
    return (BASE4 if family == 4 else BASE6) + (RESULT_FAILED if failed else RESULT_OK)


OK_BODIES = (body(4, False), body(6, False))  # 14, 38: successful pings
FAILED_BODIES = (body(4, True), body(6, True))  # 12, 36: about 1 in 6
SMALLEST_BODY = min(FAILED_BODIES)  # the smallest piece there is: a gap below it stays empty
MAX_MEASUREMENT = BASE6 + RESULT_OK + TS_ABS  # 47: IPv6, a reply, an absolute timestamp

BACKOFF = 10  # the planner may end a context up to this many measurements early
# The planner's prices (prep.pack.planner_kernels.body_price): a body is worth PRICE_MAX
# tokens of back-off once its budget is spent, 0 while the budget is at least PRICE_FREE
# sixteenths full, PRICE_STEPS steps between; budgets count UNIT a body.
PRICE_MAX, PRICE_FREE, PRICE_STEPS, UNIT = 200, 12, 16, 1024
GAP_TABLE = 4096  # gaps from here on count as fillable (rows are 1024 tokens by default)


def _fillable_table() -> np.ndarray:
    """FILLABLE[g]: the gap g, or g - 1, is a sum of bodies, any number of each (a gap may
    end at 1: with even bodies, an odd gap always does)."""
    made = np.zeros(GAP_TABLE + 1, bool)
    made[0] = True
    for a in OK_BODIES + FAILED_BODIES:  # unbounded knapsack
        for t in range(a, GAP_TABLE + 1):
            made[t] |= made[t - a]
    fill = made.copy()
    fill[1:] |= made[:-1]
    return fill[:GAP_TABLE]


FILLABLE = _fillable_table()
# The last gap that is not fillable, plus one (0x40810e1c39f3e was its bit table, for 14, 38,
# 12 and 36: every gap from 102 on is fillable).
FILLABLE_FROM = int(np.flatnonzero(~FILLABLE)[-1]) + 1 if not FILLABLE.all() else 0


@kernel(inline="always")
def fillable(gap):
    """Whether untimestamped pieces of the common sizes can fill ``gap`` tokens to at most 1."""
    return gap >= GAP_TABLE or FILLABLE[max(gap, 0)]


@kernel(nogil=True)
def piece_lengths_kernel(cost, has_ts, abs_extra, piece_start, piece_end):
    """cost[s:e].sum() + abs_extra[first timestamped measurement in the piece], per piece."""
    k = len(piece_start)
    out = np.empty(k, np.int64)
    for j in range(k):
        total = 0
        first = True
        for i in range(piece_start[j], piece_end[j]):
            total += cost[i]
            if first and has_ts[i]:
                total += abs_extra[i]
                first = False
        out[j] = total
    return out
