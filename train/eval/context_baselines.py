"""Baselines that read exactly what the model reads: each query's earlier measurements in
its own context (the probe's measurements before it in the same row segment).

The queries come in context order (train.eval.evaluate.full_mode_queries), so "earlier in
the context" is "earlier in the same run of queries"; nothing later or outside it is read,
but the train-split fits named below.

- ``context_last``: the last reply (not a failure) to the same destination earlier in the
  context: what a probe's own dashboard would show.
- ``context_ema``: the EMA (alpha 0.3, first value as is) of those replies, in context order.
- ``context_median``: the median of all earlier replies in the context, any destination.
- ``context_vivaldi``: the context's source placed in the train split's Vivaldi space, fit
  to its earlier replies with the destinations' coordinates held fixed, as a new host joins
  a running Vivaldi system (coord_kernels.place_in_contexts); then its distance to the
  query's destination.

Where a baseline has nothing (no earlier reply; for context_vivaldi, none usable yet or a
destination without coordinates) it falls back to the train split's ``pair_median`` →
``dst_median`` → ``global_median``; ``covered`` counts only its own answers. P(failed), the
same for all four: the context's earlier failure rate to that destination, else to any,
else the train split's.

Cost: one Numba pass over the contexts, O(k²) in a context's length k (k <= row length /
12), and the placement's few spring rounds per reply (rates: `make bench`, eval.*).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from train.eval import baselines as B
from train.eval import coord_kernels as K
from train.eval import registry

CONTEXT_BASELINES = registry.names(registry.CONTEXT)  # names, labels, order: train/eval/registry.py
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
    """The pair's train median, else the destination's, else the global median."""
    pair = fitted["pair_median"].predict(src, dst)
    by_dst = fitted["dst_median"].predict(src, dst)  # itself falls back to the global median
    return np.where(pair.covered, pair.rtt_ms, by_dst.rtt_ms)


def predict(ctx, src, dst, rtt, *, fallback: np.ndarray, fail_rate: float,
            vivaldi: B.Vivaldi | None = None) -> dict[str, B.Prediction]:
    """Every context baseline's answers to the queries (ctx: context id per query, runs in
    context order; src, dst: node ids as in the train fits; rtt: the true ms, -1 failed:
    only earlier ones are read). ``fallback``: per query, what an empty answer becomes."""
    starts = context_starts(ctx)
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    rtt = np.asarray(rtt, np.float64)
    last, ema, med, p_fail = _scan(starts, dst, rtt, B.EMA_ALPHA)
    p_fail = np.where(np.isnan(p_fail), fail_rate, p_fail)
    own = {"context_last": last, "context_ema": ema, "context_median": med}
    if vivaldi is not None:
        own["context_vivaldi"] = K.place_in_contexts(
            starts, src, dst, rtt, vivaldi.coords, vivaldi.heights, vivaldi.trained,
            (PLACE_ROUNDS, PLACE_CC, B.VIVALDI_HEIGHT_MIN))
    out = {}
    for name, r in own.items():
        covered = ~np.isnan(r)
        out[name] = B.Prediction(np.where(covered, r, fallback), p_fail.copy(), covered)
    return out


@njit(cache=True)
def _scan(starts, dst, rtt, alpha):
    """Per query from its context's earlier measurements: the last reply to its destination,
    their EMA, the median of all replies, P(failed) (NaN: nothing to say)."""
    n = len(dst)
    last, ema = np.full(n, np.nan), np.full(n, np.nan)
    med, p_fail = np.full(n, np.nan), np.full(n, np.nan)
    buf = np.empty(n)  # the context's replies so far, sorted: buf[a:a + m]
    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        m = fails = 0
        for i in range(a, b):
            n_pair = f_pair = 0
            for j in range(a, i):  # contexts are short (<= row length / 12 measurements)
                if dst[j] != dst[i]:
                    continue
                n_pair += 1
                if rtt[j] < 0:
                    f_pair += 1
                elif np.isnan(last[i]):
                    last[i] = ema[i] = rtt[j]
                else:
                    last[i] = rtt[j]
                    ema[i] = alpha * rtt[j] + (1.0 - alpha) * ema[i]
            if n_pair:
                p_fail[i] = f_pair / n_pair
            elif i > a:
                p_fail[i] = fails / (i - a)
            if m:  # numpy's median: the mean of the two middle values for an even count
                med[i] = 0.5 * (buf[a + (m - 1) // 2] + buf[a + m // 2])
            if rtt[i] < 0:
                fails += 1
                continue
            k = a + m  # insert rtt[i] into the sorted replies
            while k > a and buf[k - 1] > rtt[i]:
                buf[k] = buf[k - 1]
                k -= 1
            buf[k] = rtt[i]
            m += 1
    return last, ema, med, p_fail
