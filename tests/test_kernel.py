"""The Numba tokenizer against its pure-Python reference, and against hand-written tokens."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.pack.contexts import ContextConfig, free_supply, mode_thresholds, plan_contexts
from prep.schema import vocab as V
from prep.schema.measurements import DTYPES, FIELDS, Measurements, addr_words
from prep.tokens import kernel, reference

B = V.BYTE_OFFSET


def value_columns(probe: np.ndarray, time: np.ndarray) -> dict[str, np.ndarray]:
    """Columns for the value fields (prep.schema.vocab.VALUE_FIELDS; none in this vocabulary):
    a hash of each measurement's probe and time (so they travel with it when rows are
    split or shuffled) over the field's width, with 0 and the widest value among them."""
    out = {}
    for k, f in enumerate(V.VALUE_FIELDS):
        top = np.uint64(min((1 << (8 * f.width)) - 1, int(np.iinfo(DTYPES[f.name]).max)))  # all ones
        h = (time.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + probe * np.uint64(k + 3)) >> np.uint64(17)
        v = np.where(h % np.uint64(5) == 0, 0, np.where(h % np.uint64(7) == 0, top, h & top))
        out[f.name] = v.astype(DTYPES[f.name])
    return out


def make(rows) -> Measurements:
    """Measurements from (probe, time, family, src int, dst int, rtt) tuples (and random
    value fields, where there are any)."""
    cols = list(zip(*rows)) if rows else [()] * 6
    src, dst = (np.array([int(a) for a in c], dtype=object) for c in cols[3:5])
    mask = (1 << 64) - 1
    probe, time = np.array(cols[0], np.uint64), np.array(cols[1], np.int64)
    return Measurements(
        probe=probe, time=time,
        family=np.array(cols[2], np.uint8),
        src_hi=np.array([a >> 64 for a in src], np.uint64), src_lo=np.array([a & mask for a in src], np.uint64),
        dst_hi=np.array([a >> 64 for a in dst], np.uint64), dst_lo=np.array([a & mask for a in dst], np.uint64),
        rtt=np.array(cols[5], np.float64), **value_columns(probe, time))


def rows_of(m: Measurements) -> list[tuple]:
    cols = m.columns()
    return list(zip(*(cols[k].tolist() for k in FIELDS)))


def kernel_pieces(plan, starts, ends, seed):
    toks, off = kernel.encode_pieces(plan.sorted, plan, starts, ends, seed)
    return [toks[off[j]:off[j + 1]].tolist() for j in range(len(off) - 1)]


def assert_matches_reference(m: Measurements, cfg: ContextConfig, seed: int, pieces=None):
    plan = plan_contexts(m, cfg, seed)
    ref_plan = reference.plan_reference(
        rows_of(plan.sorted), row_len=cfg.row_len, max_measurements=cfg.max_measurements,
        max_gap_s=cfg.max_gap_s, max_span_s=cfg.max_span_s,
        thresholds=mode_thresholds(cfg.mode_weights), seed=seed,
        supply=free_supply(plan.sorted, cfg.row_len, mode_thresholds(cfg.mode_weights)[1])[:3])
    assert plan.ctx_start.tolist() == [c["start"] for c in ref_plan]
    assert plan.ctx_end.tolist() == [c["end"] for c in ref_plan]
    assert plan.ctx_mode.tolist() == [c["mode"] for c in ref_plan]
    assert plan.cost.tolist() == sum((c["cost"] for c in ref_plan), [])
    assert plan.has_ts.tolist() == sum((c["has_ts"] for c in ref_plan), [])
    assert plan.abs_extra.tolist() == sum((c["abs_extra"] for c in ref_plan), [])
    starts, ends = (plan.ctx_start, plan.ctx_end) if pieces is None else pieces(plan)
    got = kernel_pieces(plan, starts, ends, seed)
    assert got == reference.encode_pieces_reference(plan, starts, ends, seed)
    return plan, got


FULL = ContextConfig(mode_weights=(1, 0, 0))
IP_A, IP_B = 0xC0000201, 0xC6336407  # 192.0.2.1, 198.51.100.7


def test_one_measurement_exact_tokens():
    # 50 ms = 50,000 µs = 1562.5 * 2**5 -> exponent 5, mantissa 1563 (round half up):
    # code 5 << 11 | 1563 = 0x2E1B. 1,700,000,000 s = 0x6553F100.
    m = make([(7, 1_700_000_000, 4, IP_A, IP_B, 50.0)])
    plan, (toks,) = assert_matches_reference(m, FULL, seed=0)
    src = [V.SRC_IPV4, B + 192, B + 0, B + 2, B + 1]
    dst = [V.DST_IPV4, B + 198, B + 51, B + 100, B + 7]
    rtt = [V.RTT_START, B + 0x2E, B + 0x1B]
    ts = [V.TIMESTAMP_ABS] + [B + 0] * 4 + [B + 0x65, B + 0x53, B + 0xF1, B + 0x00]
    # the block order seed 0 draws for probe 7, measurement 0: (src, ts, rtt, dst)
    assert toks == [V.MEASUREMENT_START] + src + ts + rtt + dst
    assert plan.cost.tolist() == [1 + 5 + 5 + 3 + 9]


def test_delta_and_failed_exact_tokens():
    # two IPv4 pings 300 s apart (DELTA4), the second failed; then one 255 s later (DELTA1)
    m = make([(1, 1000, 4, IP_A, IP_B, 1.0), (1, 1300, 4, IP_A, IP_B, -1.0),
              (1, 1555, 4, IP_A, IP_B, -1.0)])
    plan, (toks,) = assert_matches_reference(m, FULL, seed=3)
    meas = []
    cur = []
    for t in toks:
        if t == V.MEASUREMENT_START and cur:
            meas.append(cur)
            cur = []
        cur.append(t)
    meas.append(cur)
    ts_blocks = [[t for t in mm if V.TIMESTAMP_ABS <= t <= V.TIMESTAMP_DELTA4] for mm in meas]
    assert ts_blocks == [[V.TIMESTAMP_ABS], [V.TIMESTAMP_DELTA4], [V.TIMESTAMP_DELTA1]]
    assert V.FAILED not in meas[0] and V.FAILED in meas[1] and V.FAILED in meas[2]
    # 1 ms = 1000 µs -> exponent 0, mantissa 1000 = 0x3E8
    i = meas[0].index(V.RTT_START)
    assert meas[0][i:i + 3] == [V.RTT_START, B + 0x03, B + 0xE8]
    i = meas[1].index(V.TIMESTAMP_DELTA4)
    assert meas[1][i:i + 5] == [V.TIMESTAMP_DELTA4, B, B, B + 1, B + 44]  # 300 = 0x012C
    i = meas[2].index(V.TIMESTAMP_DELTA1)
    assert meas[2][i:i + 2] == [V.TIMESTAMP_DELTA1, B + 255]
    assert plan.cost.tolist() == [12 + 2 + 9, 12 + 5, 12 + 2] and len(toks) == 23 + 17 + 14


@pytest.mark.parametrize("ms, code", [
    (-0.0, (0, 1)), (0.0, (0, 1)), (0.001, (0, 1)), (0.0015, (0, 2)), (2.047, (0, 2047)),
    (2.0474, (0, 2047)), (2.04751, (1, 1024)),  # 2047.51 µs rounds to 2048 = 1024 * 2**1
    (2.048, (1, 1024)), (50.0, (5, 1563)), (302_281.0, (18, 1153)),
    (1e12, (31, 2047)),  # beyond the 5-bit exponent: saturates
])
def test_rtt_code(ms, code):
    assert kernel.rtt_code(ms) == code
    assert reference.rtt_code(ms) == code


@given(st.floats(0, 4e9, allow_nan=False))
def test_rtt_code_kernel_equals_reference(ms):
    assert kernel.rtt_code(ms) == reference.rtt_code(ms)


GAPS = st.one_of(st.integers(0, 400), st.sampled_from([0, 255, 256, 86_400, 86_401, (1 << 24) + 1,
                                                       (1 << 32) + 7]))
RTTS = st.one_of(st.sampled_from([-1.0, 0.0, 0.001, 302_281.0]), st.floats(0, 500_000))


@st.composite
def measurement_sets(draw, max_size=80):
    n = draw(st.integers(1, max_size))
    rows = []
    probes = [0, 1, 2, (1 << 63) | 12345]  # a key hashed from src_addr has its top bit set
    t = {p: draw(st.integers(0, 2 ** 40)) for p in probes}
    for _ in range(n):
        p = draw(st.sampled_from(probes))
        t[p] += draw(GAPS)
        fam = draw(st.sampled_from([4, 6]))
        hi = (1 << 32) - 1 if fam == 4 else (1 << 128) - 1
        src = draw(st.one_of(st.sampled_from([0, hi, 0xFFFF_0102_0304 if fam == 6 else 1]),
                             st.integers(0, hi)))
        dst = draw(st.integers(0, hi))
        rows.append((p, t[p], fam, src, dst, draw(RTTS)))
    return rows


@settings(max_examples=150, deadline=None)
@given(measurement_sets(), st.integers(0, 2 ** 64 - 1), st.sampled_from([64, 100, 300, 1024]),
       st.sampled_from([0, 3]), st.sampled_from([0, 1000]), st.sampled_from([0, 5000]),
       st.data())
def test_kernel_equals_reference_random(rows, seed, row_len, max_meas, max_gap, max_span, data):
    cfg = ContextConfig(row_len=row_len, max_measurements=max_meas, max_gap_s=max_gap,
                        max_span_s=max_span)

    def random_pieces(plan):  # cut every context at random measurement boundaries
        starts, ends = [], []
        for s, e in zip(plan.ctx_start.tolist(), plan.ctx_end.tolist()):
            cuts = sorted(set(data.draw(st.lists(st.integers(s + 1, max(s + 1, e - 1)), max_size=3))) - {e})
            bounds = [s] + cuts + [e]
            starts += bounds[:-1]
            ends += bounds[1:]
        return np.array(starts), np.array(ends)

    plan, got = assert_matches_reference(make(rows), cfg, seed)
    assert all(len(t) <= row_len for t in got)
    assert_matches_reference(make(rows), cfg, seed, pieces=random_pieces)


def load_atlas(folder) -> Measurements:
    """prb_id, timestamp, af, src_addr, dst_addr, avg of every usable result."""
    rows = []
    for path in sorted((folder / "api").glob("*.json")):
        for r in json.loads(path.read_text()):
            try:
                fam, shi, slo = addr_words(r["src_addr"])
                dfam, dhi, dlo = addr_words(r["dst_addr"])
                avg = float(r["avg"])
            except (KeyError, ValueError, TypeError):
                continue
            if fam != dfam or fam != r.get("af", fam):
                continue
            rows.append((r["prb_id"], r["timestamp"], fam, (shi << 64) | slo, (dhi << 64) | dlo,
                         -1.0 if avg < 0 else avg))
    return make(rows)


@pytest.mark.parametrize("row_len, max_gap", [(1024, 86_400), (64, 0)])
def test_kernel_equals_reference_on_ripe_atlas(atlas_dir, row_len, max_gap):
    m = load_atlas(atlas_dir)
    assert len(m) > 3000
    plan, got = assert_matches_reference(m, ContextConfig(row_len=row_len, max_gap_s=max_gap), seed=11)
    assert sum(map(len, got)) == plan.n_tokens
    assert set(plan.ctx_mode.tolist()) == {0, 1, 2}


def test_split_and_order_do_not_change_tokens():
    rng = np.random.default_rng(5)
    n = 3000
    rows = [(int(rng.integers(0, 40)), int(rng.integers(0, 50_000)), 4, int(rng.integers(0, 2 ** 32)),
             int(rng.integers(0, 2 ** 32)), float(rng.choice([-1.0, rng.uniform(0, 300)])))
            for _ in range(n)]

    def per_probe(parts, seed):
        out = {}
        for part in parts:
            plan = plan_contexts(make(part), ContextConfig(), seed)
            toks, off = kernel.encode_plan(plan, seed)
            for c, s in enumerate(plan.ctx_start.tolist()):
                key = int(plan.sorted.probe[s])
                out.setdefault(key, []).append(toks[off[c]:off[c + 1]].tolist())
        return out

    whole = per_probe([rows], seed=9)
    shuffled = [rows[i] for i in rng.permutation(n)]
    split = [[r for r in shuffled if r[0] % 3 == k] for k in range(3)]  # buckets by probe
    assert per_probe(split, seed=9) == whole
    assert per_probe([shuffled[::-1]], seed=9) == whole
    assert per_probe([rows], seed=10) != whole


def test_encode_pieces_rejects_a_piece_across_contexts():
    m = make([(1, t, 4, IP_A, IP_B, 1.0) for t in range(0, 200, 10)])
    plan = plan_contexts(m, ContextConfig(max_measurements=5), seed=0)
    assert plan.ctx_start.tolist() == [0, 5, 10, 15]
    with pytest.raises(ValueError, match="inside one context"):
        kernel.encode_pieces(plan.sorted, plan, [3], [7], 0)
    toks, off = kernel.encode_pieces(plan.sorted, plan, [], [], 0)
    assert len(toks) == 0 and off.tolist() == [0]


def test_encode_plan_into_a_given_buffer_writes_the_same_tokens():
    from prep.pack.contexts import ContextConfig, plan_contexts
    from prep.tools.workloads import atlas_like

    plan = plan_contexts(atlas_like(3000, probes=20, seed=3), ContextConfig(), 11)
    toks, off = kernel.encode_plan(plan, 11)
    out = np.full(len(toks) + kernel.SLACK, 7, np.uint16)
    toks2, off2 = kernel.encode_plan(plan, 11, out=out)
    assert toks2.tolist() == toks.tolist() and off2.tolist() == off.tolist()
    assert np.shares_memory(toks2, out) and len(toks) == plan.n_tokens
    with pytest.raises(ValueError, match="at least"):
        kernel.encode_plan(plan, 11, out=out[:-1])


@pytest.mark.parametrize("weights", [(1, 0, 0), (0, 1, 0), (0, 0, 1)])
def test_contexts_of_more_than_64_measurements(weights):
    # Failed IPv4 pings, 60 s apart: 12-14 tokens each, so a 1024-token context holds 73-85
    # of them, past the 64 the kernel's per-piece buffers start with (they regrow).
    rows = [(7, 1_700_000_000 + 60 * k, 4, IP_A, IP_B, -1.0) for k in range(300)]
    plan, got = assert_matches_reference(make(rows), ContextConfig(mode_weights=weights), seed=3)
    sizes = (plan.ctx_end - plan.ctx_start).tolist()
    assert max(sizes) > 64 and sum(sizes) == 300


def test_layout_table():
    # Order 0 (source, destination, result, timestamp), IPv6, a reply, absolute time:
    w = int(kernel.LAYOUT[16 * 0 + 8 * 1 + 4 * 0 + 3])
    assert [(w >> (8 * b)) & 0xFF for b in range(7)] == [0, 17, 34, 37, 47, V.TIMESTAMP_ABS, 0]
    assert w >> 63 == 1
    # Order 23 (timestamp, result, destination, source), IPv4, failed, DELTA1:
    w = int(kernel.LAYOUT[16 * 23 + 8 * 0 + 4 * 1 + 1])
    assert [(w >> (8 * b)) & 0xFF for b in range(7)] == [8, 3, 2, 0, 14, V.TIMESTAMP_DELTA1, 56]
    assert w >> 63 == 0
    # No timestamp (tk 0): the four blocks of order 9 (destination, result, timestamp, source).
    w = int(kernel.LAYOUT[16 * 9 + 8 * 0 + 4 * 0 + 0])
    assert [(w >> (8 * b)) & 0xFF for b in range(5)] == [8, 0, 5, 8, 14]


def test_block_orders_are_every_permutation_in_order():
    assert kernel.N_ORDERS == len(reference.BLOCK_ORDERS) == math.factorial(V.N_BLOCKS)
    assert kernel.PERMS.tolist() == [list(p) for p in reference.BLOCK_ORDERS]
    assert sorted(map(tuple, kernel.PERMS.tolist())) == reference.BLOCK_ORDERS
    assert kernel.VALUE_OFFSET.shape == (16 * kernel.N_ORDERS, len(V.VALUE_FIELDS))
