"""Context cutting, token costs and the piece length rule the packer relies on."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.pack import planner_kernels as kernels
from prep.pack.contexts import ContextConfig, epoch_seed, piece_lengths, plan_contexts, sort_order
from prep.schema import vocab as V
from prep.schema.measurements import Measurements
from prep.tokens import costs, kernel

IP_A, IP_B = 0xC0000201, 0xC6336407  # 192.0.2.1, 198.51.100.7


def make(rows) -> Measurements:
    """Measurements from (probe, time, family, src int, dst int, rtt) tuples."""
    cols = list(zip(*rows)) if rows else [()] * 6
    words = [[(int(a) >> 64, int(a) & ((1 << 64) - 1)) for a in c] for c in cols[3:5]]
    return Measurements(
        probe=np.array(cols[0], np.uint64), time=np.array(cols[1], np.int64),
        family=np.array(cols[2], np.uint8),
        src_hi=np.array([w[0] for w in words[0]], np.uint64), src_lo=np.array([w[1] for w in words[0]], np.uint64),
        dst_hi=np.array([w[0] for w in words[1]], np.uint64), dst_lo=np.array([w[1] for w in words[1]], np.uint64),
        rtt=np.array(cols[5], np.float64))

FULL = ContextConfig(mode_weights=(1, 0, 0))


def pings(times, probe=1, fam=4, rtt=1.0):
    src, dst = (IP_A, IP_B) if fam == 4 else ((1 << 127) | IP_A, IP_B)
    return [(probe, t, fam, src, dst, rtt) for t in times]


def test_docstring_example_costs():
    plan = plan_contexts(make(pings([100, 160, 1000])), FULL, seed=0)
    assert plan.cost.tolist() == [23, 16, 19]
    assert plan.abs_extra.tolist() == [0, 7, 4]
    assert piece_lengths(plan, [1], [3]).tolist() == [42]
    toks, off = kernel.encode_pieces(plan.sorted, plan, [0, 1], [1, 3], 0)
    assert np.diff(off).tolist() == [23, 42]
    assert toks[off[1]:].tolist().count(V.TIMESTAMP_ABS) == 1  # the piece restarts absolute


def test_timestamp_cost_by_gap():
    # gaps 0, 255 -> DELTA1 (2), 256, 2**24 + 1 -> DELTA4 (5), 2**32 -> does not fit: ABS (9)
    times = np.cumsum([1000, 0, 255, 256, (1 << 24) + 1, 1 << 32]).tolist()
    plan = plan_contexts(make(pings(times)), ContextConfig(mode_weights=(1, 0, 0), max_gap_s=0), 0)
    assert len(plan.ctx_start) == 1
    assert (plan.cost - 14).tolist() == [9, 2, 2, 5, 5, 9]
    assert plan.abs_extra.tolist() == [0, 7, 7, 4, 4, 0]


def test_one_measurement_probe_and_a_long_probe():
    rows = pings([5], probe=1) + pings(range(0, 240 * 1000, 240), probe=2, fam=6)
    plan = plan_contexts(make(rows), FULL, seed=1)
    assert plan.ctx_start[0] == 0 and plan.ctx_end[0] == 1 and plan.ctx_len[0] == 14 + 9
    # IPv6 pings 240 s apart cost 38 + 2 tokens, the first of each context 38 + 9:
    # 1 + 24 fit in 1024 tokens (47 + 24 * 40 = 1007). In full mode no measurement is free,
    # so nothing could fill the 17-token gap that leaves: no context gives any back
    assert plan.ctx_end[1:].tolist() == list(range(26, 1002, 25))
    assert plan.ctx_len[1:].tolist() == [1007] * 40
    toks, off = kernel.encode_plan(plan, 1)
    assert all(int(toks[off[c]:off[c + 1]].tolist().count(V.TIMESTAMP_ABS)) == 1
               for c in range(len(off) - 1))


def cut_with_supply(rows, rate):
    """Context ends of ``rows`` (full mode) cut with a budget of ``rate`` / UNIT of each body
    (14, 38, 12, 36 tokens) a context, up to 16 contexts' worth."""
    m = make(rows)
    s = m.take(sort_order(m))
    limits = kernels.CutLimits(1024, 0, 86_400, 0, np.uint64(1 << 32), np.uint64(1 << 32))
    rate = np.array(rate, np.int64)
    supply = kernels.Supply(np.array([14, 38, 12, 36], np.int64), rate, 16 * rate)
    return kernels.cut_contexts(s.arrays(), kernels.history_index(s.probe), np.uint64(1),
                                limits, supply)


def test_a_context_gives_back_what_the_free_bodies_can_fill():
    rows = pings(range(0, 240 * 200, 240), probe=2, fam=6)  # 47 + 40 + 40 + ... tokens
    u = costs.UNIT
    # every body at hand: the 17-token gap of 1 + 24 measurements has no fill, one given
    # back leaves 57 (56 = 4 x 14): 24 measurements, 967 tokens
    start, _, length, *_ = cut_with_supply(rows, [4 * u] * 4)
    assert start.tolist()[:3] == [0, 24, 48] and length.tolist()[:2] == [967, 967]
    # IPv6 bodies only (IPv4 data absent): 57, 97, 137, 177 have no fill of 36s and 38s,
    # 217 has (216 = 6 x 36): five given back, 20 measurements, 807 tokens
    start, _, length, *_ = cut_with_supply(rows, [0, 4 * u, 0, 4 * u])
    assert start.tolist()[:3] == [0, 20, 40] and length.tolist()[:2] == [807, 807]
    # few IPv4 bodies: the first contexts spend them (one back, 4 x 14), and once their
    # budget runs low a 14 is priced above 160 tokens of back-off: five back
    start, _, length, *_ = cut_with_supply(rows, [u // 4, 4 * u, 0, 4 * u])
    ends = length.tolist()
    assert ends[0] == 967 and 807 in ends and set(ends[:-1]) <= {967, 807}


def test_max_measurements_gap_and_span_cut():
    times = [0, 10, 20, 30, 5000, 5010, 5020, 90000]
    cfg = ContextConfig(mode_weights=(1, 0, 0), max_measurements=3, max_gap_s=1000)
    assert plan_contexts(make(pings(times)), cfg, 0).ctx_start.tolist() == [0, 3, 4, 7]
    cfg = ContextConfig(mode_weights=(1, 0, 0), max_gap_s=0, max_span_s=5000)
    assert plan_contexts(make(pings(times)), cfg, 0).ctx_start.tolist() == [0, 5, 7]
    cfg = ContextConfig(mode_weights=(1, 0, 0), max_gap_s=0)
    assert plan_contexts(make(pings(times)), cfg, 0).ctx_start.tolist() == [0]


def random_rows(seed, n=4000, probes=30):
    rng = np.random.default_rng(seed)
    return [(int(rng.integers(0, probes)), int(rng.integers(0, 10 ** 6)), int(f),
             int(rng.integers(0, 2 ** 32)), int(rng.integers(0, 2 ** 32)),
             float(rng.choice([-1.0, rng.uniform(0, 300)])))
            for f in rng.choice([4, 6], n)]


def test_contexts_fit_rows_and_hold_one_probe():
    plan = plan_contexts(make(random_rows(0)), ContextConfig(max_gap_s=0), seed=2)
    s, e = plan.ctx_start, plan.ctx_end
    assert s[0] == 0 and e[-1] == len(plan.sorted) and (s[1:] == e[:-1]).all()
    assert plan.ctx_len.max() <= 1024 and plan.ctx_len.min() > 0
    p = plan.sorted.probe
    assert all((p[a:b] == p[a]).all() for a, b in zip(s.tolist(), e.tolist()))
    assert (piece_lengths(plan, s, e) == plan.ctx_len).all()
    # a cut inside a probe's history happens only when the next measurement (at most
    # 47 tokens) would not fit, moved back at most BACKOFF measurements to leave a gap the
    # packer can fill
    same_probe = p[e[:-1]] == p[s[:-1]]
    inner = plan.ctx_len[:-1][same_probe]
    assert same_probe.sum() > 50 and (inner > 1024 - (costs.BACKOFF + 1) * 47).all()
    assert (inner < 1024 - 47).any()
    assert np.mean([costs.fillable(1024 - x) for x in inner]) > 0.95
    counts = np.bincount(plan.ctx_mode, minlength=3) / len(s)
    assert abs(counts[0] - 0.4) < 0.1 and abs(counts[1] - 0.3) < 0.1 and abs(counts[2] - 0.3) < 0.1
    partial = plan.ctx_mode == 1
    kept = np.add.reduceat(plan.has_ts, s) / (e - s)
    assert (kept[plan.ctx_mode == 0] == 1).all() and (kept[plan.ctx_mode == 2] == 0).all()
    assert 0.15 < kept[partial].mean() < 0.85 and kept[partial].std() > 0.1


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 1000), st.data())
def test_piece_length_rule(seed, data):
    plan = plan_contexts(make(random_rows(seed, n=300, probes=4)), ContextConfig(row_len=300), seed)
    starts, ends = [], []
    for s, e in zip(plan.ctx_start.tolist(), plan.ctx_end.tolist()):
        cuts = sorted(set(data.draw(st.lists(st.integers(s, e), max_size=4))) | {s, e})
        starts += cuts[:-1]
        ends += cuts[1:]
    toks, off = kernel.encode_pieces(plan.sorted, plan, starts, ends, seed)
    lengths = piece_lengths(plan, starts, ends)
    assert np.diff(off).tolist() == lengths.tolist()
    for j, (s, e) in enumerate(zip(starts, ends)):
        first_ts = [i for i in range(s, e) if plan.has_ts[i]]
        expect = int(plan.cost[s:e].sum()) + (int(plan.abs_extra[first_ts[0]]) if first_ts else 0)
        assert lengths[j] == expect


def test_sort_order_is_total():
    rows = [(2, 5, 4, 9, 1, 3.0), (1, 5, 4, 9, 1, 3.0), (1, 5, 4, 8, 1, 3.0), (1, 5, 4, 8, 1, -1.0),
            (1, 4, 6, 0, 0, 1.0), (1, 5, 4, 8, 0, 7.0)]
    m = make(rows)
    expect = [4, 5, 3, 2, 1, 0]  # by probe, time, family, src, dst, rtt
    assert sort_order(m).tolist() == expect
    for perm in ([5, 4, 3, 2, 1, 0], [2, 0, 4, 1, 5, 3]):
        mm = make([rows[i] for i in perm])
        assert [perm[i] for i in sort_order(mm)] == expect
    # of some rows only: indices into m, the ties among them broken by every field
    assert sort_order(m, np.array([0, 1, 2, 3, 5])).tolist() == [5, 3, 2, 1, 0]
    assert sort_order(m, np.array([4, 0])).tolist() == [4, 0]


def test_plan_of_some_rows_is_the_plan_of_their_copy():
    m = make(random_rows(3, n=300, probes=4))
    rows = np.flatnonzero(np.arange(300) % 3 != 1)
    a = plan_contexts(m, ContextConfig(row_len=300), 5, rows)
    b = plan_contexts(m.take(rows), ContextConfig(row_len=300), 5)
    for k in ("ctx_start", "ctx_mode", "ctx_len", "cost", "has_ts", "abs_extra", "hist"):
        assert getattr(a, k).tolist() == getattr(b, k).tolist(), k
    assert a.sorted.columns().keys() == b.sorted.columns().keys()
    for k, v in a.sorted.columns().items():
        assert v.tolist() == getattr(b.sorted, k).tolist(), k


def test_epoch_seed():
    assert epoch_seed(42, 0) == 42
    seeds = {epoch_seed(42, e) for e in range(100)}
    assert len(seeds) == 100 and epoch_seed(42, 3) == epoch_seed(42, 3) != epoch_seed(43, 3)


def test_empty_input_and_bad_config():
    plan = plan_contexts(make([]), ContextConfig(), 0)
    assert len(plan.ctx_start) == 0 and plan.n_tokens == 0
    toks, off = kernel.encode_plan(plan, 0)
    assert len(toks) == 0 and off.tolist() == [0]
    with pytest.raises(ValueError, match="row_len"):
        ContextConfig(row_len=40)
    with pytest.raises(ValueError, match="max_gap_s"):
        ContextConfig(max_gap_s=-1)
    with pytest.raises(ValueError, match="mode_weights"):
        ContextConfig(mode_weights=(0, 0, 0))
    assert ContextConfig().to_dict()["max_measurements"] == 0
