"""`train`: train a decoder-only transformer on packed shards.

Usage:
    train --data shards/                          # CPU: tiny model ~1 min; GPU: the 95M model
    train --data shards/ --model base --steps 20000 --batch-size 128
    train --data shards/ --run-dir runs/exp1 --log-every 10 --eval-every 200
    train --resume                                # continue the newest run under runs/
    train --data shards/ --run-dir runs/exp1 --resume

Log lines and the closing summary go to stdout, setup notes to stderr; a bad dataset is
one line on stderr and exit status 2. Ctrl-C saves a checkpoint and exits with 130.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import click

from prep.errors import InputError
from prep.rows import RowFormatError

RUNS = Path("runs")


def _newest_run() -> Path | None:
    runs = [p for p in RUNS.glob("*") if (p / "checkpoints").is_dir()]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--data", type=click.Path(), default="shards", show_default=True,
              help="A shards folder written by `prep shards`.")
@click.option("--run-dir", type=click.Path(), default=None,
              help="Checkpoints and metrics.jsonl [default: runs/<model>-<time>].")
@click.option("--resume", is_flag=True, help="Continue the run in --run-dir (or the newest).")
@click.option("--model", type=click.Choice(["tiny", "base"]), default=None,
              help="[default: base on a GPU, tiny elsewhere]")
@click.option("--steps", type=int, default=None, help="Total optimizer steps.")
@click.option("--batch-size", type=int, default=None, help="Rows per step, all devices.")
@click.option("--lr", type=float, default=None, help="Peak learning rate.")
@click.option("--warmup", type=int, default=None, help="Linear warmup steps.")
@click.option("--log-every", type=int, default=None, help="Steps between log lines.")
@click.option("--eval-every", type=int, default=None, help="Steps between eval (0: never).")
@click.option("--eval-batches", type=int, default=None, help="Test batches per eval.")
@click.option("--ckpt-every", type=int, default=None, help="Steps between checkpoints.")
@click.option("--seed", type=int, default=None, help="Parameters and data order.")
@click.option("--attention", type=click.Choice(["auto", "xla", "cudnn"]), default=None,
              help="Packed attention kernel [default: auto = cuDNN on Hopper+].")
@click.option("--dtype", "compute_dtype", type=click.Choice(["float32", "bfloat16"]),
              default=None, help="Compute dtype; parameters stay float32.")
@click.option("--workers", "num_workers", type=int, default=None,
              help="Grain mp_prefetch worker processes (0: read in this process).")
@click.option("--distributed", is_flag=True,
              help="Call jax.distributed.initialize() first (multi-host).")
def main(data, run_dir, resume, distributed, **flags):
    """Train on the packed rows of DATA (see README: train)."""
    import jax  # after click parsed the flags: --help stays fast

    from train.config import TrainConfig, defaults_for
    from train.loop import train

    if distributed:
        jax.distributed.initialize()
    platform = jax.devices()[0].platform
    settings = defaults_for(platform, jax.device_count())
    settings.update({k: v for k, v in flags.items() if v is not None})
    if run_dir is None and resume:
        run_dir = _newest_run()
        if run_dir is None:
            _fail(f"--resume: no run with checkpoints under {RUNS}/; pass --run-dir")
    if run_dir is None:
        run_dir = RUNS / f"{settings['model']}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = TrainConfig(data=data, run_dir=str(run_dir), resume=resume, **settings)
    print("config: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()),
          file=sys.stderr)
    try:
        s = train(cfg)
    except (InputError, RowFormatError) as e:
        _fail(str(e))
    tps = f"{s['tokens_per_s']:,.0f} tok/s" if s["tokens_per_s"] else "-"
    mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "-"
    ev = f"{s['eval_loss']:.4f}" if s["eval_loss"] is not None else "-"
    loss = f"{s['loss']:.4f}" if s["loss"] is not None else "-"
    print(f"{'interrupted' if s['interrupted'] else 'done'}: step {s['step']:,} | loss {loss} | "
          f"eval loss {ev} | {tps} | mfu {mfu} | checkpoint and metrics.jsonl in {s['run_dir']}")
    if s["interrupted"]:
        sys.exit(130)


def _fail(message: str):
    click.echo(f"error: {message}", err=True)
    sys.exit(2)


if __name__ == "__main__":
    main()
