"""The token vocabulary and its grammar, as data (compatible with ping-llm's schema).

267 symbols: 11 control tokens followed by the 256 byte values, then one header token per
value field (``VALUE_FIELDS``; none in this vocabulary). Everything that emits or reads
tokens takes its ids from here, and every reader of tokens (prep.tokens.decode, prep.tokens.grammar,
prep.tokens.rowdecode) takes the grammar from ``BLOCK_OF``/``WIDTH_OF``; the fingerprint of this
table goes into every manifest so a reader can refuse shards written with another
vocabulary.

A measurement is MEASUREMENT_START, then one block of each kind in a drawn order: source,
destination, result, timestamp (only where the measurement keeps one), then one block per
value field. A block is a header token and the bytes it announces (``WIDTH_OF``).

A value field is a measurement column written as its header token and ``width`` bytes,
big-endian: the TTL, the packet size. Adding one is an entry in ``VALUE_FIELDS``, its
column in ``prep.schema.measurements.Measurements`` (an unsigned integer dtype), and an importer
that fills it; the costs, the tokenizer, its oracle, the three readers, validation and the
token roles follow from this table (docs/ARCHITECTURE.md; tests/test_value_field.py adds
the packet size to a copy of the code and runs it end to end).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

VOCAB_VERSION = 1

MEASUREMENT_START = 0
SRC_IPV4 = 1
SRC_IPV6 = 2
DST_IPV4 = 3
DST_IPV6 = 4
TIMESTAMP_ABS = 5  # 8 bytes, big-endian Unix seconds
TIMESTAMP_DELTA1 = 6  # 1 byte: seconds since the previous timestamped measurement, 0-255
TIMESTAMP_DELTA4 = 7  # 4 bytes, big-endian seconds, for gaps >= 256 s
RTT_START = 8  # 2 bytes: EEEEEMMM MMMMMMMM, µs = mantissa << exponent
THROUGHPUT_START = 9  # reserved
FAILED = 10  # the ping got no reply

BYTE_OFFSET = 11  # token id of BYTE_0; BYTE_b = BYTE_OFFSET + b


class ValueField(NamedTuple):
    """A measurement column written as a block: a header token, then ``width`` bytes of
    the value, big-endian. ``name`` is the ``Measurements`` column and the input column."""
    name: str
    width: int  # bytes, 1-8


# Each one multiplies the block orders (prep.tokens.kernel's tables, compiled in as constants):
# 120 orders with one, 5,040 with three; a fourth would make 40,320 and tables of megabytes.
VALUE_FIELDS: tuple[ValueField, ...] = ()
# The value fields' header tokens come after the bytes, so adding one moves no other id.
VALUE_HEADERS = tuple(BYTE_OFFSET + 256 + k for k in range(len(VALUE_FIELDS)))
VOCAB_SIZE = BYTE_OFFSET + 256 + len(VALUE_FIELDS)  # 267

CONTROL_NAMES = (
    "MEASUREMENT_START",
    "SRC_IPV4",
    "SRC_IPV6",
    "DST_IPV4",
    "DST_IPV6",
    "TIMESTAMP_ABS",
    "TIMESTAMP_DELTA1",
    "TIMESTAMP_DELTA4",
    "RTT_START",
    "THROUGHPUT_START",
    "FAILED",
)
NAMES = (CONTROL_NAMES + tuple(f"BYTE_{b}" for b in range(256))
         + tuple(f"{f.name.upper()}_START" for f in VALUE_FIELDS))
assert len(NAMES) == VOCAB_SIZE

# The grammar. Blocks: 0 source, 1 destination, 2 result, 3 timestamp, 4 + k value field k.
BLOCK_SRC, BLOCK_DST, BLOCK_RESULT, BLOCK_TIME = 0, 1, 2, 3
BLOCK_VALUE = 4  # value field k is block BLOCK_VALUE + k
N_BLOCKS = BLOCK_VALUE + len(VALUE_FIELDS)
REQUIRED_BLOCKS = ((1 << N_BLOCKS) - 1) & ~(1 << BLOCK_TIME)  # bits of the blocks every measurement has


def _grammar() -> tuple[np.ndarray, np.ndarray]:
    block = np.full(VOCAB_SIZE, -1, np.int8)  # not a block header: MEASUREMENT_START, bytes, reserved
    width = np.zeros(VOCAB_SIZE, np.int8)
    headers = {SRC_IPV4: (BLOCK_SRC, 4), SRC_IPV6: (BLOCK_SRC, 16), DST_IPV4: (BLOCK_DST, 4),
               DST_IPV6: (BLOCK_DST, 16), RTT_START: (BLOCK_RESULT, 2), FAILED: (BLOCK_RESULT, 0),
               TIMESTAMP_ABS: (BLOCK_TIME, 8), TIMESTAMP_DELTA1: (BLOCK_TIME, 1),
               TIMESTAMP_DELTA4: (BLOCK_TIME, 4)}
    headers.update({h: (BLOCK_VALUE + k, f.width) for k, (h, f) in enumerate(zip(VALUE_HEADERS, VALUE_FIELDS))})
    for token, (b, w) in headers.items():
        block[token], width[token] = b, w
    return block, width


BLOCK_OF, WIDTH_OF = _grammar()  # by token id: the block a header opens (-1: none), its bytes

# What a token encodes (prep.tokens.rowdecode.token_roles; evaluation reports loss by role): 0
# padding, the block markers, the address bytes, the timestamp bytes, the result choice
# (RTT_START or FAILED), the RTT bytes, then the bytes of each value field, by its name.
ROLES = (("padding", "marker", "src", "dst", "timestamp", "result", "rtt")
         + tuple(f.name for f in VALUE_FIELDS))
if len(set(ROLES)) != len(ROLES):
    raise ValueError(f"a value field is named like another role: {ROLES}")


def token_name(token: int) -> str:
    return NAMES[token]


def fingerprint() -> str:
    """Hex digest of the vocabulary table; changes whenever any id or name changes."""
    text = f"v{VOCAB_VERSION}\n" + "\n".join(f"{i} {n}" for i, n in enumerate(NAMES))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
