"""Packed rows back to measurement columns and token roles: one Numba pass, rows in, arrays out.

``decode_rows(tokens uint16[R, L], segment_ids uint8[R, L])`` returns a ``RowMeasurements``:
one entry per measurement of every row, in (row, segment, token) order, with the row, the
segment id, the measurement's index in its segment, where its tokens start and where its
result block's header stands, and the measurement itself (family, addresses as two uint64
words, failure, RTT code, time, the value fields). It reads what the tokenizer writes and
is held to ``prep.tokens.decode.decode_context`` segment by segment in tests/test_rowdecode.py.
Rows are checked first with ``prep.tokens.grammar.check_rows``; a row that is not whole
measurements is a ``RowFormatError`` naming it. The grammar comes from prep.schema.vocab
(``BLOCK_OF``, ``WIDTH_OF``), and a block's bytes are read by ``prep.tokens.decode.push_byte``
compiled here, so a new value field is read with no edit.

``token_roles`` labels every token of a row with what it encodes (``ROLES``, from
prep.schema.vocab): the block markers (MEASUREMENT_START and the source, destination, timestamp
and value field headers), the source and destination address bytes, the timestamp bytes,
the result choice (RTT_START or FAILED), the two RTT bytes, then one role per value field
for its bytes (``VALUE + k``, named by the field); 0 is padding. Evaluation reports the
loss of the token at t + 1 by its role, so roles come from the grammar, not from guesses.

Time: a measurement that carried no timestamp (``partial`` and ``none`` contexts) has
``has_time`` False and ``time`` 0. A measurement's RTT comes back as its code
(``EEEEEMMM MMMMMMMM``, -1 when it failed); ``prep.tokens.decode.rtt_ms`` turns a code into ms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from prep.base.jit import kernel
from prep.schema import vocab as V
from prep.schema.rows import RowFormatError
from prep.tokens import grammar
from prep.tokens.decode import push_byte

ROLES = V.ROLES
PAD, MARKER, SRC, DST, TIME, RESULT, RTT = range(7)
VALUE = 7  # the role of value field k's bytes is VALUE + k
_K = len(V.VALUE_FIELDS)
_B = V.BYTE_OFFSET
_BLOCK_OF, _WIDTH_OF = V.BLOCK_OF, V.WIDTH_OF  # by token id; frozen into the kernel
_BYTE_ROLE = np.array([SRC, DST, RTT, TIME] + [VALUE + k for k in range(_K)], np.uint8)  # by block
assert len(ROLES) == VALUE + _K and len(_BYTE_ROLE) == V.N_BLOCKS


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
    values: np.ndarray  # uint64[n, K]: the value fields, in prep.schema.vocab.VALUE_FIELDS order

    def __len__(self) -> int:
        return len(self.row)

    def take(self, idx) -> "RowMeasurements":
        return RowMeasurements(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @property
    def failed(self) -> np.ndarray:
        return self.rtt_code < 0

    def rtt_ms(self) -> np.ndarray:
        """float64 ms at the centre of each code's bin (as prep.tokens.decode.rtt_ms), -1 = failed."""
        code = self.rtt_code.astype(np.int64)
        ms = (code & 0x7FF) * np.exp2(code >> 11) / 1000.0
        return np.where(code < 0, -1.0, ms)


_push_byte = kernel(nogil=True)(push_byte)


@kernel(nogil=True)
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
    values = np.zeros((n, _K), np.uint64)
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
            block = np.int64(_BLOCK_OF[t])  # check_rows vouched for the grammar
            width = np.int64(_WIDTH_OF[t])
            # the header is a marker, except the result choice; its bytes carry its block's role
            roles[r, pos] = RESULT if block == V.BLOCK_RESULT else MARKER
            role = _BYTE_ROLE[block] if block >= 0 else PAD
            hi = lo = np.int64(0)  # the bytes as two words (int64 holding their bits)
            for q in range(pos + 1, pos + 1 + width):
                hi, lo = _push_byte(hi, lo, np.int64(tok[q]) - _B)
                roles[r, q] = role
            if block < 0:  # MEASUREMENT_START
                i += 1
                if seg[pos] != prev_seg:
                    prev_seg = seg[pos]
                    k = 0
                row[i], segment[i], index[i], start[i] = r, seg[pos], k, pos
                k += 1
            elif block == V.BLOCK_SRC:
                family[i] = 4 if width == 4 else 6
                src_hi[i], src_lo[i] = np.uint64(hi), np.uint64(lo)
            elif block == V.BLOCK_DST:
                dst_hi[i], dst_lo[i] = np.uint64(hi), np.uint64(lo)
            elif block == V.BLOCK_RESULT:
                result_pos[i] = pos
                rtt_code[i] = np.int32(lo) if width else -1  # FAILED has no bytes
            elif block == V.BLOCK_TIME:
                prev_t = lo if t == V.TIMESTAMP_ABS else prev_t + lo
                time[i], has_time[i] = prev_t, True
            else:
                values[i, block - V.BLOCK_VALUE] = np.uint64(lo)
            pos += 1 + width
    return (row, segment, index, start, result_pos, family, src_hi, src_lo, dst_hi, dst_lo,
            rtt_code, time, has_time, values, roles)


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


def decode_whole_rows(tokens, segment_ids) -> tuple[RowMeasurements, int]:
    """(measurements, refused): decode_rows of the rows that are whole measurements, their
    ``row`` still an index into the block given; the rows that are not (no RowFormatError)
    are left out and counted. One grammar check, as decode_rows's."""
    tokens = np.ascontiguousarray(tokens, dtype=np.uint16)
    segment_ids = np.ascontiguousarray(segment_ids, dtype=np.uint8)
    n_meas, _, _, error, _ = grammar.check_rows(tokens, segment_ids)
    good = np.flatnonzero(error == 0)
    if len(good) == len(tokens):  # (no copy of the block)
        return RowMeasurements(*_decode(tokens, segment_ids, n_meas)[:-1]), 0
    out = _decode(tokens[good], segment_ids[good], n_meas[good])[:-1]
    return RowMeasurements(good[out[0]], *out[1:]), len(tokens) - len(good)


def token_roles(tokens, segment_ids, *, where: str = "rows") -> np.ndarray:
    """uint8[R, L]: the role (index into ROLES) of every token; 0 on padding."""
    return decode_rows_and_roles(tokens, segment_ids, where=where)[1]


def decode_rows_and_roles(tokens, segment_ids, *, where: str = "rows"):
    tokens, segment_ids, n_meas = _checked(tokens, segment_ids, where)
    out = _decode(tokens, segment_ids, n_meas)
    return RowMeasurements(*out[:-1]), out[-1]
