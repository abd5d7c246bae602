"""Context baselines: exact answers on hand-built contexts, the fallback chain and
``covered``, new-node placement in a planted plane, nearest train sources, their cost."""

import time

import numpy as np
import pytest

from train.eval import baselines
from train.eval import context_baselines as C

F = -1.0  # a failed ping
# Two contexts (ids 7 and 9) of one source (node 0); node 1 and 2 are destinations.
CTX = [7, 7, 7, 7, 7, 7, 9, 9, 9, 9]
DST = [1, 2, 1, 1, 2, 1, 1, 1, 1, 2]
RTT = [10.0, 50.0, F, 20.0, 60.0, 30.0, 25.0, 25.0, 25.0, 5.0]
FALLBACK = 1000.0 + np.arange(len(CTX))  # one value per query: which ones fell back is visible
RATE = 0.25  # the train split's failure rate


@pytest.fixture(scope="module")
def answers():
    return C.predict(CTX, np.zeros(len(CTX), np.int64), DST, RTT, fallback=FALLBACK,
                     fail_rate=RATE)


def test_context_last_ema_median_exact(answers):
    last, ema, med = (answers[k] for k in ("context_last", "context_ema", "context_median"))
    # context 7: dst 1 replies 10, (failed), 20 before q5; dst 2 replied 50 before q4.
    # context 9: dst 1 repeats at 25 ms: last, EMA and median are exactly 25; nothing of
    # context 7 leaks into it (its q6 falls back, though node 0 pinged node 1 before).
    assert last.rtt_ms.tolist() == [1000, 1001, 10, 10, 50, 20, 1006, 25, 25, 1009]
    assert ema.rtt_ms.tolist() == [1000, 1001, 10, 10, 50, pytest.approx(0.3 * 20 + 0.7 * 10),
                                   1006, 25, 25, 1009]
    # every earlier reply of the context, any destination: {10}, {10, 50}, {10, 50},
    # {10, 50, 20}, {10, 50, 20, 60}; context 9: {25}, {25, 25}, {25, 25, 25}
    assert med.rtt_ms.tolist() == [1000, 10, 30, 30, 20, 35, 1006, 25, 25, 25]
    assert last.covered.tolist() == [False, False, True, True, True, True,
                                     False, True, True, False]
    assert ema.covered.tolist() == last.covered.tolist()
    assert med.covered.tolist() == [False] + [True] * 5 + [False] + [True] * 3


def test_p_failed_by_destination_then_context_then_train(answers):
    # q3: dst 1 had 10 and a failure: 1/2; q5: 1 of 3; q1: no dst-2 history, the
    # context's 0 of 1; q0 and q6: nothing earlier in their context: the train rate
    want = [RATE, 0.0, 0.0, 0.5, 0.0, 1 / 3, RATE, 0.0, 0.0, 0.0]
    for name in ("context_last", "context_ema", "context_median"):
        assert answers[name].p_fail.tolist() == pytest.approx(want)


def test_p_failed_shrunk_toward_the_context_then_the_train_rate():
    """fail_prior (s_p, s_c) = (2, 4): the context's share (f + 4 RATE) / (n + 4), the
    pair's (f + 2 that) / (n + 2). q5: dst 1 failed 1 of 3, the context 1 of 5; q3: 1 of 2,
    1 of 3; q1: no dst-2 ping, the context's 0 of 1; q0, q6: the train rate."""
    got = C.predict(CTX, np.zeros(len(CTX), np.int64), DST, RTT, fallback=FALLBACK,
                    fail_rate=RATE, fail_prior=C.FailPrior(2.0, 4.0))["context_last"].p_fail
    ctx = lambda f, n: (f + 4 * RATE) / (n + 4)
    pair = lambda f, n, c: (f + 2 * c) / (n + 2)
    want = [RATE, ctx(0, 1), pair(0, 1, ctx(0, 2)), pair(1, 2, ctx(1, 3)),
            pair(0, 1, ctx(1, 4)), pair(1, 3, ctx(1, 5)), RATE, pair(0, 1, ctx(0, 1)),
            pair(0, 2, ctx(0, 2)), ctx(0, 3)]
    assert got.tolist() == pytest.approx(want)
    assert got[5] == pytest.approx((1 + 2 * 2 / 9) / 5)  # (1 + 4 x 0.25) / 9 = 2 / 9 first


def test_a_pair_dead_or_live_weighed_by_its_pings():
    """FailPrior with dead: a pair dead (fails at 0.95) with prior 0.1, else live with a
    Beta(2 x 0.1, 2 x 0.9) prior; P(dead | f of n) by the likelihoods (the beta-binomial's
    by hand, from Gamma functions), P(failed) = w 0.95 + (1 - w) (f + 0.2) / (n + 2). A
    pair that failed on all 3 of its pings is likely dead (0.89 against the beta's 0.64),
    one reply makes it live (0.95 x 0.05 against a live pair's odds); no ping: the
    context's share, as without the mixture."""
    from math import exp, lgamma, log
    fp = C.FailPrior(2.0, 4.0, dead=0.1, dead_rate=0.95, live=0.1)
    f, n = np.array([3.0, 2.0, 0.0, 0.0]), np.array([3.0, 3.0, 5.0, 0.0])
    counts = np.stack([f, n, np.array([3.0, 2.0, 1.0, 2.0]), np.array([4.0, 6.0, 9.0, 8.0])])
    got = C.fail_shares(counts, RATE, fp)

    def by_hand(f, n):
        a, b = 0.2, 1.8
        live = (lgamma(f + a) + lgamma(n - f + b) - lgamma(n + a + b) - lgamma(a) - lgamma(b)
                + lgamma(a + b))
        dead = f * log(0.95) + (n - f) * log(0.05)
        w = 1 / (1 + exp(live - dead - log(0.1 / 0.9)))
        return w * 0.95 + (1 - w) * (f + a) / (n + 2)
    want = [by_hand(3, 3), by_hand(2, 3), by_hand(0, 5), (2 + 4 * RATE) / (8 + 4)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)
    assert got[0] == pytest.approx(0.8918, abs=1e-4) and (3 + 0.2) / 5 == 0.64
    assert got[2] == pytest.approx(0.2 / 7, rel=1e-3)  # five replies: live, its beta alone
    # no dead prior: the beta alone, the context's share its mean where live is None
    beta = C.fail_shares(counts, RATE, C.FailPrior(2.0, 4.0))
    assert beta[0] == pytest.approx((3 + 2 * (3 + 4 * RATE) / 8) / 5)


def test_destination_priors_from_its_train_pairs():
    """fail_offsets: per destination, from its train (source, destination) pairs, each pair
    once: the rate they fail at, the share of those with >= 3 pings that failed on >= 90 %
    (dead) and the others' mean rate, each shrunk toward all destinations' over 20 pairs;
    logit offsets from all destinations'. Planted: destination 1 has 4 pairs, two dead
    (3 of 3 failed, 4 of 4), two live (1 of 4, 0 of 4); destination 2 two live pairs (0 of
    3, 1 of 3); destination 3 none."""
    from math import log
    src, dst, failed = [], [], []
    for s_, d_, f_, n_ in ((0, 1, 3, 3), (1, 1, 4, 4), (2, 1, 1, 4), (3, 1, 0, 4),
                           (0, 2, 0, 3), (1, 2, 1, 3)):
        src += [s_] * n_
        dst += [d_] * n_
        failed += [True] * f_ + [False] * (n_ - f_)
    off = C.fail_offsets(np.array(src), np.array(dst), np.array(failed), 4)
    lg = lambda p: log(p / (1 - p))
    shares = [1.0, 1.0, 0.25, 0.0, 0.0, 1 / 3]
    g = (sum(shares) / 6, 2 / 6, (0.25 + 0 + 0 + 1 / 3) / 4)
    own = lambda s, n, k: (s + 20 * g[k]) / (n + 20)
    want = [[0.0, lg(own(2.25, 4, 0)) - lg(g[0]), lg(own(1 / 3, 2, 0)) - lg(g[0]), 0.0],
            [0.0, lg(own(2, 4, 1)) - lg(g[1]), lg(own(0, 2, 1)) - lg(g[1]), 0.0],
            [0.0, lg(own(0.25, 2, 2)) - lg(g[2]), lg(own(1 / 3, 2, 2)) - lg(g[2]), 0.0]]
    np.testing.assert_allclose(off, want, rtol=1e-6, atol=1e-7)
    assert off[1, 1] > 0.1 and off[1, 2] < -0.1  # more dead pairs at 1, none at 2
    # the rule with them: its rate, P(dead) and live rate moved by the destination's
    fp = C.FailPrior(2.0, 4.0, dead=0.1, dead_rate=0.95, live=0.1)
    counts = np.array([[0.0, 3.0], [0.0, 3.0], [1.0, 0.0], [4.0, 2.0]])
    o = off[:, [2, 1]]
    got = C.fail_shares(counts, RATE, fp, o)
    sig = lambda z: 1 / (1 + np.exp(-z))
    r = sig(lg(RATE) + o[0, 0])
    assert got[0] == pytest.approx((1 + 4 * r) / (4 + 4), rel=1e-6)  # (o is float32)
    moved = C.FailPrior(2.0, 4.0, dead=float(sig(lg(0.1) + o[1, 1])), dead_rate=0.95,
                        live=float(sig(lg(0.1) + o[2, 1])))
    assert got[1] == pytest.approx(C.fail_shares(counts[:, 1:], RATE, moved)[0], rel=1e-6)
    assert got[1] > C.fail_shares(counts[:, 1:], RATE, fp)[0] + 0.005  # more dead pairs at 1


def test_fail_prior_fit_on_contexts_of_their_own():
    """Planted: 400 contexts of 8 pings to one destination each; half fail every time, half
    never, so a pair's own pings say all and the weakest priors win; contexts whose
    destinations fail at random (p = 0.3, independent) want the strongest, at that rate;
    none earlier: the plain shares. Pairs that are dead (one in five; failing at 0.98) or live at a
    Beta(1, 9) rate: the mixture, its dead rate and live mean where they were planted."""
    n = 400
    ctx, dst = np.repeat(np.arange(n), 8), np.repeat(np.arange(n), 8)
    sticky = np.repeat(np.arange(n) % 2 == 0, 8)
    assert C.fit_fail_prior(ctx, dst, sticky, 0.5)[:2] == (0.5, 0.5)
    rng = np.random.default_rng(0)
    noisy = rng.random(len(ctx)) < 0.3
    fp = C.fit_fail_prior(ctx, dst, noisy, 0.3)  # (a small dead share: 3,200 pings' noise)
    assert fp[:2] == (32.0, 32.0) and fp.live == 0.3 and fp.dead <= 0.02
    assert C.fit_fail_prior(np.arange(5), np.zeros(5, np.int64), np.ones(5, bool),
                            0.2) == C.FailPrior()
    # contexts that never ping a destination twice: the context's prior alone is fit
    fp = C.fit_fail_prior(np.repeat(np.arange(50), 4), np.arange(200), noisy[:200], 0.3)
    assert fp.dead == 0.0 and fp.context == 32.0 and fp.live is None
    n = 4000
    ctx, dst = np.repeat(np.arange(n), 8), np.repeat(np.arange(n), 8)
    p = np.where(rng.random(n) < 0.2, 0.98, rng.beta(1.0, 9.0, n))
    planted = rng.random(len(ctx)) < np.repeat(p, 8)
    fp = C.fit_fail_prior(ctx, dst, planted, planted.mean())
    assert fp == C.FailPrior(8.0, 32.0, dead=0.2, dead_rate=0.98, live=0.1)


def test_fallback_chain_pair_then_dst_then_global():
    # train: (0, 1) 10 and 30 ms; (2, 1) 100 ms; (0, 3) 7 ms; node 4 never a destination
    src, dst = np.array([0, 0, 2, 0]), np.array([1, 1, 1, 3])
    rtt = np.array([10.0, 30.0, 100.0, 7.0])
    fitted = baselines.fit_all(src, dst, rtt, np.zeros(4, np.int64), np.zeros(4, bool), n_nodes=5)
    got = C.fallback_chain(fitted, np.array([0, 3, 3]), np.array([1, 1, 4]))
    # (0, 1): the pair's median 20; (3, 1): unseen pair, dst 1's median of 10, 30, 100 = 30;
    # (3, 4): nothing of dst 4: the global median of 7, 10, 30, 100 = 20
    assert got.tolist() == [20.0, 30.0, 20.0]
    # the pair's point is pair_mode's: (0, 1) with 10 replies (untimed: input order) whose
    # latest two (70, 10) the earliest eight's mode (10: off by 0.857, 0) predicts better
    # than their median (20: 0.714, 1.0); the chain gives its mode, not its median (20)
    rtt = np.array([10.0, 10.0, 10.0, 10.0, 30.0, 40.0, 50.0, 60.0, 70.0, 10.0, 100.0, 7.0])
    src, dst = np.r_[np.zeros(10, int), 2, 0], np.r_[np.ones(10, int), 1, 3]
    fitted = baselines.fit_all(src, dst, rtt, np.zeros(12, np.int64), np.zeros(12, bool),
                               n_nodes=5)
    assert fitted["pair_mode"].band == 0.0
    assert fitted["pair_median"].predict(np.array([0]), np.array([1])).rtt_ms.tolist() == [20.0]
    assert C.fallback_chain(fitted, np.array([0, 3]), np.array([1, 1])).tolist() == [10.0, 30.0]


def _plane(seed=4, n=40, held=5):
    """Nodes in a 100 x 100 ms plane; a Vivaldi space fit on every pair of the first n - held."""
    rng = np.random.default_rng(seed)
    points = rng.uniform(0, 100, (n, 2))
    k = n - held
    src, dst = np.array([(i, j) for i in range(k) for j in range(k) if i != j]).T
    dist = np.linalg.norm(points[src] - points[dst], axis=1)
    model = baselines.fit("vivaldi", src, dst, dist, np.zeros(len(src), np.int64),
                          np.zeros(len(src), bool), n_nodes=n, seed=0)
    return rng, points, k, model


def test_new_node_placement_recovers_a_held_out_node():
    rng, points, k, viv = _plane()
    ctx, q_src, q_dst = [], [], []
    for node in range(k, len(points)):  # each held-out node: one context of 25 pings
        ctx += [node] * 25
        q_src += [node] * 25
        q_dst += rng.choice(k, 25, replace=False).tolist()
    ctx, q_src, q_dst = map(np.array, (ctx, q_src, q_dst))
    truth = np.linalg.norm(points[q_src] - points[q_dst], axis=1)
    got = C.predict(ctx, q_src, q_dst, truth, fallback=np.full(len(ctx), -5.0), fail_rate=0.0,
                    vivaldi=viv)["context_vivaldi"]
    first = np.r_[True, ctx[1:] != ctx[:-1]]
    assert got.covered.tolist() == (~first).tolist()  # all but each context's first query
    assert (got.rtt_ms[first] == -5.0).all()
    index = np.arange(len(ctx)) % 25
    placed = index >= 5  # after 5 replies the node is placed: its distances to the others
    rel = np.abs(got.rtt_ms[placed] - truth[placed]) / truth[placed]
    assert np.median(rel) < 0.05 and np.quantile(rel, 0.9) < 0.10
    # the train-fit Vivaldi cannot answer for a node it never saw
    assert not viv.predict(q_src, q_dst).covered.any()


def test_placement_skips_failures_and_nodes_without_coordinates():
    rng, points, k, viv = _plane()
    node = k  # held out; its only replies are a failure and one to another held-out node
    got = C.predict([0, 0, 0], [node] * 3, [1, k + 1, 2], [F, 30.0, 40.0],
                    fallback=np.array([1.0, 2.0, 3.0]), fail_rate=0.0, vivaldi=viv)
    assert got["context_vivaldi"].rtt_ms.tolist() == [1.0, 2.0, 3.0]
    assert not got["context_vivaldi"].covered.any()


def _knn_world():
    """Train pair medians: sources 0-6 to node 10 at 10, 20, ... 70 ms and to node 11 at
    100, 200, ... 700 ms; sources 0 and 1 to node 12 at 5 and 6 ms (two pings each, so the
    median is the pair's own)."""
    src = np.repeat(np.r_[np.arange(7), np.arange(7), 0, 1], 2)
    dst = np.repeat(np.r_[[10] * 7, [11] * 7, 12, 12], 2)
    rtt = np.repeat(np.r_[10.0 * np.arange(1, 8), 100.0 * np.arange(1, 8), 5.0, 6.0], 2)
    rtt[::2] -= 1.0  # each pair: value - 1 and value, so its median is value - 0.5
    pm = baselines.fit("pair_median", src, dst, rtt, np.zeros(len(src), np.int64),
                       np.zeros(len(src), bool), n_nodes=21)
    return C.knn_table(pm)


def test_knn_reads_the_nearest_train_sources_on_the_contexts_other_destinations():
    table = _knn_world()
    # one context of new node 20: q0 to 10 (47.5 ms), q1 a failure to 11, q2 to 11,
    # q3 to 12, q4 to 11 again; then a second context that pinged 10 twice (39.5, 59.5)
    ctx = [3, 3, 3, 3, 3, 4, 4, 4]
    dst = [10, 11, 11, 12, 11, 10, 10, 11]
    rtt = [47.5, F, 999.5, 1.0, 2.0, 39.5, 59.5, 7.0]
    got = C.predict(ctx, [20] * 8, dst, rtt, fallback=-np.arange(1.0, 9.0), fail_rate=0.0,
                    knn=table)["context_knn"]
    # q1 (its truth a failure; the baselines answer it as any query) and q2: nearest on
    # node 10 to 47.5 ms (|log ratio|): 49.5, 39.5, 59.5, 69.5, 29.5 (sources 4, 3, 5, 6,
    # 2; 19.5 and 9.5 are the two left out): their medians to node 11
    # are 499.5, 399.5, 599.5, 699.5, 299.5, and the middle one is 499.5. q2 reads no
    # failure (q1) nor its own destination; q0 has no other destination yet.
    # q3 (node 12): only sources 0 and 1 answer; with nodes 10 and 11 read, the median
    # (in log space) of 4.5 and 5.5. q4 (node 11) reads node 12 too, which only sources 0
    # and 1 share: their mean distances over two nodes (1.56, 1.30) still leave them out.
    # context 4: q5 and q6 have no other destination; q7 reads node 10's two replies as
    # one, their mean log (48.47 ms): the same five
    assert got.rtt_ms[[0, 5, 6]].tolist() == [-1.0, -6.0, -7.0]
    assert got.rtt_ms[[1, 2, 3, 4, 7]] == pytest.approx(
        [499.5, 499.5, np.sqrt(4.5 * 5.5), 499.5, 499.5], rel=1e-12)
    assert got.covered.tolist() == [False, True, True, True, True, False, False, True]


def test_knn_has_no_answer_without_a_shared_destination():
    table = _knn_world()
    # replies only to nodes no train source has pinged (15) or outside the id space (-1)
    got = C.predict([0, 0, 0], [20] * 3, [15, -1, 11], [30.0, 40.0, 50.0],
                    fallback=np.array([1.0, 2.0, 3.0]), fail_rate=0.0, knn=table)
    assert got["context_knn"].rtt_ms.tolist() == [1.0, 2.0, 3.0]


def _krig_world():
    """Train: sources 0-2 ping node 10 at 10 ms times e^-0.2, 1, e^0.2 and node 11 at 100 ms
    times e^-0.4, 1, e^0.4, each pair twice, at its value times e^-0.1 and e^0.1 (the pair's
    median: the value times cosh 0.1); source 3 pings node 12 alone."""
    v10, v11 = 10.0 * np.exp([-0.2, 0.0, 0.2]), 100.0 * np.exp([-0.4, 0.0, 0.4])
    src = np.repeat(np.r_[0, 1, 2, 0, 1, 2, 3], 2)
    dst = np.repeat(np.r_[10, 10, 10, 11, 11, 11, 12], 2)
    rtt = np.repeat(np.r_[v10, v11, 7.0], 2) * np.tile(np.exp([-0.1, 0.1]), 7)
    pm = baselines.fit("pair_median", src, dst, rtt, np.zeros(len(src), np.int64),
                       np.zeros(len(src), bool), n_nodes=21)
    return C.krig_table(pm, src, dst, rtt)


def test_krig_table_holds_levels_covariances_and_the_reply_noise():
    level, keys, cov, noise = _krig_world()
    c = np.log(np.cosh(0.1))  # each pair median's log sits c above its value's
    assert level[[10, 11, 12]] == pytest.approx([np.log(10) + c, np.log(100) + c, np.log(7) + c])
    assert np.isnan(level[[0, 13]]).all()
    got = dict(zip((keys // 21 * 100 + keys % 21).tolist(), cov.tolist()))
    # residuals -0.2, 0, 0.2 and -0.4, 0, 0.4: variances over 3 sources, the covariance
    # shrunk to 3 / (3 + KRIG_SHRINK); node 12 has one source and no residual
    c01 = 0.16 / (3 + C.KRIG_SHRINK)
    assert got == pytest.approx({1010: 0.08 / 3, 1111: 0.32 / 3, 1212: 0.0, 1011: c01, 1110: c01})
    assert noise == pytest.approx(0.01 + c * c)  # replies at +-0.1 about log value, c below


def test_krig_does_not_read_a_destination_that_breaks_the_covariance():
    """A shrunk pairwise covariance need not be PSD: here nodes 10, 11 and 12 (variance 0.1
    each; 0.099 between 10 and both others, 0.07 between 11 and 12) have a negative
    eigenvalue. Bordering node 12 leaves a Schur complement below its noise, so node 12 is
    not read, and the answers are kriging's from 10 and 11 alone (before this guard, node
    10's answer was 0.54 ms where its level is 10 and the context says 13.5)."""
    n, noise = 21, 0.01
    level = np.full(n, np.nan)
    level[[10, 11, 12, 13]] = np.log([10.0, 20.0, 30.0, 40.0])
    cov = {(10, 10): 0.1, (11, 11): 0.1, (12, 12): 0.1, (13, 13): 0.1, (10, 11): 0.099,
           (10, 12): 0.099, (11, 12): 0.07, (10, 13): 0.05, (11, 13): 0.05, (12, 13): 0.05}
    cov |= {(e, d): v for (d, e), v in cov.items()}
    keys = np.array(sorted(d * n + e for d, e in cov))
    vals = np.array([cov[(k // n, k % n)] for k in keys])
    assert np.linalg.eigvalsh([[0.1, 0.099, 0.099], [0.099, 0.1, 0.07],
                               [0.099, 0.07, 0.1]])[0] < 0
    dst = [10, 11, 12, 10, 13]
    rtt = [10 * np.exp(0.3), 20 * np.exp(-0.2), 30 * np.exp(0.1), 10 * np.exp(0.3), 50.0]
    got = C.predict([0] * 5, [20] * 5, dst, rtt, fallback=-np.ones(5), fail_rate=0.0,
                    krig=(level, keys, vals, noise))["context_krig"]
    r = np.array([0.3, -0.2])  # 10's and 11's residuals; 12's is never read
    S = np.array([[0.1, 0.099], [0.099, 0.1]])
    q3 = 10 * np.exp(np.array([0.1, 0.099]) @ np.linalg.solve(S + noise * np.eye(2), r))
    q4 = 40 * np.exp(np.array([0.05, 0.05]) @ np.linalg.solve(S + np.diag([noise / 2, noise]), r))
    assert got.rtt_ms[[3, 4]] == pytest.approx([q3, q4], rel=1e-9)


def test_krig_conditions_the_query_destination_on_the_contexts_replies():
    level, keys, cov, noise = _krig_world()
    c01, v10 = 0.16 / (3 + C.KRIG_SHRINK), 0.08 / 3
    # context 0: a reply to node 10 at its level times e^0.3, a failure to 10, then node
    # 11 (q2), node 15 (no level: no answer, q3), node 11 again after a second reply to 10
    # at e^0.1; context 1: 11 first (q6)
    lv10 = np.exp(level[10])
    ctx = [0, 0, 0, 0, 0, 0, 1]
    dst = [10, 10, 11, 15, 10, 11, 11]
    rtt = [lv10 * np.exp(0.3), F, 50.0, 60.0, lv10 * np.exp(0.1), 70.0, 80.0]
    got = C.predict(ctx, [20] * 7, dst, rtt, fallback=-np.arange(1.0, 8.0), fail_rate=0.0,
                    krig=(level, keys, cov, noise))["context_krig"]
    q2 = np.exp(level[11] + c01 * 0.3 / (v10 + noise))
    # q5: node 10's two replies (mean residual 0.2, noise halved) and q2's own reply to 11
    v11, r11 = 0.32 / 3, np.log(50.0) - level[11]
    w = np.linalg.solve([[v10 + noise / 2, c01], [c01, v11 + noise]], [0.2, r11])
    q5 = np.exp(level[11] + c01 * w[0] + v11 * w[1])
    # q1 reads q0's reply to its own destination: the residual shrunk by the noise
    q1 = np.exp(level[10] + v10 * 0.3 / (v10 + noise))
    assert got.rtt_ms[[1, 2, 5]] == pytest.approx([q1, q2, q5], rel=1e-12)
    assert got.rtt_ms[[0, 3, 6]].tolist() == [-1.0, -4.0, -7.0]
    assert got.covered.tolist() == [False, True, True, False, True, True, False]


def test_cost_of_a_few_hundred_thousand_queries():
    rng, points, k, viv = _plane()
    n, per = 300_000, 40
    ctx = np.arange(n) // per
    q_src = k + ctx % (len(points) - k)
    q_dst = rng.integers(0, k, n)
    rtt = np.where(rng.random(n) < 0.1, F, rng.uniform(1, 200, n))
    # the train split for context_knn: every pair of the first k nodes
    tr_src, tr_dst = np.array([(i, j) for i in range(k) for j in range(k) if i != j]).T
    knn_pm = baselines.fit(
        "pair_median", tr_src, tr_dst, np.linalg.norm(points[tr_src] - points[tr_dst], axis=1),
        np.zeros(len(tr_src), np.int64), np.zeros(len(tr_src), bool), n_nodes=len(points))
    knn = C.knn_table(knn_pm)
    krig = C.krig_table(knn_pm, tr_src, tr_dst, knn_pm.predict(tr_src, tr_dst).rtt_ms)
    C.predict(ctx[:100], q_src[:100], q_dst[:100], rtt[:100], fallback=np.zeros(100),
              fail_rate=0.1, vivaldi=viv, knn=knn, krig=krig)  # compile
    # CPU seconds of this process (the kernels run on one thread): what other work on the
    # machine does to the wall clock is not this code's cost (wall 5.7 s at load 6 once)
    t0 = time.process_time()
    got = C.predict(ctx, q_src, q_dst, rtt, fallback=np.zeros(n), fail_rate=0.1, vivaldi=viv,
                    knn=knn, krig=krig)
    seconds = time.process_time() - t0
    assert set(got) == set(C.CONTEXT_BASELINES)
    assert seconds < 5.0, seconds  # 1.9 s of CPU on the 2-core machine, at load 4


def test_a_broken_family_against_its_pings_failing_each_on_its_own():
    """family_chain: per query, where each earlier ping of its family in its context failed,
    how many and the sum of their P(failed)'s logs; broken_shares mixes in the family broken
    by its posterior; fit_broken finds a planted broken share."""
    # one context: v6 fails (p .2), v4 replies (p .1), v6 fails (p .5), v6 (the query)
    # replies, v6 after a reply; a second context: v4 fails (p .3), v4
    starts = np.array([0, 5, 7])
    family = np.array([6, 4, 6, 6, 6, 4, 4])
    failed = np.array([True, False, True, False, False, True, False])
    p = np.array([0.2, 0.1, 0.5, 0.4, 0.4, 0.3, 0.25])
    n_fam, ll = C.family_chain(starts, family, failed, p)
    assert n_fam.tolist() == [0, 0, 1, 2, 0, 0, 1]
    np.testing.assert_allclose(ll, [0, 0, np.log(0.2), np.log(0.2 * 0.5), 0, 0, np.log(0.3)])
    got = C.broken_shares(p, family, n_fam, ll, (0.1, 0.05))
    w = 0.05 / (0.05 + 0.95 * 0.1)  # two v6 pings failed at .2 and .5 on their own
    assert got[3] == pytest.approx(w + (1 - w) * 0.4, abs=1e-12)
    w4 = 0.1 / (0.1 + 0.9 * 0.3)
    assert got[6] == pytest.approx(w4 + (1 - w4) * 0.25, abs=1e-12)
    assert got[[0, 1, 4, 5]].tolist() == p[[0, 1, 4, 5]].tolist()
    assert C.broken_shares(p, family, n_fam, ll, (0.0, 0.0)).tolist() == p.tolist()
    # planted: 6,000 contexts of 6 pings to distinct destinations, each failing at 0.2 on
    # its own; the even ones IPv6, broken (all fail) in 5 % of them; the odd ones IPv4, never
    rng = np.random.default_rng(1)
    n = 6000
    ctx, dst = np.repeat(np.arange(n), 6), np.arange(6 * n)
    fam = np.where(ctx % 2 == 0, 6, 4)
    broken = np.repeat(rng.random(n) < 0.05, 6) & (fam == 6)
    planted = broken | (rng.random(6 * n) < 0.2)
    fp = C.fit_fail_prior(ctx, dst, planted, 0.2, family=fam)
    assert fp.broken == (0.0, 0.05)
    assert C.fit_fail_prior(ctx, dst, planted, 0.2).broken == (0.0, 0.0)  # no family: none
