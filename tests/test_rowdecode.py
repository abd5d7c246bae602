"""prep.tokens.rowdecode against prep.tokens.decode.decode_context, segment by segment, on rows the real
pipeline writes; token roles spelled out on a hand-made row."""

import numpy as np
import pytest
from helpers import pipeline_rows

from prep.schema import vocab as V
from prep.schema.rows import RowFormatError
from prep.tokens import rowdecode as RD
from prep.tokens.decode import decode_context

B = V.BYTE_OFFSET


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_rows_equals_decode_context(seed):
    tok, seg, _ = pipeline_rows(seed)
    got = RD.decode_rows(tok, seg)
    want = []
    for r in range(len(tok)):
        for s in range(1, int(seg[r].max()) + 1):
            idx = np.flatnonzero(seg[r] == s)
            for k, d in enumerate(decode_context(tok[r, idx].tolist())):
                want.append((r, s, k, d))
    assert len(got) == len(want) > 1000
    rtt = got.rtt_ms()
    for i, (r, s, k, d) in enumerate(want):
        assert (got.row[i], got.segment[i], got.index[i]) == (r, s, k)
        assert (got.family[i], got.src_hi[i], got.src_lo[i], got.dst_hi[i], got.dst_lo[i]) == (
            d.family, d.src_hi, d.src_lo, d.dst_hi, d.dst_lo)
        assert rtt[i] == d.rtt and bool(got.failed[i]) == d.failed
        assert (bool(got.has_time[i]), int(got.time[i])) == (d.time is not None, d.time or 0)
        assert tuple(got.values[i].tolist()) == d.values
        assert tok[r, got.start[i]] == V.MEASUREMENT_START
        assert tok[r, got.result_pos[i]] == (V.FAILED if d.failed else V.RTT_START)
    assert got.has_time.any() and (~got.has_time).any() and got.failed.any()
    assert (got.family == 6).any() and (got.family == 4).any()
    assert got.values.shape == (len(got), len(V.VALUE_FIELDS)) and got.values.dtype == np.uint64
    some = got.take(np.array([2, 0]))
    assert len(some) == 2 and some.values.shape == (2, len(V.VALUE_FIELDS))


def test_roles_follow_the_vocabulary():
    # the seven roles of the fixed blocks, then one per value field, named by it
    assert RD.ROLES is V.ROLES
    assert RD.ROLES[:RD.VALUE] == ("padding", "marker", "src", "dst", "timestamp", "result", "rtt")
    assert RD.ROLES[RD.VALUE:] == tuple(f.name for f in V.VALUE_FIELDS)
    assert (RD.PAD, RD.MARKER, RD.SRC, RD.DST, RD.TIME, RD.RESULT, RD.RTT) == tuple(range(7))


def test_roles_of_a_hand_made_row():
    # 2 segments: [START SRC4 a.b.c.d DST4 e.f.g.h TS_ABS 8 bytes RTT_START 2 bytes]
    #             [START FAILED DST4 4 bytes SRC4 4 bytes], then 3 padding
    m1 = ([V.MEASUREMENT_START, V.SRC_IPV4] + [B + 10, B + 0, B + 0, B + 1]
          + [V.DST_IPV4] + [B + 1, B + 1, B + 1, B + 1]
          + [V.TIMESTAMP_ABS] + [B + 0] * 4 + [B + 0x69, B + 0x55, B + 0x0E, B + 0x00]
          + [V.RTT_START, B + 0x2E, B + 0x1B])
    m2 = ([V.MEASUREMENT_START, V.FAILED, V.DST_IPV4] + [B + 8] * 4
          + [V.SRC_IPV4] + [B + 9] * 4)
    tok = np.array(m1 + m2 + [0, 0, 0], np.uint16)
    seg = np.array([1] * len(m1) + [2] * len(m2) + [0] * 3, np.uint8)
    roles = RD.token_roles(tok, seg)[0]
    M, S, D, T, R, Q = RD.MARKER, RD.SRC, RD.DST, RD.TIME, RD.RESULT, RD.RTT
    assert roles.tolist() == ([M, M, S, S, S, S, M, D, D, D, D, M] + [T] * 8 + [R, Q, Q]
                              + [M, R, M, D, D, D, D, M, S, S, S, S] + [0, 0, 0])
    got = RD.decode_rows(tok, seg)
    assert got.src_lo.tolist() == [0x0A000001, 0x09090909]
    assert got.dst_lo.tolist() == [0x01010101, 0x08080808]
    assert got.time.tolist() == [0x69550E00, 0] and got.has_time.tolist() == [True, False]
    assert got.rtt_code.tolist() == [0x2E1B, -1]
    assert got.rtt_ms()[0] == 0x61B * 2.0 ** 5 / 1000  # exponent 5, mantissa 0x61B
    assert got.result_pos.tolist() == [20, 24] and got.start.tolist() == [0, 23]
    assert got.index.tolist() == [0, 0] and got.segment.tolist() == [1, 2]


def test_a_damaged_row_is_a_row_format_error():
    tok, seg, _ = pipeline_rows(0)
    tok = tok.copy()
    tok[3, 1] = V.MEASUREMENT_START + 300  # past the vocabulary
    with pytest.raises(RowFormatError, match="row 3: a token id past the vocabulary"):
        RD.decode_rows(tok, seg, where="x")
