"""`train eval`'s scores of one predictor on the RTT queries (train.eval.evaluate): the whole,
by stratum and by context length, each median relative error with a bootstrap interval.

Strata (``STRATA``, one per query, they partition the queries):

- ``pair_in_context``: an earlier reply to the same destination is in the query's context;
- ``node_known``: otherwise, the source address is in the train split (as a source or a
  destination);
- ``cold``: neither.

The 95 % interval of a median relative error is a percentile bootstrap over ``N_BOOT``
seeded resamples. A resample's median needs no resample: with the n values sorted, a
resample's k-th smallest is the value at index floor(n U_(k)), U_(k) the k-th smallest of
n uniforms, a Beta(k, n - k + 1) draw (the (k+1)-th given the k-th: U_(k) + (1 - U_(k)) ×
Beta(1, n - k)). So each resample costs two draws, not n, and the intervals are those of
resampling the values themselves (tests/test_evaluate.py holds them to it).
"""

from __future__ import annotations

import numpy as np

HISTORY_BUCKETS = ((0, 0), (1, 1), (2, 4), (5, 16), (17, None))  # earlier measurements, inclusive
STRATA = ("pair_in_context", "node_known", "cold")
N_BOOT, CI_LEVEL = 1_000, 0.95
MIN_REPLIES = 1_000  # below this, `train eval` warns that its medians are rough


def strata(pair_in_context: np.ndarray, node_known: np.ndarray) -> np.ndarray:
    """int8 per query: its index in STRATA."""
    return np.where(pair_in_context, 0, np.where(node_known, 1, 2)).astype(np.int8)


def bootstrap_median_ci(x, *, seed: int = 0, n_boot: int = N_BOOT,
                        level: float = CI_LEVEL) -> list[float] | None:
    """[lo, hi]: the percentile bootstrap interval of np.median(x) (None if x is empty)."""
    xs = np.sort(np.asarray(x, np.float64))
    n = len(xs)
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    k = (n + 1) // 2  # numpy's median: order statistic k, or the mean of k and k + 1 (even n)
    u = rng.beta(k, n - k + 1, n_boot)
    med = xs[np.minimum((n * u).astype(np.int64), n - 1)]
    if n % 2 == 0:
        u2 = u + (1.0 - u) * rng.beta(1, n - k, n_boot)
        med = 0.5 * (med + xs[np.minimum((n * u2).astype(np.int64), n - 1)])
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(med, [tail, 1.0 - tail])
    return [float(lo), float(hi)]


def metrics(pred_ms, p_fail, covered, truth_ms, failed, history, stratum, *,
            interval=None, seed: int = 0) -> dict:
    """MAE, median absolute error, median relative error and its interval, p90 relative
    error (queries with a reply); Brier score and precision / recall of P(failed) > 0.5
    (all queries); coverage; with ``interval`` (p10, p90 per query) the share of replies
    inside it. The same by stratum (STRATA) and by HISTORY_BUCKETS."""
    def one(sel):
        ok = sel & ~failed
        err = np.abs(pred_ms[ok] - truth_ms[ok])
        rel = err / np.maximum(truth_ms[ok], 1e-3)
        any_ok = bool(ok.any())
        said = sel & (p_fail > 0.5)
        hit = int((said & failed).sum())
        out = {"n": int(sel.sum()), "n_rtt": int(ok.sum()),
               "mae_ms": float(err.mean()) if any_ok else None,
               "median_ae_ms": float(np.median(err)) if any_ok else None,
               "median_rel": float(np.median(rel)) if any_ok else None,
               "median_rel_ci": bootstrap_median_ci(rel, seed=seed),
               "p90_rel": float(np.quantile(rel, 0.9)) if any_ok else None,
               "brier": float(np.mean((p_fail[sel] - failed[sel]) ** 2)) if sel.any() else None,
               "fail_precision": hit / int(said.sum()) if said.any() else None,
               "fail_recall": hit / int((sel & failed).sum()) if (sel & failed).any() else None,
               "covered": float(covered[sel].mean()) if sel.any() else None}
        if interval is not None:
            lo, hi = interval[0][ok], interval[1][ok]
            out["interval_coverage"] = (float(np.mean((lo <= truth_ms[ok]) & (truth_ms[ok] <= hi)))
                                        if any_ok else None)
        return out

    out = one(np.ones(len(truth_ms), bool))
    out["by_stratum"] = {name: one(stratum == k) for k, name in enumerate(STRATA)}
    top = np.iinfo(np.int64).max
    out["by_history"] = {bucket_name(lo, hi): one((history >= lo) & (history <= (
        top if hi is None else hi))) for lo, hi in HISTORY_BUCKETS}
    return out


def bucket_name(lo, hi) -> str:
    return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"
