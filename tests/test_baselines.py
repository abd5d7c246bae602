"""Baselines: exact answers on a hand-made set, planted structure that Vivaldi and the
factorization must recover, determinism."""

import numpy as np
import pytest

from train.eval import baselines

F = -1.0  # a failed ping
# idx: (src, dst, rtt, time, has_time). Untimestamped rows carry junk times on purpose.
ROWS = [
    (0, 1, 10.0, 100, True),
    (0, 1, 20.0, 200, True),
    (0, 1, F, 300, True),  # (0, 1)'s latest measurement failed
    (0, 1, 14.0, 250, True),  # out of time order in the input
    (1, 0, 30.0, 100, True),
    (1, 0, 40.0, 100, True),  # same time as the row above: the later index is later
    (0, 2, 50.0, 0, False),  # (0, 2) has no timestamped measurement
    (4, 2, F, 500, True),  # (4, 2) only ever failed; node 4 never succeeded
    (4, 2, F, 400, True),
    (1, 2, 4.0, 50, True),
    (1, 2, 9.0, 10, True),  # earlier than the row above, later in the input
    (1, 2, 100.0, 0, False),
    (1, 0, F, 7777, False),  # untimestamped failure: not "latest" despite its time value
    (1, 2, F, 30, True),
    (3, 1, 5.0, 600, True),
    (3, 1, 7.0, 99999, False),
]
SRC, DST, RTT, TIME, HAS = (np.array(c) for c in zip(*ROWS))
N_NODES = 5
# successes 4 5 7 9 10 14 20 30 40 50 100: median 14; 5 failures out of 16
MEDIAN, RATE = 14.0, 5 / 16
QUERIES = [(0, 1), (1, 0), (0, 2), (1, 2), (4, 2), (3, 1), (3, 0), (2, 3)]
Q_SRC, Q_DST = np.array(QUERIES).T


@pytest.fixture(scope="module")
def tiny():
    return baselines.fit_all(SRC, DST, RTT, TIME, HAS, n_nodes=N_NODES, seed=0)


def _predict(tiny, name):
    pred = tiny[name].predict(Q_SRC, Q_DST)
    return pred.rtt_ms.tolist(), pred.p_fail.tolist(), pred.covered.tolist()


def test_fit_all_names(tiny):
    assert tuple(tiny) == baselines.BASELINES
    assert all(b.name == name for name, b in tiny.items())


def test_global_median(tiny):
    rtt, p_fail, covered = _predict(tiny, "global_median")
    assert rtt == [14.0] * 8
    assert p_fail == [0.3125] * 8
    assert covered == [True] * 8


def test_dst_median(tiny):
    rtt, p_fail, covered = _predict(tiny, "dst_median")
    # dst 1: 10 20 14 5 7 and a failure; dst 0: 30 40 and a failure; dst 2: 50 4 9 100 and
    # three failures; dst 3 was never a destination
    #               (0,1) (1,0) (0,2) (1,2) (4,2) (3,1) (3,0) (2,3)
    assert rtt == [10.0, 35.0, 29.5, 29.5, 29.5, 10.0, 35.0, 14.0]
    assert p_fail == pytest.approx([1 / 6, 1 / 3, 3 / 7, 3 / 7, 3 / 7, 1 / 6, 1 / 3, 0.3125])
    assert covered == [True] * 7 + [False]


def test_pair_last(tiny):
    rtt, p_fail, covered = _predict(tiny, "pair_last")
    #               (0,1)  (1,0) (0,2)  (1,2) (4,2)  (3,1) (3,0)  (2,3)
    assert rtt == [14.0, 40.0, 14.0, 4.0, 14.0, 5.0, 14.0, 14.0]
    assert p_fail == [1.0, 0.0, 0.3125, 0.0, 1.0, 0.0, 0.3125, 0.3125]
    assert covered == [True, True, False, True, False, True, False, False]


def test_pair_ema(tiny):
    rtt, p_fail, covered = _predict(tiny, "pair_ema")
    # (0,1): 10, 20, 14 in time order -> 10, 13, 13.3; (1,0): 30 then 40 -> 33;
    # (1,2): 9 then 4 -> 7.5; failure indicators (0,1): 0 0 0 1 -> 0.3, (1,2): 0 1 0 -> 0.21
    assert rtt == [13.3, 33.0, 14.0, 7.5, 14.0, 5.0, 14.0, 14.0]
    assert p_fail == [0.3, 0.0, 0.3125, 0.21, 1.0, 0.0, 0.3125, 0.3125]
    assert covered == [True, True, False, True, False, True, False, False]


def test_pair_median(tiny):
    rtt, p_fail, covered = _predict(tiny, "pair_median")
    # all measurements, timestamped or not: (1,0) is 30, 40 and a failure; (3,1) is 5, 7
    assert rtt == [14.0, 35.0, 50.0, 9.0, 14.0, 6.0, 14.0, 14.0]
    assert p_fail == [0.25, 1 / 3, 0.0, 0.25, 1.0, 0.0, 0.3125, 0.3125]
    assert covered == [True, True, True, True, False, True, False, False]


def test_pair_baselines_answer_an_unseen_direction_with_the_reverse_pair(tiny):
    """(2, 1) and (2, 0) were never pinged: (1, 2) and (0, 2) were. A pair seen in its own
    direction keeps its own answer even where the reverse differs ((1, 0) is not (0, 1))."""
    src, dst = np.array([2, 2, 1]), np.array([1, 0, 0])
    got = {n: tiny[n].predict(src, dst) for n in ("pair_median", "pair_last", "pair_ema")}
    # (1, 2): 4, 9, 100 and a failure, timestamped 4 (t 50), 9 (t 10), failure (t 30); (0, 2):
    # 50 only, untimestamped (no pair_last or pair_ema of its own, nor a reverse)
    assert got["pair_median"].rtt_ms.tolist() == [9.0, 50.0, 35.0]
    assert got["pair_median"].p_fail.tolist() == [0.25, 0.0, 1 / 3]
    assert got["pair_median"].covered.tolist() == [True, True, True]
    assert got["pair_last"].rtt_ms.tolist() == [4.0, MEDIAN, 40.0]
    assert got["pair_last"].covered.tolist() == [True, False, True]
    assert got["pair_ema"].rtt_ms.tolist() == pytest.approx([0.3 * 4.0 + 0.7 * 9.0, MEDIAN, 33.0])
    assert got["pair_ema"].covered.tolist() == [True, False, True]
    # dst_median never reads a reverse pair: destination 1's own replies
    assert tiny["dst_median"].predict(src[:1], dst[:1]).rtt_ms.tolist() == [10.0]


@pytest.mark.parametrize("name, covered", [
    # Vivaldi: both nodes in a successful ping (node 4 never was)
    ("vivaldi", [True, True, True, True, False, True, True, True]),
    # factorization: source seen as a source and destination as a destination, or the
    # reverse: (2, 3), node 2 only ever a destination, is answered as (3, 2)
    ("matrix_factorization", [True, True, True, True, False, True, True, True]),
])
def test_coordinate_models_fall_back(tiny, name, covered):
    pred = tiny[name].predict(Q_SRC, Q_DST)
    assert pred.covered.tolist() == covered
    assert pred.rtt_ms[~pred.covered].tolist() == [MEDIAN] * (8 - sum(covered))
    assert (pred.rtt_ms[pred.covered] > 0).all()
    assert pred.p_fail.tolist() == [RATE] * 8  # no failure model


def test_unknown_node_ids_fall_back(tiny):
    for b in tiny.values():
        pred = b.predict([7, -1, 0], [0, 1, 9])
        assert pred.rtt_ms.tolist() == [MEDIAN] * 3
        assert pred.p_fail.tolist() == [RATE] * 3
        assert pred.covered.tolist() == [b.name == "global_median"] * 3


def test_bad_inputs():
    with pytest.raises(ValueError, match="no successful ping"):
        baselines.fit_all(SRC, DST, np.full(len(SRC), F), TIME, HAS, n_nodes=N_NODES)
    with pytest.raises(ValueError, match="rtt must be"):
        baselines.fit("pair_median", SRC, DST, np.where(RTT < 0, -2.0, RTT), TIME, HAS,
                      n_nodes=N_NODES)
    with pytest.raises(ValueError, match="node ids"):
        baselines.fit("pair_median", SRC, DST, RTT, TIME, HAS, n_nodes=4)
    with pytest.raises(ValueError, match="unknown baseline"):
        baselines.fit("oracle", SRC, DST, RTT, TIME, HAS, n_nodes=N_NODES)
    with pytest.raises(TypeError, match="no options"):
        baselines.fit("pair_last", SRC, DST, RTT, TIME, HAS, n_nodes=N_NODES, rank=3)


def _no_time(n):
    return np.zeros(n, np.int64), np.zeros(n, bool)


def _median_rel_err(pred, truth):
    return float(np.median(np.abs(pred - truth) / truth))


def test_vivaldi_recovers_a_plane():
    rng = np.random.default_rng(1)
    n = 40
    points = rng.uniform(0, 100, (n, 2))
    src, dst = np.array([(i, j) for i in range(n) for j in range(n) if i != j]).T
    dist = np.linalg.norm(points[src] - points[dst], axis=1)
    held_out = rng.random(len(src)) < 0.2
    tr = ~held_out
    model = baselines.fit("vivaldi", src[tr], dst[tr], dist[tr], *_no_time(tr.sum()),
                          n_nodes=n, seed=0)
    pred = model.predict(src[held_out], dst[held_out])
    assert pred.covered.all()
    assert _median_rel_err(pred.rtt_ms, dist[held_out]) < 0.005
    assert _median_rel_err(np.full(held_out.sum(), model.median_ms), dist[held_out]) > 0.2


def test_a_node_seen_only_as_a_destination_is_placed():
    """A held-out probe that others pinged: Vivaldi places it (springs move both ends); the
    factorization answers its pings as the reverse pings (a symmetric RTT matrix here)."""
    rng = np.random.default_rng(5)
    n = 30
    points = rng.uniform(0, 100, (n, 2))
    src, dst = np.array([(i, j) for i in range(1, n) for j in range(n) if i != j]).T
    dist = np.linalg.norm(points[src] - points[dst], axis=1)  # node 0: destination only
    q_src, q_dst = np.zeros(n - 1, np.int64), np.arange(1, n)
    truth = np.linalg.norm(points[0] - points[q_dst], axis=1)
    for name, tol in (("vivaldi", 0.02), ("matrix_factorization", 0.1)):
        model = baselines.fit(name, src, dst, dist, *_no_time(len(src)), n_nodes=n, seed=0)
        pred = model.predict(q_src, q_dst)
        assert pred.covered.all(), name
        assert _median_rel_err(pred.rtt_ms, truth) < tol, name


def test_factorization_recovers_a_rank_3_matrix():
    rng = np.random.default_rng(2)
    n = 60
    log_rtt = np.log(40.0) + rng.normal(0, 0.5, (n, 3)) @ rng.normal(0, 0.5, (n, 3)).T
    src, dst = (a.ravel() for a in np.meshgrid(np.arange(n), np.arange(n), indexing="ij"))
    rtt = np.exp(log_rtt.ravel())
    held_out = rng.random(len(src)) < 0.5
    tr = ~held_out
    model = baselines.fit("matrix_factorization", src[tr], dst[tr], rtt[tr],
                          *_no_time(tr.sum()), n_nodes=n, seed=0)
    pred = model.predict(src[held_out], dst[held_out])
    assert pred.covered.all()
    assert _median_rel_err(pred.rtt_ms, rtt[held_out]) < 0.04
    assert _median_rel_err(np.full(held_out.sum(), model.median_ms), rtt[held_out]) > 0.15


@pytest.mark.parametrize("name", ["vivaldi", "matrix_factorization"])
def test_deterministic_for_a_seed(name):
    rng = np.random.default_rng(3)
    src, dst = rng.integers(0, 30, 2000), rng.integers(0, 30, 2000)
    rtt = np.where(rng.random(2000) < 0.1, F, rng.uniform(1, 200, 2000))
    time, has = _no_time(2000)
    q_src, q_dst = rng.integers(0, 30, 500), rng.integers(0, 30, 500)

    def run(seed):
        model = baselines.fit(name, src, dst, rtt, time, has, n_nodes=30, seed=seed)
        return model.predict(q_src, q_dst)

    a, b, c = run(5), run(5), run(6)
    assert a.rtt_ms.tobytes() == b.rtt_ms.tobytes()
    assert a.p_fail.tobytes() == b.p_fail.tobytes()
    assert a.covered.tolist() == b.covered.tolist()
    assert a.rtt_ms.tobytes() != c.rtt_ms.tobytes()  # the seed is used


# --- pair_mode: the densest window of a pair's RTTs, its band picked on the train split ---

@pytest.mark.parametrize("values, e, point", [
    ([10.0, 10.5, 11.0, 20.0, 21.0], 0.1, 0.5 * (11.0 * 0.9 + 10.0 * 1.1)),  # 10-11: 3 values
    ([1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 4.0], 0.0, 3.0),  # e = 0: the most frequent value
    ([1.0, 1.0, 5.0, 5.0, 9.0], 0.0, 5.0),  # two values twice: the one nearer the median (5)
    ([1.0, 1.0, 3.0, 9.0, 9.0], 0.0, 1.0),  # the median is 3: log-nearer is 1 (x3), not 9 (x3)
    ([7.0], 0.2, 7.0),
])
def test_band_point_is_the_centre_of_the_densest_window(values, e, point):
    got = baselines._band_points(np.array([0, len(values)]), np.array(values), e)
    assert got.tolist() == pytest.approx([point])


def _mode_rows():
    """Pair (0, 1): 20 replies, every other one 100 ms, in time order t = 0..19 and given
    in reverse; pair (1, 0): 4 replies (too few to score a band); a failure of (0, 1)."""
    rtt = [100.0, 150.0, 100.0, 170.0, 100.0, 190.0, 100.0, 160.0, 100.0, 180.0] * 2
    rows = [(0, 1, r, t, True) for t, r in enumerate(rtt)][::-1]
    rows += [(1, 0, r, t, True) for t, r in enumerate([30.0, 40.0, 41.0, 90.0])]
    rows.append((0, 1, F, 5, True))
    return (np.array(c) for c in zip(*rows))


def test_pair_mode_picks_its_band_on_each_pairs_latest_fifth():
    """(0, 1)'s earliest 16 replies: eight at 100 ms, eight of 150-190 (median 125); its
    latest 4 (100, 160, 100, 180) are scored: the median is off by 0.25, 0.219, 0.25, 0.306
    (median 0.25); 100 ms by 0, 0.375, 0, 0.444 (0.1875); e = 0.2's densest window is
    100-150 (10 replies), centred at 120 (0.2, 0.25, 0.2, 0.333: 0.225). Bands 0-0.1 all
    find 100: the first, 0, is taken."""
    src, dst, rtt, time, has = _mode_rows()
    b = baselines.fit("pair_mode", src, dst, rtt, time, has, n_nodes=2)
    assert b.band == 0.0
    assert b.band_errors == pytest.approx({None: 0.25, 0.0: 0.1875, 0.01: 0.1875, 0.02: 0.1875,
                                           0.05: 0.1875, 0.1: 0.1875, 0.2: 0.225})
    pred = b.predict(np.array([0, 1]), np.array([1, 0]))
    # fit again on all replies: (0, 1)'s ten 100s; (1, 0)'s four distinct values: each its
    # own window of one, the one log-nearest the median (40.5) is 41
    assert pred.rtt_ms.tolist() == [100.0, 41.0]
    assert pred.p_fail.tolist() == [1 / 21, 0.0]


def test_pair_mode_is_the_median_where_the_median_predicts_better_or_no_pair_can_say(tiny):
    """No pair of the hand-made set has 5 replies: no band is scored, and pair_mode is
    pair_median. A pair whose latest replies sit at its median takes the median."""
    assert tiny["pair_mode"].band is None and tiny["pair_mode"].band_errors == {}
    assert _predict(tiny, "pair_mode") == _predict(tiny, "pair_median")
    rtt = np.array([10.0, 14.0, 20.0, 28.0, 40.0, 56.0, 80.0, 112.0, 34.0, 34.0])
    n = len(rtt)
    b = baselines.fit("pair_mode", np.zeros(n, int), np.ones(n, int), rtt, np.arange(n),
                      np.ones(n, bool), n_nodes=2)
    # the earliest 8 (x1.4 apart): median 34 hits the latest two; every band up to 0.1 has
    # windows of one, the log-nearest to 34 is 40 (off by 0.176); 0.2's windows of two, the
    # nearest 28-40 centred at 32.8 (0.035)
    assert b.band is None
    assert b.band_errors == pytest.approx({None: 0.0, **dict.fromkeys((0.0, 0.01, 0.02, 0.05, 0.1),
                                           6 / 34), 0.2: 1.2 / 34})
    assert b.predict(np.array([0]), np.array([1])).rtt_ms.tolist() == [34.0]
