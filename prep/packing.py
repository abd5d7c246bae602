"""Offline packing of contexts into fixed-length rows: best-fit decreasing, then splitting.

``pack`` turns contexts (ranges of tokenized measurements) into pieces placed in rows of
``row_len`` tokens. All of it is one Numba pass over integer arrays:

1. Length of every context by the piece length rule (docs/CONTRACTS.md): ``cost[s:e].sum()``
   plus ``abs_extra`` of the first timestamped measurement, O(1) per piece from a
   cumulative cost array and a "next timestamped measurement" index.
2. Order contexts longest first (counting sort; equal lengths by index).
3. Best fit: each context goes to the open row with the smallest gap that holds it, else
   to a new row. Open rows sit in per-gap FIFO lists; a segment tree over gaps 0..row_len
   finds the smallest non-empty gap >= x (or the largest) in O(log row_len). A row
   leaves the lists when it is full or holds ``max_segments`` pieces.
4. Split (``split=True``): dissolve donor rows into the other rows' gaps. Donors come in
   order of fill + the timestamp tokens cutting them could add, so least full and cheapest
   to cut first (a context without timestamps is cut for free). Each donor piece goes, whole
   or as a prefix cut at a measurement boundary, where (waste left in the best-fit gap +
   tokens the cut adds) is least; ties take the longer prefix. A cut piece is encoded as a
   context of its own, so its first timestamp becomes absolute: that is the cut's cost.
   Phase 4 stops at the first donor that does not fit entirely; its rest stays in its row.
5. Rows emptied by step 4 disappear; rows are renumbered in order; pieces are listed by
   (row, slot), slot = order of arrival in the row.

Measured (bench/bench_packing.py and `prep analyze-padding`, 1024-token rows, 2 shared cores):

    data                                   whole-context BFD   this packer   rows / lower bound
    synthetic sparse mix (1-80 meas.)            0.09 %           0.09 %          1.0009
    synthetic busy probes (all ~1010 tok.)       1.21 %           0.45 %          1.0045
    `prep synth` data (busy-dominated)            1.44 %           0.40 %          1.0040
    (same data: pad-to-crop 3.38 %, Grain best-fit with 256 bins 1.79 %)

(bench/bench_packing.py measures the `prep synth` row on the real pipeline: synth 3M rows ->
read_validated -> plan_contexts; 75.6k contexts.) What is left is rows whose context the
tokenizer cut near 1024: gaps under 12 tokens (smaller than any measurement) and odd gaps
(bodies are 12/14/36/38 tokens, so a piece is odd only through its absolute timestamp, i.e.
a cut of a timestamped context costing 4 or 7 tokens). An exact-fill repair (rows give up
tail measurements, gaps filled from an index of exact piece lengths) reached 0.25 % padding
but 1.0046x rows, since those cuts cost about as many tokens as they save; not adopted. Speed: ~1.7M contexts/s (sparse), ~0.6M/s (busy: ~45 measurements each).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(frozen=True)
class Packing:
    piece_start: np.ndarray  # int64[k]: piece j is sorted measurements [start, end)
    piece_end: np.ndarray  # int64[k]
    piece_len: np.ndarray  # int32[k]: tokens, by the piece length rule
    piece_row: np.ndarray  # int64[k]: row of piece j; pieces ordered by (row, slot)
    n_rows: int


GRAIN_WEIGHT = 16  # donor key: weight of tokens per measurement (coarse pieces fit fewer gaps)
PATIENCE = 1000  # step 4 ends after this many donors in a row that could not be dissolved


@njit(cache=True)
def _plen(cum, nts, abs_extra, s, e):
    f = nts[s]
    return cum[e] - cum[s] + (abs_extra[f] if f < e else 0)


@njit(cache=True)
def _prefix_arrays(cost, has_ts):
    n = cost.shape[0]
    cum = np.zeros(n + 1, np.int64)
    for i in range(n):
        cum[i + 1] = cum[i] + cost[i]
    nts = np.empty(n + 1, np.int64)  # first timestamped index >= i (n if none)
    nts[n] = n
    for i in range(n - 1, -1, -1):
        nts[i] = i if has_ts[i] else nts[i + 1]
    return cum, nts


@njit(cache=True)
def _lengths(ctx_start, ctx_end, cum, nts, abs_extra):
    out = np.empty(ctx_start.shape[0], np.int64)
    for c in range(ctx_start.shape[0]):
        out[c] = _plen(cum, nts, abs_extra, ctx_start[c], ctx_end[c])
    return out


def context_lengths(ctx_start, ctx_end, cost, has_ts, abs_extra) -> np.ndarray:
    """Token length of every context (int64), by the piece length rule."""
    s, e, cost, has_ts, abs_extra = _as_arrays(ctx_start, ctx_end, cost, has_ts, abs_extra)
    cum, nts = _prefix_arrays(cost, has_ts)
    return _lengths(s, e, cum, nts, abs_extra)


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
def _tree_max(tree):
    size = tree.shape[0] // 2
    if tree[1] == 0:
        return -1
    i = 1
    while i < size:
        i = 2 * i + 1 if tree[2 * i + 1] > 0 else 2 * i
    return i - size


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
def _pack(ctx_start, ctx_end, cum, nts, abs_extra, clen, row_len, cap, split):
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
        # 4. donors: cheapest to dissolve first: least fill, fewest timestamp tokens a cut
        # could add, finest measurements (small pieces fill small gaps)
        xcum = np.zeros(abs_extra.shape[0] + 1, np.int64)  # abs_extra sums (0 if no timestamp)
        for i in range(abs_extra.shape[0]):
            xcum[i + 1] = xcum[i] + abs_extra[i]
        key = np.empty(n_rows, np.int64)
        for r in range(n_rows):
            fill = row_len - gap[r]
            extra = 0
            n_meas = 0
            q = rfirst[r]
            while q >= 0:  # whole contexts here: their length minus cost is 0, so use cost
                n_meas += pe[q] - ps[q]
                extra += xcum[pe[q]] - xcum[ps[q]]
                q = pnext[q]
            key[r] = fill + extra + GRAIN_WEIGHT * fill // n_meas
        donors = np.argsort(key, kind="mergesort")
        failures = 0
        for d in donors:
            if is_open[d]:
                _remove(head, tail, nxt, prv, tree, d, gap[d])
                is_open[d] = False
            stuck = False
            q = rfirst[d]
            while q >= 0 and not stuck:
                if not alive[q]:
                    q = pnext[q]
                    continue
                p, e = ps[q], pe[q]
                while True:
                    maxg = _tree_max(tree)
                    best_m, best_g, best_score = -1, -1, 1 << 62
                    f = nts[p]
                    whole = _plen(cum, nts, abs_extra, p, e)
                    for m in range(p + 1, e + 1):
                        ln = cum[m] - cum[p] + (abs_extra[f] if f < m else 0)
                        if ln > maxg:
                            break
                        g = _tree_ge(tree, ln)
                        score = g - ln
                        if m < e:
                            score += ln + _plen(cum, nts, abs_extra, m, e) - whole
                        if score <= best_score:
                            best_m, best_g, best_score = m, g, score
                    if best_m < 0:
                        stuck = True
                        break
                    t = head[best_g]
                    _remove(head, tail, nxt, prv, tree, t, best_g)
                    if k == ps.shape[0]:
                        ps, pe, pr = _grow(ps, k + 1), _grow(pe, k + 1), _grow(pr, k + 1)
                        pnext, alive = _grow(pnext, k + 1), _grow(alive, k + 1)
                    ps[k], pe[k], pr[k], pnext[k], alive[k] = p, best_m, t, -1, True
                    pnext[rlast[t]] = k
                    rlast[t] = k
                    k += 1
                    gap[t] -= _plen(cum, nts, abs_extra, p, best_m)
                    nseg[t] += 1
                    is_open[t] = gap[t] > 0 and (cap == 0 or nseg[t] < cap)
                    if is_open[t]:
                        _push(head, tail, nxt, prv, tree, t, gap[t])
                    p = best_m
                    if p == e:
                        alive[q] = False
                        break
                ps[q] = p  # a donor stuck midway keeps its piece's rest in place
                q = pnext[q]
            if not stuck:
                failures = 0
                continue
            # the donor keeps what did not fit and takes pieces again, with its larger gap
            gap[d] = row_len
            nseg[d] = 0
            q = rfirst[d]
            while q >= 0:
                if alive[q]:
                    gap[d] -= _plen(cum, nts, abs_extra, ps[q], pe[q])
                    nseg[d] += 1
                q = pnext[q]
            is_open[d] = gap[d] > 0 and (cap == 0 or nseg[d] < cap)
            if is_open[d]:
                _push(head, tail, nxt, prv, tree, d, gap[d])
            failures += 1
            if failures == PATIENCE:
                break

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
                o_l[j] = _plen(cum, nts, abs_extra, ps[q], pe[q])
                j += 1
            q = pnext[q]
    return o_s, o_e, o_l, o_r, n_out


def _as_arrays(ctx_start, ctx_end, cost, has_ts, abs_extra):
    return (np.ascontiguousarray(ctx_start, np.int64), np.ascontiguousarray(ctx_end, np.int64),
            np.ascontiguousarray(cost, np.int64), np.ascontiguousarray(has_ts, np.bool_),
            np.ascontiguousarray(abs_extra, np.int64))


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
    abs_extra = np.where(arrs[3], arrs[4], 0)  # the rule reads abs_extra only where has_ts
    cum, nts = _prefix_arrays(cost_, arrs[3])
    clen = _lengths(s, e, cum, nts, abs_extra)
    if len(clen) and clen.max() > row_len:
        c = int(np.argmax(clen))
        raise ValueError(f"context {c} is {clen[c]} tokens, longer than a row ({row_len})")
    o_s, o_e, o_l, o_r, n_rows = _pack(s, e, cum, nts, abs_extra, clen, row_len, max_segments,
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
