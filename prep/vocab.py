"""The token vocabulary, as data (compatible with ping-llm's schema).

267 symbols: 11 control tokens followed by the 256 byte values. Everything that
emits or reads tokens takes its ids from here; the fingerprint of this table goes
into every manifest so a reader can refuse shards written with another vocabulary.
"""

from __future__ import annotations

import hashlib

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
VOCAB_SIZE = BYTE_OFFSET + 256  # 267

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
NAMES = CONTROL_NAMES + tuple(f"BYTE_{b}" for b in range(256))
assert len(NAMES) == VOCAB_SIZE


def token_name(token: int) -> str:
    return NAMES[token]


def fingerprint() -> str:
    """Hex digest of the vocabulary table; changes whenever any id or name changes."""
    text = f"v{VOCAB_VERSION}\n" + "\n".join(f"{i} {n}" for i, n in enumerate(NAMES))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
