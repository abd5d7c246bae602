"""The model's RTT answers: exact quantiles and P(failed), held to a brute force over every
canonical first byte; query encoding spelled out."""

import dataclasses

import jax
import numpy as np
import pytest

from prep.base.errors import InputError
from prep.schema import vocab as V
from prep.tokens.decode import decode_context
from train.model import model
from train.model.arch import MODELS
from train.predict import predictor as P

B = V.BYTE_OFFSET
CFG = dataclasses.replace(MODELS["tiny"], seq_len=128)


@pytest.fixture(scope="module")
def predictor():
    params = model.init_params(CFG, 7)
    # a sharper head than at init, so the distributions have shape to get wrong
    params["head"] = params["head"] * 60
    return P.Predictor(jax.device_put(params), CFG, batch_size=4)


def m(src, dst, time, code):
    return dataclasses.replace(P.query_measurement(src, dst, time), rtt_code=code)


def test_canonical_first_bytes_are_in_value_order():
    assert len(P.CANONICAL_B1) == 132
    assert P.CANONICAL_B1[:10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 12, 13]
    lows = P.code_ms(P.CANONICAL_B1 << 8)
    highs = P.code_ms((P.CANONICAL_B1 << 8) | 0xFF)
    assert np.all(highs[:-1] < lows[1:])  # bins of consecutive first bytes do not overlap


def test_encode_context_full_mode_result_last():
    ctx = [m("10.0.0.1", "1.1.1.1", 1_000_000, 0x2E1B),
           m("10.0.0.1", "8.8.8.8", 1_000_030, -1),
           m("10.0.0.1", "1.1.1.1", 1_000_400, P.UNKNOWN)]
    tokens, choice, rtt = P.encode_context(ctx)
    ms = V.MEASUREMENT_START
    assert tokens == ([ms, V.SRC_IPV4, B + 10, B, B, B + 1, V.DST_IPV4, B + 1, B + 1, B + 1, B + 1,
                       V.TIMESTAMP_ABS, B, B, B, B, B, B + 0x0F, B + 0x42, B + 0x40,
                       V.RTT_START, B + 0x2E, B + 0x1B]
                      + [ms, V.SRC_IPV4, B + 10, B, B, B + 1, V.DST_IPV4] + [B + 8] * 4
                      + [V.TIMESTAMP_DELTA1, B + 30, V.FAILED]
                      + [ms, V.SRC_IPV4, B + 10, B, B, B + 1, V.DST_IPV4] + [B + 1] * 4
                      + [V.TIMESTAMP_DELTA4, B, B, B + 1, B + 114, V.RTT_START])
    assert choice == [19, 35, 52] and rtt == [20, -1, 53]
    # what the tokenizer's decoder reads back (the query's placeholder result aside)
    d = decode_context(tokens[:37])
    assert [x.time for x in d] == [1_000_000, 1_000_030] and d[1].failed


_forward = jax.jit(model.forward, static_argnums=3)


def brute_force(pred, tokens, choice, rtt):
    """P(failed) and the quantile codes from the full joint over canonical codes: one
    forward per canonical first byte, the joint sorted in value order."""
    L = CFG.seq_len
    row = np.zeros(L, np.int32)
    seg = np.zeros(L, np.int32)
    row[:rtt + 1] = tokens[:rtt + 1]
    seg[:rtt + 1] = 1
    logits = np.asarray(_forward(pred.params, row[None], seg[None], CFG)[0], np.float64)
    sm = lambda x: np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    p = sm(logits[choice])
    p_fail = p[V.FAILED] / (p[V.FAILED] + p[V.RTT_START])
    pb1 = sm(logits[rtt])[B + P.CANONICAL_B1]
    pb1 /= pb1.sum()
    rows = np.repeat(row[None], len(P.CANONICAL_B1), 0)
    segs = np.repeat(seg[None], len(P.CANONICAL_B1), 0)
    rows[:, rtt + 1] = B + P.CANONICAL_B1
    segs[:, rtt + 1] = 1
    lg = np.asarray(_forward(pred.params, rows, segs, CFG)[:, rtt + 1], np.float64)
    pb2 = np.exp(lg[:, B:B + 256] - lg.max(axis=1, keepdims=True))
    pb2 /= pb2.sum(axis=1, keepdims=True)
    joint = (pb1[:, None] * pb2).ravel()  # canonical first bytes ascending, then b2: value order
    cum = np.cumsum(joint)
    codes = (np.repeat(P.CANONICAL_B1, 256) << 8) | np.tile(np.arange(256), len(P.CANONICAL_B1))
    return p_fail, [int(codes[np.argmax(cum >= q)]) for q in P.QUANTILES], (joint, codes, pb1)


def brute_band_point(joint, codes, pb1, band):
    """The band point by brute force: over the codes of the MODE_FIRST_BYTES likeliest
    first bytes, each code value's mass within ``band`` of it, summed code by code."""
    top = np.argsort(-pb1, kind="stable")[:P.MODE_FIRST_BYTES]
    keep = np.isin(codes >> 8, P.CANONICAL_B1[top])
    ms, mass = P.code_ms(codes[keep]), joint[keep]
    within = [mass[np.abs(p - ms) <= band * ms + 1e-12 * p].sum() for p in ms]
    return ms[int(np.argmax(within))]


def test_answers_equal_brute_force(predictor):
    contexts = [
        [m("10.0.0.1", "1.1.1.1", 1_000_000, 0x2E1B), m("10.0.0.1", "1.1.1.1", 1_000_060, 0x2E20),
         m("10.0.0.1", "9.9.9.9", 1_000_100, P.UNKNOWN)],
        [m("2001:db8::1", "2001:db8::53", 1_700_000_000, P.UNKNOWN)],
        [m("192.0.2.7", "193.0.14.129", 1_000, -1), m("192.0.2.7", "193.0.14.129", 1_300, 0x1F00)],
    ]
    enc = [P.encode_context(c) for c in contexts]
    tok, seg, where = P.pack_contexts([e[0] for e in enc], CFG.seq_len)
    q_row, q_choice, q_rtt, brute = [], [], [], []
    for (tokens, choice, rtt), (r, off) in zip(enc, where):
        for c, t in zip(choice, rtt):
            q_row.append(r)
            q_choice.append(off + c)
            q_rtt.append(off + t if t >= 0 else -1)
            brute.append(brute_force(predictor, tokens, c, t) if t >= 0 else None)
    ans = predictor.answer(tok, seg, np.array(q_row), np.array(q_choice), np.array(q_rtt))
    assert len(tok) == 2 and len(q_row) == 6  # two rows: queries in shared rows and alone
    for i, b in enumerate(brute):
        if b is None:
            assert ans.quantile_code[i].tolist() == [-1, -1, -1]
            continue
        p_fail, codes, _ = b
        assert ans.quantile_code[i].tolist() == codes
        np.testing.assert_allclose(ans.p_failed[i], p_fail, rtol=1e-4)
        np.testing.assert_allclose(ans.quantile_ms[i], P.code_ms(codes))
    assert len({tuple(c) for c in ans.quantile_code[[0, 1, 2, 3, 5]].tolist()}) > 1
    assert np.all(ans.quantile_ms[[0, 1, 2, 3, 5], 0] <= ans.quantile_ms[[0, 1, 2, 3, 5], 2])


@pytest.mark.parametrize("band", [0.0, 0.02, 0.2])
def test_band_point_equals_brute_force(predictor, band):
    """With a band, each query's point is the code value the most mass of its likeliest
    first bytes' codes lies within the band of; the quantiles stay as they were."""
    contexts = [
        [m("10.0.0.1", "1.1.1.1", 1_000_000, 0x2E1B), m("10.0.0.1", "1.1.1.1", 1_000_060, 0x2E20),
         m("10.0.0.1", "9.9.9.9", 1_000_100, P.UNKNOWN)],
        [m("2001:db8::1", "2001:db8::53", 1_700_000_000, P.UNKNOWN)],
    ]
    enc = [P.encode_context(c) for c in contexts]
    tok, seg, where = P.pack_contexts([e[0] for e in enc], CFG.seq_len)
    q = [(k, c, t) for k, (_, choice, rtt) in enumerate(enc) for c, t in zip(choice, rtt)
         if t >= 0]
    q_row = np.array([where[k][0] for k, _, _ in q])
    q_choice = np.array([where[k][1] + c for k, c, _ in q])
    q_rtt = np.array([where[k][1] + t for k, _, t in q])
    plain = predictor.answer(tok, seg, q_row, q_choice, q_rtt)
    ans = predictor.answer(tok, seg, q_row, q_choice, q_rtt, band=band)
    assert plain.point_ms is None and plain.rtt_ms.tolist() == plain.quantile_ms[:, 1].tolist()
    assert ans.quantile_code.tolist() == plain.quantile_code.tolist()
    for i, (k, c, t) in enumerate(q):
        _, _, (joint, codes, pb1) = brute_force(predictor, enc[k][0], c, t)
        assert ans.point_ms[i] == pytest.approx(brute_band_point(joint, codes, pb1, band),
                                                rel=1e-9)
        assert ans.rtt_ms[i] == ans.point_ms[i]


def test_predict_api_equals_answer_on_the_same_context(predictor):
    hist = [m("10.0.0.1", "1.1.1.1", 1_000_000, 0x2E1B), m("10.0.0.1", "1.1.1.1", 1_000_060, -1)]
    got = predictor.predict("10.0.0.1", "9.9.9.9", time=1_000_100, history=hist)
    tokens, choice, rtt = P.encode_context(hist + [m("10.0.0.1", "9.9.9.9", 1_000_100, P.UNKNOWN)])
    p_fail, codes, _ = brute_force(predictor, tokens, choice[-1], rtt[-1])
    assert [got["p10_ms"], got["rtt_ms"], got["p90_ms"]] == P.code_ms(codes).tolist()
    assert got["p_failed"] == pytest.approx(p_fail, rel=1e-4)
    assert got["history_used"] == 2


def test_history_past_a_row_keeps_the_most_recent(predictor):
    hist = [m("10.0.0.1", "1.1.1.1", 1_000_000 + 10 * i, 0x2E1B) for i in range(20)]  # 20 x 18 tokens
    got = predictor.predict("10.0.0.1", "1.1.1.1", time=1_000_300, history=hist)
    # 16 tokens a measurement (DELTA1), +7 for the first (ABS), 14 for the query:
    # 23 + 16 x 5 + 14 = 117 <= 128 < 133
    assert got["history_used"] == 6


def test_bad_queries_name_the_fix(predictor):
    with pytest.raises(InputError, match="give IPv4 or IPv6 addresses"):
        predictor.predict("10.0.0.300", "1.1.1.1")
    with pytest.raises(InputError, match="one address family"):
        predictor.predict("10.0.0.1", "2001:db8::1")


def test_band_points_covered_and_the_self_picked_band(predictor):
    """Every band's point as ``band_point`` gives it, the median where the band is None, and
    the model's own P(|p - y| <= t y) summed code by code; the picked band per group is the
    one whose mean P first reaches one half at the least t."""
    enc = P.encode_context([m("10.0.0.1", "1.1.1.1", 1_000_000, 0x2E1B),
                            m("10.0.0.1", "9.9.9.9", 1_000_100, P.UNKNOWN)])
    tokens, choice, rtt = enc
    _, codes, (joint, all_codes, pb1) = brute_force(predictor, tokens, choice[-1], rtt[-1])
    top = np.sort(np.argsort(-pb1, kind="stable")[:P.MODE_FIRST_BYTES])
    b1, p_b1 = P.CANONICAL_B1[top][None], pb1[top][None]
    lp = np.log(np.maximum(joint.reshape(len(pb1), 256)[top] / pb1[top][:, None], 1e-300))
    lp_b2 = np.full((1, len(top), V.VOCAB_SIZE), -np.inf)
    lp_b2[0, :, B:B + 256] = lp
    bands = (None, 0.0, 0.05)
    med = P.code_ms(codes[1])
    points, cover = P.band_points_covered(b1, p_b1, lp_b2, bands, np.array([med]))
    keep = np.isin(all_codes >> 8, P.CANONICAL_B1[top])
    ms, mass = P.code_ms(all_codes[keep]), joint[keep]
    for j, e in enumerate(bands):
        want = med if e is None else brute_band_point(joint, all_codes, pb1, e)
        assert points[0, j] == pytest.approx(want, rel=1e-9)
        for k in (0, 60, 150, len(P.COVER_T) - 1):
            t = P.COVER_T[k]
            near = mass[np.abs(points[0, j] - ms) <= t * ms + 1e-12 * ms].sum()
            assert cover[0, j, k] == pytest.approx(near, abs=1e-9)
    # every row at once as one row at a time, rows whose values span less than a factor of
    # 2 (one exponent's first bytes) asked far beyond them (t near 1 asks p / 1e-9)
    rows = np.array([[10.0, 11.0, 11.0, 13.0], [10.5, 11.0, 12.0, 12.5]])
    x = np.stack([rows[:, 3] * 1e9, rows[:, 1], rows[:, 0] / 3, rows[:, 2] * 1.0001], axis=1)
    for side in ("left", "right"):
        want = [np.searchsorted(r, q, side=side) for r, q in zip(rows, x)]
        assert P._rowwise_searchsorted(rows, x, side).tolist() == np.array(want).tolist()
    # planted: group 0 reaches one half at t index 10 with band 1, 30 with band 0; group 1
    # never with band 0 (its last t counts), at index 5 with band 1
    T = len(P.COVER_T)
    c = np.zeros((2, 2, T))
    c[0, 0, 30:] = c[0, 1, 10:] = c[1, 1, 5:] = 1.0
    pick, expected = P.pick_bands(c, np.array([1, 1]))
    assert pick.tolist() == [1, 1]
    assert expected.tolist() == [[P.COVER_T[30], P.COVER_T[10]], [P.COVER_T[-1], P.COVER_T[5]]]
