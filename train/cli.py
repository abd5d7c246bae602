"""`train`: train a decoder-only transformer on packed shards, evaluate it, query it.

Usage:
    train --data shards/                          # CPU: tiny model ~1 min; GPU: the 95M model
    train --data shards/ --model base --steps 20000 --batch-size 128
    train --data shards/ --run-dir runs/exp1 --log-every 10 --eval-every 200
    train --resume                                # continue the newest run under runs/
    train --data shards/ --run-dir runs/exp1 --resume
    train --distributed --coordinator 10.0.0.1:5555 --num-processes 2 --process-id 0 ...
    train eval runs/exp1 --plot eval.png          # the model vs RTT baselines on the test split
    train eval runs/exp1 --max-queries 5000       # exactly 5,000 queries: eval/step-<S>-q5000.json
    train predict runs/exp1 --src 192.0.2.7 --dst 193.0.14.129 --time 2026-01-02T12:00:00Z
    train predict runs/exp1 --queries q.parquet --out answers.parquet

`train ARGS` is `train fit ARGS` (training is the default command); `train --help` lists the
commands with an example each, `train COMMAND --help` a command's options.

Log lines and the closing summary go to stdout, setup notes to stderr; a bad dataset is
one line on stderr and exit status 2. Ctrl-C saves a checkpoint and exits with 130,
SIGTERM the same with 143. `--resume` takes the run's settings from its config.json
(flags given must agree with the run's, see train.fit.config.RUN_BINDING) and its dataset
(`--data` defaults to the run's own, and must hold the same shards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import click

from prep.base.errors import InputError
from prep.base.options import options
from prep.base.plotfile import PlotFile
from prep.schema.rows import RowFormatError
from train.fit.config import SMALL_CPU, TrainConfig

RUNS = Path("runs")


def _newest_run() -> Path | None:
    from train.fit.checkpoint import newest_first, step_dirs

    runs = newest_first(p for p in RUNS.glob("*") if step_dirs(p / "checkpoints"))
    return runs[0] if runs else None


class _Train(click.Group):
    """`train ARGS` is `train fit ARGS` unless ARGS start with a subcommand; InputError is
    one line on stderr and exit code 2."""

    def parse_args(self, ctx, args):
        ctx.meta["train.args"] = list(args)  # as given: `train --distributed` runs them again
        if not args or (args[0] not in self.commands
                        and args[0] not in ("--version", *ctx.help_option_names)):
            args = ["fit", *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (InputError, RowFormatError) as e:
            _fail(str(e))


class _Fit(click.Command):
    """The default command: its usage line says `fit` may be left out."""

    def format_usage(self, ctx, formatter):
        formatter.write_usage(f"{ctx.find_root().info_name} [fit]",
                              " ".join(self.collect_usage_pieces(ctx)))


@click.group(cls=_Train, context_settings={"help_option_names": ["-h", "--help"]},
             subcommand_metavar="[COMMAND] [ARGS]...")
@click.version_option(package_name="ping-pack", prog_name="train")
def main():
    """Train, evaluate and query a transformer on packed ping shards.

    \b
    Examples, one per command:
      train --data shards/                # fit: CPU tiny model ~1 min; GPU the 95M model
      train eval runs/tiny-20261123-101500 --plot eval.png
      train pool runs/small-world0 runs/small-world1   # several evals as one, e.g. worlds
      train predict runs/tiny-20261123-101500 --src 192.0.2.7 --dst 193.0.14.129

    `train ARGS` is `train fit ARGS` (training is the default command); `train COMMAND
    --help` lists a command's options.
    """


@main.command(cls=_Fit, short_help="Train a model on shards (the default command).",
              epilog="Then: `train eval RUN_DIR` (the model against RTT baselines) and "
              "`train predict RUN_DIR --src A --dst B` (RTT and P(failed) of one ping); "
              "`train --help` lists the commands.")
@options(TrainConfig)
@click.option("--distributed", is_flag=True,
              help="One of several processes (hosts) training one model: jax.distributed "
                   "with the flags below, else what it finds (SLURM, Open MPI, Kubernetes, "
                   "Cloud TPU). README: `train --distributed`.")
@click.option("--coordinator", metavar="HOST:PORT", default=None,
              help="With --distributed: process 0's address and a free port every process "
                   "reaches [default: $JAX_COORDINATOR_ADDRESS, else detected].")
@click.option("--num-processes", type=int, default=None,
              help="With --distributed: how many processes [default: $JAX_NUM_PROCESSES, "
                   "else detected].")
@click.option("--process-id", type=int, default=None,
              help="With --distributed: this one's, 0..N-1; 0 logs and writes the run's "
                   "files [default: $JAX_PROCESS_ID, else detected].")
@click.option("--join-timeout", type=int, default=300, show_default=True,
              help="With --distributed: seconds to wait for every process to join.")
@click.option("--heartbeat-timeout", type=int, default=100, show_default=True,
              help="With --distributed: seconds without word from a process before the "
                   "others stop with an error.")
@click.option("--device", type=click.Choice(["auto", "gpu", "cpu"]), default="auto",
              show_default=True, help="auto: the GPU when jax has one (an NVIDIA GPU that jax "
              "cannot use is an error naming the install); cpu: the CPU on purpose.")
def fit(data, run_dir, resume, distributed, coordinator, num_processes, process_id,
        join_timeout, heartbeat_timeout, device, **flags):
    """Train on the packed rows of --data; `train ARGS` is `train fit ARGS` (see README: train).

    \b
    Examples:
      train --data shards/                    # CPU: tiny model, ~1 min; GPU: the 95M model
      train --data shards-256 --model small   # the CPU recipe (docs/learning.md)
      train --data shards/ --model base --steps 20000 --run-dir runs/base1
      train --resume                          # continue the newest run under runs/
      train --distributed --coordinator 10.0.0.1:5555 --num-processes 2 --process-id 0 ...
                           # host 1; host 2 the same with --process-id 1 (README)
    """
    from train.fit import multihost

    if not distributed:
        if coordinator is not None or num_processes is not None or process_id is not None:
            raise InputError("--coordinator, --num-processes and --process-id go with "
                             "--distributed")
        code = _fit(data, run_dir, resume, device, flags)
        if code:
            sys.exit(code)  # 130 after SIGINT (Ctrl-C), 143 after SIGTERM
        return
    hosts = multihost.resolve(coordinator=coordinator, num_processes=num_processes,
                              process_id=process_id, join_timeout=join_timeout,
                              heartbeat_timeout=heartbeat_timeout)
    if not multihost.supervised():  # the trainer runs under this process (multihost.supervise)
        sys.exit(multihost.supervise(hosts, click.get_current_context().meta["train.args"]))
    try:  # the trainer: every way out but success skips jax's shutdown barrier (leave)
        from train.fit.device import use_cpu

        if device == "cpu":
            use_cpu()
        multihost.initialize(hosts)
        code = _fit(data, run_dir, resume, device, flags, hosts)
    except (InputError, RowFormatError) as e:  # most are met by every process alike
        multihost.leave(2, str(e), together=True)
    except SystemExit as e:
        multihost.leave(e.code if isinstance(e.code, int) else 2, together=True)
    except KeyboardInterrupt:  # a second signal: abort, no checkpoint
        multihost.leave(130, f"{hosts.who}: aborted by a second signal before its checkpoint; "
                             "the other processes stop too")
    except Exception as e:
        if multihost.lost_peer(e):
            multihost.leave(2, multihost.lost_message(hosts, multihost.short_reason(e)))
        import traceback

        traceback.print_exc()
        multihost.leave(1)
    if code:
        sys.exit(code)  # interrupted: every process stopped at the same step, all exit


def _fit(data, run_dir, resume, device, flags, hosts=None) -> int:
    """`train fit` after the multi-host setup: the exit code (0, or 130/143 after a signal)."""
    from train.fit.device import check_backend

    check_backend(device)  # before anything asks jax for devices (after jax.distributed)
    import jax  # after click parsed the flags: --help stays fast

    from prep.base.storage import is_remote
    from train.fit.config import defaults_for
    from train.fit.loop import train
    from train.fit.runfolder import load_run

    given = {k: v for k, v in flags.items() if v is not None}
    if resume:  # the run's own settings and data, unless given (train() refuses conflicts)
        if run_dir is None:
            run_dir = _newest_run()
            if run_dir is None:
                _fail(f"--resume: no run with checkpoints under {RUNS}/; pass --run-dir")
        saved = load_run(run_dir)["train"]
        fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"data", "run_dir", "resume"}
        settings = {k: v for k, v in saved.items() if k in fields}
        if data is None:
            data = saved.get("data", "shards")
            if not is_remote(data) and not Path(data).is_dir():
                _fail(f"--resume: the run's dataset {data} (its config.json) is not there "
                      f"from {Path.cwd()}; pass --data where it is now")
    preset = None
    if not resume:
        settings = defaults_for(jax.devices()[0].platform, jax.device_count(),
                                model=given.get("model"))
        data = data if data is not None else "shards"
        if given.get("model") == "small" and settings == SMALL_CPU:  # the recipe's own
            preset = {k: v for k, v in settings.items() if k not in given}
    settings.update(given)
    if run_dir is None:
        run_dir = RUNS / f"{settings['model']}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = TrainConfig(data=data, run_dir=str(run_dir), resume=resume, **settings)
    # prints the config line (and what the preset set) once the run starts: nothing before
    s = train(cfg, preset=preset)
    if jax.process_index() > 0:  # process 0 logs; the others say only how they ended
        click.echo(f"{hosts.who if hosts else 'process'}: "
                   f"{'interrupted' if s['interrupted'] else 'done'} at step {s['step']:,}; "
                   f"process 0 logs the run", err=True)
        return s["exit_code"]
    tps = f"{s['tokens_per_s']:,.0f} tok/s" if s["tokens_per_s"] else "-"
    mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] is not None else "-"
    ev = f"{s['eval_loss']:.4f}" if s["eval_loss"] is not None else "-"
    loss = f"{s['loss']:.4f}" if s["loss"] is not None else "-"
    print(f"{'interrupted' if s['interrupted'] else 'done'}: step {s['step']:,} | loss {loss} | "
          f"eval loss {ev} | {tps} | mfu {mfu} | checkpoint and metrics.jsonl in {s['run_dir']}")
    return s["exit_code"]  # 130 after SIGINT (Ctrl-C), 143 after SIGTERM


@main.command("eval", short_help="The model of a run against RTT baselines on the test split.")
@click.argument("run_dir", type=click.Path(), required=False)
@click.option("--data", default=None, help="Shards folder [default: the one the run trained on].")
@click.option("--step", type=int, default=None, help="Checkpoint step [default: the latest].")
@click.option("--max-queries", type=click.IntRange(0), default=0, show_default=True,
              help="Exactly this many RTT queries, whole contexts sampled by --seed, the last "
                   "one cut (0: the whole test split); all there are, with a warning, where "
                   "the split holds fewer. Written to eval/step-<S>-q<N>.json, N the "
                   "queries it holds.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Seed of that sample and of the bootstrap intervals.")
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="Rows per forward pass [default: the run's batch size, at most 64].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--plot", type=PlotFile(), default=None,
              help="Write a figure (.png, .pdf, .svg): relative-error CDFs, overall and by "
                   "stratum, and the loss curves.")
@click.option("--overwrite", is_flag=True,
              help="Replace the file already at --plot; it stays as it was until the figure "
                   "is drawn. (The report under RUN_DIR/eval/ is the evaluation's own: "
                   "evaluating again rewrites it.)")
def eval_cmd(run_dir, data, step, max_queries, seed, batch_size, as_json, plot, overwrite):
    """The model of RUN_DIR against RTT baselines on the test split.

    Loss and accuracy by token role; RTT median / p10 / p90 and P(failed) for every test
    measurement of a full-timestamp context given the ones before it, and given nothing
    (the model without context), scored in each stratum by the point whose median relative
    error it expects least of itself there (its median, or its band point: the value the
    most probability lies within a band of; its median beside it); the same from the
    context baselines (last reply to the
    destination, its EMA, the context's median, the source placed in the train Vivaldi
    space, among the train sources by its nearest 5, and kriged through the destinations'
    covariance; their P(failed): the context's failures to the destination shrunk toward
    its failures to any (or a live pair's rate), those toward the train split's rate, and
    the pair possibly dead, weighed by its pings' likelihood, by priors fit on the train
    split) and the train-fit ones (global median; destination median; per-pair
    last-seen, EMA, median, mode, each from the reverse pair where the pair has no ping of
    its own; Vivaldi; matrix factorization). Overall, by stratum (pair_in_context: an earlier
    reply to the destination in the context; node_known: else the source is in the train
    split, a NAT's private address never; cold) and by context length, with 95 %
    bootstrap intervals resampling whole sources; the model's
    [p10, p90] coverage; the verdict per scope: the model minus the strongest baseline on
    RTTs, and its P(failed) against the lowest Brier of the baselines, paired on the same
    queries. Writes RUN_DIR/eval/step-<S>.json. Without RUN_DIR: the newest
    run under runs/ (the one that saved a checkpoint last), as `train --resume` takes.

    \b
    Example:
      train eval runs/tiny-20261123-101500 --max-queries 5000 --plot eval.png
    """
    import json

    from prep.base.signals import Interrupted
    from train.eval.evaluate import EvalConfig, evaluate
    from train.eval.plot import plot as plot_fn
    from train.eval.report import format_report

    _new_file("--plot", plot, overwrite, "it stays as it was until the figure is drawn")
    run_dir = _run_or_newest(run_dir, "train eval", "evaluating")
    written = []  # the report, then the figure: what the line of a stop names

    def what(e: KeyboardInterrupt) -> str:  # each file is written whole or not at all
        if isinstance(e, Interrupted) and e.published:  # as the report was written
            written.append(str(e.out))
        return (f"while evaluating {run_dir}; nothing was written" if not written else
                f"after writing {' and '.join([written[0] + ' and its answers', *written[1:]])}"
                + (f"; {plot} was not written" if plot and plot not in written else ""))

    with _stops_on_signals("train eval", what):
        report, detail = evaluate(EvalConfig(
            run_dir=run_dir, data=data, step=step, max_queries=max_queries, seed=seed,
            batch_size=batch_size))
        written.append(report["written_to"])
        if as_json:  # the table holds the warnings; beside JSON they go to stderr
            for w in report["warnings"]:
                click.echo(f"warning: {w}", err=True)
        click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
        if plot:
            plot_fn(report, detail, plot)
            written.append(plot)
            click.echo(f"wrote {plot}", err=True)


@main.command("pool", short_help="Several evaluations (e.g. one per world) scored as one.")
@click.argument("answers", nargs=-1, type=click.Path())
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Also write the pooled report as JSON here.")
@click.option("--overwrite", is_flag=True, help="Replace the file already at --out.")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Seed of the bootstrap intervals.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout.")
def pool_cmd(answers, out, overwrite, seed, as_json):
    """The per-query answers of several `train eval` runs (ANSWERS: their
    eval/step-<S>.answers.npz files, or run folders, for the answers of their newest
    whole-split evaluation) scored as one test split: every predictor's median relative
    error by stratum with its 95 % interval, and the verdict (the model minus the strongest
    baseline per stratum, paired; P(failed) against the lowest Brier), the intervals
    resampling whole (evaluation, source) pairs. For a result across worlds: one world's
    interval may hold 0 where the pooled one does not. Two evaluations of one test split
    (its queries, or samples of its probes) are refused; runs that did not train alike
    (preset, steps, batch, objective, model settings) are named in a warning.

    \b
    Example, five generated worlds (prep synth --seed 0..4, a run on each):
      train pool runs/small-w0 runs/small-w1 runs/small-w2 runs/small-w3 runs/small-w4 \\
          --out pooled.json
    """
    import json

    from train.eval.pool import format_pooled, pool, write_pooled

    if not answers:
        raise click.UsageError("name the answers of at least one `train eval` (its "
                               "eval/step-<S>.answers.npz) or a run folder")
    _new_file("--out", out, overwrite)
    report = pool(list(answers), seed=seed)
    click.echo(json.dumps(report, indent=2) if as_json else format_pooled(report))
    if out:
        click.echo(f"wrote {write_pooled(report, out)}", err=True)


@main.command(short_help="RTT median, p10, p90 and P(failed) of pings, from a run's model.")
@click.argument("run_dir", type=click.Path(), required=False)
@click.option("--src", help="Source address (the probe), IPv4 or IPv6.")
@click.option("--dst", help="Destination address.")
@click.option("--time", "when", default=None,
              help="When (ISO-8601, UTC unless it has an offset, or Unix seconds; "
                   "1970-01-01 <= t < 2100-01-01, as `prep` accepts); without it the query "
                   "carries no timestamp.")
@click.option("--history", type=click.Path(), default=None,
              help="Parquet of earlier measurements (the input schema of `prep shards`): "
                   "the model's context. Each query (--src or --queries) reads the rows with "
                   "its src_addr from before its time; the rows of other sources are left "
                   "out and counted on stderr.")
@click.option("--queries", type=click.Path(), default=None,
              help="Parquet of queries: src_addr, dst_addr and optionally event_time. "
                   "The answers add rtt_ms, p10_ms, p90_ms, p_failed, history_used "
                   "(point_ms with --band), and event_time as a UTC timestamp.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write the answers here: parquet, a row per query (one for --src), that "
                   "reads back as --queries.")
@click.option("--overwrite", is_flag=True,
              help="Replace the file already at --out; it stays as it was until every query "
                   "is answered.")
@click.option("--band", type=click.FloatRange(0, 1, max_open=True), default=None, metavar="E",
              help="Also the band point at E (point_ms): the RTT the most of the model's "
                   "probability lies within E of (|p - y| <= E y), the point a median "
                   "relative error rewards where the median is the one half lies each side "
                   "of. `train eval`'s report names the band (or the median) the model "
                   "picks in each stratum, e.g. 0.02 where the context holds replies to "
                   "the destination. [default: none, the median only]")
@click.option("--step", type=int, default=None, help="Checkpoint step [default: the latest].")
@click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
def predict(run_dir, src, dst, when, history, queries, out, overwrite, band, step, as_json):
    """RTT median, p10, p90 and P(failed) of pings, from the model of RUN_DIR (without it:
    the newest run under runs/, as `train eval` takes).

    \b
    Examples:
      train predict runs/x --src 192.0.2.7 --dst 193.0.14.129 --time 2026-01-02T12:00:00Z
      train predict runs/x --queries q.parquet --history h.parquet --out answers.parquet
      train predict runs/x --src 192.0.2.7 --dst 193.0.14.129 --history h.parquet --band 0.02
    """
    import json

    from train.predict import queries as queries_lib

    for flag, path in (("--queries", queries), ("--history", history)):
        _parquet_file(flag, path)
    if queries:
        if src or dst or when:
            raise InputError("--queries takes the queries from the file; drop --src/--dst/--time")
        if not out and not as_json:
            raise InputError("--queries needs --out FILE.parquet (or --json to print them)")
    elif not src or not dst:
        raise InputError("give --src and --dst (or --queries FILE.parquet); "
                         "e.g. train predict RUN_DIR --src 192.0.2.7 --dst 193.0.14.129")
    _new_file("--out", out, overwrite, "it stays as it was until every query is answered")
    run_dir = _run_or_newest(run_dir, "train predict", "answering from")
    had_out, printed = bool(out) and os.path.lexists(out), 0

    def emit(answers):  # each piece as it is answered
        nonlocal printed
        click.echo("\n".join(json.dumps(a) for a in answers))
        printed += len(answers)

    def what(e: KeyboardInterrupt) -> str:  # the answers file is written whole or not at all
        if getattr(e, "published", False):
            return f"after writing {out}"
        notes = [f"{out} holds what it held before" if had_out else f"{out} was not written"
                 ] if out else []
        notes += [f"the first {printed:,} answers were printed"] if printed else []
        return (f"while answering {queries or f'{src} -> {dst}'} from {run_dir}; "
                f"{' and '.join(notes) or 'nothing was written'}")

    with _stops_on_signals("train predict", what):
        if queries:
            queries_lib.predict_file(run_dir, queries, history, out, step=step,
                                     emit=emit if as_json else None, band=band)
            return
        a = queries_lib.predict_one(run_dir, src, dst, when, history, step=step, out=out,
                                    band=band)
        if as_json:
            click.echo(json.dumps(a))
        else:
            click.echo(f"{src} -> {dst}: RTT median {a['rtt_ms']:.2f} ms (p10 "
                       f"{a['p10_ms']:.2f}, p90 {a['p90_ms']:.2f})"
                       + ("" if band is None else f", band point at {band:g} "
                          f"{a['point_ms']:.2f} ms") + ", P(failed) "
                       f"{a['p_failed']:.3f}; {a['history_used']} earlier measurements as context")


@contextlib.contextmanager
def _stops_on_signals(command: str, what):
    """The body of `train eval` and `train predict`: SIGINT and SIGTERM stop it
    (prep.base.signals.stop_on_signals) with one line, "COMMAND: stopped by SIGINT " and
    ``what(e)`` (what it wrote, or did not), and exit 128 + the signal, at once
    (multihost.leave): an XLA compile the signal cut short goes on in its thread, and
    Python's shutdown under it crashes (SIGSEGV)."""
    from prep.base.signals import stop_on_signals

    try:
        with stop_on_signals(command=command):
            yield
    except KeyboardInterrupt as e:
        from train.fit.multihost import leave

        name = signal.Signals(getattr(e, "signum", signal.SIGINT))
        leave(128 + name, f"{command}: stopped by {name.name} {what(e)}")


def _new_file(flag: str, path: str | None, overwrite: bool, kept: str = "") -> None:
    """InputError if ``path`` (if given) is there and not ``overwrite``, before the work, as
    `prep` refuses an --out; ``kept``: what becomes of the old file meanwhile."""
    if path and os.path.lexists(path) and not overwrite:
        raise InputError(f"{flag} {path}: already there; pass --overwrite to replace it"
                         f"{f' ({kept})' if kept else ''}, or use another {flag}")


def _parquet_file(flag: str, path: str | None) -> None:
    """InputError unless ``path`` (if given) is a file, before a model loads."""
    if path is None:
        return
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: a folder; {flag} takes one parquet file")
    if not os.path.exists(path):
        raise InputError(f"{flag} {path}: no such file; check the path")


def _run_or_newest(run_dir: str | None, command: str, doing: str) -> str:
    """RUN_DIR as given, else the newest run under runs/ (said on stderr)."""
    if run_dir is not None:
        return run_dir
    newest = _newest_run()
    if newest is None:
        _fail(f"no run with checkpoints under {RUNS}/; give RUN_DIR, e.g. "
              f"{command} runs/tiny-20261123-101500")
    click.echo(f"{doing} {newest}, the newest run under {RUNS}/", err=True)
    return str(newest)


def _fail(message: str, code: int = 2):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
