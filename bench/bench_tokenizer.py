"""Tokenizer benchmark: the Numba kernel beside the pure-Python reference, one run, one core.

Data: 2**20 measurements in the shape of RIPE Atlas (3,000 probes pinging every 240 s,
58 % IPv4, ~17 % failed, lognormal RTTs), planned into contexts once. Then:

- ``kernel_measurements_per_s``: ``prep.tokens.kernel.encode_plan`` on all of them, warm (the
  first call compiles or loads the cache), best of 3; Numba runs on one thread.
- ``reference_measurements_per_s``: ``prep.tokens.reference.encode_context`` on the first
  contexts of the same plan until >= 20,000 measurements are covered (the reference
  takes ~0.1 s per 20k; timing all 1M would take a minute), best of 3. Converting the columns to
  Python tuples is not timed, so the reference pays for encoding only. Its tokens are
  checked against the kernel's.
- ``kernel_prealloc_measurements_per_s``: the same into an output buffer that is already
  mapped (``encode_plan(..., out=)``), i.e. without the OS zeroing fresh pages; reported
  beside ``speedup_prealloc`` for what the kernel itself costs, not used for ``speedup``.
- ``speedup``: the ratio of the two (fresh output each call); ``plan_measurements_per_s``: ``plan_contexts``
  (sort + cut) on the same data.
"""

from __future__ import annotations

import time

import numpy as np

from prep.pack.contexts import ContextConfig, plan_contexts
from prep.tokens import kernel, reference
from prep.tools.workloads import atlas_like

N = 1 << 20
SEED = 0
REFERENCE_MIN_MEASUREMENTS = 20_000


def best_of(k: int, fn) -> float:
    times = []
    for _ in range(k):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def run() -> dict[str, float]:
    m = atlas_like(N, seed=SEED)
    cfg = ContextConfig()
    plan_contexts(m, cfg, SEED)  # compile / load the cache
    t_plan = best_of(3, lambda: plan_contexts(m, cfg, SEED))
    plan = plan_contexts(m, cfg, SEED)
    toks, off = kernel.encode_plan(plan, SEED)  # compile / load the cache
    t_kernel = best_of(3, lambda: kernel.encode_plan(plan, SEED))
    # The same, writing into a buffer that is already mapped: the kernel's own work, without
    # the page zeroing a fresh 50 MB output costs (reported beside, not used for speedup).
    out = np.zeros(len(toks) + kernel.SLACK, np.uint16)
    t_prealloc = best_of(3, lambda: kernel.encode_plan(plan, SEED, out=out))

    n_ctx = int(np.searchsorted(plan.ctx_end, REFERENCE_MIN_MEASUREMENTS)) + 1
    starts, ends = plan.ctx_start[:n_ctx].tolist(), plan.ctx_end[:n_ctx].tolist()
    cols = plan.sorted.columns()
    rows = list(zip(*(cols[k].tolist() for k in
                      ("probe", "time", "family", "src_hi", "src_lo", "dst_hi", "dst_lo", "rtt"))))
    has_ts, hist, modes = plan.has_ts.tolist(), plan.hist.tolist(), plan.ctx_mode.tolist()
    def encode_reference():
        return [reference.encode_context(rows[s:e], has_ts[s:e], hist[s], modes[c], SEED)
                for c, (s, e) in enumerate(zip(starts, ends))]

    ref = encode_reference()
    t_ref = best_of(3, encode_reference)  # best of 3 as for the kernel: the same treatment
    n_ref = ends[-1]
    for c in range(n_ctx):
        if ref[c] != toks[off[c]:off[c + 1]].tolist():
            raise AssertionError(f"kernel and reference differ on context {c}")

    kernel_rate = len(m) / t_kernel
    ref_rate = n_ref / t_ref
    return {
        "tokenizer.measurements": float(len(m)),
        "tokenizer.tokens_per_measurement": len(toks) / len(m),
        "tokenizer.plan_measurements_per_s": len(m) / t_plan,
        "tokenizer.kernel_measurements_per_s": kernel_rate,
        "tokenizer.kernel_tokens_per_s": len(toks) / t_kernel,
        "tokenizer.kernel_prealloc_measurements_per_s": len(m) / t_prealloc,
        "tokenizer.speedup_prealloc": len(m) / t_prealloc / ref_rate,
        "tokenizer.reference_measurements": float(n_ref),
        "tokenizer.reference_measurements_per_s": ref_rate,
        "tokenizer.speedup": kernel_rate / ref_rate,
    }


if __name__ == "__main__":
    for k, v in run().items():
        print(f"{k:<40} {v:>16,.1f}")
