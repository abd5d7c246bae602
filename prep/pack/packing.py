"""Offline packing of contexts into fixed-length rows: best-fit decreasing, splitting, repacking.

``pack`` turns contexts (ranges of tokenized measurements) into pieces placed in rows of
``row_len`` tokens, by Numba kernels over integer arrays (``_pack`` calls them in turn):

1. Length of every context by the piece length rule (prep.tokens.costs), from a cumulative
   cost array: the only array as long as the measurements, since fresh memory costs more
   in page faults than the loops over it.
2. Order contexts longest first (counting sort; equal lengths by index).
3. Best fit: each context goes to the open row with the smallest gap that holds it, else to
   a new row. Open rows sit in per-gap FIFO lists; a segment tree over gaps 0..row_len finds
   the smallest non-empty gap >= x in O(log row_len). A row leaves the lists when it is
   full or holds ``max_segments`` pieces.
4. Fill (``split=True``): untimestamped rows are cut into windows that fill the other rows'
   gaps exactly (prep.pack.fill). Timestamped contexts are never cut, so no token is added.
5. Rows emptied by step 4 disappear; rows are renumbered in order; pieces are listed by
   (row, slot), slot = order of arrival in the row.
6. Repack (``split=True``, no ``max_segments``): rows of small whole pieces are re-laid by
   subset sums, kept only if that saves a row (prep.pack.repack).

The planner (prep.pack.planner_kernels.cut_contexts) helps: a context the row length ends
gives back up to BACKOFF measurements until its gap is ``fillable``. The padding achieved,
against the lower bound ceil(tokens / row_len) and other strategies, is what ``make bench``
prints (bench/bench_packing.py; README, "What it measures").
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import numpy as np

from prep.base.jit import helper, kernel
from prep.pack.closing import (
    P_END,
    P_LEN,
    P_NEXT,
    P_ROW,
    P_START,
    R_FIRST,
    R_GAP,
    R_LAST,
    R_NSEG,
)
from prep.pack.fill import fill_gaps
from prep.pack.repack import repack  # (see the docstring)


@dataclass(frozen=True)
class Packing:
    piece_start: np.ndarray  # int64[k]: piece j is sorted measurements [start, end)
    piece_end: np.ndarray  # int64[k]
    piece_len: np.ndarray  # int32[k]: tokens, by the piece length rule
    piece_row: np.ndarray  # int64[k]: row of piece j; pieces ordered by (row, slot)
    n_rows: int


@helper
def _plen(cum, has_ts, abs_extra, s, e):
    """Tokens of piece [s, e): its costs plus abs_extra of its first timestamped measurement
    (a scan of has_ts, which stops at once in a timestamped context)."""
    for i in range(s, e):
        if has_ts[i]:
            return cum[e] - cum[s] + abs_extra[i]
    return cum[e] - cum[s]


@kernel
def _cumulative(cost):
    """cum[i] = cost[:i].sum(): the one array as long as the measurements that packing makes
    (a fresh array costs more in page faults than a loop over it)."""
    n = cost.shape[0]
    cum = np.empty(n + 1, np.int64)
    cum[0] = 0
    for i in range(n):
        cum[i + 1] = cum[i] + cost[i]
    return cum


@kernel
def _lengths(ctx_start, ctx_end, cum, has_ts, abs_extra):
    out = np.empty(ctx_start.shape[0], np.int64)
    for c in range(ctx_start.shape[0]):
        out[c] = _plen(cum, has_ts, abs_extra, ctx_start[c], ctx_end[c])
    return out


def context_lengths(ctx_start, ctx_end, cost, has_ts, abs_extra) -> np.ndarray:
    """Token length of every context (int64), by the piece length rule."""
    s, e, cost, has_ts, abs_extra = _as_arrays(ctx_start, ctx_end, cost, has_ts, abs_extra)
    return _lengths(s, e, _cumulative(cost), has_ts, abs_extra)


# Step 3's open rows, bucketed by gap: per-gap doubly linked FIFO lists (head[g], tail[g];
# nxt[r], prv[r]) plus a segment tree whose leaves count the rows in each bucket.
OpenRows = namedtuple("OpenRows", "head tail nxt prv tree")  # inlined: see prep.pack.fill


@helper(inline=True)  # called with literals 1 and -1
def _tree_add(tree, leaf, d):
    i = leaf + tree.shape[0] // 2
    while i >= 1:
        tree[i] += d
        i >>= 1


@helper
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


@helper(inline=True)
def _push(op, r, g):
    op.nxt[r] = -1
    op.prv[r] = op.tail[g]
    if op.tail[g] >= 0:
        op.nxt[op.tail[g]] = r
    else:
        op.head[g] = r
    op.tail[g] = r
    _tree_add(op.tree, g, 1)


@helper(inline=True)
def _remove(op, r, g):
    if op.prv[r] >= 0:
        op.nxt[op.prv[r]] = op.nxt[r]
    else:
        op.head[g] = op.nxt[r]
    if op.nxt[r] >= 0:
        op.prv[op.nxt[r]] = op.prv[r]
    else:
        op.tail[g] = op.prv[r]
    _tree_add(op.tree, g, -1)


@kernel
def _longest_first(clen, row_len):
    """Step 2: the contexts longest first, by counting sort (stable: equal lengths keep
    index order)."""
    n_ctx = clen.shape[0]
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
    return order


@kernel
def _best_fit(ctx_start, ctx_end, clen, order, row_len, cap):
    """Step 3: best fit of whole contexts, in ``order``: (pieces, rows, k pieces, n_rows).
    The piece arrays have room for step 4 to start; a row holds at most ``cap`` pieces
    (0: no cap)."""
    n_ctx = ctx_start.shape[0]
    size = 1
    while size < row_len + 1:
        size *= 2
    op = OpenRows(np.full(row_len + 1, -1, np.int64), np.full(row_len + 1, -1, np.int64),
                  np.full(n_ctx, -1, np.int64), np.full(n_ctx, -1, np.int64),
                  np.zeros(2 * size, np.int64))
    head, tree = op.head, op.tree
    rows = np.empty((n_ctx, R_LAST + 1), np.int64)  # columns: prep.pack.closing
    for r in range(n_ctx):
        rows[r, R_GAP], rows[r, R_NSEG], rows[r, R_FIRST], rows[r, R_LAST] = 0, 0, -1, -1
    # pieces, in creation order; P_NEXT chains the pieces of one row in slot order
    p = np.empty((n_ctx + n_ctx // 8 + 16, P_LEN + 1), np.int64)
    k = 0
    n_rows = 0
    for j in range(n_ctx):
        c = order[j]
        ln = clen[c]
        g = _tree_ge(tree, ln)
        if g < 0:
            r = n_rows
            n_rows += 1
            rows[r, R_GAP] = row_len
        else:
            r = head[g]
            _remove(op, r, g)
        p[k, P_START], p[k, P_END], p[k, P_ROW], p[k, P_NEXT] = ctx_start[c], ctx_end[c], r, -1
        p[k, P_LEN] = ln
        if rows[r, R_LAST] >= 0:
            p[rows[r, R_LAST], P_NEXT] = k
        else:
            rows[r, R_FIRST] = k
        rows[r, R_LAST] = k
        k += 1
        rows[r, R_GAP] -= ln
        rows[r, R_NSEG] += 1
        if rows[r, R_GAP] > 0 and (cap == 0 or rows[r, R_NSEG] < cap):  # still open
            _push(op, r, rows[r, R_GAP])
    return p, rows, k, n_rows


@kernel
def _renumber(p, rows, k, n_rows):
    """Step 5: the rows that still hold pieces, renumbered in order, and their pieces by
    (row, slot): (start, end, tokens, row of each, rows)."""
    new_id = np.full(n_rows, -1, np.int64)
    for q in range(k):
        if p[q, P_ROW] >= 0:
            new_id[p[q, P_ROW]] = 0
    n_out = 0
    for r in range(n_rows):
        if new_id[r] == 0:
            new_id[r] = n_out
            n_out += 1
    out_n = 0
    for q in range(k):
        if p[q, P_ROW] >= 0:
            out_n += 1
    o_s = np.empty(out_n, np.int64)
    o_e = np.empty(out_n, np.int64)
    o_l = np.empty(out_n, np.int32)
    o_r = np.empty(out_n, np.int64)
    j = 0
    for r in range(n_rows):
        if new_id[r] < 0:
            continue
        q = rows[r, R_FIRST]
        while q >= 0:
            if p[q, P_ROW] >= 0:
                o_s[j], o_e[j], o_r[j] = p[q, P_START], p[q, P_END], new_id[r]
                o_l[j] = p[q, P_LEN]
                j += 1
            q = p[q, P_NEXT]
    return o_s, o_e, o_l, o_r, n_out


def _pack(ctx_start, ctx_end, cum, has_ts, abs_extra, clen, row_len, cap, split):
    """Steps 2-6, each a kernel called from Python: Numba optimizes and compiles a kernel
    again inside every kernel that calls it, so one kernel over all steps cost a first run
    twice the compile time of its parts (the steps take microseconds to call)."""
    order = _longest_first(clen, row_len)  # 2.
    p, rows, k, n_rows = _best_fit(ctx_start, ctx_end, clen, order, row_len, cap)  # 3.
    if split and n_rows > 1:  # 4.
        p, rows, k, n_rows = fill_gaps(cum, has_ts, abs_extra, ctx_start, ctx_end, order, row_len,
                                       cap, p, rows, k, n_rows)
    o_s, o_e, o_l, o_r, n_out = _renumber(p, rows, k, n_rows)  # 5.
    if split and cap == 0 and n_out > 1:  # 6. repack the rows of small pieces
        order, o_r2, n2 = repack(o_l, o_r, n_out, row_len)
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
