"""`make bench-gpu`: training throughput of the base (~95M) config on the GPU(s) here.

Runs the real trainer (train.fit.loop.train: Grain reader, packed cuDNN attention, bf16
compute, data-parallel over all local GPUs) for a few hundred steps and reports, over
the steps after warm-up: real (non-padding) tokens/s, MFU, the share of step time spent
waiting for data, and step time. Writes ``bench/results/gpu-<device>.json``.

Targets on one H100: >= 45 % MFU, >= 700k real tokens/s, < 1 % data
wait. Without a GPU it runs the tiny config on the CPU so the script itself stays tested,
says so, and writes ``bench/results/gpu-cpu-tiny.json`` (not a GPU result).

    python -m bench.gpu                       # synthetic 1024-token rows
    python -m bench.gpu --data shards/ --steps 300 --batch-size 32
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench import synthetic_shards as synthetic
from bench.run import RESULTS, machine
from prep.schema import vocab
from train.fit.config import GPU_ROWS, TrainConfig
from train.fit.loop import train


def _synthetic_shards(d: Path, rows: int) -> Path:
    """1024-token rows like the built-in data's: ~8 contexts a row, 0.2 % padding."""
    tokens, segs = synthetic.counting_rows(rows, 1024, seed=0, max_segments=16, pad=2)
    rng = np.random.default_rng(0)
    tokens = np.where(segs > 0, rng.integers(0, vocab.VOCAB_SIZE, tokens.shape), 0)
    split = rows // 16
    synthetic.write_shards(d, {"train": (tokens[split:].astype(np.uint16), segs[split:]),
                               "test": (tokens[:split].astype(np.uint16), segs[:split])},
                           rows_per_shard=rows // 4)
    return d


def device_name() -> str:
    """The first device's kind as a file-name part: 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", help="a shards folder (default: synthetic rows)")
    p.add_argument("--steps", type=int, help="default: 300 on a GPU, 30 on a CPU")
    p.add_argument("--batch-size", type=int, help="rows per step (default: train's, 48 per GPU)")
    p.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    p.add_argument("--out", help="the JSON's path [bench/results/gpu-<device>.json]")
    args = p.parse_args(argv)

    from prep.schema.errors import InputError
    from train.fit.device import check_backend

    try:
        gpu = check_backend("auto") == "gpu"  # a GPU jax cannot use is an error, not the CPU
    except InputError as e:
        print(f"[bench-gpu] error: {e}", file=sys.stderr)
        return 2
    n = jax.device_count()
    if gpu:
        settings = dict(model="base", steps=args.steps or 300, batch_size=args.batch_size or GPU_ROWS * n,
                        compute_dtype="bfloat16", log_every=25, lr=6e-4, warmup=50)
        name = device_name()
    else:
        print("[bench-gpu] no GPU here: running the tiny config on the CPU to exercise the "
              "script; these are not GPU numbers", file=sys.stderr)
        settings = dict(model="tiny", steps=args.steps or 30, batch_size=args.batch_size or 8,
                        compute_dtype="float32", log_every=5, lr=3e-3, warmup=5)
        name = "cpu-tiny"
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(_synthetic_shards(Path(tmp) / "shards", 4096 if gpu else 256))
        cfg = TrainConfig(data=data, run_dir=str(Path(tmp) / "run"), eval_every=0,
                          ckpt_every=0, attention=args.attention, **settings)
        t0 = time.perf_counter()
        summary = train(cfg)
        wall = time.perf_counter() - t0
        recs = [json.loads(x) for x in (Path(tmp) / "run/metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if "step_ms" in r][1:]  # the first window still warms up
    mean = lambda k: float(np.mean([r[k] for r in timed])) if timed and timed[0].get(k) is not None else None
    metrics = {
        "gpu.real_tokens_per_s": mean("tokens_per_s"), "gpu.mfu": mean("mfu"),
        "gpu.data_wait": mean("data_wait"), "gpu.step_ms": mean("step_ms"),
        "gpu.final_loss": summary["loss"], "gpu.params": summary["params"],
        "gpu.devices": n, "gpu.batch_size": cfg.batch_size, "gpu.wall_s": wall,
    }
    out = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": gpu,
           "config": {**settings, "attention": summary["attention"], "data": args.data or "synthetic"},
           "metrics": metrics}
    path = Path(args.out) if args.out else RESULTS / f"gpu-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    for k, v in metrics.items():
        print(f"{k:<24} {'-' if v is None else f'{v:,.4g}'}")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
