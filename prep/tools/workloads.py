"""The workloads the benchmarks time, and the tests that pin their figures reuse.

- ``atlas_like``: measurements in the shape of RIPE Atlas (3,000 probes pinging every 240 s,
  58 % IPv4, ~17 % failed, lognormal RTTs);
- ``synthetic_contexts``: planned contexts of token costs shaped like the tokenizer's output,
  sparse (most contexts short) or busy (every context cut near the row length);
- ``builtin_contexts``: `prep synth` data planned as `prep shards` plans it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from prep.base.jit import kernel
from prep.schema.measurements import Measurements
from prep.tokens.costs import (
    BACKOFF,
    FAILED_BODIES,
    OK_BODIES,
    TS_ABS,
    TS_DELTA1,
    TS_DELTA4,
    fillable,
)

ROW_LEN = 1024
SYNTH_ROWS = 3_000_000  # the Makefile's `prep synth` settings: 3M rows, 3000 probes, 2 days


def atlas_like(n: int, probes: int = 3000, seed: int = 0) -> Measurements:
    rng = np.random.default_rng(seed)
    probe = np.sort(rng.integers(1, 1_000_000, probes).astype(np.uint64))[rng.integers(0, probes, n)]
    fam = np.where(rng.random(n) < 0.58, 4, 6).astype(np.uint8)
    v6 = fam == 6

    def words():
        hi = np.where(v6, rng.integers(0, 2 ** 63, n, dtype=np.uint64) | np.uint64(0x2000 << 48), 0)
        lo = np.where(v6, rng.integers(0, 2 ** 63, n, dtype=np.uint64), rng.integers(0, 2 ** 32, n))
        return hi.astype(np.uint64), lo.astype(np.uint64)

    (src_hi, src_lo), (dst_hi, dst_lo) = words(), words()
    time_ = 1_700_000_000 + 240 * rng.integers(0, 20_000, n) + rng.integers(0, 5, n)
    rtt = np.where(rng.random(n) < 0.17, -1.0, rng.lognormal(np.log(50), 0.9, n))
    return Measurements(probe=probe, time=time_.astype(np.int64), family=fam, src_hi=src_hi,
                        src_lo=src_lo, dst_hi=dst_hi, dst_lo=dst_lo, rtt=rtt)


@kernel
def _synth(n_ctx, busy, seed, row_len):
    """Contexts shaped like the tokenizer's output (prep.tokens.costs: bodies 12-38 tokens, timestamps
    0/2/5/9)."""
    np.random.seed(seed)
    cap = n_ctx * (70 if busy else 14) + 100
    cost = np.empty(cap, np.int32)
    has_ts = np.zeros(cap, np.bool_)
    abs_extra = np.zeros(cap, np.int32)
    starts = np.empty(n_ctx, np.int64)
    ends = np.empty(n_ctx, np.int64)
    n = 0
    for c in range(n_ctx):
        p6 = (0.0, 0.42, 1.0)[np.random.randint(3)]  # v4-only, dual-stack, v6-only probes
        u = np.random.random()
        mode = 0 if u < 0.4 else (1 if u < 0.7 else 2)  # full / partial / none
        keep = 1.0 if mode == 0 else (0.1 + 0.8 * np.random.random() if mode == 1 else 0.0)
        # sparse: 1-80 measurements, most contexts short (time-window cuts)
        want = 1 << 30 if busy else min(80, 1 + int(np.random.exponential(10.0)))
        if n + 200 > cost.shape[0]:
            break
        starts[c] = n
        total = 0
        first = True
        for _ in range(want):
            v6 = 1 if np.random.random() < p6 else 0
            failed = np.random.random() < 0.17
            body = FAILED_BODIES[v6] if failed else OK_BODIES[v6]
            ts = np.random.random() < keep
            t = 0
            if ts:
                t = TS_ABS if first else (TS_DELTA1 if np.random.random() < 0.9 else TS_DELTA4)
            if total + body + t > row_len:  # end it as the planner does (prep.pack.planner_kernels)
                back = 0
                while back < BACKOFF and n - 1 > starts[c] and \
                        not fillable(row_len - total):
                    n -= 1
                    total -= cost[n]
                    back += 1
                break
            cost[n] = body + t
            has_ts[n] = ts
            abs_extra[n] = TS_ABS - t if ts else 0
            if ts:
                first = False
            total += body + t
            n += 1
        ends[c] = n
    return starts, ends, cost[:n], has_ts[:n], abs_extra[:n]


def synthetic_contexts(n_ctx: int, *, busy: bool, seed: int = 0):
    """(ctx_start, ctx_end, cost, has_ts, abs_extra) for ``n_ctx`` synthetic contexts."""
    return _synth(n_ctx, busy, seed, ROW_LEN)


def builtin_contexts(rows: int = SYNTH_ROWS, *, probes: int = 3_000, days: int = 2,
                     seed: int = 0):
    """(ctx_start, ctx_end, cost, has_ts, abs_extra) of `prep synth` data, planned as
    `prep shards` plans it (synth -> read_validated -> plan_contexts)."""
    from prep.ingest.synth import SynthConfig, synth
    from prep.pack.contexts import ContextConfig, plan_contexts
    from prep.schema.validate import list_inputs, read_validated

    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        synth(SynthConfig(out=Path(tmp), rows=rows, probes=probes, days=days, seed=seed))
        m, _, _ = read_validated(list_inputs([tmp]))
    plan = plan_contexts(m, ContextConfig(), seed=0)
    return plan.ctx_start, plan.ctx_end, plan.cost, plan.has_ts, plan.abs_extra
