"""decode(encode(x)): what comes back exactly, what within the RTT bin, and edge cases."""

import ipaddress

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prep.pack.contexts import ContextConfig, plan_contexts
from prep.schema import vocab as V
from prep.schema.measurements import Measurements, addr_words
from prep.tokens import kernel
from prep.tokens.decode import Decoded, DecodeError, decode_context, render


def make(rows) -> Measurements:
    """Measurements from (probe, time, src text, dst text, rtt) tuples."""
    w = [(addr_words(r[2]), addr_words(r[3])) for r in rows]
    return Measurements(
        probe=np.array([r[0] for r in rows], np.uint64), time=np.array([r[1] for r in rows], np.int64),
        family=np.array([s[0] for s, _ in w], np.uint8),
        src_hi=np.array([s[1] for s, _ in w], np.uint64), src_lo=np.array([s[2] for s, _ in w], np.uint64),
        dst_hi=np.array([d[1] for _, d in w], np.uint64), dst_lo=np.array([d[2] for _, d in w], np.uint64),
        rtt=np.array([r[4] for r in rows], np.float64))


def roundtrip(m: Measurements, cfg: ContextConfig, seed: int):
    """(plan, [(sorted index, Decoded)] per context), matched back to the input by key."""
    plan = plan_contexts(m, cfg, seed)
    toks, off = kernel.encode_plan(plan, seed)
    s = plan.sorted
    out = []
    for c, (a, b) in enumerate(zip(plan.ctx_start.tolist(), plan.ctx_end.tolist())):
        dec = decode_context(toks[off[c]:off[c + 1]])
        assert len(dec) == b - a
        key = lambda d: (d.family, d.src_hi, d.src_lo, d.dst_hi, d.dst_lo, d.failed)  # noqa: E731
        pool = {}
        for i in range(a, b):
            k = (int(s.family[i]), int(s.src_hi[i]), int(s.src_lo[i]), int(s.dst_hi[i]),
                 int(s.dst_lo[i]), bool(s.rtt[i] < 0))
            pool.setdefault(k, []).append(i)
        matched = []
        for d in dec:
            candidates = pool[key(d)]  # KeyError: an address, family or failure changed
            # among equal keys, the timestamp flag, the RTT and then the time pick the partner
            best = min(candidates, key=lambda i: (
                (d.time is None) == bool(plan.has_ts[i]), abs(d.rtt - s.rtt[i]),
                0 if d.time is None else abs(d.time - int(s.time[i]))))
            candidates.remove(best)
            matched.append((best, d))
        out.append(matched)
    return plan, out


def text(family: int, value: int) -> str:
    if family == 4:
        return str(ipaddress.IPv4Address(value % 2 ** 32))
    return str(ipaddress.IPv6Address(value))


def check_rtt(original: float, decoded: float):
    if original < 0:
        assert decoded == -1.0
        return
    us = max(1.0, original * 1000)
    # half a mantissa step: 0.5 µs below 2048 µs, else at most us / 2048 (mantissa >= 1024)
    assert abs(decoded * 1000 - us) <= max(0.5, us / 2048) * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 10 ** 6), st.sampled_from([4, 6]),
                          st.integers(0, 2 ** 128 - 1), st.integers(0, 2 ** 128 - 1),
                          st.one_of(st.just(-1.0), st.floats(0, 400_000))), min_size=1, max_size=60),
       st.integers(0, 2 ** 32), st.sampled_from([(1, 0, 0), (0.4, 0.3, 0.3)]))
def test_roundtrip_random(rows, seed, weights):
    rows = [(p, t, text(f, a), text(f, b), r) for p, t, f, a, b, r in rows]
    plan, contexts = roundtrip(make(rows), ContextConfig(mode_weights=weights, max_gap_s=0), seed)
    s = plan.sorted
    for c, matched in enumerate(contexts):
        if plan.ctx_mode[c] == 0:  # full: time order, every timestamp exact
            assert [i for i, _ in matched] == sorted(i for i, _ in matched)
        for i, d in matched:
            check_rtt(float(s.rtt[i]), d.rtt)
            assert (d.time is not None) == bool(plan.has_ts[i])
            if d.time is not None:
                assert d.time == int(s.time[i])


def test_edge_cases_roundtrip_exactly():
    gaps = [0, 255, 256, (1 << 24) + 3]
    times = (1_700_000_000 + np.cumsum([0] + gaps)).tolist()
    addrs = [("0.0.0.0", "255.255.255.255"), ("::", "::1"), ("::ffff:192.0.2.1", "::ffff:0.0.0.0"),
             ("2001:db8::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), ("10.0.0.1", "10.0.0.2")]
    rtts = [0.0, 0.001, 302_281.0, -1.0, 50.0]
    rows = [(9, t, s, d, r) for t, (s, d), r in zip(times, addrs, rtts)]
    plan, (matched,) = roundtrip(make(rows), ContextConfig(mode_weights=(1, 0, 0), max_gap_s=0),
                                 seed=4)
    got = [(text(d.family, (d.src_hi << 64) | d.src_lo), text(d.family, (d.dst_hi << 64) | d.dst_lo),
            d.failed, d.rtt, d.time) for _, d in matched]
    assert got == [
        ("0.0.0.0", "255.255.255.255", False, 0.001, times[0]),  # 0 ms: the 1 µs floor
        ("::", "::1", False, 0.001, times[1]),
        ("::ffff:c000:201", "::ffff:0:0", False, 302_252.032, times[2]),  # 1153 << 18 µs
        ("2001:db8::1", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", True, -1.0, times[3]),
        ("10.0.0.1", "10.0.0.2", False, 50.016, times[4]),  # 1563 << 5 µs
    ]
    assert [d.family for _, d in matched] == [4, 6, 6, 6, 4]
    assert abs(302_252.032 - 302_281) / 302_281 < 1 / 4096
    toks, _ = kernel.encode_plan(plan, 4)
    kinds = [t for t in toks.tolist() if V.TIMESTAMP_ABS <= t <= V.TIMESTAMP_DELTA4]
    assert kinds == [V.TIMESTAMP_ABS, V.TIMESTAMP_DELTA1, V.TIMESTAMP_DELTA1, V.TIMESTAMP_DELTA4,
                     V.TIMESTAMP_DELTA4]


def test_decode_rejects_malformed_tokens():
    with pytest.raises(DecodeError, match="MEASUREMENT_START"):
        decode_context([V.FAILED])
    with pytest.raises(DecodeError, match="without dst, result"):
        decode_context([V.MEASUREMENT_START, V.SRC_IPV4, 11, 11, 11, 11])
    with pytest.raises(DecodeError, match="context ends"):
        decode_context([V.MEASUREMENT_START, V.SRC_IPV4, 11])
    with pytest.raises(DecodeError, match="no absolute"):
        decode_context([V.MEASUREMENT_START, V.TIMESTAMP_DELTA1, 11])


def test_value_fields_come_back_as_values():
    # none in this vocabulary: every measurement's values are empty, and a Decoded built
    # without them (as before value fields) equals one decoded
    m = [V.MEASUREMENT_START, V.SRC_IPV4, 11, 11, 11, 11, V.DST_IPV4, 12, 12, 12, 12, V.FAILED]
    (d,) = decode_context(m)
    assert V.VALUE_FIELDS == () and d.values == ()
    assert d == Decoded(4, 0, 0, 0, 0x01010101, True, -1.0, None)
    assert Decoded._fields[-1] == "values"


def test_render():
    toks = [V.MEASUREMENT_START, V.FAILED, V.BYTE_OFFSET + 7, V.MEASUREMENT_START, V.RTT_START]
    assert render(toks) == "MEASUREMENT_START FAILED 7\nMEASUREMENT_START RTT_START"


def test_decode_errors_carry_their_rule_and_position():
    import pickle

    cases = [([V.FAILED], "no_start", 0),
             ([V.MEASUREMENT_START, V.SRC_IPV4, 11, 11, 11, 11], "incomplete", 6),
             ([V.MEASUREMENT_START, V.SRC_IPV4, 11], "bad_bytes", 2),
             ([V.MEASUREMENT_START, V.TIMESTAMP_DELTA1, 11], "delta_first", 1)]
    for tokens, kind, pos in cases:
        with pytest.raises(DecodeError) as e:
            decode_context(tokens)
        assert (e.value.kind, e.value.pos) == (kind, pos)
        assert str(e.value).startswith(f"token {pos}: ")
        again = pickle.loads(pickle.dumps(e.value))
        assert (again.kind, again.pos, str(again)) == (kind, pos, str(e.value))
