"""train.eval.metrics: strata on a hand-built split, the bootstrap interval (against
resampling the values, and covering a planted median), calibration and failure scores."""

import numpy as np
import pytest

from train.eval import metrics as EM


def test_strata_partition_on_a_hand_built_split():
    # 7 queries: an earlier reply to the same destination wins over a known source
    pair = np.array([1, 1, 0, 0, 0, 1, 0], bool)
    known = np.array([1, 0, 1, 1, 0, 0, 0], bool)
    s = EM.strata(pair, known)
    assert s.tolist() == [0, 0, 1, 1, 2, 0, 2]
    truth = np.array([10.0, 20.0, -1.0, 40.0, 50.0, 60.0, 70.0])
    failed = truth < 0
    pred = truth * 1.1
    m = EM.metrics(pred, np.zeros(7), np.ones(7, bool), truth, failed, np.arange(7), s)
    by = m["by_stratum"]
    assert [by[k]["n"] for k in EM.STRATA] == [3, 2, 2]
    assert [by[k]["n_rtt"] for k in EM.STRATA] == [3, 1, 2]
    assert sum(by[k]["n"] for k in EM.STRATA) == m["n"] == 7
    assert by["node_known"]["median_rel"] == pytest.approx(0.1)


def _resampled_ci(x, n_boot, seed):
    rng = np.random.default_rng(seed)
    med = np.median(x[rng.integers(0, len(x), (n_boot, len(x)))], axis=1)
    return np.quantile(med, [0.025, 0.975])


@pytest.mark.parametrize("n", [301, 300])  # odd: one middle value; even: the mean of two
def test_bootstrap_matches_resampling_the_values(n):
    x = np.random.default_rng(n).lognormal(0.0, 1.0, n)
    lo, hi = EM.bootstrap_median_ci(x, seed=0, n_boot=20_000)
    want_lo, want_hi = _resampled_ci(x, 20_000, 1)
    spread = want_hi - want_lo
    assert abs(lo - want_lo) < 0.05 * spread and abs(hi - want_hi) < 0.05 * spread


def test_bootstrap_interval_covers_the_true_median():
    # lognormal(0, 1) has median exactly 1; 2,001 seeded draws
    x = np.random.default_rng(0).lognormal(0.0, 1.0, 2001)
    lo, hi = EM.bootstrap_median_ci(x, seed=0)
    assert lo < 1.0 < hi and hi - lo < 0.2
    # and about 95 % of such intervals do (300 samples: 0.95 +- 0.03 at 2.5 sigma)
    covers = [lo < 1.0 < hi for lo, hi in (EM.bootstrap_median_ci(
        np.random.default_rng(s).lognormal(0.0, 1.0, 501), seed=s) for s in range(1, 301))]
    assert 0.92 <= np.mean(covers) <= 0.98
    assert EM.bootstrap_median_ci(x, seed=0) == [lo, hi]  # seeded
    assert EM.bootstrap_median_ci([], seed=0) is None
    assert EM.bootstrap_median_ci([3.0], seed=0) == [3.0, 3.0]


def test_interval_coverage_and_failure_scores():
    truth = np.array([10.0, 20.0, 30.0, 40.0, -1.0, -1.0])
    failed = truth < 0
    p10 = np.array([5.0, 21.0, 30.0, 0.0, np.nan, np.nan])
    p90 = np.array([15.0, 25.0, 30.0, 39.0, np.nan, np.nan])
    p_fail = np.array([0.9, 0.1, 0.2, 0.6, 0.7, 0.4])
    m = EM.metrics(truth.clip(0), p_fail, np.ones(6, bool), truth, failed, np.zeros(6),
                   np.zeros(6, np.int8), interval=(p10, p90))
    assert m["interval_coverage"] == 0.5  # 10 in [5, 15], 30 in [30, 30]; 20 and 40 out
    # P(failed) > 0.5 says "failed" for queries 0, 3, 4: one of them failed; one of two found
    assert (m["fail_precision"], m["fail_recall"]) == (pytest.approx(1 / 3), 0.5)
    none = EM.metrics(truth.clip(0), np.zeros(6), np.ones(6, bool), truth, failed,
                      np.zeros(6), np.zeros(6, np.int8))
    assert none["fail_precision"] is None and none["fail_recall"] == 0.0
    assert "interval_coverage" not in none
