import numpy as np
import pytest

from prep.schema import rows, vocab


def test_worked_row_from_docstring():
    tokens = np.array([0, 1, 11, 12, 13, 14, 0, 3, 11, 11, 11, 12, 10, 0, 0, 0], np.uint16)
    seg = np.array([1] * 6 + [2] * 7 + [0] * 3, np.uint8)
    rec = rows.encode_row(tokens, seg)
    assert len(rec) == rows.record_size(16) == 16 + 48
    assert rec[:4] == b"PPRW"
    t, s = rows.decode_row(rec)
    assert t.tolist() == tokens.tolist() and s.tolist() == seg.tolist()
    assert rows.positions(s).tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 0, 0, 0]
    assert rows.loss_mask(s).tolist() == [True] * 5 + [False] + [True] * 6 + [False] * 4
    assert rows.encode_rows(tokens[None], seg[None]) == [rec]


def test_damaged_records_name_the_fix():
    rec = rows.encode_row(np.zeros(8, np.uint16), np.zeros(8, np.uint8))
    with pytest.raises(rows.RowFormatError, match=r"x#3: .*re-run `prep shards`"):
        rows.decode_row(rec[:-1], where="x#3")
    with pytest.raises(rows.RowFormatError, match="not a ping-pack row"):
        rows.decode_row(b"XXXX" + rec[4:])
    with pytest.raises(rows.RowFormatError, match="version 9"):
        rows.decode_row(rec[:4] + (9).to_bytes(2, "little") + rec[6:])


def test_vocab_table():
    assert vocab.VOCAB_SIZE == 267 and vocab.NAMES[11] == "BYTE_0" and vocab.NAMES[266] == "BYTE_255"
    assert vocab.token_name(vocab.FAILED) == "FAILED"
    assert len(vocab.fingerprint()) == 16
