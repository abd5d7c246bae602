"""prep.tokens.grammar.check_rows against its plain-Python twin (layout checks + decode_context),
on rows the real pipeline writes and on damaged copies of them; exact codes on hand-made rows."""

import numpy as np
import pytest
from helpers import PIPELINE_L, pipeline_rows

from prep.schema import vocab as V
from prep.tokens import grammar as G

B = V.BYTE_OFFSET
L = PIPELINE_L  # pipeline_rows' rows


def assert_agrees(tok, seg):
    """Same decision per row; same counts where both accept; same code and position where
    both reject, except that the kernel alone rejects a duplicated block (the twin's first
    complaint, if any, comes no earlier)."""
    got = G.check_rows(tok, seg)
    want = G.check_rows_reference(tok, seg)
    dup = got[3] == G.DUPLICATE_BLOCK
    assert np.array_equal(got[3][~dup], want[3][~dup])
    assert np.array_equal(got[4][~dup], want[4][~dup])
    for k in range(3):
        assert np.array_equal(got[k][~dup], want[k][~dup])
    assert np.all((want[3][dup] == 0) | (want[4][dup] >= got[4][dup]))
    return got


@pytest.fixture(scope="module")
def sound():
    return [pipeline_rows(s) for s in (1, 2)]


def test_accepts_every_row_the_pipeline_writes(sound):
    for tok, seg, n in sound:
        got = assert_agrees(tok, seg)
        assert not got[3].any()
        assert got[0].sum() == n  # every measurement, once
        assert got[1].sum() == np.count_nonzero(seg) and got[2].sum() == seg.max(axis=1).sum()


def test_agrees_with_the_twin_on_damaged_rows(sound):
    rng = np.random.default_rng(7)
    tok0, seg0, _ = sound[0]
    tok, seg = tok0.copy(), seg0.copy()
    for r in range(len(tok)):
        n = int(np.count_nonzero(seg[r]))
        i = int(rng.integers(0, n))
        kind = r % 5
        if kind == 0:  # flip a token to any id, some past the vocabulary
            tok[r, i] = rng.integers(0, V.VOCAB_SIZE + 3)
        elif kind == 1:  # drop a token: the rest of the row moves up one
            tok[r, i:n - 1] = tok[r, i + 1:n].copy()
            seg[r, i:n - 1] = seg[r, i + 1:n].copy()
            tok[r, n - 1] = seg[r, n - 1] = 0
        elif kind == 2:  # change a segment id
            seg[r, i] = rng.integers(0, seg[r].max() + 2)
        elif kind == 3 and n < L:  # nonzero padding
            tok[r, int(rng.integers(n, L))] = rng.integers(1, V.VOCAB_SIZE)
        else:  # a control token somewhere
            tok[r, i] = rng.integers(0, B)
    got = assert_agrees(tok, seg)
    assert (got[3] != 0).mean() > 0.5  # most damage is caught
    assert {G.BAD_BYTES, G.UNEXPECTED, G.SEGMENT_ORDER, G.PADDING_TOKEN} <= set(got[3].tolist())


def row(*segments, length=64):
    """A row (tokens, segment ids) of token lists, one per segment, padded to ``length``."""
    tok = np.zeros((1, length), np.uint16)
    seg = np.zeros((1, length), np.uint8)
    pos = 0
    for j, s in enumerate(segments):
        tok[0, pos:pos + len(s)] = s
        seg[0, pos:pos + len(s)] = j + 1
        pos += len(s)
    return tok, seg


V4 = [V.SRC_IPV4, B + 10, B, B, B + 1, V.DST_IPV4, B + 193, B, B + 14, B + 1]
RTT = [V.RTT_START, B + 3, B + 200]
TS = [V.TIMESTAMP_ABS] + [B] * 7 + [B + 5]
D1 = [V.TIMESTAMP_DELTA1, B + 60]


def code_of(tok, seg):
    got = G.check_rows(tok, seg)
    return int(got[3][0]), int(got[4][0])


def test_exact_codes_on_hand_made_rows():
    ms = V.MEASUREMENT_START
    good = [ms] + TS + V4 + RTT + [ms] + D1 + V4 + [V.FAILED]
    tok, seg = row(good, [ms] + V4 + RTT)
    got = G.check_rows(tok, seg)
    assert [int(x[0]) for x in got] == [3, len(good) + 1 + len(V4) + len(RTT), 2, 0, -1]

    assert code_of(*row()) == (G.EMPTY_ROW, 0)
    t, s = row(good, [ms] + V4 + RTT)
    s[0, 3] = 0
    assert code_of(t, s) == (G.PADDING_GAP, 3)
    t, s = row(good, [ms] + V4 + RTT)
    s[0, len(good):] = np.where(s[0, len(good):] == 2, 3, 0)
    assert code_of(t, s) == (G.SEGMENT_ORDER, len(good))
    t, s = row(good)
    t[0, 60] = 1
    assert code_of(t, s) == (G.PADDING_TOKEN, 60)
    t, s = row(good)
    t[0, 5] = V.VOCAB_SIZE
    assert code_of(t, s) == (G.PAST_VOCAB, 5)
    assert code_of(*row(good, V4 + RTT)) == (G.NO_START, len(good))
    assert code_of(*row([ms] + V4 + RTT[:2])) == (G.BAD_BYTES, 1 + len(V4) + 1)
    assert code_of(*row([ms] + V4[:3] + [V.FAILED] + V4[4:] + RTT)) == (G.BAD_BYTES, 2)
    assert code_of(*row([ms] + D1 + V4 + RTT)) == (G.DELTA_FIRST, 1)
    assert code_of(*row([ms] + V4 + [V.THROUGHPUT_START])) == (G.UNEXPECTED, 1 + len(V4))
    assert code_of(*row([ms] + V4 + [ms] + V4 + RTT)) == (G.INCOMPLETE, 1 + len(V4))
    v6dst = [V.DST_IPV6] + [B] * 16
    assert code_of(*row([ms] + V4[:5] + v6dst + RTT)) == (G.FAMILIES_DIFFER, 1 + 5 + 17 + 3)
    # decode_context lets the second result overwrite the first; the kernel refuses it
    dup = [ms] + V4 + RTT + [V.FAILED]
    assert code_of(*row(dup)) == (G.DUPLICATE_BLOCK, 1 + len(V4) + len(RTT))
    assert G.check_rows_reference(*row(dup))[3][0] == 0
    assert set(G.MESSAGES) == set(range(13))
