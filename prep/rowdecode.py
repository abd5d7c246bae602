"""Packed rows back to measurement columns and token roles: one Numba pass, rows in, arrays out.

``decode_rows(tokens uint16[R, L], segment_ids uint8[R, L])`` returns a ``RowMeasurements``:
one entry per measurement of every row, in (row, segment, token) order, with the row, the
segment id, the measurement's index in its segment, where its tokens start and where its
result block's header stands, and the measurement itself (family, addresses as two uint64
words, failure, RTT code, time). It reads what the tokenizer writes and
is held to ``prep.decode.decode_context`` segment by segment in tests/test_rowdecode.py.
Rows are checked first with ``prep.grammar.check_rows``; a row that is not whole
measurements is a ``RowFormatError`` naming it.

``token_roles`` labels every token of a row with what it encodes (``ROLES``): the block
markers (MEASUREMENT_START and the source, destination and timestamp headers), the
source and destination address bytes, the timestamp bytes, the result choice (RTT_START
or FAILED) and the two RTT bytes; 0 is padding. Evaluation reports the loss of the token
at t + 1 by its role, so roles come from the grammar, not from guesses.

Time: a measurement that carried no timestamp (``partial`` and ``none`` contexts) has
``has_time`` False and ``time`` 0. A measurement's RTT comes back as its code
(``EEEEEMMM MMMMMMMM``, -1 when it failed); ``prep.decode.rtt_ms`` turns a code into ms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
from numba import njit

from prep import grammar
from prep import vocab as V
from prep.rows import RowFormatError

PAD, MARKER, SRC, DST, TIME, RESULT, RTT = range(7)
ROLES = ("padding", "marker", "src", "dst", "timestamp", "result", "rtt")
_B = V.BYTE_OFFSET


@dataclass(frozen=True)
class RowMeasurements:
    row: np.ndarray  # int64: the row (index into the block given) holding the measurement
    segment: np.ndarray  # int32: its segment id in that row (1, 2, ...)
    index: np.ndarray  # int32: its index among its segment's measurements, in token order
    start: np.ndarray  # int32: token offset of its MEASUREMENT_START in the row
    result_pos: np.ndarray  # int32: token offset of its RTT_START or FAILED
    family: np.ndarray  # uint8: 4 or 6
    src_hi: np.ndarray  # uint64 (IPv4: 0)
    src_lo: np.ndarray  # uint64 (IPv4: the 32-bit address)
    dst_hi: np.ndarray  # uint64
    dst_lo: np.ndarray  # uint64
    rtt_code: np.ndarray  # int32: EEEEEMMM MMMMMMMM, -1 = failed
    time: np.ndarray  # int64 Unix seconds, 0 where has_time is False
    has_time: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.row)

    def take(self, idx) -> "RowMeasurements":
        return RowMeasurements(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @property
    def failed(self) -> np.ndarray:
        return self.rtt_code < 0

    def rtt_ms(self) -> np.ndarray:
        """float64 ms at the centre of each code's bin (as prep.decode.rtt_ms), -1 = failed."""
        code = self.rtt_code.astype(np.int64)
        ms = (code & 0x7FF) * np.exp2(code >> 11) / 1000.0
        return np.where(code < 0, -1.0, ms)


@njit(cache=True, nogil=True)
def _bytes_value(tok, pos, n):
    v = np.uint64(0)
    for k in range(pos, pos + n):
        v = (v << np.uint64(8)) | np.uint64(tok[k] - _B)
    return v


@njit(cache=True, nogil=True)
def _decode(tokens, segment_ids, n_meas_per_row):
    R, L = tokens.shape
    n = 0
    for r in range(R):
        n += n_meas_per_row[r]
    row = np.zeros(n, np.int64)
    segment = np.zeros(n, np.int32)
    index = np.zeros(n, np.int32)
    start = np.zeros(n, np.int32)
    result_pos = np.zeros(n, np.int32)
    family = np.zeros(n, np.uint8)
    src_hi = np.zeros(n, np.uint64)
    src_lo = np.zeros(n, np.uint64)
    dst_hi = np.zeros(n, np.uint64)
    dst_lo = np.zeros(n, np.uint64)
    rtt_code = np.zeros(n, np.int32)
    time = np.zeros(n, np.int64)
    has_time = np.zeros(n, np.bool_)
    roles = np.zeros((R, L), np.uint8)
    i = -1
    for r in range(R):
        tok, seg = tokens[r], segment_ids[r]
        prev_seg = 0
        prev_t = np.int64(0)
        k = 0
        pos = 0
        while pos < L and seg[pos] != 0:
            t = np.int64(tok[pos])
            role = MARKER
            width = 0
            if t == V.MEASUREMENT_START:
                i += 1
                if seg[pos] != prev_seg:
                    prev_seg = seg[pos]
                    k = 0
                row[i], segment[i], index[i], start[i] = r, seg[pos], k, pos
                k += 1
            elif t == V.SRC_IPV4 or t == V.SRC_IPV6:
                width = 4 if t == V.SRC_IPV4 else 16
                family[i] = 4 if t == V.SRC_IPV4 else 6
                role = SRC
                src_hi[i] = _bytes_value(tok, pos + 1, width - 8) if width == 16 else np.uint64(0)
                src_lo[i] = _bytes_value(tok, pos + 1 + width - min(width, 8), min(width, 8))
            elif t == V.DST_IPV4 or t == V.DST_IPV6:
                width = 4 if t == V.DST_IPV4 else 16
                role = DST
                dst_hi[i] = _bytes_value(tok, pos + 1, width - 8) if width == 16 else np.uint64(0)
                dst_lo[i] = _bytes_value(tok, pos + 1 + width - min(width, 8), min(width, 8))
            elif t == V.RTT_START:
                width, role = 2, RTT
                result_pos[i] = pos
                rtt_code[i] = np.int32(_bytes_value(tok, pos + 1, 2))
            elif t == V.FAILED:
                role = RESULT
                result_pos[i] = pos
                rtt_code[i] = -1
            else:  # a timestamp header (check_rows vouched for the grammar)
                role = TIME
                if t == V.TIMESTAMP_ABS:
                    width = 8
                    prev_t = np.int64(_bytes_value(tok, pos + 1, 8))
                else:
                    width = 1 if t == V.TIMESTAMP_DELTA1 else 4
                    prev_t += np.int64(_bytes_value(tok, pos + 1, width))
                time[i], has_time[i] = prev_t, True
            # the header is a marker, except the result choice; its bytes carry the role
            roles[r, pos] = RESULT if (t == V.RTT_START or t == V.FAILED) else MARKER
            for q in range(pos + 1, pos + 1 + width):
                roles[r, q] = role
            pos += 1 + width
    return (row, segment, index, start, result_pos, family, src_hi, src_lo, dst_hi, dst_lo,
            rtt_code, time, has_time, roles)


def _checked(tokens, segment_ids, where: str):
    tokens = np.ascontiguousarray(tokens, dtype=np.uint16)
    segment_ids = np.ascontiguousarray(segment_ids, dtype=np.uint8)
    if tokens.ndim == 1:
        tokens, segment_ids = tokens[None], segment_ids[None]
    n_meas, _, _, error, error_pos = grammar.check_rows(tokens, segment_ids)
    bad = np.flatnonzero(error)
    if len(bad):
        r = int(bad[0])
        raise RowFormatError(f"{where}: row {r}: {grammar.MESSAGES[int(error[r])]} (token "
                             f"{int(error_pos[r])}); re-run `prep shards` to rebuild the dataset")
    return tokens, segment_ids, n_meas


def decode_rows(tokens, segment_ids, *, where: str = "rows") -> RowMeasurements:
    """The measurements of a block of rows (see the module doc); RowFormatError if a row
    is not what the tokenizer writes."""
    return decode_rows_and_roles(tokens, segment_ids, where=where)[0]


def token_roles(tokens, segment_ids, *, where: str = "rows") -> np.ndarray:
    """uint8[R, L]: the role (index into ROLES) of every token; 0 on padding."""
    return decode_rows_and_roles(tokens, segment_ids, where=where)[1]


def decode_rows_and_roles(tokens, segment_ids, *, where: str = "rows"):
    tokens, segment_ids, n_meas = _checked(tokens, segment_ids, where)
    out = _decode(tokens, segment_ids, n_meas)
    return RowMeasurements(*out[:-1]), out[-1]
