"""Offline packing of contexts into fixed-length rows: best-fit decreasing, splitting, repacking.

``pack`` turns contexts (ranges of tokenized measurements) into pieces placed in rows of
``row_len`` tokens. All of it is one Numba pass over integer arrays:

1. Length of every context by the piece length rule (prep.costs): ``cost[s:e].sum()``
   plus ``abs_extra`` of the first timestamped measurement, from a cumulative cost array
   and a scan for that measurement. The cumulative array is the only one as long as the
   measurements: on these machines fresh memory costs more in page faults than the loops
   over it.
2. Order contexts longest first (counting sort; equal lengths by index).
3. Best fit: each context goes to the open row with the smallest gap that holds it, else
   to a new row. Open rows sit in per-gap FIFO lists; a segment tree over gaps 0..row_len
   finds the smallest non-empty gap >= x in O(log row_len). A row
   leaves the lists when it is full or holds ``max_segments`` pieces.
4. Fill (``split=True``): rows whose pieces have no timestamp that a cut would make absolute
   (none-mode contexts) are "free": cutting them costs nothing. Free rows, least full first,
   become donors one at a time as the other rows (in row order) need them, and every window
   of a donor's pieces up to WINDOW_MAX tokens is listed by length. A row with gap g takes a
   window of exactly g tokens, else g - 1 (bodies are even, so a timestamped row's odd gap
   ends at 1), else the longest whose rest is still ``fillable``; a long gap takes a long
   run of the opened donors; only what nothing fills takes the longest window that fits.
   What the donors keep is laid into new rows in order, each closed the same way.
   Timestamped contexts are never cut here, so the packer adds no tokens.
5. Rows emptied by step 4 disappear; rows are renumbered in order; pieces are listed by
   (row, slot), slot = order of arrival in the row.
6. Repack (``split=True``, no ``max_segments``), only while rows exceed the lower bound:
   rows whose pieces are all at most SMALL tokens are dissolved and their pieces, whole,
   pooled by length. They first fill the gaps of the kept rows (in row order), then make new
   rows, each the largest subset sum <= row_len of the pool (bounded subset sum over the
   lengths, long pieces preferred; an exact row is repeated while the pool holds it). Kept
   rows keep their order, new rows follow. The result is taken only if it has fewer rows.
   This is for single-measurement contexts (RIPE Atlas: mostly 23-token timestamped and
   14-token untimestamped pings), which steps 3-4 cannot cut or mix: best fit lays the 23s
   first, 44 x 23 = 1012, and no 14 fills the gap of 12; exact mixes exist (36 x 23 +
   14 x 14, 22 x 23 + 37 x 14, 8 x 23 + 60 x 14 = 1024). No piece is cut, so no token added.

The planner (prep.planner_kernels.cut_contexts) does its part: a context that the row length ends
gives back up to BACKOFF last measurements until its gap is ``fillable`` (2-10 tokens fit
no measurement; 16-24 are no sum of the common body sizes), since cut points are free.

Measured (bench/bench_packing.py, 1024-token rows, 2 shared cores):

    data                                   whole-context BFD   this packer   rows / lower bound
    synthetic sparse mix (1-80 meas.)            0.09 %           0.05 %          1.0005
    synthetic busy probes (all ~1010 tok.)       ~4 %             0.13 %          1.0013
    `prep synth` data (busy-dominated)           ~4.8 %           0.12 %          1.0012
    RIPE Atlas sample (../shared), train         1.06 %           0.21 %          1.0000

Step 6 took busy from 0.17 % to 0.13 %, `prep synth` from 0.14 % to 0.12 % and the Atlas
sample from 117 rows to 116, its lower bound (the whole dataset: 1.31 % to 0.54 %, 130 rows
to 129), for ~2 ms of the ~110 ms that 80k contexts take.

The whole-context column is higher than the planner's greedy cuts gave (1.4 %), because the
planner now leaves fillable gaps on purpose. The lower bound is ceil(tokens of the plan's
contexts / row_len); against the greedy plan's (slightly fewer) tokens the built-in data is
at 1.0019. Speed (`make bench`): ~1M contexts/s or more on the built-in data (about 40M
measurements/s), ~4M/s sparse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from prep.costs import SMALLEST_BODY, fillable


@dataclass(frozen=True)
class Packing:
    piece_start: np.ndarray  # int64[k]: piece j is sorted measurements [start, end)
    piece_end: np.ndarray  # int64[k]
    piece_len: np.ndarray  # int32[k]: tokens, by the piece length rule
    piece_row: np.ndarray  # int64[k]: row of piece j; pieces ordered by (row, slot)
    n_rows: int


WINDOW_MAX = 64  # step 4 lists donor windows up to this many tokens
DONORS_PER_ROW = 2  # step 4 opens at most this many donors for one row's gap
SMALL = 64  # step 6 dissolves rows whose pieces are all at most this many tokens


@njit(cache=True)
def _plen(cum, has_ts, abs_extra, s, e):
    """Tokens of piece [s, e): its costs plus abs_extra of its first timestamped measurement
    (a scan of has_ts, which stops at once in a timestamped context)."""
    for i in range(s, e):
        if has_ts[i]:
            return cum[e] - cum[s] + abs_extra[i]
    return cum[e] - cum[s]


@njit(cache=True)
def _cumulative(cost):
    """cum[i] = cost[:i].sum(): the one array as long as the measurements that packing makes
    (a fresh int64 array costs ~3 ns an element here in page faults, more than a loop over
    it)."""
    n = cost.shape[0]
    cum = np.empty(n + 1, np.int64)
    cum[0] = 0
    for i in range(n):
        cum[i + 1] = cum[i] + cost[i]
    return cum


@njit(cache=True)
def _lengths(ctx_start, ctx_end, cum, has_ts, abs_extra):
    out = np.empty(ctx_start.shape[0], np.int64)
    for c in range(ctx_start.shape[0]):
        out[c] = _plen(cum, has_ts, abs_extra, ctx_start[c], ctx_end[c])
    return out


def context_lengths(ctx_start, ctx_end, cost, has_ts, abs_extra) -> np.ndarray:
    """Token length of every context (int64), by the piece length rule."""
    s, e, cost, has_ts, abs_extra = _as_arrays(ctx_start, ctx_end, cost, has_ts, abs_extra)
    return _lengths(s, e, _cumulative(cost), has_ts, abs_extra)


# Open rows, bucketed by gap: per-gap doubly linked FIFO lists plus a segment tree whose
# leaves count the rows in each bucket. st = [head, tail, nxt, prv, tree] travel together.
@njit(cache=True)
def _tree_add(tree, leaf, d):
    i = leaf + tree.shape[0] // 2
    while i >= 1:
        tree[i] += d
        i >>= 1


@njit(cache=True)
def _tree_ge(tree, x):
    """Smallest non-empty gap >= x, or -1."""
    size = tree.shape[0] // 2
    if x >= size:
        return -1
    i = x + size
    if tree[i] > 0:
        return x
    while i > 1:
        if (i & 1) == 0 and tree[i + 1] > 0:
            i += 1
            while i < size:
                i = 2 * i if tree[2 * i] > 0 else 2 * i + 1
            return i - size
        i >>= 1
    return -1


@njit(cache=True)
def _push(head, tail, nxt, prv, tree, r, g):
    nxt[r] = -1
    prv[r] = tail[g]
    if tail[g] >= 0:
        nxt[tail[g]] = r
    else:
        head[g] = r
    tail[g] = r
    _tree_add(tree, g, 1)


@njit(cache=True)
def _remove(head, tail, nxt, prv, tree, r, g):
    if prv[r] >= 0:
        nxt[prv[r]] = nxt[r]
    else:
        head[g] = nxt[r]
    if nxt[r] >= 0:
        prv[nxt[r]] = prv[r]
    else:
        tail[g] = prv[r]
    _tree_add(tree, g, -1)


@njit(cache=True)
def _grow(a, n):
    b = np.empty(max(n, 2 * a.shape[0]), a.dtype)
    b[: a.shape[0]] = a
    return b


@njit(cache=True)
def _room(ps, pe, pr, pnext, alive, n):
    """The piece arrays, grown to hold at least ``n`` pieces."""
    return _grow(ps, n), _grow(pe, n), _grow(pr, n), _grow(pnext, n), _grow(alive, n)


@njit(cache=True)
def _place(ps, pe, pr, pnext, alive, k, rfirst, rlast, r, a, b, cum, used, gap, nseg):
    """Step 4: free measurements [a, b) become piece k, the last of row r (a cut costs
    nothing); returns k + 1. The arrays have room (``_fill_exact`` makes it up front)."""
    for i in range(a, b):  # not used[a:b] = True: a slice is a view, refcounted
        used[i] = True
    gap[r] -= cum[b] - cum[a]
    nseg[r] += 1
    ps[k], pe[k], pr[k], pnext[k], alive[k] = a, b, r, -1, True
    if rlast[r] >= 0:
        pnext[rlast[r]] = k
    else:
        rfirst[r] = k
    rlast[r] = k
    return k + 1


@njit(cache=True)
def _find_window(head, wx, wy, wn, used, g, exact, last):
    """(x, y, length) of a listed window with no used measurement for a gap of ``g``: exactly
    g tokens, else g - 1, else (``exact``) the longest whose rest is ``fillable`` (not on a
    row's ``last`` slot), else (not ``exact``) the longest that fits; (-1, -1, 0) if none."""
    for want in range(min(g, WINDOW_MAX), 0, -1):
        if exact and want < g - 1 and (last or g - want < SMALLEST_BODY or not fillable(g - want)):
            continue
        while head[want] >= 0:  # drop windows that lost a measurement
            w = head[want]
            ok = True
            for i in range(wx[w], wy[w]):
                if used[i]:
                    ok = False
                    break
            if ok:
                return wx[w], wy[w], want
            head[want] = wn[w]
    return -1, -1, 0


@njit(cache=True)
def _fill_exact(cum, has_ts, abs_extra, row_len, cap, n_rows, gap, nseg, rfirst, rlast, ps, pe,
                pr, pnext, alive, k):
    """Step 4: fill the other rows' gaps exactly with windows of rows that cost nothing to cut.

    A row is free when no piece of it has a timestamp that a cut would make absolute
    (none-mode contexts). Free rows, least full first, become donors one at a time as the
    rows to fill (all others, in row order) need them; each window [x, y) of a donor's pieces
    of up to WINDOW_MAX tokens is listed by length. What donors keep is laid into new rows,
    each closed the same way before the next one opens.
    """
    n0 = n_rows
    fill = row_len - gap[:n0]
    free = np.zeros(n0, np.bool_)
    m_free = 0  # measurements in free rows, and the cheapest of them (for the room below)
    cheapest = WINDOW_MAX
    for r in range(n0):
        free[r] = True
        m, c = 0, WINDOW_MAX
        q = rfirst[r]
        while q >= 0 and free[r]:
            m += pe[q] - ps[q]
            for i in range(ps[q], pe[q]):
                if has_ts[i] and abs_extra[i] != 0:  # a cut before it would make it absolute
                    free[r] = False
                    break
                c = min(c, cum[i + 1] - cum[i])
            q = pnext[q]
        if free[r]:
            m_free += m
            cheapest = min(cheapest, c)
    fr = np.nonzero(free)[0]
    fr = fr[np.argsort(-fill[fr], kind="mergesort")]
    order = np.concatenate((np.nonzero(~free)[0], fr))  # fill from the front, donors from the end
    # Room for all that can come, allocated once: an array reassigned inside the loops below
    # would cost Numba an atomic incref/decref pair per pass (once 2/3 of this step's time),
    # and np.empty's pages are only mapped where written. Every piece and every new row
    # holds at least one measurement of a free row; a window starting at a measurement
    # spans at most WINDOW_MAX // (its cheapest measurement) of them.
    ps, pe, pr, pnext, alive = _room(ps, pe, pr, pnext, alive, k + m_free + 1)
    gap, nseg = _grow(gap, n_rows + m_free + 1), _grow(nseg, n_rows + m_free + 1)
    rfirst, rlast = _grow(rfirst, n_rows + m_free + 1), _grow(rlast, n_rows + m_free + 1)
    n_win = m_free * (WINDOW_MAX // max(cheapest, 1)) + 1
    wx, wy, wn = np.empty(n_win, np.int64), np.empty(n_win, np.int64), np.empty(n_win, np.int64)
    used = np.zeros(cum.shape[0], np.bool_)
    head = np.full(WINDOW_MAX + 1, -1, np.int64)  # windows by length: stacks in flat arrays
    nw = 0
    donors = np.empty(fr.shape[0], np.int64)
    nd = 0
    ti, dj = 0, n0 - 1
    cur, cq, ca = 0, -1, 0  # long gaps: donor, piece and measurement to take runs from
    while ti <= dj:
        t = order[ti]
        ti += 1
        opened = 0
        while gap[t] >= SMALLEST_BODY and (cap == 0 or nseg[t] < cap):
            g = gap[t]
            wa, wb, ln = -1, -1, 0
            if g > WINDOW_MAX + SMALLEST_BODY and (cap == 0 or nseg[t] < cap - 1):
                # a long gap takes a long run: the next unused run of the opened donors
                while cur < nd and wa < 0:
                    q = cq if cq >= 0 else rfirst[donors[cur]]
                    a = max(ca, ps[q])
                    while a < pe[q] and used[a]:
                        a += 1
                    m = a
                    while m < pe[q] and not used[m] and cum[m + 1] - cum[a] <= g:
                        m += 1
                    while m > a and cum[m] - cum[a] != g and not (
                            g - (cum[m] - cum[a]) >= SMALLEST_BODY and fillable(g - (cum[m] - cum[a]))):
                        m -= 1
                    if m > a:
                        wa, wb, ln = a, m, cum[m] - cum[a]
                        cq, ca = q, m
                    elif a < pe[q] and not used[a] and cum[a + 1] - cum[a] <= g:
                        break  # this run cannot leave a fillable rest here: use windows
                    else:  # the piece is spent: next piece, next donor
                        cq, ca = pnext[q], 0
                        if cq < 0:
                            cur += 1
            if wa < 0:
                wa, wb, ln = _find_window(head, wx, wy, wn, used, g, True,
                                          cap > 0 and nseg[t] == cap - 1)
            if wa < 0 and fillable(g) and opened < DONORS_PER_ROW and ti <= dj and \
                    free[order[dj]]:
                opened += 1  # open the next donor and look again
                d = order[dj]
                dj -= 1
                donors[nd] = d
                nd += 1
                q = rfirst[d]
                while q >= 0:
                    alive[q] = False  # its pieces leave the row: windows or new rows take them
                    for x in range(ps[q], pe[q]):
                        for y in range(x + 1, pe[q] + 1):
                            wl = cum[y] - cum[x]
                            if wl > WINDOW_MAX:
                                break
                            wx[nw], wy[nw], wn[nw] = x, y, head[wl]
                            head[wl] = nw
                            nw += 1
                    q = pnext[q]
                continue
            if wa < 0:  # nothing fills it: the longest window that fits
                wa, wb, ln = _find_window(head, wx, wy, wn, used, g, False, False)
            if wa < 0:
                break
            k = _place(ps, pe, pr, pnext, alive, k, rfirst, rlast, t, wa, wb, cum, used, gap,
                       nseg)
    # what the donors kept, in order, into new rows; a row that cannot take the next
    # measurement is first closed with windows from what is still to come
    r = -1
    for j in range(nd):
        q = rfirst[donors[j]]
        while q >= 0:
            a = ps[q]
            while a < pe[q]:
                if used[a]:
                    a += 1
                    continue
                c = cum[a + 1] - cum[a]
                if r >= 0 and (gap[r] < c or (cap > 0 and nseg[r] >= cap)):
                    while gap[r] >= SMALLEST_BODY and (cap == 0 or nseg[r] < cap):
                        wa, wb, ln = _find_window(head, wx, wy, wn, used, gap[r], True,
                                                  cap > 0 and nseg[r] == cap - 1)
                        if wa < 0:
                            break
                        k = _place(ps, pe, pr, pnext, alive, k, rfirst, rlast, r, wa, wb, cum,
                                   used, gap, nseg)
                    r = -1
                    continue  # the windows may have taken measurement a
                if r < 0:
                    r = n_rows
                    n_rows += 1
                    gap[r], nseg[r], rfirst[r], rlast[r] = row_len, 0, -1, -1
                m = a
                while m < pe[q] and not used[m] and cum[m + 1] - cum[a] <= gap[r]:
                    m += 1
                k = _place(ps, pe, pr, pnext, alive, k, rfirst, rlast, r, a, m, cum, used, gap,
                           nseg)
                a = m
            q = pnext[q]
    return ps, pe, pr, pnext, alive, k, n_rows, gap, nseg, rfirst, rlast


# Step 6: rows of small pieces, pooled by length and laid again by exact subset sums.
@njit(cache=True)
def _subset(cnt, cap, via, used, take):
    """The largest total <= ``cap`` of the pooled pieces (cnt[v] of v tokens), long pieces
    preferred; take[v] = the pieces of v tokens it uses. Bounded subset sum, one pass a
    length, longest first: via[s] = the length that first reached s (-1: not reached),
    used[s] = the pieces of that length on the chain ending at s."""
    via[: cap + 1] = -1
    via[0] = 0
    for v in range(min(cnt.shape[0] - 1, cap), 0, -1):
        if cnt[v] == 0:
            continue
        for s in range(v, cap + 1):
            if via[s] < 0 and via[s - v] >= 0:
                u = used[s - v] + 1 if via[s - v] == v else 1
                if u <= cnt[v]:
                    via[s], used[s] = v, u
    best = cap
    while via[best] < 0:
        best -= 1
    take[:] = 0
    s = best
    while s > 0:
        take[via[s]] += 1
        s -= via[s]
    return best


@njit(cache=True)
def _pool(o_l, o_r, kid, top):
    """The pieces of the rows that step 6 dissolves (kid < 0), by length: cnt[v] of v
    tokens, stack[ptr[v]:ptr[v + 1]] their indices in order. row[j] = the new row of piece j
    (-1 while pooled); seq[:nseq] = the kept pieces in order, the others to come."""
    k = o_l.shape[0]
    cnt = np.zeros(top + 1, np.int64)
    row, seq = np.full(k, -1, np.int64), np.empty(k, np.int64)
    nseq = 0
    for j in range(k):
        if kid[o_r[j]] >= 0:
            row[j] = kid[o_r[j]]
            seq[nseq] = j
            nseq += 1
        else:
            cnt[o_l[j]] += 1
    ptr = np.zeros(top + 2, np.int64)
    for v in range(top + 1):
        ptr[v + 1] = ptr[v] + cnt[v]
    stack = np.empty(k - nseq, np.int64)
    for j in range(k):
        if row[j] < 0:
            stack[ptr[o_l[j]]] = j
            ptr[o_l[j]] += 1
    for v in range(top, 0, -1):  # back to the starts
        ptr[v] = ptr[v - 1]
    ptr[0] = 0
    return cnt, stack, ptr, row, seq, nseq


@njit(cache=True)
def _take(take, cnt, stack, ptr, row, seq, nseq, r):
    """Moves take[v] pooled pieces of v tokens (longest first, lowest index first) to row r,
    in order of arrival (seq); returns the new length of seq."""
    for v in range(take.shape[0] - 1, 0, -1):
        for _ in range(take[v]):
            j = stack[ptr[v]]
            ptr[v] += 1
            row[j] = r
            seq[nseq] = j
            nseq += 1
        cnt[v] -= take[v]
    return nseq


@njit(cache=True)
def _by_row(seq, row, n_rows):
    """The pieces of seq ordered by (row, place in seq): a stable counting sort."""
    pos = np.zeros(n_rows + 1, np.int64)
    for j in seq:
        pos[row[j] + 1] += 1
    for r in range(n_rows):
        pos[r + 1] += pos[r]
    out = np.empty(seq.shape[0], np.int64)
    for j in seq:
        out[pos[row[j]]] = j
        pos[row[j]] += 1
    return out


@njit(cache=True)
def _repack(o_l, o_r, n_rows, row_len):
    """Step 6 on the pieces listed by row: (order of the pieces, their new rows, rows), or an
    empty order when it would save no row. Rows whose pieces are all at most SMALL tokens
    are dissolved; their pieces first fill the other rows' gaps, in row order, then make new
    rows, each the largest subset sum <= row_len of what is left (an exact one is repeated
    while the pool holds it)."""
    top = min(SMALL, row_len)
    fill, big = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int64)
    for j in range(o_l.shape[0]):
        fill[o_r[j]] += o_l[j]
        big[o_r[j]] = max(big[o_r[j]], o_l[j])
    kid = np.full(n_rows, -1, np.int64)  # kept rows, renumbered in order
    n_new = 0
    for r in range(n_rows):
        if big[r] > top:
            kid[r] = n_new
            n_new += 1
    none = np.empty(0, np.int64)
    if n_rows <= (fill.sum() + row_len - 1) // row_len or n_new == n_rows:
        return none, none, n_rows  # at the lower bound already, or nothing to pool
    cnt, stack, ptr, row, seq, nseq = _pool(o_l, o_r, kid, top)
    via, used = np.empty(row_len + 1, np.int64), np.zeros(row_len + 1, np.int64)
    take = np.zeros(top + 1, np.int64)
    low = 1  # the shortest pooled piece
    while cnt[low] == 0:
        low += 1
    for r in range(n_rows):
        if kid[r] >= 0 and row_len - fill[r] >= low and nseq < seq.shape[0]:
            _subset(cnt, row_len - fill[r], via, used, take)
            nseq = _take(take, cnt, stack, ptr, row, seq, nseq, kid[r])
    while nseq < seq.shape[0]:
        reps = 1
        if _subset(cnt, row_len, via, used, take) == row_len:
            reps = seq.shape[0]
            for v in range(1, top + 1):
                if take[v] > 0:
                    reps = min(reps, cnt[v] // take[v])
        for _ in range(reps):
            if n_new >= n_rows - 1:
                return none, none, n_rows  # no row saved
            nseq = _take(take, cnt, stack, ptr, row, seq, nseq, n_new)
            n_new += 1
    order = _by_row(seq, row, n_new)
    return order, row[order], n_new


@njit(cache=True)
def _pack(ctx_start, ctx_end, cum, has_ts, abs_extra, clen, row_len, cap, split):
    n_ctx = ctx_start.shape[0]
    # 2. longest first, by counting sort (stable: equal lengths keep index order)
    pos = np.zeros(row_len + 2, np.int64)
    for c in range(n_ctx):
        pos[clen[c]] += 1
    acc = 0
    for ln in range(row_len, -1, -1):
        acc, pos[ln] = acc + pos[ln], acc
    order = np.empty(n_ctx, np.int64)
    for c in range(n_ctx):
        order[pos[clen[c]]] = c
        pos[clen[c]] += 1

    size = 1
    while size < row_len + 1:
        size *= 2
    tree = np.zeros(2 * size, np.int64)
    head = np.full(row_len + 1, -1, np.int64)
    tail = np.full(row_len + 1, -1, np.int64)
    nxt = np.full(n_ctx, -1, np.int64)
    prv = np.full(n_ctx, -1, np.int64)
    gap = np.zeros(n_ctx, np.int64)
    nseg = np.zeros(n_ctx, np.int64)
    is_open = np.zeros(n_ctx, np.bool_)
    # pieces, in creation order; pnext chains the pieces of one row in slot order
    kcap = n_ctx + n_ctx // 8 + 16
    ps = np.empty(kcap, np.int64)
    pe = np.empty(kcap, np.int64)
    pr = np.empty(kcap, np.int64)
    pnext = np.empty(kcap, np.int64)
    alive = np.ones(kcap, np.bool_)
    rfirst = np.full(n_ctx, -1, np.int64)
    rlast = np.full(n_ctx, -1, np.int64)
    k = 0
    n_rows = 0

    # 3. best-fit decreasing on whole contexts
    for j in range(n_ctx):
        c = order[j]
        ln = clen[c]
        g = _tree_ge(tree, ln)
        if g < 0:
            r = n_rows
            n_rows += 1
            gap[r] = row_len
        else:
            r = head[g]
            _remove(head, tail, nxt, prv, tree, r, g)
        ps[k], pe[k], pr[k], pnext[k] = ctx_start[c], ctx_end[c], r, -1
        if rlast[r] >= 0:
            pnext[rlast[r]] = k
        else:
            rfirst[r] = k
        rlast[r] = k
        k += 1
        gap[r] -= ln
        nseg[r] += 1
        is_open[r] = gap[r] > 0 and (cap == 0 or nseg[r] < cap)
        if is_open[r]:
            _push(head, tail, nxt, prv, tree, r, gap[r])

    if split and n_rows > 1:
        ps, pe, pr, pnext, alive, k, n_rows, gap, nseg, rfirst, rlast = _fill_exact(
            cum, has_ts, abs_extra, row_len, cap, n_rows, gap, nseg, rfirst, rlast, ps, pe, pr,
            pnext, alive, k)

    # 5. renumber the rows that still hold pieces; list pieces by (row, slot)
    new_id = np.full(n_rows, -1, np.int64)
    for q in range(k):
        if alive[q]:
            new_id[pr[q]] = 0
    n_out = 0
    for r in range(n_rows):
        if new_id[r] == 0:
            new_id[r] = n_out
            n_out += 1
    out_n = 0
    for q in range(k):
        if alive[q]:
            out_n += 1
    o_s = np.empty(out_n, np.int64)
    o_e = np.empty(out_n, np.int64)
    o_l = np.empty(out_n, np.int32)
    o_r = np.empty(out_n, np.int64)
    j = 0
    for r in range(n_rows):
        if new_id[r] < 0:
            continue
        q = rfirst[r]
        while q >= 0:
            if alive[q]:
                o_s[j], o_e[j], o_r[j] = ps[q], pe[q], new_id[r]
                o_l[j] = _plen(cum, has_ts, abs_extra, ps[q], pe[q])
                j += 1
            q = pnext[q]
    if split and cap == 0 and n_out > 1:  # 6. repack the rows of small pieces
        order, o_r2, n2 = _repack(o_l, o_r, n_out, row_len)
        if order.shape[0] > 0:
            return o_s[order], o_e[order], o_l[order], o_r2, n2
    return o_s, o_e, o_l, o_r, n_out


def _int32(a, name):
    """``a`` as contiguous int32, without a copy when it is one (the planner's cost and
    abs_extra are); other integer arrays must fit."""
    a = np.ascontiguousarray(a)
    if a.dtype == np.int32:
        return a
    if a.dtype.kind not in "iub" or (len(a) and (a.min() < -2**31 or a.max() >= 2**31)):
        raise ValueError(f"{name} must be integers that fit int32")
    return a.astype(np.int32)


def _as_arrays(ctx_start, ctx_end, cost, has_ts, abs_extra):
    return (np.ascontiguousarray(ctx_start, np.int64), np.ascontiguousarray(ctx_end, np.int64),
            _int32(cost, "cost"), np.ascontiguousarray(has_ts, np.bool_),
            _int32(abs_extra, "abs_extra"))


def pack(ctx_start, ctx_end, cost, has_ts, abs_extra, *, row_len: int = 1024,
         max_segments: int = 0, split: bool = True) -> Packing:
    """Pack contexts [ctx_start[c], ctx_end[c]) into rows of ``row_len`` tokens.

    ``max_segments`` > 0 caps the pieces per row. ``split=False`` keeps every context whole.
    Deterministic: the same arrays give the same Packing.
    """
    arrs = _as_arrays(ctx_start, ctx_end, cost, has_ts, abs_extra)
    s, e, cost_, _, _ = arrs
    if row_len < 1 or max_segments < 0:
        raise ValueError(f"row_len {row_len} and max_segments {max_segments}: need >= 1 and >= 0")
    if len(s) != len(e):
        raise ValueError("ctx_start and ctx_end differ in length")
    if len(s) and (np.any(e <= s) or s.min() < 0 or e.max() > len(cost_)):
        raise ValueError("every context needs 0 <= start < end <= len(cost)")
    if len(cost_) and cost_.min() < 1:
        raise ValueError("every measurement costs at least one token")
    has_ts, abs_extra = arrs[3], arrs[4]  # the rule reads abs_extra only where has_ts
    cum = _cumulative(cost_)
    clen = _lengths(s, e, cum, has_ts, abs_extra)
    if len(clen) and clen.max() > row_len:
        c = int(np.argmax(clen))
        raise ValueError(f"context {c} is {clen[c]} tokens, longer than a row ({row_len})")
    o_s, o_e, o_l, o_r, n_rows = _pack(s, e, cum, has_ts, abs_extra, clen, row_len, max_segments,
                                       split)
    return Packing(o_s, o_e, o_l, o_r, int(n_rows))


def stats(packing: Packing, context_tokens: int, *, row_len: int = 1024) -> dict:
    """Summary figures: rows, tokens, padding, lower bound, pieces cut, segments per row.

    ``context_tokens`` is the total length of the whole contexts; the lower bound is
    ceil(context_tokens / row_len), so tokens added by cuts count against the packer.
    """
    tokens = int(packing.piece_len.sum(dtype=np.int64))
    slots = packing.n_rows * row_len
    segs = np.bincount(packing.piece_row, minlength=packing.n_rows) if packing.n_rows else \
        np.zeros(0, np.int64)
    hist = np.bincount(segs) if len(segs) else np.zeros(0, np.int64)
    return {
        "rows": packing.n_rows,
        "tokens": tokens,
        "padding_fraction": (slots - tokens) / slots if slots else 0.0,
        "lower_bound_rows": -(-int(context_tokens) // row_len),
        "cut_tokens": tokens - int(context_tokens),
        "segments_per_row": {str(i): int(v) for i, v in enumerate(hist) if v},
    }
