"""The packed attention alone, forward and backward, at base's shape: what cuDNN's segment
tables cost, and what a dense causal kernel with the segments as a mask would cost instead.

For one batch (rows of --seq tokens, the segment ids of a real dataset's rows with --data,
else rows cut into --segments equal segments), q, k, v [B, T, N, H] in bf16, times the
gradient of sum(out * w) with respect to q, k, v:

- ``packed-M``: train.model.attention.attention on "cudnn" with segment tables of M slots
  (the trainer's path; M from --tables);
- ``dense-mask``: jax.nn.dot_product_attention on cuDNN with is_causal and the segments as
  a [B, 1, T, T] boolean mask (the kernel computes every block below the diagonal);
- ``xla``: the XLA attention (T x T scores in memory), the reference.

Each: compile, --warmup calls, then the median of --reps timed calls. On a CPU only
``xla`` runs (a dry run of the script).

    python -m bench.attention_kernels --data shards --out bench/results/attention-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parent.parent


def _segments(args) -> np.ndarray:
    if args.data:
        from prep.schema import manifest as manifest_lib
        from train.fit.reader import read_split

        manifest = manifest_lib.load_manifest(args.data)
        _, seg = read_split(args.data, manifest, "train", sha256=False)
        pick = np.random.default_rng(0).choice(len(seg), args.batch, replace=False)
        return seg[np.sort(pick)].astype(np.int32)
    T, S = args.seq, args.segments
    return np.repeat(np.arange(1, S + 1), -(-T // S))[:T][None].repeat(args.batch, 0).astype(np.int32)


def _timed(fn, inputs, warmup: int, reps: int) -> dict:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - t)
    return {"ms": 1e3 * float(np.median(times)), "compile_s": round(compile_s, 2)}


def main(argv: list[str] | None = None) -> int:
    head, _, example = __doc__.rpartition("\n\n")
    p = argparse.ArgumentParser(description=head.split("\n\n")[0], epilog="example:\n" + example,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a shards folder whose train rows give the segments [none: "
                                  "--segments equal segments a row]")
    p.add_argument("--batch", type=int, default=48, help="rows [48]")
    p.add_argument("--seq", type=int, default=1024, help="tokens a row without --data [1024]")
    p.add_argument("--segments", type=int, default=16, help="segments a row without --data [16]")
    p.add_argument("--heads", type=int, default=10, help="[10]")
    p.add_argument("--head-dim", type=int, default=64, help="[64]")
    p.add_argument("--tables", default="16,32,64", help="segment-table sizes to time [16,32,64]")
    p.add_argument("--warmup", type=int, default=3, help="[3]")
    p.add_argument("--reps", type=int, default=10, help="[10]")
    p.add_argument("--out", help="the JSON's path [none: print only]")
    args = p.parse_args(argv)
    from bench.run import machine
    from train.model import attention

    from prep.base.errors import InputError

    try:
        seg = _segments(args)
    except InputError as e:
        print(f"[attention-kernels] error: {e}", file=sys.stderr)
        return 2
    B, T = seg.shape
    most = int(seg.max())
    rng = np.random.default_rng(1)
    dt = jnp.bfloat16
    q, k, v, w = (jnp.asarray(rng.normal(size=(B, T, args.heads, args.head_dim)), dt)
                  for _ in range(4))
    segj = jnp.asarray(seg)
    gpu = jax.devices()[0].platform == "gpu"

    def grad_of(att):
        f = lambda q, k, v: jnp.sum(att(q, k, v).astype(jnp.float32) * w.astype(jnp.float32))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    runs = {}
    cands = {"xla": lambda q, k, v: attention.xla_attention(q, k, v, segj)}
    if gpu:
        for m in (int(x) for x in args.tables.split(",") if x):
            if m >= most:
                cands[f"packed-{m}"] = (lambda m: lambda q, k, v: attention.attention(
                    q, k, v, segj, implementation="cudnn", max_segments=m))(m)
        mask = attention.segment_mask(segj)
        cands["dense-mask"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="cudnn")
    for name, att in cands.items():
        try:
            runs[name] = _timed(grad_of(att), (q, k, v), args.warmup, args.reps)
        except Exception as e:  # a kernel this JAX/cuDNN refuses: say which and why
            runs[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        print(f"{name:<12} {runs[name]}", flush=True)
    out = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "shape": {"batch": B, "seq": T, "heads": args.heads, "head_dim": args.head_dim,
                     "most_segments": most, "mean_segments": float(seg.max(1).mean()),
                     "data": args.data or f"{args.segments} equal segments"},
           "what": "forward + backward (grad of sum(out * w) w.r.t. q, k, v), bf16, median of "
                   f"{args.reps} calls after {args.warmup}", "runs": runs}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
