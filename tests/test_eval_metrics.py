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


def _flat(d):
    """model, baseline, diff and the interval's ends, in that order."""
    return [d["model"], d["baseline"], d["diff"], *d["diff_ci"]]


def test_verdict_takes_the_strongest_baseline_per_stratum_and_pairs_the_queries():
    # issue 36, item 8: who wins in each stratum and by how much, on the same queries
    truth = np.full(6, 100.0)
    failed = np.array([False, False, False, False, True, False])
    s = np.array([0, 0, 0, 1, 1, 1], np.int8)  # pair_in_context x3, node_known x3, cold none
    pred = {"model": truth * 1.1,  # 0.1 relative error everywhere
            "model_no_context": truth,  # perfect, but a model: never the bar
            "context_ema": np.array([130.0, 130, 130, 150, 150, 150]),  # 0.3 / 0.5
            "dst_median": np.array([140.0, 140, 140, 105, 105, 105])}  # 0.4 / 0.05
    pf = {"model": np.full(6, 0.1), "model_no_context": np.zeros(6),
          "context_ema": np.full(6, 0.5), "dst_median": np.full(6, 0.2)}
    cov = np.ones(6, bool)
    scores = {k: EM.metrics(pred[k], pf[k], cov, truth, failed, np.zeros(6), s) for k in pred}
    v = EM.verdict(pred, pf, truth, failed, s, scores, ["context_ema", "dst_median"])
    assert list(v) == ["all", "pair_in_context", "node_known", "cold"]
    pic, nk = v["pair_in_context"], v["node_known"]
    assert (pic["baseline"], pic["n"], pic["n_rtt"], pic["winner"]) == (
        "context_ema", 3, 3, "model")
    assert _flat(pic["median_rel"]) == pytest.approx([0.1, 0.3, -0.2, -0.2, -0.2])
    assert _flat(pic["mae_ms"]) == pytest.approx([10.0, 30.0, -20.0, -20.0, -20.0])
    assert _flat(pic["brier"]) == pytest.approx([0.01, 0.25, -0.24, -0.24, -0.24])
    # node_known: dst median is the bar there; 2 replies (one failed), Brier over all 3
    assert (nk["baseline"], nk["n"], nk["n_rtt"], nk["winner"]) == (
        "dst_median", 3, 2, "baseline")
    assert _flat(nk["median_rel"]) == pytest.approx([0.1, 0.05, 0.05, 0.05, 0.05])
    assert nk["brier"]["model"] == pytest.approx((0.01 + 0.81 + 0.01) / 3)
    assert nk["baseline_covered"] == 1.0
    assert v["cold"] == {"n": 0, "n_rtt": 0, "baseline": None}
    assert v["all"]["baseline"] == "context_ema"  # median of 0.3 x3, 0.5 x2 beats 0.4/0.05
    # P(failed)'s bar is the lowest Brier there, not the RTTs': pair_in_context's is the
    # destination median (0.04 against the EMA's 0.25), the model 0.03 below it each query
    f = pic["failures"]
    assert (f["baseline"], f["winner"]) == ("dst_median", "model")
    assert _flat(f["brier"]) == pytest.approx([0.01, 0.04, -0.03, -0.03, -0.03])
    # node_known: the destination median is both bars; its Brier (0.04 + 0.64 + 0.04) / 3
    # below the model's; the failed query's +0.17 against two -0.03s: the interval holds 0
    f = nk["failures"]
    assert (f["baseline"], f["winner"], f["brier"]) == ("dst_median", "neither", nk["brier"])
    assert f["brier"]["baseline"] == pytest.approx(0.72 / 3)
    assert f["brier"]["diff_ci"] == pytest.approx([-0.03, 0.17])
    assert v["all"]["failures"]["baseline"] == "dst_median"  # (5 x 0.04 + 0.64) / 6 < 0.25
    # no ping failed (a latency matrix): the model's P(failed) 1e-21 against a baseline's 0
    # is "better" by an interval of [1e-21, 1e-21]; within BRIER_TIE it is a tie
    ok = np.zeros(6, bool)
    pf0 = {"model": np.full(6, 1e-21), "model_no_context": np.zeros(6),
           "context_ema": np.zeros(6), "dst_median": np.zeros(6)}
    scores0 = {k: EM.metrics(pred[k], pf0[k], cov, truth, ok, np.zeros(6), s) for k in pred}
    f = EM.verdict(pred, pf0, truth, ok, s, scores0, ["context_ema", "dst_median"])["all"]
    assert f["failures"]["winner"] == "neither" and f["failures"]["brier"]["diff_ci"][0] > 0


def test_the_verdict_interval_takes_ten_thousand_resamples_of_whole_sources():
    """The verdict's winner is the side of 0 an interval's end falls on; with 1,000
    resamples of whole sources that end moves with the seed by as much as a close call's
    margin. 60 sources of 20 queries, the model 0.01 better than the baseline on average
    with a source-level spread of 0.1: the verdict's interval is the 10,000-resample one
    (seed 0 for `all`), and its upper end varies over seeds less than 1,000 resamples' do."""
    rng = np.random.default_rng(7)
    groups = np.repeat(np.arange(60), 20)
    truth = np.full(1200, 100.0)
    base = 100.0 * (1.2 + rng.normal(0, 0.1, 60)[groups] + rng.normal(0, 0.05, 1200))
    model = base - 1.0 + 100.0 * rng.normal(0, 0.1, 60)[groups]
    pred = {"model": model, "dst_median": base}
    pf = {"model": np.zeros(1200), "dst_median": np.zeros(1200)}
    failed, s = np.zeros(1200, bool), np.full(1200, 2, np.int8)
    scores = {k: EM.metrics(pred[k], pf[k], np.ones(1200, bool), truth, failed,
                            np.zeros(1200), s) for k in pred}
    v = EM.verdict(pred, pf, truth, failed, s, scores, ["dst_median"], groups=groups)
    rel_m, rel_b = np.abs(model - truth) / truth, np.abs(base - truth) / truth
    assert EM.VERDICT_N_BOOT == 10_000
    want = EM.paired_bootstrap_ci(rel_m, rel_b, seed=0, n_boot=10_000, groups=groups)
    assert v["all"]["median_rel"]["diff_ci"] == want
    assert v["cold"]["median_rel"]["diff_ci"] == EM.paired_bootstrap_ci(
        rel_m, rel_b, seed=3, n_boot=10_000, groups=groups)
    assert want != EM.paired_bootstrap_ci(rel_m, rel_b, seed=0, groups=groups)

    def spread(n_boot):
        his = [EM.paired_bootstrap_ci(rel_m, rel_b, seed=k, n_boot=n_boot, groups=groups)[1]
               for k in range(8)]
        return max(his) - min(his)
    assert spread(10_000) < spread(1_000) / 2


def test_the_paired_interval_is_that_of_the_difference():
    # b is a plus noise-free 0.5: every paired resample differs by exactly 0.5, where two
    # independent resamples of a would spread over most of its range
    a = np.random.default_rng(1).exponential(size=501)
    assert EM.paired_bootstrap_ci(a + 0.5, a, np.median) == pytest.approx([0.5, 0.5])
    assert EM.paired_bootstrap_ci(a + 0.5, a, np.mean) == pytest.approx([0.5, 0.5])
    lo, hi = EM.paired_bootstrap_ci(a, np.zeros(501), np.median, seed=3)
    assert lo < np.median(a) < hi
    assert EM.paired_bootstrap_ci([], [], np.median) is None


def test_multiset_medians_are_those_of_the_repeated_values():
    rng = np.random.default_rng(5)
    xs = np.sort(rng.lognormal(size=40))
    w = rng.integers(0, 4, (300, 40))
    w[:, 7] += 1  # no empty multiset
    got = EM._multiset_medians(xs, w)
    want = [np.median(np.repeat(xs, row)) for row in w]
    assert got == pytest.approx(want, rel=0, abs=0)
    # one value once, and two values once each (the mean of the middle two)
    assert EM._multiset_medians(np.array([1.0, 2.0, 9.0]), np.array([[0, 1, 0], [1, 0, 1]])
                                ).tolist() == [2.0, 5.0]


def test_grouped_interval_resamples_whole_groups():
    # 10 probes of 100 queries each, every query of probe g at exactly g: resampling single
    # queries sees 1,000 independent values and pins the median to 4 or 5 (the middle
    # two probes); resampling probes sees 10 and spreads it over the probes' range
    x = np.repeat(np.arange(10.0), 100)
    g = np.repeat(np.arange(10), 100)
    lo, hi = EM.bootstrap_median_ci(x, seed=0)
    assert 4.0 <= lo <= hi <= 5.0
    glo, ghi = EM.bootstrap_median_ci(x, seed=0, groups=g)
    assert glo <= 2.5 and ghi >= 6.5
    # each value its own group: the same interval as resampling the values, within noise
    y = np.random.default_rng(2).lognormal(0.0, 1.0, 301)
    want_lo, want_hi = _resampled_ci(y, 4_000, 1)
    lo, hi = EM.bootstrap_median_ci(y, seed=0, n_boot=4_000, groups=np.arange(301))
    spread = want_hi - want_lo
    assert abs(lo - want_lo) < 0.1 * spread and abs(hi - want_hi) < 0.1 * spread
    # one group: every resample is the whole sample
    assert EM.bootstrap_median_ci(y, groups=np.zeros(301)) == [np.median(y)] * 2


def test_grouped_paired_interval():
    # model and baseline differ by +1 on probe 0's 500 queries and by -1 on probe 1's 5:
    # query by query the model is surely worse (every resample's median diff is +1 ...);
    # probe by probe, half the resamples hold only probe 1 or both, so the sign is open
    a = np.r_[np.full(500, 2.0), np.full(5, 0.0)]
    b = np.ones(505)
    g = np.r_[np.zeros(500, int), np.ones(5, int)]
    assert EM.paired_bootstrap_ci(a, b, np.median) == [1.0, 1.0]
    assert EM.paired_bootstrap_ci(a, b, np.median, groups=g) == [-1.0, 1.0]
    lo, hi = EM.paired_bootstrap_ci(a, b, np.mean, groups=g)
    assert (lo, hi) == (pytest.approx(-1.0), pytest.approx(1.0))
    # a shift is a shift whatever the groups
    c = np.random.default_rng(1).exponential(size=505)
    assert EM.paired_bootstrap_ci(c + 0.5, c, np.median, groups=g) == pytest.approx([0.5, 0.5])
    assert EM.paired_bootstrap_ci(c + 0.5, c, np.mean, groups=g) == pytest.approx([0.5, 0.5])


def test_fail_prior_line_says_each_part_of_the_rule():
    from train.eval.report import fail_prior_line
    fp = {"pair": 4.0, "context": 32.0, "dead": 0.05, "dead_rate": 0.95, "live": 0.1,
          "rate": 0.18, "dst_shrink": 20.0, "broken": (0.0, 0.02)}
    assert fail_prior_line(fp) == (
        "P(failed) of the context baselines: the context's failures to the destination over "
        "4 pseudo-pings of a live pair's rate 0.1; or the pair is dead (fails at 0.95), prior "
        "0.05, weighed by its pings' likelihood; else the context's failures to any over 32 "
        "of the train split's rate 0.180 (beta priors fit on the train split's contexts); the "
        "rate, P(dead) and the live rate each destination's, from its train pairs shrunk over "
        "20 pairs toward all destinations'; where every earlier ping of the query's family "
        "failed, the probe's family broken (IPv4 prior 0, IPv6 0.02) against each failing on "
        "its own")
    # a report from before 2026-12-02 (no family term): the line as it was
    old = {k: v for k, v in fp.items() if k != "broken"}
    assert fail_prior_line(old) == fail_prior_line(fp | {"broken": [0.0, 0.0]})
    assert "broken" not in fail_prior_line(old)
