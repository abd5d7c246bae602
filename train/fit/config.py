"""The frozen settings of a training run (the model's shape is train.model.arch.ModelConfig).

Each setting is one field of ``TrainConfig``: its default in the library, its `train` flag
and help (prep.base.options builds the click options from them; a flag not given arrives
as None, so the defaults here can be told apart from it), its defaults on a CPU and on a
GPU where they differ (``defaults_for``, and the help's "[default: ...]"), and whether a
resumed run is bound to it (``RUN_BINDING``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import click

from prep.base import options
from prep.base.errors import InputError
from prep.base.options import Finite
from train.model.arch import MODELS

_NONE = object()

# Rows of 1024 tokens per GPU for the base model: the batch with the most real tokens/s in
# the H200 sweep of make gpu-check (bench/results/gpu-nvidia-h200-batch.json); larger ones
# ran slower or did not fit.
GPU_ROWS = 48


def setting(default, flag: str | None = None, help=None, *, cpu=_NONE, gpu=_NONE,  # noqa: A002
            per_device: bool = False, binds: bool = False, **click_kw):
    """A TrainConfig field. ``cpu``, ``gpu``: what `train` takes where no flag says
    (``defaults_for``; ``per_device``: times the devices); ``binds``: it shapes the model,
    the data order or the optimizer, so a resume may not change it (the dataset itself is
    held to the run's data_fingerprint). The help ends in its default(s) unless it names
    them itself."""
    on = {"cpu": cpu, "gpu": gpu, "per_device": per_device} if cpu is not _NONE else None

    def text():
        words = help() if callable(help) else help
        if "[default:" in words or click_kw.get("is_flag"):
            return words
        if on and cpu != gpu:
            scale = " per GPU" if per_device else ""
            return f"{words} [default: {cpu} on a CPU, {gpu}{scale} on a GPU]"
        return f"{words} [default: {default}]"

    return options.setting(default, flag, text if flag else None,
                           cli_default=None if flag and not click_kw.get("is_flag") else default,
                           meta={"platform": on, "binds": binds, "type": click_kw.get("type")},
                           **click_kw)


def _model_help() -> str:
    return ("[default: base on a GPU, tiny elsewhere] small: the CPU recipe (rows of "
            f"{SMALL_ROW_LEN}, docs/learning.md); on a CPU it also sets "
            f"{preset_text(SMALL_CPU)}, each overridden by its flag")


@dataclass(frozen=True)
class TrainConfig:
    data: str = setting(
        "shards", "--data", type=click.Path(),
        help="A shards folder written by `prep shards`, or s3://BUCKET/PREFIX (copied to a "
             "local cache checked by sha256) [default: shards; with --resume, the run's own].")
    run_dir: str = setting(  # checkpoints/, metrics.jsonl, config.json
        "runs/run", "--run-dir", type=click.Path(),
        help="Checkpoints and metrics.jsonl [default: runs/<model>-<time>].")
    resume: bool = setting(
        False, "--resume", is_flag=True,
        help="Continue the run in --run-dir (or the newest under runs/: the one that saved a "
             "checkpoint last).")
    model: str = setting(  # a key of train.model.arch.MODELS
        "tiny", "--model", _model_help, type=click.Choice(list(MODELS)), cpu="tiny",
        gpu="base", binds=True)
    steps: int = setting(  # the LR schedule spans them (unless schedule_steps)
        1000, "--steps", "Total optimizer steps.", type=click.IntRange(1), cpu=100, gpu=5000)
    batch_size: int = setting(  # all processes and devices together
        16, "--batch-size", "Rows per step, all devices.", type=click.IntRange(1), cpu=2,
        gpu=GPU_ROWS, per_device=True, binds=True)
    lr: float = setting(  # after warmup
        1e-3, "--lr", "Peak learning rate.", type=Finite(0, min_open=True), cpu=3e-3,
        gpu=6e-4, binds=True)
    # cosine decay ends at lr * this
    min_lr_ratio: float = setting(0.1, binds=True, type=Finite(0, 1))
    warmup: int = setting(
        50, "--warmup", "Linear warmup steps.", type=click.IntRange(0), cpu=10, gpu=200,
        binds=True)
    # 0: --steps; fixed when a run starts, so a resumed run with more --steps goes on at the
    # schedule's final rate instead of raising the rate again (pass it on resume to re-span
    # on purpose)
    schedule_steps: int = setting(
        0, "--schedule-steps", type=click.IntRange(0),
        help="Steps the warmup + cosine LR schedule spans [default: --steps of the run's "
             "start; a resume with more --steps keeps it and runs on at the final rate].")
    # per target role (prep.schema.vocab.ROLES), "rtt=10,src=0.5"; "" = every target alike
    loss_weights: str = setting(
        "", "--loss-weights", metavar="ROLE=W,...", binds=True,
        help="Weight of each target role in the training objective, e.g. 'rtt=10,result=10' "
             "(roles: marker, src, dst, timestamp, result, rtt; unnamed roles 1) [default: "
             "every target alike; small on a CPU: rtt=10,result=10]; the logged loss stays "
             "the plain mean.")
    # AdamW, matrices and embeddings only (train.model.arch.param_specs)
    weight_decay: float = setting(0.1, binds=True, type=Finite(0))
    b1: float = setting(0.9, binds=True, type=Finite(0, 1, max_open=True))
    b2: float = setting(0.95, binds=True, type=Finite(0, 1, max_open=True))
    # global-norm clipping
    grad_clip: float = setting(1.0, binds=True, type=Finite(0, min_open=True))
    log_every: int = setting(  # (and host syncs)
        10, "--log-every", "Steps between log lines.", type=click.IntRange(1), cpu=10, gpu=50)
    eval_every: int = setting(  # test-split evaluations
        100, "--eval-every", "Steps between evals (0: never).", type=click.IntRange(0),
        cpu=50, gpu=500)
    eval_rows: int = setting(
        256, "--eval-rows", "Test rows each eval reads (a fixed sample, seeded by --seed).",
        type=click.IntRange(1), cpu=16, gpu=1024)
    ckpt_every: int = setting(  # also saved at the end and on Ctrl-C
        500, "--ckpt-every", "Steps between checkpoints (0: only at the end).",
        type=click.IntRange(0), cpu=50, gpu=1000)
    keep_checkpoints: int = 3  # the newest checkpoints kept (a learning curve keeps them all)
    seed: int = setting(
        0, "--seed", "Parameters and data order.", type=click.IntRange(0), binds=True)
    attention: str = setting(
        "auto", "--attention", type=click.Choice(["auto", "xla", "cudnn", "dense"]),
        help="Packed attention kernel: dense (cuDNN's dense causal kernel, the segments as a "
             "mask; takes the match head's bias), cudnn (cuDNN's packed kernel), xla "
             "[default: auto = dense on a GPU where it compiles, else cudnn where that "
             "does, else XLA].")
    # cuDNN's per-row segment tables: sized per batch (the smallest power of two that holds
    # the batch's most segments in a row: one compiled step per size met) or once for the
    # whole dataset (its most segments in any row); the kernel's cost grows with the table
    # (docs/learning.md 6.4). One size on several processes, which must run one program
    segment_tables: str = setting(
        "batch", "--segment-tables", type=click.Choice(["batch", "data"]),
        help="cuDNN's segment tables sized per batch (powers of two, a compiled step each) or "
             "once for the dataset's fullest row [default: batch].")
    compute_dtype: str = setting(
        "float32", "--dtype", "Compute dtype; parameters stay float32.",
        type=click.Choice(["float32", "bfloat16"]), cpu="float32", gpu="bfloat16",
        binds=True)
    num_workers: int = setting(
        0, "--workers", "Grain mp_prefetch worker processes (0: read in this process).",
        type=click.IntRange(0))
    # "counts" (size if listed, record count), "sha256" (and every file's digest) or "auto"
    # (sha256 up to train.fit.reader.HASH_LIMIT_BYTES)
    data_check: str = setting(
        "auto", "--check-data", type=click.Choice(["auto", "counts", "sha256"]),
        help="How the shards are held to the manifest at start: record counts and sizes, or "
             "also every sha256 [default: auto = sha256 up to 2 GiB].")

    def __post_init__(self):
        for f in dataclasses.fields(self):  # what click never saw: config.json, the library
            kind = f.metadata.get("type")
            if isinstance(kind, Finite):
                try:
                    kind.convert(getattr(self, f.name), None, None)
                except click.BadParameter as e:
                    raise InputError(f"{flag(f.name)}: {e.message}") from None


# What a resumed run keeps from its config.json; the rest (steps, log/eval/checkpoint
# intervals, eval rows, workers, attention kernel, data check) may change on resume.
RUN_BINDING = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("binds"))


def flag(field: str) -> str:
    """The flag of a TrainConfig field, for messages (fields without one are named as in
    config.json)."""
    return options.flag_of(TrainConfig, field) or f"{field} (config.json)"


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




def defaults_for(platform: str, n_devices: int = 1, *, model: str | None = None) -> dict:
    """What `train --data shards/` does with no other flags, per platform (the fields'
    ``cpu`` and ``gpu``) and, where ``model`` has a recipe of its own there, per model. A
    CPU runs the tiny model for about a minute, loss visibly falling, in small batches: the
    XLA attention over 1024-token rows is slow on a CPU core (docs/measurements.md)."""
    if model == "small" and platform != "gpu":
        return dict(SMALL_CPU)
    key = "gpu" if platform == "gpu" else "cpu"
    out = {}
    for f in dataclasses.fields(TrainConfig):
        on = f.metadata.get("platform")
        if on:
            out[f.name] = on[key] * n_devices if on["per_device"] else on[key]
    return out
