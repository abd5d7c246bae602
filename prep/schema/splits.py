"""Split rules of `prep shards` (``--split``, ``--test-from``) and the default time cutoff.

Rules (``ShardsConfig.split``; ``test_from`` is the cutoff, Unix seconds):

- ``probe``: a probe's whole history goes to train or to test (``is_test_probe``: a
  salted hash of the probe key, ``test_fraction`` of the probes in test).
- ``time``: measurements with time < test_from go to train, the others to test,
  whatever the probe.
- ``time+probe``: test = the held-out probes' (``is_test_probe``) measurements at or after
  test_from; train = the other probes' measurements before it. The rest (held-out probes
  before the cutoff, the others from it on) is in neither split and counted as
  ``measurements_excluded_by_split``.

Default cutoff (a time split without ``--test-from``): the smallest whole-minute boundary
c (a multiple of 60 s) such that at most ``test_fraction`` of the accepted measurements
have time >= c. Pass 1 already reads every row once, so each read task returns a
histogram of its accepted measurements per whole minute (``minute_histogram``) and the
driver sums them (``MinuteHistogram``): no second read, memory bounded by the number of
distinct minutes (525,600 a year), not the rows. A sum of counts does not depend on the
worker count, the file order or where units start, so neither does the cutoff. An exact
per-second rule would need a histogram 60 times larger (or a second read of the data);
the minute rule is exact for what it states, and the test share it gives is at most
``test_fraction`` (less by at most one minute's measurements).
"""

from __future__ import annotations

import re
from datetime import datetime, timezone

import numpy as np

SPLIT_RULES = ("probe", "time", "time+probe")
TIME_RULES = ("time", "time+probe")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def parse_time(text: str) -> int:
    """Unix seconds of ``text``: ISO-8601 (``2026-01-02T12:00:00Z``, ``2026-01-02``; UTC
    unless it carries an offset) or an integer number of Unix seconds; ValueError if neither."""
    s = str(text).strip()
    if re.fullmatch(r"[+-]?\d+", s):
        value = int(s)
    else:
        try:
            dt = datetime.fromisoformat(s)
        except ValueError:
            raise ValueError(f"{text!r}: not an ISO-8601 time (2026-01-02T12:00:00Z, "
                             "2026-01-02) nor Unix seconds") from None
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=timezone.utc)
        if dt.microsecond:
            raise ValueError(f"{text!r}: the cutoff is whole seconds; drop the fraction")
        value = int(dt.timestamp())
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{text!r}: out of the int64 range of Unix seconds")
    return value


def format_time(t: int) -> str:
    """``2026-01-02T14:37:00Z`` (UTC), or the number where no calendar date fits."""
    try:
        return datetime.fromtimestamp(int(t), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return str(int(t))


def more_test_rows(config: dict) -> str:
    """How to rebuild a dataset whose test split is empty, by the rule in its manifest's
    ``config``: a time split's test rows are those from the cutoff on (--test-from), which
    --test-fraction does not move once the cutoff is known."""
    rule = config.get("split", "probe")
    if rule not in TIME_RULES:
        return "rebuild with `prep shards --test-fraction` above 0"
    fix = f"rebuild with `prep shards --split {rule} --test-from` an earlier cutoff"
    if config.get("test_from") is not None:
        fix += f" than its {format_time(config['test_from'])}"
    if rule == "time+probe" and not config.get("test_fraction"):
        fix += " and --test-fraction above 0 (the probes held out)"
    return fix


def minute_histogram(times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(minutes int64, counts int64): the distinct whole minutes (time // 60) of ``times``,
    ascending, and how many times fall in each."""
    minutes = np.asarray(times, np.int64) // 60
    if len(minutes) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo, hi = int(minutes.min()), int(minutes.max())
    if hi - lo < 4 * len(minutes) + 1024:  # a dense span (the usual case): no sort
        counts = np.bincount(minutes - lo)
        keys = np.flatnonzero(counts)
        return keys.astype(np.int64) + lo, counts[keys].astype(np.int64)
    keys, counts = np.unique(minutes, return_counts=True)
    return keys.astype(np.int64), counts.astype(np.int64)


def merge_histograms(parts) -> tuple[np.ndarray, np.ndarray]:
    """The sum of (minutes, counts) histograms, as one ascending histogram."""
    parts = [(np.asarray(k, np.int64), np.asarray(c, np.int64)) for k, c in parts]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    keys = np.concatenate([k for k, _ in parts])
    counts = np.concatenate([c for _, c in parts])
    uniq, inv = np.unique(keys, return_inverse=True)
    return uniq, np.bincount(inv, weights=counts, minlength=len(uniq)).astype(np.int64)


class MinuteHistogram:
    """Sums histograms as they come (pass 1's read tasks), merging in amortized batches."""

    def __init__(self):
        self._merged = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._pending: list = []
        self._n_pending = 0

    def add(self, minutes, counts) -> None:
        self._pending.append((minutes, counts))
        self._n_pending += len(minutes)
        if self._n_pending > max(1 << 16, len(self._merged[0])):
            self._compact()

    def _compact(self) -> None:
        self._merged = merge_histograms([self._merged, *self._pending])
        self._pending, self._n_pending = [], 0

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        self._compact()
        return self._merged


def default_cutoff(minutes, counts, test_fraction: float) -> int:
    """The smallest whole-minute boundary c (Unix seconds, a multiple of 60) such that at most
    ``test_fraction`` of the histogram's measurements have time >= c.

    How many measurements lie at or after c only changes at a minute that holds some, so
    c is the boundary just after the last minute that must stay in train (the first
    minute's own boundary when all may go to test; 0 when there is no measurement).
    """
    minutes, counts = merge_histograms([(minutes, counts)])  # sorted, distinct, summed
    if len(minutes) == 0:
        return 0
    at_or_after = np.cumsum(counts[::-1])[::-1]  # measurements at minute i or later
    allowed = test_fraction * float(at_or_after[0])
    i = int(np.argmax(at_or_after <= allowed)) if at_or_after[-1] <= allowed else len(minutes)
    if i == 0:
        return int(minutes[0]) * 60
    return (int(minutes[i - 1]) + 1) * 60
