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

# Step 4's state, in eight arrays: a call of a compiled helper increfs and decrefs, one
# atomic operation each, every array it is passed, so fewer arrays cost fewer of those.
# - cum (the measurements' cost prefix sums) and used (measurements taken from donors);
# - windows: the donors' windows, a stack per length, in chunks of WINDOW_CHUNK slots:
#   slot 0 of a chunk holds the chunk below it in its stack (-1: none), slots 1.. the
#   windows, each start << 8 | its measurements (a window of l tokens: the measurements
#   from start on that cost l). A stack's windows lie side by side, so dropping the ones
#   that lost a measurement reads memory in order; an emptied chunk is reused;
#   sizes[s] = (S_MEASUREMENT, S_NEXT): the opened donors' measurements, a stack per size
#   likewise;
# - table[ROW, c], one row per quantity, indexed by a size c (or a sum t) up to WINDOW_MAX:
#   WINDOW_HEAD[l] the top chunk of the windows of l tokens (-1: none) and WINDOW_TOP[l]
#   its first free slot, CHUNKS[0] the chunks handed out, CHUNKS[1] the first emptied one
#   (-1: none; slot 0 chains them), SIZE_HEAD[c] the measurement of c
#   tokens listed last, AVAILABLE[c] of them unused, FREE_LEFT[c] the unused ones in all
#   free rows, DEMAND[c] and SCARCE[c] (0/1, ``demand``), QUOTA[c]; REST_STALE[0] != 0
#   while the rest table rest_ok (a bitset: bit r set = a rest of r tokens has a fill) is
#   stale; ``close_gap``'s table: SUM_COST[t] and SUM_VIA[t] (the cheapest sum of t
#   tokens and its last size), right for t <= SUM_LEN[0] while each size's price is
#   still SUM_KEY[c] (0: none left), kept from call to call; its scratch: SIZE_COUNT[c],
#   and its bounded knapsack's items[i] = (I_SIZE, I_COUNT, I_PRICE) and taken[i, t].
Fill = namedtuple("Fill", "cum used windows sizes table rest_ok items taken")
# The pieces and rows that steps 3-5 share (prep.pack.packing), int64: piece j =
# p[j] = (P_START, P_END, P_ROW, P_NEXT, P_LEN), measurements [start, end) in row `row`
# (-1 once that row became a donor), next the next piece of its row (slot order, -1: the
# last), len its tokens; pieces in creation order. Row r = rows[r] = (R_GAP, R_NSEG, R_FIRST, R_LAST): tokens
# free, pieces, its first and last piece.
P_START, P_END, P_ROW, P_NEXT, P_LEN = range(5)
R_GAP, R_NSEG, R_FIRST, R_LAST = range(4)
(WINDOW_HEAD, WINDOW_TOP, CHUNKS, SIZE_HEAD, AVAILABLE, FREE_LEFT, DEMAND, SCARCE, QUOTA,
 REST_STALE, SUM_COST, SUM_VIA, SUM_KEY, SUM_LEN, SIZE_COUNT, N_TABLE) = range(16)
WINDOW_CHUNK = 64  # slots of a chunk of windows: the chunk below, then 63 windows
S_MEASUREMENT, S_NEXT = range(2)
I_SIZE, I_COUNT, I_PRICE = range(3)
assert CLOSE_MAX <= WINDOW_MAX  # the sums share the table's width


@helper
def place(f, p, rows, r, a, b, k):
    """Free measurements [a, b) become piece k, the last of row r (a cut costs nothing);
    returns k + 1. The arrays have room (``fill_gaps`` makes it up front)."""
    used, cum, tab = f.used, f.cum, f.table
    for i in range(a, b):  # not used[a:b] = True: a slice is a view, refcounted
        used[i] = True
        c = cum[i + 1] - cum[i]
        if c <= WINDOW_MAX:
            tab[AVAILABLE, c] -= 1
            tab[FREE_LEFT, c] -= 1
            if tab[AVAILABLE, c] == 0:
                tab[REST_STALE, 0] = 1  # a size ran out: the table of rests is stale
    rows[r, R_GAP] -= cum[b] - cum[a]
    rows[r, R_NSEG] += 1
    p[k, P_START], p[k, P_END], p[k, P_ROW], p[k, P_NEXT] = a, b, r, -1
    p[k, P_LEN] = cum[b] - cum[a]  # a free row's: no timestamp to make absolute
    if rows[r, R_LAST] >= 0:
        p[rows[r, R_LAST], P_NEXT] = k
    else:
        rows[r, R_FIRST] = k
    rows[r, R_LAST] = k
    return k + 1


@helper(inline=True)
def size_price(tab, c):
    """The price of one measurement of c tokens: its demand over what is left of it."""
    return 1 + PRICE_K * tab[DEMAND, c] // (tab[FREE_LEFT, c] + 1)


@helper(inline=True)
def scarce_at(cum, tab, i):
    """Whether measurement i is of a scarce size: runs and windows pass over it, closing
    sets take it."""
    c = cum[i + 1] - cum[i]
    return c <= WINDOW_MAX and tab[SCARCE, c] != 0


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
    ok, tab = f.rest_ok, f.table
    n = ok.shape[0] * 64
    ok[:] = 0
    ok[0] = 1
    for c in range(1, WINDOW_MAX + 1):
        left_c = min(tab[AVAILABLE, c], tab[QUOTA, c])
        if left_c <= 0:
            continue  # no division (slow) for the many sizes none are left of
        left_c = min(left_c, n // c)
        step = 1
        while left_c > 0:
            m = min(step, left_c)
            _or_shifted(ok, c * m)
            left_c -= m
            step *= 2
    _or_shifted(ok, 1)  # or one token more
    tab[REST_STALE, 0] = 0


@helper
def refresh_quota(f, row_len):
    """quota[c]: how many measurements of c tokens one row may count on, about 1.5 times
    its share of what the opened donors hold, plus 2; a change makes the table stale."""
    tab = f.table
    tokens = 0
    for c in range(1, WINDOW_MAX + 1):
        tokens += tab[AVAILABLE, c] * c
    for c in range(1, WINDOW_MAX + 1):
        avail = tab[AVAILABLE, c]
        qc = min(avail, (3 * avail * row_len) // (2 * max(tokens, 1)) + 2)
        if qc != tab[QUOTA, c]:
            tab[QUOTA, c] = qc
            tab[REST_STALE, 0] = 1


@helper
def fresh(f):
    """The rest table, made anew if a size ran out or came in since (``closable`` reads it)."""
    if f.table[REST_STALE, 0] != 0:
        rest_table(f)


@helper(inline=True)
def closable(ok, r):
    """Whether a rest of r tokens can still be filled (to 1) from the opened donors, by the
    rest table ``ok`` (fresh: ``_fresh``): r beyond it counts as yes (a long run comes
    first)."""
    if r >= ok.shape[0] * 64:
        return True
    return (ok[r >> 6] >> np.uint64(r & 63)) & np.uint64(1) != 0


@helper
def take_single(f, p, rows, r, c, k):
    """An unused measurement of c tokens from the opened donors (one is there) becomes the
    last piece of row r; returns k + 1."""
    sz, used, tab = f.sizes, f.used, f.table
    while used[sz[tab[SIZE_HEAD, c], S_MEASUREMENT]]:  # drop the measurements used since
        tab[SIZE_HEAD, c] = sz[tab[SIZE_HEAD, c], S_NEXT]
    i = sz[tab[SIZE_HEAD, c], S_MEASUREMENT]
    return place(f, p, rows, r, i, i + 1, k)


@helper
def close_gap(f, p, rows, r, k):
    """Fills row r's gap g (to 1 token) with the cheapest set of single unused measurements
    of the opened donors; returns k, or -1 and nothing placed if no set does. The cheapest
    sum with any number of each size first (its table kept while the prices of the sizes
    it read stay, and only lengthened); only where that takes more of a size than there
    is, a bounded knapsack (each size split into items of 1, 2, 4, ...)."""
    tab, it, take = f.table, f.items, f.taken
    g = rows[r, R_GAP]
    if g < SMALLEST_BODY or g > CLOSE_MAX:
        return -1
    ns = 0
    for c in range(SMALLEST_BODY, min(g, WINDOW_MAX) + 1):
        pc = 0
        if tab[AVAILABLE, c] > 0:
            pc = size_price(tab, c)
            it[ns, I_SIZE], it[ns, I_PRICE] = c, pc
            ns += 1
        if pc != tab[SUM_KEY, c]:
            tab[SUM_KEY, c] = pc
            if c <= tab[SUM_LEN, 0]:
                tab[SUM_LEN, 0] = 0  # a price the table read changed
    if ns == 0:
        return -1
    tab[SUM_COST, 0], tab[SUM_VIA, 0] = 0, -1
    for t in range(tab[SUM_LEN, 0] + 1, g + 1):  # the sums of up to t tokens read sizes <= t
        best, v = INF, -1
        for b in range(ns):
            s = it[b, I_SIZE]
            if s <= t and tab[SUM_COST, t - s] < INF and \
                    tab[SUM_COST, t - s] + it[b, I_PRICE] < best:
                best, v = tab[SUM_COST, t - s] + it[b, I_PRICE], s
        tab[SUM_COST, t], tab[SUM_VIA, t] = best, v
    tab[SUM_LEN, 0] = max(tab[SUM_LEN, 0], g)
    t = g - 1 if tab[SUM_COST, g - 1] < tab[SUM_COST, g] else g
    if tab[SUM_COST, t] >= INF:
        return -1
    fits = True
    u = t
    while u > 0:
        c = tab[SUM_VIA, u]
        tab[SIZE_COUNT, c] += 1
        if tab[SIZE_COUNT, c] > tab[AVAILABLE, c]:
            fits = False
        u -= c
    u = t
    while u > 0:  # the counts back to zeros
        c = tab[SUM_VIA, u]
        tab[SIZE_COUNT, c] = 0
        u -= c
    if fits:
        while t > 0:
            c = tab[SUM_VIA, t]
            t -= c
            k = take_single(f, p, rows, r, c, k)
        return k
    ni = 0
    for b in range(ns):
        c = it[b, I_SIZE]
        pr_b = size_price(tab, c)
        n = min(tab[AVAILABLE, c], g // c)
        step = 1
        while n > 0:
            m = min(step, n)
            it[ns + ni, I_SIZE], it[ni, I_COUNT], it[ns + ni, I_PRICE] = c, m, m * pr_b
            ni += 1
            n -= m
            step *= 2
    tab[SUM_LEN, 0] = 0  # the bounded knapsack takes the table's place
    for t in range(g + 1):
        tab[SUM_COST, t] = INF
    tab[SUM_COST, 0] = 0
    for i in range(ni):
        s, pr_ = it[ns + i, I_SIZE] * it[i, I_COUNT], it[ns + i, I_PRICE]
        for t in range(g, s - 1, -1):
            take[i, t] = False
            if tab[SUM_COST, t - s] < INF and tab[SUM_COST, t - s] + pr_ < tab[SUM_COST, t]:
                tab[SUM_COST, t] = tab[SUM_COST, t - s] + pr_
                take[i, t] = True
        for t in range(min(s, g + 1)):
            take[i, t] = False
    t = g - 1 if tab[SUM_COST, g - 1] < tab[SUM_COST, g] else g
    if tab[SUM_COST, t] >= INF:
        return -1
    for i in range(ni - 1, -1, -1):
        if take[i, t]:
            c = it[ns + i, I_SIZE]
            for _ in range(it[i, I_COUNT]):
                k = take_single(f, p, rows, r, c, k)
            t -= c * it[i, I_COUNT]
    return k


@helper
def step(f, p, rows, r, k):
    """One single unused measurement of the opened donors into row r, of the cheapest size
    that leaves a rest that can still be filled; returns k, or -1 if none does."""
    tab, ok = f.table, f.rest_ok
    g = rows[r, R_GAP]
    best, best_price = -1, INF
    fresh(f)
    for c in range(SMALLEST_BODY, min(g, WINDOW_MAX) + 1):
        if tab[AVAILABLE, c] > 0 and (g - c <= 1 or closable(ok, g - c)):
            pc = size_price(tab, c)
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
