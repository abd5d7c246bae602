"""Counts in words for the lines people read: ``count(1, "measurement")`` is "1
measurement", ``count(2_000, "measurement")`` "2,000 measurements"."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` (with thousands separators) and ``noun``, plural unless ``n`` is 1."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
