"""The tokenizer in plain Python: the oracle the Numba kernels are held to.

Written for reading, not speed: one measurement at a time, Python ints, the same
counter-based RNG as ``prep.tokens.draws`` (SplitMix64's finalizer over
``key + counter * GOLDEN``, see that module's docstring for the streams). The tests
compare ``plan_reference`` with ``prep.pack.contexts.plan_contexts`` (``prep.pack.planner_kernels``)
and ``encode_context``
with ``prep.tokens.kernel.encode_pieces`` token for token; ``bench/bench_tokenizer.py`` times
``encode_context`` as the baseline of the kernel's speedup.

A measurement here is a tuple of the columns of ``prep.schema.measurements.Measurements`` in
``FIELDS`` order: ``(probe, time, family, src_hi, src_lo, dst_hi, dst_lo, rtt)``, then the
value fields' columns (``prep.schema.vocab.VALUE_FIELDS``, none in this vocabulary). The blocks'
tokens come from ``addr_block``, ``result_block``, ``timestamp_block`` and ``value_block``,
which ``train.predict.predictor`` writes its queries with too.
"""

from __future__ import annotations

import bisect
import itertools
import math

from prep.schema import vocab as V
from prep.schema.hashing import GOLDEN, MASK, mix64
from prep.schema.measurements import FIELDS
from prep.tokens.costs import (
    BACKOFF,
    MAX_MEASUREMENT,
    PRICE_FREE,
    PRICE_MAX,
    PRICE_STEPS,
    TS_ABS,
    TS_DELTA1,
    TS_DELTA4,
    UNIT,
    body,
)

STREAM_MODE, STREAM_FRAC, STREAM_DROP, STREAM_FIELD, STREAM_SHUFFLE = 1, 2, 3, 4, 5
MODE_FULL, MODE_PARTIAL, MODE_NONE = 0, 1, 2
DROP_LO, DROP_SPAN = 429_496_730, 3_435_973_837  # [0.1, 0.9) of 2**32
# Every order of the blocks (prep.schema.vocab: 0 source, 1 destination, 2 result, 3 timestamp,
# 4 + k value field k), lexicographic: 24 without value fields.
BLOCK_ORDERS = list(itertools.permutations(range(V.N_BLOCKS)))
N_ORDERS = math.factorial(V.N_BLOCKS)  # a measurement's order: BLOCK_ORDERS[draw * N_ORDERS >> 32]
# Where a row tuple holds each column, by name: value columns come after the others.
PROBE, TIME, FAMILY, SRC_HI, SRC_LO, DST_HI, DST_LO, RTT = (
    FIELDS.index(k) for k in ("probe", "time", "family", "src_hi", "src_lo", "dst_hi", "dst_lo", "rtt"))
VALUE_COLUMNS = tuple(FIELDS.index(f.name) for f in V.VALUE_FIELDS)


def stream_key(seed: int, probe: int, stream: int) -> int:
    return mix64(mix64((seed + stream * GOLDEN) & MASK) ^ probe)


def draw(key: int, counter: int) -> int:
    return mix64((key + counter * GOLDEN) & MASK)


def context_mode(seed: int, probe: int, first: int, thresholds: tuple[int, int]) -> int:
    r = draw(stream_key(seed, probe, STREAM_MODE), first) >> 32
    return MODE_FULL if r < thresholds[0] else MODE_PARTIAL if r < thresholds[1] else MODE_NONE


def keeps_timestamp(seed: int, probe: int, first: int, index: int, mode: int) -> bool:
    """Does measurement ``index`` keep its timestamp in a context starting at ``first``?"""
    if mode != MODE_PARTIAL:
        return mode == MODE_FULL
    drop = DROP_LO + (((draw(stream_key(seed, probe, STREAM_FRAC), first) >> 32) * DROP_SPAN) >> 32)
    return (draw(stream_key(seed, probe, STREAM_DROP), index) >> 32) >= drop


def ts_tokens(prev: int | None, t: int) -> int:
    if prev is None or t - prev >= 1 << 32:
        return TS_ABS
    return TS_DELTA1 if t - prev < 256 else TS_DELTA4


def rtt_code(ms: float) -> tuple[int, int]:
    """(exponent, mantissa) of an RTT: µs = mantissa * 2**exponent, rounded to nearest."""
    us = max(1.0, ms * 1000.0)
    e = 0
    while math.floor(us / 2.0 ** e + 0.5) >= 2048:
        e += 1
    if e > 31:
        return 31, 2047
    return e, int(math.floor(us / 2.0 ** e + 0.5))


def body_price(budget: int, cap: int) -> float:
    """The planner's price of a body, in tokens of back-off (``inf``: the data has none)."""
    if cap <= 0:
        return math.inf
    knee = cap * PRICE_FREE // 16
    if knee <= 0 or budget <= 0:
        return PRICE_MAX
    if budget >= knee:
        return 0
    return PRICE_MAX * ((PRICE_STEPS * (knee - budget) + knee - 1) // knee) // PRICE_STEPS


def cheapest_fill(sizes: list[int], prices: list[float], gap: int) -> tuple[float, list[int]]:
    """(price, bodies) of the cheapest bodies that fill ``gap``, or gap - 1 where that is
    cheaper; bodies as indices into ``sizes``, the last one first; (inf, []) if none does.
    A sum's cheapest way ends with the first body that gives its least price."""
    best: list[tuple[float, int]] = [(0, -1)]
    for t in range(1, gap + 1):
        c, v = math.inf, -1
        for b, s in enumerate(sizes):
            if s <= t and best[t - s][0] + prices[b] < c:
                c, v = best[t - s][0] + prices[b], b
        best.append((c, v))
    t = gap - 1 if gap >= 1 and best[gap - 1][0] < best[gap][0] else gap
    bodies = []
    u = t
    while u > 0 and best[u][1] >= 0:
        bodies.append(best[u][1])
        u -= sizes[best[u][1]]
    return best[t][0], bodies


def plan_reference(rows: list[tuple], *, row_len: int, max_measurements: int, max_gap_s: int,
                   max_span_s: int, thresholds: tuple[int, int], seed: int,
                   supply: tuple[list[int], list[int], list[int]]) -> list[dict]:
    """Contexts of sorted ``rows``: dicts with start, end, mode, has_ts, cost, abs_extra.
    ``supply``: (sizes, rates, caps) of the free bodies (prep.pack.contexts.free_supply)."""
    sizes, rates, caps = (list(map(int, x)) for x in supply)
    budgets = list(caps)
    contexts = []
    hist = []
    for i, r in enumerate(rows):
        hist.append(0 if i == 0 or rows[i - 1][PROBE] != r[PROBE] else hist[-1] + 1)
    i = 0
    while i < len(rows):
        probe = rows[i][PROBE]
        mode = context_mode(seed, probe, hist[i], thresholds)
        ctx = {"start": i, "mode": mode, "has_ts": [], "cost": [], "abs_extra": []}
        prev = None
        j = i
        while j < len(rows) and rows[j][PROBE] == probe:
            has_ts = keeps_timestamp(seed, probe, hist[i], hist[j], mode)
            tt = ts_tokens(prev, rows[j][TIME]) if has_ts else 0
            c = measurement_tokens(rows[j]) + tt
            n = j - i
            if n and (sum(ctx["cost"]) + c > row_len
                      or (max_measurements and n >= max_measurements)
                      or (max_gap_s and rows[j][TIME] - rows[j - 1][TIME] > max_gap_s)
                      or (max_span_s and rows[j][TIME] - rows[i][TIME] > max_span_s)):
                break
            ctx["has_ts"].append(has_ts)
            ctx["cost"].append(c)
            ctx["abs_extra"].append(TS_ABS - tt if has_ts else 0)
            if has_ts:
                prev = rows[j][TIME]
            j += 1
        full = j < len(rows) and rows[j][PROBE] == probe and sum(ctx["cost"]) + c > row_len
        if full:  # give back the measurements whose loss and fill price least (cut_contexts)
            budgets = [min(b + r, cap) for b, r, cap in zip(budgets, rates, caps)]
            prices = [body_price(b, cap) for b, cap in zip(budgets, caps)]
            top = (BACKOFF + 1) * MAX_MEASUREMENT + 1
            length = sum(ctx["cost"])
            best = None  # (score, measurements given back, bodies of the fill)
            for back in range(min(BACKOFF, len(ctx["cost"]) - 1) + 1):
                given = sum(ctx["cost"][len(ctx["cost"]) - back:]) if back else 0
                if best is not None and given >= best[0]:
                    break
                if row_len - (length - given) > top:
                    continue
                price, bodies = cheapest_fill(sizes, prices, row_len - (length - given))
                if price < math.inf:
                    score = given + (0 if mode == MODE_NONE else price)
                    if best is None or score < best[0]:
                        best = (score, back, bodies)
            if best is not None:
                for _ in range(best[1]):
                    j -= 1
                    for key in ("has_ts", "cost", "abs_extra"):
                        ctx[key].pop()
                if mode != MODE_NONE:
                    for b in best[2]:
                        budgets[b] -= UNIT
        ctx["end"] = j
        contexts.append(ctx)
        i = j
    return contexts


def measurement_tokens(row: tuple) -> int:
    return body(row[FAMILY], row[RTT] < 0)


def _bytes(x: int, n: int) -> list[int]:
    return [V.BYTE_OFFSET + b for b in x.to_bytes(n, "big")]


def addr_block(tok4: int, family: int, hi: int, lo: int) -> list[int]:
    """An address block: ``tok4`` (SRC_IPV4 or DST_IPV4; its IPv6 id follows it) and the
    address's 4 or 16 bytes."""
    if family == 4:
        return [tok4] + _bytes(lo & 0xFFFF_FFFF, 4)
    return [tok4 + 1] + _bytes((hi << 64) | lo, 16)


def rtt_payload(ms: float) -> int:
    """The 16-bit RTT code of ``ms``: ``exponent << 11 | mantissa`` (``rtt_code``)."""
    e, mant = rtt_code(ms)
    return (e << 11) | mant


def result_block(code: int) -> list[int]:
    """The result block of an RTT code (``rtt_payload``); a negative code: FAILED."""
    if code < 0:
        return [V.FAILED]
    return [V.RTT_START, V.BYTE_OFFSET + (code >> 8), V.BYTE_OFFSET + (code & 0xFF)]


def timestamp_block(prev: int | None, t: int) -> list[int]:
    """The timestamp block of time ``t``, ``prev`` the time of the context's previous
    timestamped measurement (None: there is none, so ``t`` is written absolute)."""
    n = ts_tokens(prev, t)
    if n == TS_DELTA1:
        return [V.TIMESTAMP_DELTA1, V.BYTE_OFFSET + t - prev]
    if n == TS_DELTA4:
        return [V.TIMESTAMP_DELTA4] + _bytes(t - prev, 4)
    return [V.TIMESTAMP_ABS] + _bytes(t & MASK, 8)


def value_block(k: int, value: int) -> list[int]:
    """The block of value field k (``prep.schema.vocab.VALUE_FIELDS[k]``): its header, then the
    value's ``width`` bytes, big-endian (OverflowError for a value wider than that)."""
    return [V.VALUE_HEADERS[k]] + _bytes(value, V.VALUE_FIELDS[k].width)


def _shuffled(has_ts: list[bool], hist0: int, mode: int, seed: int, probe: int) -> list[int]:
    """The order a context's measurements are written in (``prep.tokens.kernel._shuffle``)."""
    m = len(has_ts)
    order = list(range(m))
    if mode == MODE_FULL:
        return order
    k_shuf = draw(stream_key(seed, probe, STREAM_SHUFFLE), hist0)
    for x in range(m - 1, 0, -1):  # Fisher-Yates, one draw per step
        q = ((draw(k_shuf, x) >> 32) * (x + 1)) >> 32
        order[x], order[q] = order[q], order[x]
    # timestamped measurements return to time order within the slots they were given
    timed = iter(i for i in range(m) if has_ts[i])
    return [next(timed) if has_ts[i] else i for i in order]


def encode_context(rows: list[tuple], has_ts: list[bool], hist0: int, mode: int,
                   seed: int) -> list[int]:
    """Tokens of consecutive sorted measurements of one probe, encoded as one context.

    ``hist0`` is the index of ``rows[0]`` in its probe's sorted history; ``mode`` and
    ``has_ts`` come from the context the rows belong to (they may be a piece of it).
    """
    seed &= MASK
    probe = rows[0][PROBE]
    k_field = stream_key(seed, probe, STREAM_FIELD)
    out: list[int] = []
    prev = None
    for i in _shuffled(has_ts, hist0, mode, seed, probe):
        row = rows[i]
        out.append(V.MEASUREMENT_START)
        for block in BLOCK_ORDERS[((draw(k_field, hist0 + i) >> 32) * N_ORDERS) >> 32]:
            if block == V.BLOCK_SRC:
                out += addr_block(V.SRC_IPV4, row[FAMILY], row[SRC_HI], row[SRC_LO])
            elif block == V.BLOCK_DST:
                out += addr_block(V.DST_IPV4, row[FAMILY], row[DST_HI], row[DST_LO])
            elif block == V.BLOCK_RESULT:
                out += result_block(-1 if row[RTT] < 0 else rtt_payload(row[RTT]))
            elif block == V.BLOCK_TIME:
                if has_ts[i]:  # a measurement without a timestamp skips its block
                    out += timestamp_block(prev, row[TIME])
                    prev = row[TIME]
            else:  # block BLOCK_VALUE + k: value field k
                k = block - V.BLOCK_VALUE
                out += value_block(k, row[VALUE_COLUMNS[k]])
    return out


def encode_pieces_reference(plan, piece_start, piece_end, seed: int) -> list[list[int]]:
    """``encode_context`` of each piece of a ``prep.pack.contexts.Plan``."""
    cols = plan.sorted.columns()
    rows = list(zip(*(cols[k].tolist() for k in FIELDS)))
    starts = plan.ctx_start.tolist()
    has_ts, hist, modes = plan.has_ts.tolist(), plan.hist.tolist(), plan.ctx_mode.tolist()
    out = []
    for s, e in zip(list(piece_start), list(piece_end)):
        s, e = int(s), int(e)
        mode = modes[bisect.bisect_right(starts, s) - 1]
        out.append(encode_context(rows[s:e], has_ts[s:e], hist[s], mode, seed))
    return out
