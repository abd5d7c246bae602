"""The planner's Numba kernels: sort a bucket, index each probe's history, cut contexts.

- ``argsort_probe_time``, ``history_index``: a stable radix sort by (probe, time) that
  only runs the 11-bit passes whose digit varies (usually 4; faster than numpy's two stable
  argsorts: docs/measurements.md), and each measurement's index in its probe's history;
- ``cut_contexts``: walks one sorted bucket once and decides, per context, the timestamp
  mode and where the context ends, and per measurement whether it carries a timestamp
  and how many tokens it costs (the numbers the packer plans with);

``prep.pack.contexts`` calls them; ``prep.tokens.reference.plan_reference`` is the pure-Python twin
of ``cut_contexts`` that the tests hold it to. The draws (streams MODE, FRAC, DROP) are
``prep.tokens.draws``'.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from prep.base.jit import helper, kernel
from prep.pack.supply import INF, cheapest_fills, slack_target
from prep.tokens.costs import (
    BACKOFF,
    BASE4,
    BASE6,
    DELTA4_LIMIT,
    MAX_MEASUREMENT,
    PRICE_FREE,
    PRICE_MAX,
    PRICE_STEPS,
    RESULT_FAILED,
    RESULT_OK,
    TS_ABS,
    TS_DELTA1,
    TS_DELTA4,
    UNIT,
)
from prep.tokens.draws import (
    MODE_FULL,
    MODE_NONE,
    MODE_PARTIAL,
    S32,
    STREAM_DROP,
    STREAM_FRAC,
    STREAM_MODE,
    draw,
    stream_key,
)

# A partial-mode context drops a fraction in [0.1, 0.9) of its timestamps: 32-bit fixed point.
DROP_LO = 429_496_730  # 0.1 * 2**32
DROP_SPAN = 3_435_973_837  # 0.8 * 2**32

# What ends a context (``cut_contexts``): row_len, max_meas, max_gap and max_span as ints (0
# turns a limit off), t_full and t_partial the mode thresholds as uint64 (prep.pack.contexts).
CutLimits = namedtuple("CutLimits", "row_len max_meas max_gap max_span t_full t_partial")
# The free bodies the packer will have (prep.pack.supply.budget): body b is size[b] tokens;
# each context the row length ends earns rate[b] / UNIT of it, up to cap[b] / UNIT.
Supply = namedtuple("Supply", "size rate cap")


@helper(inline=True)
def _ts_tokens(have_prev, prev, t):
    if not have_prev:
        return TS_ABS
    d = t - prev
    if d < 256:
        return TS_DELTA1
    if d < DELTA4_LIMIT:
        return TS_DELTA4
    return TS_ABS


@helper
def _radix_pass_all(key, idx, tmp_key, tmp_idx):
    """Stable LSD radix sort of (key, idx) pairs by key, 11 bits a pass, in place: the
    passes go back and forth between the arrays and tmp_key, tmp_idx."""
    n = len(key)
    varying = np.uint64(0)
    for i in range(n):
        varying |= key[i] ^ key[0]
    mask = np.uint64(0x7FF)
    sk, si, dk, di = key, idx, tmp_key, tmp_idx
    moved = False  # the sorted pairs are in tmp_key, tmp_idx
    for shift in range(0, 64, 11):
        sh = np.uint64(shift)
        if (varying >> sh) & mask == 0:
            continue  # every key shares this digit: the pass would not move anything
        count = np.zeros(2049, np.int64)
        for i in range(n):
            count[((sk[i] >> sh) & mask) + np.uint64(1)] += 1
        for d in range(2048):
            count[d + 1] += count[d]
        for i in range(n):
            d = (sk[i] >> sh) & mask
            dst = count[d]
            count[d] = dst + 1
            dk[dst] = sk[i]
            di[dst] = si[i]
        sk, si, dk, di = dk, di, sk, si
        moved = not moved
    if moved:
        for i in range(n):  # a loop, not key[:] = tmp_key: see prep.base.jit
            key[i] = tmp_key[i]
            idx[i] = tmp_idx[i]


@kernel(nogil=True)
def argsort_probe_time(probe, time):
    """Stable order by (probe, time): radix passes over the digits that vary, only."""
    n = len(probe)
    idx = np.arange(n)
    tmp_idx = np.empty(n, np.int64)
    tmp_key = np.empty(n, np.uint64)
    if n == 0:
        return idx
    t0 = time[0]
    for i in range(1, n):  # not time.min(): see prep.base.jit
        t0 = min(t0, time[i])
    key = np.empty(n, np.uint64)
    for i in range(n):
        key[i] = np.uint64(time[i] - t0)  # offset from the minimum: unsigned, same order
    _radix_pass_all(key, idx, tmp_key, tmp_idx)
    for i in range(n):
        key[i] = probe[idx[i]]
    _radix_pass_all(key, idx, tmp_key, tmp_idx)
    return idx


@kernel(nogil=True)
def history_index(probe):
    """Index of each measurement within its probe's run of a sorted probe column."""
    n = len(probe)
    hist = np.empty(n, np.int64)
    for i in range(n):
        hist[i] = 0 if i == 0 or probe[i] != probe[i - 1] else hist[i - 1] + 1
    return hist


@helper
def body_price(budget, cap):
    """A body's price in tokens of back-off: 0 while its budget is at least PRICE_FREE
    sixteenths full, rising in PRICE_STEPS steps to PRICE_MAX as it empties; INF for a
    body the data has none of."""
    if cap <= 0:
        return INF
    knee = cap * PRICE_FREE // 16
    if knee <= 0 or budget <= 0:
        return PRICE_MAX
    if budget >= knee:
        return 0
    return PRICE_MAX * ((PRICE_STEPS * (knee - budget) + knee - 1) // knee) // PRICE_STEPS


@kernel(nogil=True)
def cut_contexts(cols, hist, seed, limits, supply):
    """Contexts of one sorted bucket: (ctx_start, ctx_mode, ctx_len, cost, has_ts, abs_extra).

    ``cols``: its ``prep.schema.measurements.Columns``; ``limits``: a ``CutLimits``;
    ``supply``: a ``Supply``.

    A measurement costs START + two address blocks (5 or 17 tokens each) + its result
    (FAILED 1, RTT 3) + its timestamp block. A context ends before the measurement that would change the probe, overflow
    ``row_len`` tokens, exceed ``max_meas`` measurements, follow a gap > ``max_gap`` s or
    reach > ``max_span`` s past the context's first measurement (0 turns a limit off).

    A context ended by the row length may give up to ``BACKOFF`` last measurements to the
    next one (cut points are free): it ends where (tokens given back) + (the price of the
    cheapest bodies that fill its row's gap) is least, the first such end on a tie. Each
    body's price follows its budget (``body_price``): each such context earns every body
    its rate and spends the bodies of its fill, so a body the free rows hold few of (IPv4
    bodies on IPv6 data) goes to the gaps that need it most. A none-mode context, whose row
    the packer may cut anyway, ends at the first end whose gap has any fill and spends
    nothing. No end with a fill: it keeps all it holds.
    """
    probe, time, family, rtt = cols.probe, cols.time, cols.family, cols.rtt
    row_len, max_meas, max_gap, max_span = (limits.row_len, limits.max_meas, limits.max_gap,
                                            limits.max_span)
    t_full, t_partial = limits.t_full, limits.t_partial
    size, rate, cap = supply
    nb = size.shape[0]
    budget = cap.copy()
    price = np.full(nb, -1, np.int64)
    top = (BACKOFF + 1) * MAX_MEASUREMENT + 1  # the widest gap a full context can leave
    fcost, fvia = np.empty(top + 1, np.int64), np.empty(top + 1, np.int64)
    n = len(probe)
    ctx_start = np.empty(n, np.int64)
    ctx_mode = np.empty(n, np.uint8)
    ctx_len = np.empty(n, np.int32)
    cost = np.empty(n, np.int32)
    has_ts = np.zeros(n, np.bool_)
    abs_extra = np.zeros(n, np.int32)
    k_mode = k_frac = k_drop = np.uint64(0)
    k = 0
    i = 0
    while i < n:
        p = probe[i]
        if i == 0 or p != probe[i - 1]:
            k_mode = stream_key(seed, p, STREAM_MODE)
            k_frac = stream_key(seed, p, STREAM_FRAC)
            k_drop = stream_key(seed, p, STREAM_DROP)
        r = draw(k_mode, hist[i]) >> S32
        mode = MODE_FULL if r < t_full else (MODE_PARTIAL if r < t_partial else MODE_NONE)
        thr = np.uint64(DROP_LO) + (((draw(k_frac, hist[i]) >> S32) * np.uint64(DROP_SPAN)) >> S32)
        length = 0
        have_prev = False
        prev = np.int64(0)
        j = i
        full = False
        while j < n and probe[j] == p:
            if mode == MODE_FULL:
                ts = True
            elif mode == MODE_PARTIAL:
                ts = (draw(k_drop, hist[j]) >> S32) >= thr
            else:
                ts = False
            tt = _ts_tokens(have_prev, prev, time[j]) if ts else 0
            c = (BASE4 if family[j] == 4 else BASE6) + (RESULT_FAILED if rtt[j] < 0.0 else RESULT_OK) + tt
            full = length + c > row_len
            if j > i and (full
                          or (max_meas > 0 and j - i >= max_meas)
                          or (max_gap > 0 and time[j] - time[j - 1] > max_gap)
                          or (max_span > 0 and time[j] - time[i] > max_span)):
                break
            cost[j] = c
            has_ts[j] = ts
            abs_extra[j] = TS_ABS - tt if ts else 0
            length += c
            if ts:
                have_prev = True
                prev = time[j]
            j += 1
        if full:
            changed = False
            for b in range(nb):
                budget[b] = min(budget[b] + rate[b], cap[b])
                pb = body_price(budget[b], cap[b])
                if pb != price[b]:
                    price[b], changed = pb, True
            if changed:
                cheapest_fills(size, price, top, fcost, fvia)
            free_mode = mode == MODE_NONE
            best, best_score, best_t = j, -1, -1
            jj, ln = j, length
            for _ in range(BACKOFF + 1):
                t = slack_target(fcost, row_len - ln) if row_len - ln <= top else -1
                if t >= 0 and fcost[t] < INF:
                    sc = length - ln + (0 if free_mode else fcost[t])
                    if best_score < 0 or sc < best_score:
                        best, best_score, best_t = jj, sc, t
                if jj - 1 <= i or (best_score >= 0 and length - ln >= best_score):
                    break  # no shorter end can score better
                jj -= 1
                ln -= cost[jj]
            while j > best:
                j -= 1  # leave the last measurement to the next context
                length -= cost[j]
            if not free_mode:
                t = best_t
                while t > 0:  # spend the fill's bodies
                    budget[fvia[t]] -= UNIT
                    t -= size[fvia[t]]
        ctx_start[k] = i
        ctx_mode[k] = mode
        ctx_len[k] = length
        k += 1
        i = j
    return ctx_start[:k], ctx_mode[:k], ctx_len[:k], cost, has_ts, abs_extra
