"""Contexts: the runs of one probe's measurements that become segments of a row.

``plan_contexts`` sorts a bucket's measurements by (probe, time, then every other
column, so input order cannot matter) and walks each probe's history once, cutting a
new context before the measurement that would

1. belong to another probe,
2. push the context past ``row_len`` tokens; such a context then ends up to ``BACKOFF``
   measurements earlier if that leaves its row a gap untimestamped pieces can fill
   (prep.tokens.costs.fillable: a gap of 2-10 tokens fits no measurement),
3. make it longer than ``max_measurements`` measurements,
4. follow a silence longer than ``max_gap_s``, or end more than ``max_span_s`` after
   the context's first measurement.

A cut never falls inside a measurement, and every context starts with an absolute
timestamp. Each context draws its timestamp mode (full / partial / none) and, in
partial mode, which measurements lose their timestamp, from the counter-based RNG of
``prep.tokens.draws``; that fixes each measurement's token ``cost`` before anything is
encoded, so the packer can plan with lengths alone.

The piece length rule is prep.tokens.costs'. Example, one probe, full mode, IPv4 pings at
t = 100, 160, 1000 (14 tokens without the timestamp; ABS 9, DELTA1 2, DELTA4 5 more):
cost = [23, 16, 19], abs_extra = [0, 7, 4]; the piece [1, 3), which restarts with an
absolute timestamp, is 16 + 19 + 7 = 42 tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from prep.pack import planner_kernels as kernels
from prep.pack import supply
from prep.schema.hashing import MASK, mix64
from prep.schema.measurements import FIELDS, Measurements
from prep.tokens.costs import MAX_MEASUREMENT, body, piece_lengths_kernel


@dataclass(frozen=True)
class ContextConfig:
    row_len: int = 1024  # tokens per row; no context is longer
    max_measurements: int = 0  # measurements per context, 0 = no cap (README: why)
    max_gap_s: int = 86_400  # cut after a silence longer than this (s), 0 = never
    max_span_s: int = 0  # cut when a context would cover more than this (s), 0 = never
    mode_weights: tuple[float, float, float] = (0.4, 0.3, 0.3)  # full / partial / none

    def __post_init__(self):
        if self.row_len < MAX_MEASUREMENT:
            raise ValueError(f"row_len {self.row_len} cannot hold one IPv6 measurement "
                             f"({MAX_MEASUREMENT} tokens); use >= 64")
        for name in ("max_measurements", "max_gap_s", "max_span_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns the limit off)")
        w = self.mode_weights
        if len(w) != 3 or min(w) < 0 or sum(w) <= 0:
            raise ValueError(f"mode_weights {w}: three non-negative weights, not all zero")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    sorted: Measurements  # the input sorted by (probe, time, every other column)
    ctx_start: np.ndarray  # int64[n_ctx]: context c is sorted measurements [start, end)
    ctx_end: np.ndarray  # int64[n_ctx]
    ctx_mode: np.ndarray  # uint8[n_ctx]: 0 full, 1 partial, 2 none
    ctx_len: np.ndarray  # int32[n_ctx]: tokens of the whole context
    cost: np.ndarray  # int32[n]: tokens of measurement i inside its context
    has_ts: np.ndarray  # bool[n]: measurement i carries a timestamp
    abs_extra: np.ndarray  # int32[n]: 9 - its timestamp tokens if has_ts, else 0
    hist: np.ndarray  # int64[n]: index of measurement i in its probe's sorted history

    @property
    def n_tokens(self) -> int:
        return int(self.ctx_len.sum())


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of pass ``epoch`` over the data; epoch 0 is ``seed`` itself."""
    if epoch == 0:
        return seed & MASK
    return mix64((seed ^ mix64(epoch & MASK)) & MASK)


def mode_thresholds(weights) -> tuple[int, int]:
    """32-bit thresholds: a draw below the first picks full, below the second partial."""
    w0, w1, w2 = (float(x) for x in weights)
    total = w0 + w1 + w2
    return (min(1 << 32, round(w0 / total * (1 << 32))),
            min(1 << 32, round((w0 + w1) / total * (1 << 32))))


def sort_order(m: Measurements, rows: np.ndarray | None = None) -> np.ndarray:
    """Indices into ``m`` that sort ``m[rows]`` (all of ``m`` when None) by (probe, time,
    family, src, dst, rtt)."""
    # A radix sort orders by (probe, time); only rows tied on both need the other
    # columns, so the full 8-key lexsort runs on those rows alone (usually none).
    if rows is None:
        order = kernels.argsort_probe_time(m.probe, m.time)
    else:
        order = rows[kernels.argsort_probe_time(m.probe[rows], m.time[rows])]
    p, t = m.probe[order], m.time[order]
    tie = (p[1:] == p[:-1]) & (t[1:] == t[:-1])
    if tie.any():
        in_run = np.zeros(len(order), bool)
        in_run[1:] |= tie
        in_run[:-1] |= tie
        tied = order[in_run]
        sub = np.lexsort([getattr(m, k)[tied] for k in reversed(FIELDS)])  # all fields, in order
        order[in_run] = tied[sub]  # tie runs are contiguous, so their slots stay theirs
    return order


def free_supply(s: Measurements, row_len: int, t_partial: int) -> kernels.Supply:
    """The planner's budget of free bodies (prep.pack.supply.budget) for the measurements
    ``s``: their bodies counted, a share 1 - t_partial / 2**32 of them in none mode."""
    failed = s.rtt < 0
    sizes, counts = [], []
    for family, fail in ((4, False), (6, False), (4, True), (6, True)):
        sizes.append(body(family, fail))
        counts.append(int(np.count_nonzero((s.family == family) & (failed == fail))))
    rate, cap = supply.budget(sizes, counts, ((1 << 32) - t_partial) / 2**32, row_len)
    return kernels.Supply(np.array(sizes, np.int64), rate, cap)


def plan_contexts(m: Measurements, cfg: ContextConfig, seed: int,
                  rows: np.ndarray | None = None) -> Plan:
    """Sort ``m[rows]`` (all of ``m`` when None), cut it into contexts and fix every
    measurement's token cost. ``rows`` (a split's, say) spares the caller a copy of them."""
    s = m.take(sort_order(m, rows))
    hist = kernels.history_index(s.probe)
    t_full, t_partial = mode_thresholds(cfg.mode_weights)
    n = len(s)
    if n == 0:
        z64, z32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
        return Plan(s, z64, z64.copy(), np.zeros(0, np.uint8), z32, z32.copy(),
                    np.zeros(0, bool), z32.copy(), z64.copy())
    limits = kernels.CutLimits(cfg.row_len, cfg.max_measurements, cfg.max_gap_s, cfg.max_span_s,
                               np.uint64(min(t_full, (1 << 64) - 1)),
                               np.uint64(min(t_partial, (1 << 64) - 1)))
    ctx_start, ctx_mode, ctx_len, cost, has_ts, abs_extra = kernels.cut_contexts(
        s.arrays(), hist, np.uint64(seed & 0xFFFF_FFFF_FFFF_FFFF), limits,
        free_supply(s, cfg.row_len, t_partial))
    ctx_end = np.empty_like(ctx_start)
    ctx_end[:-1] = ctx_start[1:]
    ctx_end[-1] = n
    return Plan(s, ctx_start, ctx_end, ctx_mode, ctx_len, cost, has_ts, abs_extra, hist)


def piece_lengths(plan: Plan, piece_start, piece_end) -> np.ndarray:
    """int64 token length of each piece [s, e), by the piece length rule."""
    return piece_lengths_kernel(plan.cost, plan.has_ts, plan.abs_extra,
                                        np.ascontiguousarray(piece_start, dtype=np.int64),
                                        np.ascontiguousarray(piece_end, dtype=np.int64))
