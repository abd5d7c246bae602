"""Packing: our offline packer beside pad-to-crop and Grain's online packers, same contexts.

Metrics (``packing.*``): ``padding_fraction``, ``rows_over_lower_bound``, ``contexts_per_s``
on the built-in data through the real pipeline (``prep synth`` of ``SYNTH_ROWS`` measurements
with the Makefile's probes/days/seed into a temp dir -> prep.validate.read_validated ->
prep.contexts.plan_contexts with the default ContextConfig, seed 0), so
``data_is_plan_contexts`` is 1; ``busy_*`` on ``synthetic_contexts(busy=True)`` (every context
cut near 1024 tokens); and for reference on the same contexts ``pad_to_crop_padding_fraction``,
``grain_first_fit_padding_fraction``, ``grain_best_fit_padding_fraction`` (Grain's packers on a
sample of the same lengths) and ``no_split_padding_fraction`` (whole-context best fit).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from numba import njit

from prep import costs, packing

ROW_LEN = 1024
GRAIN_SAMPLE = 5_000  # Grain packs in Python at ~3k sequences/s here: a sample is enough
SYNTH_ROWS = 3_000_000  # the Makefile's `prep synth` settings: 3M rows, 3000 probes, 2 days


@njit(cache=True)
def _synth(n_ctx, busy, seed, row_len):
    """Contexts shaped like the tokenizer's output (body 12-38 tokens + 0/2/5/9 timestamp)."""
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
            body = 38 if np.random.random() < p6 else 14
            body -= 2 if np.random.random() < 0.17 else 0  # failed: FAILED instead of RTT
            ts = np.random.random() < keep
            t = 0
            if ts:
                t = 9 if first else (2 if np.random.random() < 0.9 else 5)
            if total + body + t > row_len:  # end it as the planner does (prep.planner_kernels)
                back = 0
                while back < costs.BACKOFF and n - 1 > starts[c] and \
                        not costs.fillable(row_len - total):
                    n -= 1
                    total -= cost[n]
                    back += 1
                break
            cost[n] = body + t
            has_ts[n] = ts
            abs_extra[n] = 9 - t if ts else 0
            if ts:
                first = False
            total += body + t
            n += 1
        ends[c] = n
    return starts, ends, cost[:n], has_ts[:n], abs_extra[:n]


def synthetic_contexts(n_ctx: int, *, busy: bool, seed: int = 0):
    """(ctx_start, ctx_end, cost, has_ts, abs_extra) for ``n_ctx`` synthetic contexts."""
    return _synth(n_ctx, busy, seed, ROW_LEN)


def grain_padding(lengths: np.ndarray, *, best_fit: bool, num_bins: int,
                  row_len: int = ROW_LEN) -> tuple[float, int]:
    """(padding fraction, rows) of Grain's own online packer run on ``lengths``."""
    import grain

    ds = grain.MapDataset.source([{"t": np.ones(int(n), np.int32)} for n in lengths])
    cls = (grain.experimental.BestFitPackIterDataset if best_fit
           else grain.experimental.FirstFitPackIterDataset)
    packed = cls(ds.to_iter_dataset(), length_struct={"t": row_len},
                 num_packing_bins=num_bins, shuffle_bins=False)
    rows = 0
    real = 0
    for ex in packed:
        rows += 1
        real += int((ex["t_segment_ids"] > 0).sum())
    return (1 - real / (rows * row_len) if rows else 0.0), rows


def builtin_contexts(rows: int = SYNTH_ROWS, *, probes: int = 3_000, days: int = 2,
                     seed: int = 0):
    """(ctx_start, ctx_end, cost, has_ts, abs_extra) of `prep synth` data, planned as
    `prep shards` plans it (synth -> read_validated -> plan_contexts)."""
    from prep.contexts import ContextConfig, plan_contexts
    from prep.synth import SynthConfig, synth
    from prep.validate import list_inputs, read_validated

    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        synth(SynthConfig(out=Path(tmp), rows=rows, probes=probes, days=days, seed=seed))
        m, _, _ = read_validated(list_inputs([tmp]))
    plan = plan_contexts(m, ContextConfig(), seed=0)
    return plan.ctx_start, plan.ctx_end, plan.cost, plan.has_ts, plan.abs_extra


def run() -> dict[str, float]:
    out: dict[str, float] = {}
    arrs = builtin_contexts()
    out["packing.data_is_plan_contexts"] = 1.0
    busy = synthetic_contexts(100_000, busy=True, seed=1)
    packing.pack(*synthetic_contexts(1000, busy=False, seed=2))  # compile
    for name, a in (("", arrs), ("busy_", busy)):
        lengths = packing.context_lengths(*a)
        dt = float("inf")
        for _ in range(3):  # best of 3: the machine is shared
            t0 = time.perf_counter()
            p = packing.pack(*a)
            dt = min(dt, time.perf_counter() - t0)
        st = packing.stats(p, int(lengths.sum()))
        out[f"packing.{name}padding_fraction"] = st["padding_fraction"]
        out[f"packing.{name}rows_over_lower_bound"] = st["rows"] / st["lower_bound_rows"]
        out[f"packing.{name}contexts_per_s"] = len(lengths) / dt
        whole = packing.pack(*a, split=False)
        out[f"packing.{name}no_split_padding_fraction"] = packing.stats(
            whole, int(lengths.sum()))["padding_fraction"]
        out[f"packing.{name}pad_to_crop_padding_fraction"] = 1 - lengths.mean() / ROW_LEN
        sample = lengths[:GRAIN_SAMPLE]
        for best in (False, True):
            label = "best_fit" if best else "first_fit"
            pad, _ = grain_padding(sample, best_fit=best, num_bins=128)
            out[f"packing.{name}grain_{label}_padding_fraction"] = pad
        print(f"[bench] packing {name or 'built-in '}data: {len(lengths):,} contexts, "
              f"{st['rows']:,} rows, lower bound {st['lower_bound_rows']:,}", file=sys.stderr)
    return out


if __name__ == "__main__":
    for k, v in sorted(run().items()):
        print(f"{k:<50} {v:.5f}")
