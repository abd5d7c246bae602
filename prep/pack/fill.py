"""Step 4 of the packer (prep.pack.packing): fill the rows' gaps exactly from donor rows.

A row is free when no piece of it has a timestamp that a cut would make absolute
(none-mode contexts): cutting it costs nothing. Free rows, least full first, become donors
one at a time as the rows to fill (all others, in row order) need them; each window
[x, y) of a donor's pieces of up to WINDOW_MAX tokens is listed by length, and each of its
measurements by size. A gap takes a window of exactly its size, else one less, else the
cheapest set of single measurements that fills it (prep.pack.closing: sizes priced by
their demand over their supply, so the scarce small bodies go to the gaps that only they
fill), else the longest window whose rest can still be filled; a long gap first takes a
long run of the opened donors that leaves such a rest. What the donors keep is laid into
new rows in order: a run stops before a measurement that would leave the row a rest with
no fill (it is passed over, for a later row or a closing set), and a row that cannot take
the next measurement is closed by single measurements that keep its rest fillable, then
a closing set. Windows and runs pass over measurements of a scarce size.

The pieces and rows that steps 3-5 share (prep.pack.closing names their columns) are
grown here, once: a grown array is a new array.
``fill_gaps`` runs in Python and calls the step's kernels (see prep.pack.packing._pack).
"""

from __future__ import annotations

import numpy as np

from prep.base.jit import helper, kernel
from prep.pack.closing import (
    AVAILABLE,
    CHUNKS,
    CLOSE_MAX,
    DEMAND,
    FREE_LEFT,
    I_PRICE,
    N_TABLE,
    P_END,
    P_NEXT,
    P_ROW,
    P_START,
    QUOTA,
    R_FIRST,
    R_GAP,
    R_LAST,
    R_NSEG,
    REST_STALE,
    S_MEASUREMENT,
    S_NEXT,
    SCARCE,
    SIZE_HEAD,
    WINDOW_CHUNK,
    WINDOW_HEAD,
    WINDOW_MAX,
    WINDOW_TOP,
    Fill,
    closable,
    close_gap,
    demand,
    fresh,
    place,
    refresh_quota,
    rest_table,
    scarce_at,
    step,
)
from prep.tokens.costs import SMALLEST_BODY, fillable

DONORS_PER_ROW = 2  # at most this many donors are opened for one row's gap
SKIP_MAX = 16  # measurements a new row may pass over (``_lay_kept``)



def _grow(a, n):
    """The piece or row array ``a``, grown to hold at least ``n``."""
    b = np.empty((max(n, 2 * a.shape[0]), a.shape[1]), a.dtype)
    b[: a.shape[0]] = a
    return b


@helper(inline=True)
def _push_window(win, tab, wl, v):
    """Window v (start << 8 | measurements) onto the stack of windows of wl tokens."""
    c = tab[WINDOW_HEAD, wl]
    if c < 0 or tab[WINDOW_TOP, wl] == WINDOW_CHUNK:  # a chunk on top: an emptied one or new
        n = tab[CHUNKS, 1]
        if n >= 0:
            tab[CHUNKS, 1] = win[n, 0]
        else:
            n = tab[CHUNKS, 0]
            tab[CHUNKS, 0] += 1
        win[n, 0] = c
        tab[WINDOW_HEAD, wl], tab[WINDOW_TOP, wl] = n, 1
        c = n
    win[c, tab[WINDOW_TOP, wl]] = v
    tab[WINDOW_TOP, wl] += 1


@helper(inline=True)
def _pop_window(win, tab, wl):
    """Drops the top window of wl tokens; an emptied chunk goes to the reused ones."""
    c = tab[WINDOW_HEAD, wl]
    tab[WINDOW_TOP, wl] -= 1
    if tab[WINDOW_TOP, wl] == 1:
        tab[WINDOW_HEAD, wl], tab[WINDOW_TOP, wl] = win[c, 0], WINDOW_CHUNK  # full below
        win[c, 0] = tab[CHUNKS, 1]
        tab[CHUNKS, 1] = c


@helper
def _find_window(win, tab, used, rest_ok, g, exact, last):
    """(x, y, length) of a listed window with no used measurement for a gap of ``g``: exactly
    g tokens, else g - 1, else (``exact``) the longest whose rest can be filled (not on a
    row's ``last`` slot; the rest table fresh), else (not ``exact``) the longest
    that fits; (-1, -1, 0) if none. Fill's arrays, not Fill: fewer to incref per call."""
    for want in range(min(g, WINDOW_MAX), 0, -1):
        if exact and want < g - 1 and (last or g - want < SMALLEST_BODY
                                       or not closable(rest_ok, g - want)):
            continue
        while tab[WINDOW_HEAD, want] >= 0:  # drop windows that lost a measurement
            v = win[tab[WINDOW_HEAD, want], tab[WINDOW_TOP, want] - 1]
            x = v >> 8
            y = x + (v & 255)
            i = x
            while i < y and not used[i]:
                i += 1
            if i == y:
                return x, y, want
            _pop_window(win, tab, want)
    return -1, -1, 0


@kernel
def _free_rows(cum, has_ts, abs_extra, ctx_start, ctx_end, order, p, n0):
    """(free[r] for the first n0 rows, the measurements in free rows, the cheapest of them,
    left[c]: how many of them cost c tokens): a row is free when no measurement of it has a
    timestamp that a cut would make absolute. Piece j of p is context order[j] (step 3).
    Both passes read the contexts in their order in memory: the rows' pieces lie anywhere
    in it, and read row by row each piece costs cache misses."""
    n_ctx = ctx_start.shape[0]
    free_ctx = np.ones(n_ctx, np.bool_)
    for c in range(n_ctx):
        for i in range(ctx_start[c], ctx_end[c]):
            if has_ts[i] and abs_extra[i] != 0:  # a cut before it would make it absolute
                free_ctx[c] = False
                break
    free = np.ones(n0, np.bool_)
    row_of = np.empty(n_ctx, np.int64)
    for j in range(n_ctx):
        row_of[order[j]] = p[j, P_ROW]
        if not free_ctx[order[j]]:
            free[p[j, P_ROW]] = False
    left = np.zeros(WINDOW_MAX + 1, np.int64)
    m_free = 0
    cheapest = WINDOW_MAX
    for c in range(n_ctx):
        if free[row_of[c]]:
            m_free += ctx_end[c] - ctx_start[c]
            for i in range(ctx_start[c], ctx_end[c]):
                ci = cum[i + 1] - cum[i]
                cheapest = min(cheapest, ci)
                if ci <= WINDOW_MAX:
                    left[ci] += 1
    return free, m_free, cheapest, left


@helper
def _open_donor(f, p, rows, d, ns):
    """Row d becomes a donor: its pieces leave it (windows or new rows take them), every
    window of them up to WINDOW_MAX tokens is listed, and every measurement by size, from
    index ns on; returns the new ns."""
    cum, win, sz, tab = f.cum, f.windows, f.sizes, f.table
    q = rows[d, R_FIRST]
    while q >= 0:
        p[q, P_ROW] = -1  # its row is a donor now
        for x in range(p[q, P_START], p[q, P_END]):
            c = cum[x + 1] - cum[x]
            if c <= WINDOW_MAX:
                sz[ns, S_MEASUREMENT], sz[ns, S_NEXT] = x, tab[SIZE_HEAD, c]
                tab[SIZE_HEAD, c] = ns
                ns += 1
                tab[AVAILABLE, c] += 1
                if tab[AVAILABLE, c] == 1:
                    tab[REST_STALE, 0] = 1
            for y in range(x + 1, p[q, P_END] + 1):
                wl = cum[y] - cum[x]
                if wl > WINDOW_MAX or (y > x + 1 and (scarce_at(cum, tab, x)
                                                         or scarce_at(cum, tab, y - 1))):
                    break
                _push_window(win, tab, wl, x << 8 | (y - x))
        q = p[q, P_NEXT]
    return ns


@helper
def _long_run(f, p, rows, donors, nd, g, cur, cq, ca):
    """A long gap of ``g`` takes a long run: the next unused run [a, m) of the opened donors
    (donors[:nd]), read on from donor cur, piece cq (-1: its first), measurement ca, that
    fills g exactly or leaves a rest that can be filled. Returns (a, m, cur, cq, ca), a = -1
    when none: the donors are spent, or the run at hand cannot leave such a rest here."""
    cum, used, tab, ok = f.cum, f.used, f.table, f.rest_ok
    fresh(f)
    while cur < nd:
        q = cq if cq >= 0 else rows[donors[cur], R_FIRST]
        a = max(ca, p[q, P_START])
        while a < p[q, P_END] and (used[a] or scarce_at(cum, tab, a)):
            a += 1
        m = a
        while m < p[q, P_END] and not used[m] and not scarce_at(cum, tab, m) and \
                cum[m + 1] - cum[a] <= g:
            m += 1
        while m > a and cum[m] - cum[a] != g and not (
                g - (cum[m] - cum[a]) >= SMALLEST_BODY and closable(ok, g - (cum[m] - cum[a]))):
            m -= 1
        if m > a:
            return a, m, cur, q, m
        if a < p[q, P_END] and not used[a] and cum[a + 1] - cum[a] <= g:
            break  # this run cannot leave a rest that can be filled here: use windows
        cq, ca = p[q, P_NEXT], 0  # the piece is spent: next piece, next donor
        if cq < 0:
            cur += 1
    return -1, -1, cur, cq, ca


@kernel
def _fill_rows(f, p, rows, order, free, donors, cap, k):
    """Fills the gaps of the rows in ``order`` from the front, opening donors from its end
    (free rows) as they are needed; returns (k, the donors opened, listed in donors)."""
    # Counters that a kernel call takes start as np.int64, not a literal 0: Numba types a
    # call at the first sight of its arguments, and a literal there compiles the callee
    # twice (once for Literal[int](0), once for int64), several seconds each cold.
    cum, win, tab, used, ok = f.cum, f.windows, f.table, f.used, f.rest_ok
    nd = ns = np.int64(0)
    ti, dj = 0, order.shape[0] - 1
    # long gaps: donor, piece and measurement to take runs from
    cur, cq, ca = np.int64(0), np.int64(-1), np.int64(0)
    while ti <= dj:
        t = order[ti]
        ti += 1
        opened = 0
        while rows[t, R_GAP] >= SMALLEST_BODY and (cap == 0 or rows[t, R_NSEG] < cap):
            g = rows[t, R_GAP]
            wa, wb = -1, -1
            if g > WINDOW_MAX + SMALLEST_BODY and (cap == 0 or rows[t, R_NSEG] < cap - 1):
                wa, wb, cur, cq, ca = _long_run(f, p, rows, donors, nd, g, cur, cq, ca)
            if wa < 0:
                if tab[REST_STALE, 0] != 0:
                    rest_table(f)
                last = cap > 0 and rows[t, R_NSEG] == cap - 1
                wa, wb, _ = _find_window(win, tab, used, ok, g, True, last)
                if cap == 0 and (wa < 0 or g - (cum[wb] - cum[wa]) > 1):
                    k2 = close_gap(f, p, rows, t, k)  # no window fills it: single measurements
                    if k2 >= 0:
                        k = k2
                        continue
            if wa < 0 and fillable(g) and opened < DONORS_PER_ROW and ti <= dj and \
                    free[order[dj]]:
                opened += 1  # open the next donor and look again
                d = order[dj]
                dj -= 1
                donors[nd] = d
                nd += 1
                ns = _open_donor(f, p, rows, d, ns)
                continue
            if wa < 0:  # nothing fills it: the longest window that fits
                wa, wb, _ = _find_window(win, tab, used, ok, g, False, False)
            if wa < 0:
                break
            k = place(f, p, rows, t, wa, wb, k)
    return k, nd


@helper
def _close_row(f, p, rows, r, cap, k):
    """Closes row r: without a cap, single measurements that keep its rest fillable until a
    set of them closes it; then (or with a cap) windows while its gap takes one. Returns k."""
    cum, win, tab, used, ok = f.cum, f.windows, f.table, f.used, f.rest_ok
    while cap == 0 and rows[r, R_GAP] >= SMALLEST_BODY:
        k2 = close_gap(f, p, rows, r, k)
        if k2 >= 0:
            return k2
        k2 = step(f, p, rows, r, k)
        if k2 < 0:
            break
        k = k2
    while rows[r, R_GAP] >= SMALLEST_BODY and (cap == 0 or rows[r, R_NSEG] < cap):
        last = cap > 0 and rows[r, R_NSEG] == cap - 1
        if tab[REST_STALE, 0] != 0:
            rest_table(f)
        wa, wb, _ = _find_window(win, tab, used, ok, rows[r, R_GAP], True, last)
        if wa < 0:
            break
        k = place(f, p, rows, r, wa, wb, k)
    return k


@kernel
def _lay_kept(f, p, rows, donors, row_len, cap, k, n_rows):
    """What the donors kept, in order, into new rows from n_rows on. A run stops before a
    measurement that would turn a rest that can be filled into one that cannot; that one is
    passed over (up to SKIP_MAX a row) for a later row or a closing set, and a row that
    cannot take the next measurement is closed (``_close_row``). A second pass lays what
    the first passed over (and the scarce sizes). Returns (k, n_rows)."""
    cum, used, tab, ok = f.cum, f.used, f.table, f.rest_ok
    r = np.int64(-1)  # not a literal: see _fill_rows
    skips = 0
    for pass_ in range(2):
        for d in donors:
            q = rows[d, R_FIRST]
            while q >= 0:
                a = p[q, P_START]
                while a < p[q, P_END]:
                    if used[a] or (pass_ == 0 and scarce_at(cum, tab, a)):
                        a += 1
                        continue
                    c = cum[a + 1] - cum[a]
                    if r >= 0:
                        rest = rows[r, R_GAP] - c
                        if rest < 0 or (cap > 0 and rows[r, R_NSEG] >= cap):
                            k = _close_row(f, p, rows, r, cap, k)
                            r = -1
                            continue  # the closing may have taken measurement a
                        if tab[REST_STALE, 0] != 0:
                            rest_table(f)
                        if cap == 0 and rest > 1 and not closable(ok, rest) and \
                                closable(ok, rows[r, R_GAP]):
                            if pass_ == 0 and skips < SKIP_MAX:
                                skips += 1
                                a += 1  # passed over: a later row or a closing set takes it
                                continue
                            k = _close_row(f, p, rows, r, cap, k)
                            r = -1
                            continue
                    if r < 0:
                        r = n_rows
                        n_rows += 1
                        rows[r, R_GAP], rows[r, R_NSEG] = row_len, 0
                        rows[r, R_FIRST], rows[r, R_LAST] = -1, -1
                        skips = 0
                        refresh_quota(f, row_len)
                    m = a + 1
                    if tab[REST_STALE, 0] != 0:
                        rest_table(f)
                    while (m < p[q, P_END] and not used[m]
                           and cum[m + 1] - cum[a] <= rows[r, R_GAP]
                           and (pass_ > 0 or not scarce_at(cum, tab, m))):
                        rest = rows[r, R_GAP] - (cum[m + 1] - cum[a])
                        if cap == 0 and rest > 1 and not closable(ok, rest) and \
                                closable(ok, rows[r, R_GAP] - (cum[m] - cum[a])):
                            break
                        m += 1
                    k = place(f, p, rows, r, a, m, k)
                    a = m
                q = p[q, P_NEXT]
    return k, n_rows


def fill_gaps(cum, has_ts, abs_extra, ctx_start, ctx_end, order, row_len, cap, p, rows, k,
              n_rows):
    """Step 4 on pieces p[:k] in rows[:n_rows], piece j being context order[j] (step 3's
    whole contexts): returns (p, rows, k, n_rows), the arrays grown. Donor rows stay, their
    pieces no longer in a row."""
    n0 = n_rows
    free, m_free, cheapest, left = _free_rows(cum, has_ts, abs_extra, ctx_start, ctx_end, order,
                                              p, n0)
    fill = row_len - rows[:n0, R_GAP]
    fr = np.flatnonzero(free)
    fr = fr[np.argsort(-fill[fr], kind="stable")]
    order = np.concatenate((np.flatnonzero(~free), fr))  # fill from the front, donors from the end
    dem, scarce = demand(rows[:n0, R_GAP], free, left)
    if cap > 0:
        scarce[:] = False  # under a cap on pieces, single measurements would fill rows up
    # Room for all that can come, allocated once: an array reassigned inside the loops
    # would cost Numba an atomic incref/decref pair per pass (once 2/3 of this step's time),
    # and np.empty's pages are only mapped where written. Every piece and every new row
    # holds at least one measurement of a free row; a window starting at a measurement
    # spans at most WINDOW_MAX // (its cheapest measurement) of them.
    p, rows = _grow(p, k + m_free + 1), _grow(rows, n_rows + m_free + 1)
    n_win = m_free * (WINDOW_MAX // max(cheapest, 1)) + 1
    n_chunks = n_win // (WINDOW_CHUNK - 1) + WINDOW_MAX + 2  # full ones, one top a length
    n_items = (WINDOW_MAX + 1) * 8
    tab = np.zeros((N_TABLE, WINDOW_MAX + 1), np.int64)
    tab[WINDOW_HEAD] = tab[SIZE_HEAD] = -1
    tab[CHUNKS, 1] = -1
    tab[FREE_LEFT], tab[DEMAND], tab[SCARCE] = left, dem, scarce
    tab[QUOTA] = row_len // np.maximum(np.arange(WINDOW_MAX + 1), 1)
    tab[REST_STALE, 0] = 1
    f = Fill(cum=cum, used=np.zeros(cum.shape[0], np.bool_),
             windows=np.empty((n_chunks, WINDOW_CHUNK), np.int64), sizes=np.empty((m_free + 1, 2), np.int64),
             table=tab, rest_ok=np.zeros(row_len // 64 + 1, np.uint64),
             items=np.empty((n_items, I_PRICE + 1), np.int64),
             taken=np.zeros((n_items, CLOSE_MAX + 1), np.bool_))
    donors = np.empty(fr.shape[0], np.int64)
    k, nd = _fill_rows(f, p, rows, order, free, donors, cap, k)
    tab[REST_STALE, 0] = 1  # from here on the rest table counts at most quota[c] of each size
    k, n_rows = _lay_kept(f, p, rows, donors[:nd], row_len, cap, k, n_rows)
    return p, rows, k, n_rows
