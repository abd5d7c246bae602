"""`make bench` part "train": training throughput of the CPU models, `tiny` beside `small`.

Each trains with the real trainer (train.fit.loop.train: Grain reader, XLA packed attention,
float32) on the same packed rows of 256 tokens from `prep synth` + `prep shards` (20k
measurements), batch 8 (the recipe's), 160 steps; real (non-padding) tokens/s over the steps
after compilation. `small` is `tiny` plus the grammar embedding, the destination-match head,
byte waves, the destination memory and prior and anonymous sources (train.model.arch), so
the ratio is their cost; the recipe's minutes on 2 cores follow from it (docs/learning.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

STEPS, BATCH = 160, 8


def run() -> dict[str, float]:
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards
    from train.fit.config import TrainConfig
    from train.fit.loop import train

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        synth(SynthConfig(out=d / "raw", rows=20_000, probes=100, days=1, seed=0))
        run_shards([str(d / "raw")], str(d / "shards"), ShardsConfig(seed=0, row_len=256),
                   workers=1, progress=False)
        for name in ("tiny", "small"):
            cfg = TrainConfig(data=str(d / "shards"), run_dir=str(d / name), model=name,
                              steps=STEPS, batch_size=BATCH, lr=3e-3, warmup=10,
                              log_every=STEPS, eval_every=0, ckpt_every=0)
            out[f"train.{name}_tokens_per_s"] = train(cfg)["tokens_per_s"]
    out["train.small_vs_tiny"] = out["train.small_tokens_per_s"] / out["train.tiny_tokens_per_s"]
    return out
