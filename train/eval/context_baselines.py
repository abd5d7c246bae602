"""Baselines that read exactly what the model reads: each query's earlier measurements in
its own context (the probe's before it in the same row segment), in context order
(train.eval.evaluate.full_mode_queries); nothing later or outside it, but the train-split
fits named below.

- ``context_last``: the last reply (not a failure) to the same destination earlier in the
  context; ``context_ema``: their EMA (alpha 0.3, first value as is), in context order;
  ``context_median``: the median of all earlier replies in the context, any destination.
- ``context_vivaldi``: the source placed in the train split's Vivaldi space by its earlier
  replies, the destinations' coordinates held fixed, as a new host joins a running Vivaldi
  system (coord_kernels.place_in_contexts); then its distance to the query's destination.
- ``context_knn``: the source placed among the train split's sources instead: the
  ``KNN_K`` with a reply to the query's destination whose pair medians are nearest (mean
  |log ratio|) to the context's replies to other destinations; the median (in log space)
  of their pair medians to the query's destination.
- ``context_krig``: placed by the destinations' covariance (kriging): each train pair
  median's log ratio to its destination's median of them, covariances over the sources
  that reached both destinations (shrunk, KRIG_SHRINK); the query's ratio is the Gaussian
  mean given the context's replies (a reply's noise: the train replies' about their pairs).

Where a baseline has nothing (no earlier reply; for the placements, none usable yet) it
falls back to the train split's ``pair_mode`` (its point at the band the train split picks,
the median where that is better) → ``dst_median`` → ``global_median``;
``covered`` counts only its own answers. P(failed), the same for all: the context's earlier
failures to that destination, shrunk toward its failures to any destination (or a live
pair's rate), shrunk toward the train split's rate (each as a beta prior of so many
pseudo-pings: (failed + s prior) / (pings + s)); and the pair may be dead (failing on
nearly every ping: a firewalled target, a broken family) with a prior probability, weighed
against the beta by its pings' likelihood (``FailPrior``). The priors are those of the grids
below that score best (Brier) on the train split's own contexts (``fit_fail_prior``); with
none, the plain shares (the rule until 2026-12-01, which a pair seen to fail on 1 ping of 1
gave 1); the dead-or-live mixture since 2026-12-02 (docs/learning.md section 8.30); each
destination's priors (section 8.32); and where every earlier ping of the query's family in
its context failed, the probe's family broken (all its pings fail, e.g. IPv6 without a
route) weighed against each of those pings failing on its own (``family_chain``,
FailPrior.broken; section 8.33). Cost:
Numba passes, O(k²) in a context's length k (k <= row length / 12); rates: `make bench`,
eval.*.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from train.eval import baselines as B
from train.eval import coord_kernels as K
from train.eval import registry
# the rule and its grids are the model's too (ModelConfig.context_fail_anchor)
from train.model.failprior import (  # noqa: F401 (the grids: this module's names too)
    DEAD_PRIORS, DEAD_RATES, FAIL_STRENGTHS, FIT_SAMPLE, LIVE_RATES, FailPrior, broken_shares,
    dst_offsets, fail_shares, fit_broken, fit_counts, pair_counts)
from train.model.store import KRIG_SHRINK, pairs_in_runs

CONTEXT_BASELINES = registry.names(registry.CONTEXT)  # names, labels, order: train/eval/registry.py
_FLOOR = B.RTT_FLOOR_MS
KNN_K = 5  # neighbours whose pair medians context_knn's answer is the median of
# placement: spring rounds over the replies so far after each new one, and the timestep
# (a fixed node's error is ~0 next to a new node's 1, so the paper's c_c * w is c_c)
PLACE_ROUNDS, PLACE_CC = 4, 0.25


def context_starts(ctx: np.ndarray) -> np.ndarray:
    """Where each run of equal context ids starts, and the end: int64[n_contexts + 1]."""
    ctx = np.asarray(ctx)
    if not len(ctx):
        return np.zeros(1, np.int64)
    return np.append(np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]]), len(ctx)).astype(np.int64)


def fallback_chain(fitted: dict, src, dst) -> np.ndarray:
    """The pair's train point (pair_mode: its band point, or its median where the train
    split prefers that), else the destination's median, else the global median."""
    pair = fitted["pair_mode"].predict(src, dst)
    by_dst = fitted["dst_median"].predict(src, dst)  # itself falls back to the global median
    return np.where(pair.covered, pair.rtt_ms, by_dst.rtt_ms)


def knn_table(pair_median: B.PairTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """context_knn's view of the train split: per destination (``ptr[d]:ptr[d + 1]``), the
    sources with a pair median RTT to it, by id, and the log of those medians."""
    n = pair_median.n_nodes
    own = ~np.isnan(pair_median.rtt_ms)
    keys, rtt = pair_median.keys[own], pair_median.rtt_ms[own]
    src, dst = keys // n, keys % n
    o = np.lexsort((src, dst))
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=ptr[1:])
    return ptr, src[o].astype(np.int64), np.log(np.maximum(rtt[o], B.RTT_FLOOR_MS))


def krig_table(pair_median: B.PairTable, src, dst, rtt) -> tuple:
    """context_krig's view of the train split (its measurements: node ids, ms, -1 failed):
    (per node its destination median of log pair medians, NaN: none; the covariance's
    sorted keys d * n + e and values, its diagonal being the residuals' variance; a
    reply's noise variance about its pair's log median)."""
    n = pair_median.n_nodes
    own = ~np.isnan(pair_median.rtt_ms)
    keys, logm = pair_median.keys[own], np.log(np.maximum(pair_median.rtt_ms[own], _FLOOR))
    p_src, p_dst = keys // n, keys % n
    level = np.full(n, np.nan)
    o = np.lexsort((logm, p_dst))
    d_sorted, starts = p_dst[o], np.flatnonzero(np.r_[True, np.diff(p_dst[o]) != 0])
    counts = np.diff(np.r_[starts, len(o)])
    lo, hi = starts + (counts - 1) // 2, starts + counts // 2
    level[d_sorted[starts]] = 0.5 * (logm[o][lo] + logm[o][hi])
    resid = logm - level[p_dst]
    # every ordered pair of destinations one source reached: its residuals' product
    o = np.argsort(p_src, kind="stable")
    s_dst, s_res = p_dst[o], resid[o]
    first, second = pairs_in_runs(p_src[o])
    pair_key = s_dst[first] * n + s_dst[second]
    ukeys, inv = np.unique(pair_key, return_inverse=True)
    total = np.bincount(inv, s_res[first] * s_res[second], len(ukeys))
    shared = np.bincount(inv, minlength=len(ukeys)).astype(np.float64)
    diag = ukeys // n == ukeys % n
    cov = np.where(diag, total / shared, total / (shared + KRIG_SHRINK))
    ok = (np.asarray(src) >= 0) & (np.asarray(rtt) >= 0)
    t_src, t_dst = np.asarray(src)[ok], np.asarray(dst)[ok]
    t_log = np.log(np.maximum(np.asarray(rtt, np.float64)[ok], _FLOOR))
    pair = pair_median.predict(t_src, t_dst)
    dev = t_log - np.log(np.maximum(pair.rtt_ms, _FLOOR))
    noise = float(np.mean(dev[pair.covered] ** 2)) if pair.covered.any() else 0.0
    return level, ukeys.astype(np.int64), cov, max(noise, 1e-6)


def predict(ctx, src, dst, rtt, *, fallback: np.ndarray, fail_rate: float,
            fail_prior: FailPrior = FailPrior(), fail_dst: np.ndarray | None = None,
            family: np.ndarray | None = None,
            vivaldi: B.Vivaldi | None = None,
            knn: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
            krig: tuple | None = None) -> dict[str, B.Prediction]:
    """Every context baseline's answers to the queries (ctx: context id per query, runs in
    context order; src, dst: node ids as in the train fits; rtt: the true ms, -1 failed:
    only earlier ones are read). ``fallback``: per query, what an empty answer becomes;
    ``vivaldi``, ``knn`` (``knn_table``), ``krig`` (``krig_table``): context_vivaldi's,
    context_knn's and context_krig's train fits. ``fail_prior``: P(failed)'s priors
    (``fit_fail_prior``; the default: the plain shares); ``fail_dst``: each destination's
    offsets to them (``fail_offsets``, float[3, nodes]; None: one prior for all);
    ``family`` (4/6 per query): where each earlier ping of the query's family in its
    context failed, the family may be broken (FailPrior.broken; None: never)."""
    starts = context_starts(ctx)
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    rtt = np.asarray(rtt, np.float64)
    last, ema, med = _scan(starts, dst, rtt, B.EMA_ALPHA)
    p_fail = fail_shares(fail_counts(starts, dst, rtt < 0), fail_rate, fail_prior,
                         None if fail_dst is None else fail_dst[:, dst])
    if family is not None and any(fail_prior.broken):
        p_fail = broken_shares(p_fail, family, *family_chain(starts, family, rtt < 0, p_fail),
                               fail_prior.broken)
    own = {"context_last": last, "context_ema": ema, "context_median": med}
    if vivaldi is not None:
        own["context_vivaldi"] = K.place_in_contexts(
            starts, src, dst, rtt, vivaldi.coords, vivaldi.heights, vivaldi.trained,
            (PLACE_ROUNDS, PLACE_CC, B.VIVALDI_HEIGHT_MIN))
    if knn is not None:
        own["context_knn"] = _knn(starts, dst, rtt, *knn, KNN_K)
    if krig is not None:
        own["context_krig"] = _krig(starts, dst, rtt, *krig)
    out = {}
    for name, r in own.items():
        covered = ~np.isnan(r)
        out[name] = B.Prediction(np.where(covered, r, fallback), p_fail.copy(), covered)
    return out


def fail_counts(starts, dst, failed) -> np.ndarray:
    """float64[4, n]: per query (contexts from ``starts``, context_starts'), how many of its
    context's earlier measurements to its destination failed and how many there are, then
    the same over every destination."""
    return _fail_counts(np.asarray(starts, np.int64), np.asarray(dst, np.int64),
                        np.asarray(failed, np.bool_))


@njit(cache=True)
def _fail_counts(starts, dst, failed):
    out = np.zeros((4, len(dst)))
    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        for i in range(a, b):
            for j in range(a, i):
                out[2, i] += failed[j]
                out[3, i] += 1.0
                if dst[j] == dst[i]:
                    out[0, i] += failed[j]
                    out[1, i] += 1.0
    return out


def fail_offsets(src, dst, failed, n_nodes: int) -> np.ndarray:
    """float32[3, n_nodes]: each destination's offsets to P(failed)'s priors from the train
    split's measurements (node ids; train.model.failprior.dst_offsets over their pairs)."""
    return dst_offsets(*pair_counts(src, dst, failed), n_nodes)


def fit_fail_prior(ctx, dst, failed, rate: float, seed: int = 0,
                   family: np.ndarray | None = None) -> FailPrior:
    """The FailPrior whose fail_shares score the lowest Brier on measurements in contexts of
    their own (the train split's: ``ctx`` a context id per measurement, in context order),
    over those with an earlier one (train.model.failprior.fit_counts on their fail_counts);
    with ``family`` (4/6 per measurement), then its ``broken`` priors (fit_broken on those
    whose context's earlier pings of their family all failed)."""
    starts = context_starts(ctx)
    counts = fail_counts(starts, dst, failed)
    prior = fit_counts(counts, failed, rate, seed)
    if family is None:
        return prior
    p = fail_shares(counts, rate, prior)
    n_fam, loglik = family_chain(starts, family, failed, p)
    return prior._replace(broken=fit_broken(p, family, n_fam, loglik, failed))


def family_chain(starts, family, failed, p) -> tuple[np.ndarray, np.ndarray]:
    """(n_fam, loglik) per query (contexts from ``starts``): where every one of its
    context's earlier measurements of its family (4/6) failed, how many there are and the
    sum of the logs of their P(failed) ``p`` (the likelihood that they failed each on its
    own, by the chain rule); 0 and 0 where one replied or there is none
    (train.model.failprior.broken_shares)."""
    return _family_chain(np.asarray(starts, np.int64), np.asarray(family, np.int64),
                         np.asarray(failed, np.bool_), np.asarray(p, np.float64))


@njit(cache=True)
def _family_chain(starts, family, failed, p):
    n_fam, loglik = np.zeros(len(family)), np.zeros(len(family))
    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        for fam in (4, 6):
            k, ll, ok = 0.0, 0.0, True
            for i in range(a, b):
                if family[i] != fam:
                    continue
                if ok and k > 0:
                    n_fam[i], loglik[i] = k, ll
                if failed[i]:
                    k += 1.0
                    ll += np.log(max(p[i], 1e-12))
                else:
                    ok = False
    return n_fam, loglik


@njit(cache=True)
def _scan(starts, dst, rtt, alpha):
    """Per query from its context's earlier measurements: the last reply to its destination,
    their EMA, the median of all replies (NaN: nothing to say)."""
    n = len(dst)
    last, ema = np.full(n, np.nan), np.full(n, np.nan)
    med = np.full(n, np.nan)
    buf = np.empty(n)  # the context's replies so far, sorted: buf[a:a + m]
    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        m = 0
        for i in range(a, b):
            for j in range(a, i):  # contexts are short (<= row length / 12 measurements)
                if dst[j] != dst[i] or rtt[j] < 0:
                    continue
                if np.isnan(last[i]):
                    last[i] = ema[i] = rtt[j]
                else:
                    last[i] = rtt[j]
                    ema[i] = alpha * rtt[j] + (1.0 - alpha) * ema[i]
            if m:  # numpy's median: the mean of the two middle values for an even count
                med[i] = 0.5 * (buf[a + (m - 1) // 2] + buf[a + m // 2])
            if rtt[i] < 0:
                continue
            k = a + m  # insert rtt[i] into the sorted replies
            while k > a and buf[k - 1] > rtt[i]:
                buf[k] = buf[k - 1]
                k -= 1
            buf[k] = rtt[i]
            m += 1
    return last, ema, med


@njit(cache=True)
def _knn(starts, dst, rtt, ptr, col_src, col_log, k):
    """context_knn per query (NaN: no train source with a reply to its destination shares
    a destination with the context's earlier replies to others)."""
    n, n_nodes = len(dst), len(ptr) - 1
    out = np.full(n, np.nan)
    stamp = np.full(n_nodes, -1, np.int64)  # stamp[s] == i: s is a candidate of query i
    dist, shared = np.zeros(n_nodes), np.zeros(n_nodes, np.int64)
    best_d, best_v = np.empty(k), np.empty(k)
    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        for i in range(a, b):
            d = dst[i]
            if d < 0 or d >= n_nodes or ptr[d] == ptr[d + 1]:
                continue
            for t in range(ptr[d], ptr[d + 1]):
                s = col_src[t]
                stamp[s], dist[s], shared[s] = i, 0.0, 0
            for j in range(a, i):  # each other destination once: the mean log of its replies
                e = dst[j]
                if e == d or e < 0 or e >= n_nodes or rtt[j] < 0:
                    continue
                first, total, m = True, 0.0, 0
                for jj in range(a, i):
                    if dst[jj] == e and rtt[jj] >= 0:
                        if jj < j:
                            first = False
                            break
                        total += np.log(max(rtt[jj], _FLOOR))
                        m += 1
                if not first:
                    continue
                v = total / m
                for t in range(ptr[e], ptr[e + 1]):
                    s = col_src[t]
                    if stamp[s] == i:
                        dist[s] += abs(v - col_log[t])
                        shared[s] += 1
            got = 0  # the k nearest, kept sorted by distance (ties: the lower source id)
            for t in range(ptr[d], ptr[d + 1]):
                s = col_src[t]
                if shared[s] == 0:
                    continue
                x = dist[s] / shared[s]
                if got == k and x >= best_d[k - 1]:
                    continue
                q = got if got < k else k - 1
                while q > 0 and best_d[q - 1] > x:
                    best_d[q], best_v[q] = best_d[q - 1], best_v[q - 1]
                    q -= 1
                best_d[q], best_v[q] = x, col_log[t]
                if got < k:
                    got += 1
            if got:
                v = np.sort(best_v[:got])
                out[i] = np.exp(0.5 * (v[(got - 1) // 2] + v[got // 2]))
    return out


@njit(cache=True)
def _cov(keys, vals, n, d, e):
    """The covariance of destinations d and e (0 where no source reached both)."""
    k = d * n + e
    pos = np.searchsorted(keys, k)
    return vals[pos] if pos < len(keys) and keys[pos] == k else 0.0


@njit(cache=True)
def _krig(starts, dst, rtt, level, keys, vals, noise):
    """context_krig per query (NaN: its destination has no train level, or the context no
    earlier reply to a destination with one). Along a context the inverse of the replied
    destinations' covariance (plus each one's noise over its reply count) is kept up to
    date, a new destination by bordering it and one more reply by Sherman-Morrison, so a
    query costs O(m²) in its m destinations. A shrunk pairwise covariance need not be
    positive semidefinite, and where it is not, the matrix with the replies' noise can come
    near singular and its inverse send a query's answer anywhere (1e17 ms seen on rows of
    1,024). Where the covariance is PSD, a new destination's Schur complement is at least its
    noise, and one more reply shrinks its noise by a rank-one update whose denominator is at
    least 1/2; so a destination whose bordering falls below the one is not read, and a
    reply whose update falls below the other keeps its destination's noise where it was
    (its mean still counts it)."""
    n, n_nodes = len(dst), len(level)
    out = np.full(n, np.nan)
    cap = 1
    for c in range(len(starts) - 1):
        cap = max(cap, starts[c + 1] - starts[c])
    es, tot, cnt = np.empty(cap, np.int64), np.empty(cap), np.empty(cap)
    ncnt = np.empty(cap)  # the replies each destination's noise term is over: noise / ncnt
    inv, u, r = np.empty((cap, cap)), np.empty(cap), np.empty(cap)
    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        m = 0  # destinations read so far: es[:m], their sums of logs and counts, inv[:m, :m]
        for i in range(a, b):
            d = dst[i]
            if m and d >= 0 and d < n_nodes and not np.isnan(level[d]):
                for p in range(m):
                    r[p] = tot[p] / cnt[p] - level[es[p]]
                x = 0.0
                for p in range(m):
                    w = 0.0
                    for q in range(m):
                        w += inv[p, q] * r[q]
                    x += _cov(keys, vals, n_nodes, d, es[p]) * w
                out[i] = np.exp(level[d] + x)
            e = dst[i]  # then this reply, if any, joins what later queries read
            if e < 0 or e >= n_nodes or rtt[i] < 0 or np.isnan(level[e]):
                continue
            v = np.log(max(rtt[i], _FLOOR))
            p = 0
            while p < m and es[p] != e:
                p += 1
            if p < m:  # one more reply: its noise noise / k becomes noise / (k + 1)
                tot[p] += v
                cnt[p] += 1.0
                delta = noise / (ncnt[p] + 1.0) - noise / ncnt[p]
                for q in range(m):
                    u[q] = inv[q, p]
                den = 1.0 + delta * u[p]
                if den < 0.5 - 1e-9:  # not PSD along this destination: keep its noise
                    continue
                for q in range(m):
                    for t in range(m):
                        inv[q, t] -= delta * u[q] * u[t] / den
                ncnt[p] += 1.0
                continue
            s = _cov(keys, vals, n_nodes, e, e) + noise  # a new destination: border inv
            for q in range(m):
                acc = 0.0
                for t in range(m):
                    acc += inv[q, t] * _cov(keys, vals, n_nodes, es[t], e)
                u[q] = acc
                s -= _cov(keys, vals, n_nodes, es[q], e) * acc
            if s < noise * (1.0 - 1e-9):  # not PSD with it: it is not read
                continue
            for q in range(m):
                for t in range(m):
                    inv[q, t] += u[q] * u[t] / s
                inv[q, m] = inv[m, q] = -u[q] / s
            inv[m, m] = 1.0 / s
            es[m], tot[m], cnt[m], ncnt[m] = e, v, 1.0, 1.0
            m += 1
    return out
