"""Validated measurements as plain column arrays: the contract between validation and tokenizing.

Every entry point (parquet, RIPE Atlas import, synthetic data) ends in ``Measurements``;
everything downstream (contexts, tokenizer, packer, Beam) starts from it. Addresses are
already parsed: 128 bits as two uint64 words, IPv4 in the low 32 bits of ``*_lo`` with
``*_hi == 0`` (family tells them apart, so ``0.0.0.0`` and ``::`` differ).
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, fields

import numpy as np

HASHED_KEY_BIT = np.uint64(1 << 63)  # probe keys derived from src_addr have the top bit set


@dataclass(frozen=True)
class Measurements:
    probe: np.ndarray  # uint64: prb_id, or stable_key(src_addr) | HASHED_KEY_BIT without prb_id
    time: np.ndarray  # int64 Unix seconds
    family: np.ndarray  # uint8, 4 or 6 (source and destination always share it)
    src_hi: np.ndarray  # uint64, high 64 bits of the source address (0 for IPv4)
    src_lo: np.ndarray  # uint64, low 64 bits (IPv4: the 32-bit address)
    dst_hi: np.ndarray  # uint64
    dst_lo: np.ndarray  # uint64
    rtt: np.ndarray  # float64 milliseconds, -1.0 = failed (nothing received)

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


DTYPES = {"probe": np.uint64, "time": np.int64, "family": np.uint8, "src_hi": np.uint64,
          "src_lo": np.uint64, "dst_hi": np.uint64, "dst_lo": np.uint64, "rtt": np.float64}


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
