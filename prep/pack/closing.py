"""The closing sets of step 4 (prep.pack.fill): fill a gap exactly from the opened donors.

Step 4 fills gaps with windows and runs of donor rows where it can (contiguous pieces);
what closes a gap exactly where they cannot is a set of single measurements, and what
keeps that possible is a rest that still has a fill. Both are priced (prep.pack.supply):

- ``demand``: how many measurements of each size the gaps would take, filled with the
  fewest; a minor size that the free rows hold less than twice that many of is scarce:
  windows and runs pass over its measurements, which only closing sets take;
- ``size_price``: a size costs 1 + PRICE_K x its demand // (its measurements left + 1);
- ``close_gap``: the cheapest set of single measurements that fills a gap (to 1 token);
- ``rest_table``, ``closable``: whether a rest of r tokens has a fill, from the sizes the
  opened donors hold, at most ``quota[c]`` of each (a bitset knapsack, made anew only when
  a size runs out or comes in, or a quota changes); ``refresh_quota`` sets a row's quotas
  to about 1.5 times its share of each size, so that rows laid of IPv6 bodies take one 36
  each (26 x 38 + 36) and leave the others for the rows that need them;
- ``step``: one single measurement, the cheapest that keeps the rest fillable.

``Fill`` is step 4's working state; ``place`` puts free measurements into a row.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from prep.base.jit import helper, kernel
from prep.pack.supply import INF, cheapest_fills, slack_target
from prep.tokens.costs import SMALLEST_BODY

WINDOW_MAX = 160  # donor windows are listed up to this many tokens; sizes are counted to it
CLOSE_MAX = 160  # gaps up to this many tokens may be closed by a set of single measurements
PRICE_K = 1 << 10  # a size's price: 1 + PRICE_K x its demand // (its measurements left + 1)

# Step 4's state: cum_cost (the measurements' cost prefix sums), used (measurements taken
# from donors) and the donors' windows by length, stacks in flat arrays: window_head[l] the
# window of l tokens listed last, window w = [window_start[w], window_end[w]), window_next[w]
# the one listed before it (-1: none). The opened donors' measurements by size, stacks
# likewise: size_head[c], size_measurement, size_next; available[c] of them unused;
# free_left[c] the unused ones of c tokens in all free rows; demand[c], scarce[c]
# (``demand``); quota[c]; rest_ok, the rest table (a bitset: bit r set = a rest of r tokens
# has a fill), stale while rest_stale[0] != 0. ``close_gap``'s scratch: sum_cost[t] and
# sum_via[t] (the cheapest sum of t tokens and its last size), size_count[c], and its
# bounded knapsack's items: item_size, item_count, item_price, item_taken[item, t].
# The kernels take the fields they use into short locals (cum, avail, ok, st, ...).
Fill = namedtuple("Fill", "cum_cost used window_head window_start window_end window_next "
                          "size_head size_measurement size_next available free_left demand "
                          "scarce quota rest_ok rest_stale sum_cost sum_via size_count "
                          "item_taken item_size item_count item_price")
# An array read out of a tuple argument costs Numba an incref/decref pair (atomic) where it
# is not pruned: the functions below take the fields they use into locals once, up front,
# and the helpers run per measurement take arrays, not the tuple.


@helper(inline=True)
def place(f, p, rows, r, a, b, k):
    """Free measurements [a, b) become piece k, the last of row r (a cut costs nothing);
    returns k + 1. The arrays have room (``fill_gaps`` makes it up front)."""
    used, cum, avail, left, st = f.used, f.cum_cost, f.available, f.free_left, f.rest_stale
    gap, nseg, rfirst, rlast = rows
    ps, pe, pr, pnext, alive = p
    for i in range(a, b):  # not used[a:b] = True: a slice is a view, refcounted
        used[i] = True
        c = cum[i + 1] - cum[i]
        if c <= WINDOW_MAX:
            avail[c] -= 1
            left[c] -= 1
            if avail[c] == 0:
                st[0] = 1  # a size ran out: the table of rests is stale
    gap[r] -= cum[b] - cum[a]
    nseg[r] += 1
    ps[k], pe[k], pr[k], pnext[k], alive[k] = a, b, r, -1, True
    if rlast[r] >= 0:
        pnext[rlast[r]] = k
    else:
        rfirst[r] = k
    rlast[r] = k
    return k + 1


@helper(inline=True)
def size_price(dem, left, c):
    """The price of one measurement of c tokens: its demand over what is left of it."""
    return 1 + PRICE_K * dem[c] // (left[c] + 1)


@helper(inline=True)
def scarce_at(cum, scarce, i):
    """Whether measurement i is of a scarce size: runs and windows pass over it, closing
    sets take it."""
    c = cum[i + 1] - cum[i]
    return c <= WINDOW_MAX and scarce[c]


@helper(inline=True)
def _or_shifted(bits, s):
    """bits |= bits << s, over a bitset of uint64 words (an item of s tokens, 0/1 knapsack)."""
    ws, b = s >> 6, np.uint64(s & 63)
    for w in range(bits.shape[0] - 1, ws - 1, -1):
        v = bits[w - ws] << b
        if b != 0 and w - ws - 1 >= 0:
            v |= bits[w - ws - 1] >> (np.uint64(64) - b)
        bits[w] |= v


@helper
def rest_table(f):
    """ok (a bitset): r, or r - 1, is a sum of the measurements the opened donors hold, at
    most quota[c] of each size c, as a bounded knapsack: 1, 2, 4, ... of a size as one item."""
    ok, avail, quota, st = f.rest_ok, f.available, f.quota, f.rest_stale
    n = ok.shape[0] * 64
    ok[:] = 0
    ok[0] = 1
    for c in range(1, WINDOW_MAX + 1):
        left_c = min(avail[c], quota[c], n // c)
        step = 1
        while left_c > 0:
            m = min(step, left_c)
            _or_shifted(ok, c * m)
            left_c -= m
            step *= 2
    _or_shifted(ok, 1)  # or one token more
    st[0] = 0


@helper
def refresh_quota(f, row_len):
    """quota[c]: how many measurements of c tokens one row may count on, about 1.5 times
    its share of what the opened donors hold, plus 2; a change makes the table stale."""
    avail, quota, st = f.available, f.quota, f.rest_stale
    tokens = 0
    for c in range(1, WINDOW_MAX + 1):
        tokens += avail[c] * c
    for c in range(1, WINDOW_MAX + 1):
        qc = min(avail[c], (3 * avail[c] * row_len) // (2 * max(tokens, 1)) + 2)
        if qc != quota[c]:
            quota[c] = qc
            st[0] = 1


@helper(inline=True)
def fresh(f):
    """The rest table, made anew if a size ran out or came in since (``closable`` reads it)."""
    if f.rest_stale[0] != 0:
        rest_table(f)


@helper(inline=True)
def closable(ok, r):
    """Whether a rest of r tokens can still be filled (to 1) from the opened donors, by the
    rest table ``ok`` (fresh: ``_fresh``): r beyond it counts as yes (a long run comes
    first)."""
    if r >= ok.shape[0] * 64:
        return True
    return (ok[r >> 6] >> np.uint64(r & 63)) & np.uint64(1) != 0


@helper(inline=True)
def take_single(f, p, rows, r, c, k):
    """An unused measurement of c tokens from the opened donors (one is there) becomes the
    last piece of row r; returns k + 1."""
    shead, sx, sn, used = f.size_head, f.size_measurement, f.size_next, f.used
    while used[sx[shead[c]]]:  # drop the measurements used since
        shead[c] = sn[shead[c]]
    i = sx[shead[c]]
    return place(f, p, rows, r, i, i + 1, k)


@helper
def close_gap(f, p, rows, r, k):
    """Fills row r's gap g (to 1 token) with the cheapest set of single unused measurements
    of the opened donors; returns k, or -1 and nothing placed if no set does. The cheapest
    sum with any number of each size first; only where that takes more of a size than
    there is, a bounded knapsack (each size split into items of 1, 2, 4, ...)."""
    cost, via, take = f.sum_cost, f.sum_via, f.item_taken
    isz, icnt, ipr = f.item_size, f.item_count, f.item_price
    avail, cnt, dem, left = f.available, f.size_count, f.demand, f.free_left
    g = rows.gap[r]
    if g < SMALLEST_BODY or g > CLOSE_MAX:
        return -1
    ns = 0
    for c in range(SMALLEST_BODY, min(g, WINDOW_MAX) + 1):
        if avail[c] > 0:
            isz[ns], ipr[ns] = c, size_price(dem, left, c)
            ns += 1
    if ns == 0:
        return -1
    cost[0], via[0] = 0, -1
    for t in range(1, g + 1):
        best, v = INF, -1
        for b in range(ns):
            s = isz[b]
            if s <= t and cost[t - s] < INF and cost[t - s] + ipr[b] < best:
                best, v = cost[t - s] + ipr[b], s
        cost[t], via[t] = best, v
    t = g - 1 if cost[g - 1] < cost[g] else g
    if cost[t] >= INF:
        return -1
    fits = True
    u = t
    while u > 0:
        cnt[via[u]] += 1
        if cnt[via[u]] > avail[via[u]]:
            fits = False
        u -= via[u]
    u = t
    while u > 0:  # cnt back to zeros
        cnt[via[u]] = 0
        u -= via[u]
    if fits:
        while t > 0:
            c = via[t]
            t -= c
            k = take_single(f, p, rows, r, c, k)
        return k
    ni = 0
    for b in range(ns):
        c, pr_b = isz[b], size_price(dem, left, isz[b])
        n = min(avail[c], g // c)
        step = 1
        while n > 0:
            m = min(step, n)
            isz[ns + ni], icnt[ni], ipr[ns + ni] = c, m, m * pr_b
            ni += 1
            n -= m
            step *= 2
    cost[: g + 1] = INF
    cost[0] = 0
    for it in range(ni):
        s, pr_ = isz[ns + it] * icnt[it], ipr[ns + it]
        for t in range(g, s - 1, -1):
            take[it, t] = False
            if cost[t - s] < INF and cost[t - s] + pr_ < cost[t]:
                cost[t] = cost[t - s] + pr_
                take[it, t] = True
        for t in range(min(s, g + 1)):
            take[it, t] = False
    t = g - 1 if cost[g - 1] < cost[g] else g
    if cost[t] >= INF:
        return -1
    for it in range(ni - 1, -1, -1):
        if take[it, t]:
            c = isz[ns + it]
            for _ in range(icnt[it]):
                k = take_single(f, p, rows, r, c, k)
            t -= c * icnt[it]
    return k


@helper
def step(f, p, rows, r, k):
    """One single unused measurement of the opened donors into row r, of the cheapest size
    that leaves a rest that can still be filled; returns k, or -1 if none does."""
    avail, dem, left, ok = f.available, f.demand, f.free_left, f.rest_ok
    g = rows.gap[r]
    best, best_price = -1, INF
    fresh(f)
    for c in range(SMALLEST_BODY, min(g, WINDOW_MAX) + 1):
        if avail[c] > 0 and (g - c <= 1 or closable(ok, g - c)):
            pc = size_price(dem, left, c)
            if pc < best_price:
                best, best_price = c, pc
    if best < 0:
        return -1
    return take_single(f, p, rows, r, best, k)


@kernel
def demand(gap, free, left):
    """(dem[c], scarce[c]): how many measurements of c tokens the gaps of the rows that are
    not free would take, each filled with the fewest measurements of the sizes the free rows
    hold; a size is scarce when that is more than half of what they hold and they hold
    less than a quarter of their tokens in it (the IPv4 bodies of IPv6 data)."""
    size = np.nonzero(left > 0)[0]
    dem = np.zeros(WINDOW_MAX + 1, np.int64)
    scarce = np.zeros(WINDOW_MAX + 1, np.bool_)
    if size.shape[0] == 0:
        return dem, scarce
    hist = np.zeros(CLOSE_MAX + 1, np.int64)
    for r in range(gap.shape[0]):
        if not free[r] and SMALLEST_BODY <= gap[r] <= CLOSE_MAX:
            hist[gap[r]] += 1
    cost, via = np.empty(CLOSE_MAX + 1, np.int64), np.empty(CLOSE_MAX + 1, np.int64)
    cheapest_fills(size, np.ones(size.shape[0], np.int64), np.int64(CLOSE_MAX), cost,
                   via)  # int64 as `budget` passes it: one compiled version
    for g in range(SMALLEST_BODY, CLOSE_MAX + 1):
        if hist[g] > 0:
            t = slack_target(cost, g)
            if cost[t] < INF:
                while t > 0:
                    dem[size[via[t]]] += hist[g]
                    t -= size[via[t]]
    tokens = 0
    for c in range(WINDOW_MAX + 1):
        tokens += c * left[c]
    for c in range(WINDOW_MAX + 1):
        scarce[c] = 2 * dem[c] > left[c] > 0 and 4 * c * left[c] < tokens
    return dem, scarce
