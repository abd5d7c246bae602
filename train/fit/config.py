"""The frozen settings of a training run (the model's shape is train.model.arch.ModelConfig)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    data: str = "shards"  # a shards folder written by `prep shards`
    run_dir: str = "runs/run"  # checkpoints/, metrics.jsonl, config.json
    model: str = "tiny"  # a key of train.model.arch.MODELS
    steps: int = 1000  # total optimizer steps (the LR schedule spans them)
    batch_size: int = 16  # rows per step, all processes and devices together
    lr: float = 1e-3  # peak learning rate after warmup
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * this
    # steps the warmup + cosine schedule spans (0: --steps); fixed when a run starts, so a
    # resumed run with more --steps goes on at the schedule's final rate instead of
    # raising the rate again (pass it on resume to re-span on purpose)
    schedule_steps: int = 0
    # the training objective's weight per target role (prep.schema.vocab.ROLES), "rtt=10,src=0.5";
    # "" = every target alike. The logged loss stays the plain mean.
    loss_weights: str = ""
    warmup: int = 50  # linear warmup steps
    weight_decay: float = 0.1  # AdamW, matrices and embeddings only (train.model.arch.param_specs)
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping
    seed: int = 0  # parameters and the data order
    compute_dtype: str = "float32"  # "bfloat16" on GPUs; parameters stay float32
    attention: str = "auto"  # "auto" (cuDNN packed where possible), "xla" or "cudnn"
    log_every: int = 10  # steps between log lines (and host syncs)
    eval_every: int = 100  # steps between test-split evaluations (0 = never)
    eval_rows: int = 256  # a fixed sample of test rows (seeded by `seed`) each eval reads
    ckpt_every: int = 500  # steps between checkpoints (also saved at the end and on Ctrl-C)
    keep_checkpoints: int = 3  # the newest checkpoints kept (a learning curve keeps them all)
    num_workers: int = 0  # Grain mp_prefetch worker processes (0 = read in this process)
    resume: bool = False
    # shards held to the manifest at start: "counts" (size if listed, record count),
    # "sha256" (and every file's digest) or "auto" (sha256 up to train.fit.reader.HASH_LIMIT_BYTES)
    data_check: str = "auto"


# What a resumed run keeps from its config.json: these shape the model, the data order or
# the optimizer, so a resume may not change them (the dataset itself is held to the run's
# data_fingerprint). The rest (steps, log/eval/checkpoint intervals, eval rows, workers,
# attention kernel, data check) may change on resume.
RUN_BINDING = ("model", "batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay", "b1",
               "b2", "grad_clip", "seed", "compute_dtype", "loss_weights")
# the `train` flag of each setting, for messages
FLAGS = {"data": "--data", "model": "--model", "steps": "--steps", "batch_size": "--batch-size",
         "lr": "--lr", "warmup": "--warmup", "seed": "--seed", "compute_dtype": "--dtype",
         "log_every": "--log-every", "eval_every": "--eval-every", "eval_rows": "--eval-rows",
         "ckpt_every": "--ckpt-every", "attention": "--attention", "num_workers": "--workers",
         "data_check": "--check-data", "loss_weights": "--loss-weights",
         "schedule_steps": "--schedule-steps"}


def flag(field: str) -> str:
    """The flag of a TrainConfig field (fields without one are named as in config.json)."""
    return FLAGS.get(field, f"{field} (config.json)")


# `train --model small` on a CPU: the recipe of docs/learning.md (2 cores, rows of 256,
# 3.3M tokens): the objective weighted toward the result and its RTT bytes, small batches
# (more updates per token reach the same error sooner), the lr and warmup the study ran;
# the model preset is train.model.arch.MODELS["small"]
SMALL_CPU = dict(model="small", steps=2400, batch_size=8, lr=3e-3, warmup=100,
                 loss_weights="rtt=10,result=10", compute_dtype="float32", log_every=100,
                 eval_every=400, eval_rows=64, ckpt_every=400)
SMALL_ROW_LEN = 256  # the rows the recipe was measured on (prep shards --row-len 256)


def preset_text(preset: dict) -> str:
    """``--steps 1600, --batch-size 8, ...``: a preset's settings as the flags that override
    them (for --help and the config line)."""
    return ", ".join(f"{flag(k)} {v}" for k, v in preset.items() if k != "model")


def start_warnings(cfg: TrainConfig, row_len: int, platform: str) -> list[str]:
    """What a run's settings make likely to go wrong, said at its start (stderr)."""
    out = []
    if cfg.model == "small" and platform != "gpu" and row_len != SMALL_ROW_LEN:
        out.append(f"--model small: its CPU recipe (docs/learning.md) reads rows of "
                   f"{SMALL_ROW_LEN} tokens; {cfg.data} holds rows of {row_len:,}, each "
                   f"{row_len / SMALL_ROW_LEN:g}x the tokens and more attention per row; "
                   f"build the recipe's data with `prep shards ... --row-len {SMALL_ROW_LEN}`")
    if cfg.steps < cfg.warmup:
        out.append(f"--steps {cfg.steps} ends inside the {cfg.warmup}-step warm-up: the "
                   f"learning rate never reaches --lr {cfg.lr:g} (pass --warmup below "
                   f"--steps, or more --steps)")
    return out


# Rows of 1024 tokens per GPU for the base model: the batch with the most real tokens/s in
# the H200 sweep of make gpu-check (bench/results/gpu-nvidia-h200-batch.json); larger ones
# ran slower or did not fit.
GPU_ROWS = 48


def defaults_for(platform: str, n_devices: int = 1, *, model: str | None = None) -> dict:
    """What `train --data shards/` does with no other flags, per platform (and, where
    ``model`` has a recipe of its own there, per model)."""
    if model == "small" and platform != "gpu":
        return dict(SMALL_CPU)
    if platform == "gpu":
        return dict(model="base", steps=5000, batch_size=GPU_ROWS * n_devices, lr=6e-4, warmup=200,
                    compute_dtype="bfloat16", log_every=50, eval_every=500, eval_rows=1024, ckpt_every=1000)
    # a CPU: the tiny model for about a minute, loss visibly falling. Small batches: the
    # XLA attention over 1024-token rows is slow on a CPU core (docs/measurements.md)
    return dict(model="tiny", steps=100, batch_size=2 * n_devices, lr=3e-3, warmup=10,
                compute_dtype="float32", log_every=10, eval_every=50, eval_rows=16,
                ckpt_every=50)
