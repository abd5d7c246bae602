"""Validated measurements as plain column arrays: the contract between validation and tokenizing.

Every entry point (parquet, RIPE Atlas import, synthetic data) ends in ``Measurements``;
everything downstream (contexts, tokenizer, packer, Beam) starts from it. Addresses are
already parsed: 128 bits as two uint64 words, IPv4 in the low 32 bits of ``*_lo`` with
``*_hi == 0`` (family tells them apart, so ``0.0.0.0`` and ``::`` differ).
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections import namedtuple
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa

from prep.schema.vocab import VALUE_FIELDS

HASHED_KEY_BIT = np.uint64(1 << 63)  # probe keys derived from src_addr have the top bit set


def _column(dtype) -> "field":
    return field(metadata={"dtype": np.dtype(dtype)})


@dataclass(frozen=True)
class Measurements:
    """The schema: the fields below, in this order, with their dtypes. Everything else
    (DTYPES, FIELDS, the Arrow schema, the sort key) is derived from it."""
    probe: np.ndarray = _column(np.uint64)  # prb_id, or stable_key(src_addr) | HASHED_KEY_BIT
    time: np.ndarray = _column(np.int64)  # Unix seconds
    family: np.ndarray = _column(np.uint8)  # 4 or 6 (source and destination always share it)
    src_hi: np.ndarray = _column(np.uint64)  # high 64 bits of the source address (0 for IPv4)
    src_lo: np.ndarray = _column(np.uint64)  # low 64 bits (IPv4: the 32-bit address)
    dst_hi: np.ndarray = _column(np.uint64)
    dst_lo: np.ndarray = _column(np.uint64)
    rtt: np.ndarray = _column(np.float64)  # milliseconds, -1.0 = failed (nothing received)

    def __len__(self) -> int:
        return len(self.time)

    def take(self, idx: np.ndarray) -> "Measurements":
        return Measurements(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    @staticmethod
    def concat(parts: list["Measurements"]) -> "Measurements":
        if not parts:
            return empty()
        return Measurements(**{f.name: np.concatenate([getattr(p, f.name) for p in parts])
                               for f in fields(Measurements)})

    def columns(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def arrays(self) -> "Columns":
        """The columns as one ``Columns`` namedtuple: how the Numba kernels take them."""
        return Columns(*(getattr(self, k) for k in FIELDS))

    def values(self) -> np.ndarray:
        """uint64[K, n]: the value fields' columns (prep.schema.vocab.VALUE_FIELDS), in that order."""
        out = np.empty((len(VALUE_FIELDS), len(self)), np.uint64)
        for k, f in enumerate(VALUE_FIELDS):
            out[k] = getattr(self, f.name)
        return out


DTYPES = {f.name: f.metadata["dtype"] for f in fields(Measurements)}
# The fields in order. Sorting by all of them, in this order, is the total order that
# determinism rests on (prep.pack.contexts.sort_order breaks (probe, time) ties with the rest).
FIELDS = tuple(DTYPES)
# The columns as one argument of a Numba kernel (prep.tokens.kernel, prep.pack.planner_kernels): a
# namedtuple of arrays, read by field name (``cols.rtt[i]``).
Columns = namedtuple("Columns", FIELDS)
for _f in VALUE_FIELDS:  # its column holds every value of its width
    _dt = DTYPES.get(_f.name, np.dtype(np.float64))
    if _dt.kind != "u" or _dt.itemsize < _f.width:
        raise TypeError(f"value field {_f.name!r} needs a Measurements column of an unsigned "
                        f"dtype of at least {_f.width} bytes")
ARROW_SCHEMA = pa.schema([(k, pa.from_numpy_dtype(v)) for k, v in DTYPES.items()])


def to_arrow(m: Measurements) -> pa.RecordBatch:
    return pa.record_batch([pa.array(getattr(m, k)) for k in FIELDS], schema=ARROW_SCHEMA)


def from_arrow(t: pa.Table | None) -> Measurements:
    """Measurements of a table of ARROW_SCHEMA (None: none)."""
    if t is None:
        return empty()
    t = t.combine_chunks()
    return Measurements(**{k: t.column(k).to_numpy() for k in FIELDS})


def empty() -> Measurements:
    return Measurements(**{k: np.zeros(0, dt) for k, dt in DTYPES.items()})


def stable_key(text: str) -> int:
    """Probe key for a source address when there is no prb_id: same text, same key, everywhere."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | (1 << 63)


def addr_words(text: str) -> tuple[int, int, int]:
    """(family, hi, lo) of an address text; raises ValueError when it is not an address.

    An IPv6 zone id (``fe80::1%eth0``) is refused: it names an interface of the measuring
    host, means nothing anywhere else, and two words cannot carry it, so keeping the address
    without it would silently merge different links' ``fe80::1``.
    """
    a = ipaddress.ip_address(text)
    if getattr(a, "scope_id", None):
        raise ValueError(f"{text!r} has an IPv6 zone id (%{a.scope_id}); give the address without it")
    v = int(a)
    return a.version, v >> 64, v & 0xFFFF_FFFF_FFFF_FFFF


def addr_text(family: int, hi: int, lo: int) -> str:
    if int(family) == 4:
        return str(ipaddress.IPv4Address(int(lo) & 0xFFFF_FFFF))
    return str(ipaddress.IPv6Address((int(hi) << 64) | int(lo)))
