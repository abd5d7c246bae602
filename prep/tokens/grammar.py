"""Is a block of rows exactly what the tokenizer writes? One Numba pass, rows in, codes out.

``check_rows(tokens uint16[R, L], segment_ids uint8[R, L])`` walks every row once and
returns, per row, ``(n_measurements, n_tokens, n_segments, error, error_pos)``: the counts
of a sound row (0 where ``error != 0``), or the first problem's code (``MESSAGES``) and
the position in the row it refers to. The checks, in the order they are made:

1. layout (the row format, prep.schema.rows): not empty; padding only after the last
   segment; segment ids run 1, 2, 3, …; every segment opens with MEASUREMENT_START;
   padding is token 0; every token id is below VOCAB_SIZE;
2. grammar (what prep.tokens.kernel writes), segment by segment, measurement by measurement: each
   block header is followed by its bytes inside the segment; a delta timestamp has an
   earlier timestamped measurement in its segment; no other token stands between blocks;
   each measurement has a source, a destination and a result, of one family, and a block
   of every value field. Which block a header opens and how many bytes follow it come
   from prep.schema.vocab (``BLOCK_OF``, ``WIDTH_OF``, ``REQUIRED_BLOCKS``), frozen into the kernel.

Its plain-Python twin, ``check_rows_reference``, runs the layout checks in numpy, then
``prep.tokens.decode.decode_context`` on every segment. The kernel is stricter in one way: a
block written twice in a measurement (which the tokenizer never does) is
``DUPLICATE_BLOCK``, where ``decode_context`` keeps the later one. ``error_pos`` is the row
position ``decode_context`` names (``BAD_BYTES``: the block's first byte; ``INCOMPLETE``,
``FAMILIES_DIFFER``: the token after the measurement); ``segment_ids[error_pos - 1]`` is the
segment at fault.
"""

from __future__ import annotations

import numpy as np

from prep.base.jit import kernel
from prep.schema import vocab as V
from prep.tokens.decode import DecodeError, decode_context

OK = 0
EMPTY_ROW = 1
PADDING_GAP = 2
SEGMENT_ORDER = 3
PADDING_TOKEN = 4
PAST_VOCAB = 5
NO_START = 6
BAD_BYTES = 7
DELTA_FIRST = 8
UNEXPECTED = 9
INCOMPLETE = 10
FAMILIES_DIFFER = 11
DUPLICATE_BLOCK = 12

_NEEDED = ("source", "destination", "result") + tuple(f.name for f in V.VALUE_FIELDS)
LAYOUT_CODES = (EMPTY_ROW, PADDING_GAP, SEGMENT_ORDER, PADDING_TOKEN, PAST_VOCAB, NO_START)
MESSAGES = {
    OK: "ok",
    EMPTY_ROW: "an empty row",
    PADDING_GAP: "padding before the last segment",
    SEGMENT_ORDER: "segment ids do not run 1, 2, 3, …",
    PADDING_TOKEN: "nonzero padding",
    PAST_VOCAB: "a token id past the vocabulary",
    NO_START: "a segment does not open with MEASUREMENT_START",
    BAD_BYTES: "a block's bytes are missing or not bytes",
    DELTA_FIRST: "a delta timestamp with no absolute one before it",
    UNEXPECTED: "an unexpected token between blocks",
    INCOMPLETE: f"a measurement without {', '.join(_NEEDED[:-1])} or {_NEEDED[-1]}",
    FAMILIES_DIFFER: "source and destination families differ",
    DUPLICATE_BLOCK: "a measurement holds the same block twice",
}

_MS = V.MEASUREMENT_START
_B = V.BYTE_OFFSET
_VOCAB = V.VOCAB_SIZE
_BLOCK_OF, _WIDTH_OF = V.BLOCK_OF, V.WIDTH_OF  # by token id; frozen into the kernel
_REQUIRED = V.REQUIRED_BLOCKS
_TIME_BIT = 1 << V.BLOCK_TIME


@kernel(nogil=True)
def _layout(tok, seg):
    """(error, pos, n_tokens, n_segments) of one row's layout."""
    L = len(seg)
    n = 0
    prev = 0
    first_zero = -1
    gap = False
    order_pos = start_pos = pad_pos = vocab_pos = -1
    for i in range(L):
        s = np.int64(seg[i])
        t = np.int64(tok[i])
        if s == 0:
            if first_zero < 0:
                first_zero = i
            if t != 0 and pad_pos < 0:
                pad_pos = i
        else:
            n += 1
            if first_zero >= 0:
                gap = True
            elif s != prev:  # a segment starts
                if s != prev + 1 and order_pos < 0:
                    order_pos = i
                if t != _MS and start_pos < 0:
                    start_pos = i
                prev = s
        if t >= _VOCAB and vocab_pos < 0:
            vocab_pos = i
    if n == 0:
        return EMPTY_ROW, 0, 0, 0
    if gap:
        return PADDING_GAP, first_zero, 0, 0
    if order_pos >= 0:
        return SEGMENT_ORDER, order_pos, 0, 0
    if start_pos >= 0:
        return NO_START, start_pos, 0, 0
    if pad_pos >= 0:
        return PADDING_TOKEN, pad_pos, 0, 0
    if vocab_pos >= 0:
        return PAST_VOCAB, vocab_pos, 0, 0
    return OK, -1, n, prev


@kernel(nogil=True)
def _layout_sound(tok, seg):
    """n_tokens of a row whose layout is sound, else -1: one branch-free pass (LLVM
    vectorizes it) that only says yes or no; ``_layout`` finds what is wrong."""
    L = len(seg)
    n = L
    while n > 0 and seg[n - 1] == 0:
        n -= 1
    bad = n == 0 or seg[0] != 1 or tok[0] != _MS
    for i in range(1, n):
        d = np.int64(seg[i]) - np.int64(seg[i - 1])
        bad |= (np.uint64(d) > 1) | ((d != 0) & (tok[i] != _MS))
    for i in range(n):
        bad |= tok[i] >= _VOCAB
    for i in range(n, L):
        bad |= tok[i] != 0
    return -1 if bad else n


@kernel(nogil=True)
def _segment(tok, a, b):
    """(error, pos, measurements) of the segment tok[a:b], which opens with MEASUREMENT_START."""
    n_meas = 0
    have_ts = False  # an earlier measurement of this segment had a timestamp
    pos = a
    while pos < b:
        pos += 1  # tok[pos] is MEASUREMENT_START: the inner loop stops only there or at b
        seen = 0  # bits of the blocks this measurement has
        v6_src = v6_dst = False
        while pos < b and tok[pos] != _MS:
            t = np.int64(tok[pos])  # below VOCAB_SIZE: the layout is sound
            pos += 1
            block = np.int64(_BLOCK_OF[t])
            if block < 0:
                return UNEXPECTED, pos - 1, 0
            if block == V.BLOCK_TIME and t != V.TIMESTAMP_ABS and not have_ts:
                return DELTA_FIRST, pos - 1, 0
            bit = np.int64(1) << block
            if seen & bit:
                return DUPLICATE_BLOCK, pos - 1, 0
            seen |= bit
            width = np.int64(_WIDTH_OF[t])
            if block == V.BLOCK_SRC:
                v6_src = width == 16
            elif block == V.BLOCK_DST:
                v6_dst = width == 16
            if pos + width > b:
                return BAD_BYTES, pos, 0
            for k in range(pos, pos + width):
                if np.uint64(np.int64(tok[k]) - _B) >= 256:  # not a byte
                    return BAD_BYTES, pos, 0
            pos += width
        if (seen & _REQUIRED) != _REQUIRED:
            return INCOMPLETE, pos, 0
        if v6_src != v6_dst:
            return FAMILIES_DIFFER, pos, 0
        if seen & _TIME_BIT:
            have_ts = True
        n_meas += 1
    return OK, -1, n_meas


@kernel(nogil=True)
def check_rows(tokens, segment_ids):
    """Per row: (n_measurements, n_tokens, n_segments, error, error_pos); see the module doc."""
    R = tokens.shape[0]
    n_meas = np.zeros(R, np.int64)
    n_tok = np.zeros(R, np.int64)
    n_seg = np.zeros(R, np.int64)
    error = np.zeros(R, np.int32)
    error_pos = np.full(R, -1, np.int64)
    for r in range(R):
        tok, seg = tokens[r], segment_ids[r]
        n = _layout_sound(tok, seg)
        if n >= 0:
            e, p, ns = OK, -1, np.int64(seg[n - 1])
        else:
            e, p, n, ns = _layout(tok, seg)
        m = 0
        a = 0
        while e == OK and a < n:
            b = a + 1
            while b < n and seg[b] == seg[a]:
                b += 1
            e, p, k = _segment(tok, a, b)
            m += k
            a = b
        if e == OK:
            n_meas[r], n_tok[r], n_seg[r] = m, n, ns
        else:
            error[r], error_pos[r] = e, p
    return n_meas, n_tok, n_seg, error, error_pos


# --- the plain-Python twin -------------------------------------------------------------

_DECODE_CODES = {  # decode_context's DecodeError.kind → code
    "bad_bytes": BAD_BYTES, "no_start": NO_START, "delta_first": DELTA_FIRST,
    "unexpected": UNEXPECTED, "incomplete": INCOMPLETE, "families_differ": FAMILIES_DIFFER,
}


def check_row_reference(tok: np.ndarray, seg: np.ndarray) -> tuple[int, int, int, int, int]:
    """(n_measurements, n_tokens, n_segments, error, error_pos) of one row, in numpy and
    ``decode_context``; never reports DUPLICATE_BLOCK (see the module doc)."""
    tok, seg = np.asarray(tok, np.int64), np.asarray(seg, np.int64)
    real = seg > 0
    n = int(real.sum())
    if n == 0:
        return 0, 0, 0, EMPTY_ROW, 0
    if not real[:n].all():
        return 0, 0, 0, PADDING_GAP, int(np.argmin(real))
    d = np.diff(seg[:n])
    bad = np.flatnonzero((d < 0) | (d > 1)) + 1
    if seg[0] != 1 or len(bad):
        return 0, 0, 0, SEGMENT_ORDER, 0 if seg[0] != 1 else int(bad[0])
    starts = np.concatenate([[0], np.flatnonzero(d) + 1])
    no_start = starts[tok[starts] != V.MEASUREMENT_START]
    if len(no_start):
        return 0, 0, 0, NO_START, int(no_start[0])
    if np.any(tok[n:] != 0):
        return 0, 0, 0, PADDING_TOKEN, n + int(np.argmax(tok[n:] != 0))
    if tok.max() >= V.VOCAB_SIZE:
        return 0, 0, 0, PAST_VOCAB, int(np.argmax(tok >= V.VOCAB_SIZE))
    n_meas = 0
    for a, b in zip(starts.tolist(), starts[1:].tolist() + [n]):
        try:
            n_meas += len(decode_context(tok[a:b].tolist()))
        except DecodeError as e:
            return 0, 0, 0, _DECODE_CODES[e.kind], a + e.pos
    return n_meas, n, len(starts), OK, -1


def check_rows_reference(tokens: np.ndarray, segment_ids: np.ndarray):
    """``check_rows`` row by row in plain Python (slow: for tests)."""
    out = [check_row_reference(t, s) for t, s in zip(tokens, segment_ids)]
    cols = list(zip(*out)) if out else [()] * 5
    return tuple(np.array(c, dt) for c, dt in zip(cols, [np.int64] * 3 + [np.int32, np.int64]))
