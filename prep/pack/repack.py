"""Step 6 of the packer (prep.pack.packing): repack the rows of small pieces by exact subset sums.

Rows whose pieces are all at most SMALL tokens are dissolved and their pieces, whole, pooled
by length. They first fill the gaps of the kept rows (in row order), then make new rows,
each the largest subset sum <= row_len of the pool (bounded subset sum over the lengths,
long pieces preferred; an exact row is repeated while the pool holds it). No piece is cut.
The packer takes the result only while rows exceed the lower bound and it saves a row.

This is for single-measurement contexts (RIPE Atlas: mostly 23-token timestamped and
14-token untimestamped pings), which steps 3-4 cannot cut or mix: best fit lays the 23s
first, 44 x 23 = 1012, and no 14 fills the gap of 12; exact mixes exist (36 x 23 +
14 x 14, 22 x 23 + 37 x 14, 8 x 23 + 60 x 14 = 1024).
"""

from __future__ import annotations

import numpy as np

from prep.base.jit import helper, kernel

SMALL = 64  # rows whose pieces are all at most this many tokens are dissolved


@helper
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


@helper
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


@helper
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


@helper
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


@kernel
def repack(o_l, o_r, n_rows, row_len):
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
    n_new = np.int64(0)  # not a literal (prep.pack.fill._fill_rows)
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
