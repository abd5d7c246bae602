"""The CPU recipe at GPU scale, on two generated worlds: does `small` (with its destination
memory, prior and anonymous sources, docs/learning.md section 8) reach the strongest
baseline in every stratum once it has the tokens? One command for a lent GPU.

For each `prep synth` seed: the built-in data's flags (3M rows, 3,000 probes, 2 days),
`prep shards --split time+probe --row-len 256`, then bench/learning.py with the recipe's
objective at GPU batch sizes; writes bench/results/learning-<device>-small-synth<seed>.json
(and its figure) per world, and the worlds' last checkpoints pooled (`train pool`) into
learning-<device>-small-pooled.json; with ``--seattle DIR`` (the SeattleData_* frames, README:
Seattle) the same on that real matrix, `learning-<device>-small-seattle.json`, where matrix
factorization is the bar. With ``--budget-s`` each world's run takes the steps its share
of the budget allows at ``--rate`` real tokens/s (the `small` of 11-27 ran 2.5M tokens/s on
an H200 at 32 rows; the memory's tables add a little).

    python -m bench.recipe_gpu --budget-s 480 --results $OUT        # a lent machine
    python -m bench.recipe_gpu --seattle ../shared/data/latency-matrices/seattle --budget-s 480
    python -m bench.recipe_gpu --rows 30000 --steps 20 --queries 200  # a CPU dry run
    python -m bench.recipe_gpu --seeds 0 --budget-s 300 --model-set n_layers=6 \
        --model-set d_model=256 --model-set head_dim=64 --model-set d_mlp=1024   # wider
    python -m bench.recipe_gpu --seeds 0 --budget-s 240 --tag flat \
        --synth-args "--access-ms 0 --detour 0.35 --anycast-sites 0"   # the world before 11-29
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
POINTS = 3  # checkpoints evaluated per world


def main(argv: list[str] | None = None) -> int:
    head, _, examples = __doc__.partition("\n\n    python")
    p = argparse.ArgumentParser(description=head.split("\n\n")[0],
                                epilog="examples:\n    python" + examples,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1", help="prep synth seeds, one world each [0,1]")
    p.add_argument("--rows", type=int, default=3_000_000, help="measurements per world [3000000]")
    p.add_argument("--steps", type=int, default=12_000,
                   help="steps per world (at most, under --budget-s) [12000]")
    p.add_argument("--batch-size", type=int, default=32, help="rows of 256 a step [32]")
    p.add_argument("--budget-s", type=float, default=None, help="end within this many seconds [none]")
    p.add_argument("--rate", type=float, default=2.0e6, help="assumed real tokens/s under --budget-s [2e6]")
    p.add_argument("--queries", type=int, default=5000, help="RTT queries per point [5000]")
    p.add_argument("--results", default=None, help="folder for the JSON [bench/results]")
    p.add_argument("--seattle", default=None, help="a folder of SeattleData_* frames: one more world")
    p.add_argument("--synth-args", default="", metavar="ARGS",
                   help="more `prep synth` options for the generated worlds, e.g. the flat "
                        "world of before 2026-11-29: '--access-ms 0 --detour 0.35 "
                        "--anycast-sites 0'; its JSON is named ...-synth<seed>-<--tag> [none]")
    p.add_argument("--tag", default="", help="a name for this variant in the JSON's name [none]")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a field of small's ModelConfig, e.g. n_layers=6 d_model=256 "
                        "(repeatable; the JSON's config says what ran) [none]")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: comma-separated integers, e.g. 0,1")
    frames = sorted(str(f) for f in Path(args.seattle or ".").glob("SeattleData_*"))
    if args.seattle and not frames:
        p.error(f"--seattle {args.seattle}: no SeattleData_* files there (README: Seattle)")
    if args.seattle:
        seeds.append("seattle")
    if not seeds:
        p.error("no world to run: give --seeds, --seattle or both")
    for flag, v in (("--budget-s", args.budget_s), ("--rate", args.rate), ("--rows", args.rows),
                    ("--steps", args.steps), ("--batch-size", args.batch_size),
                    ("--queries", args.queries)):
        if v is not None and v <= 0:
            p.error(f"{flag} {v:g}: must be above 0")
    synth_args = shlex.split(args.synth_args)
    if synth_args and not args.tag:
        p.error("--synth-args: give --tag too, so the JSON is not named as the built-in world's")
    if args.tag and not re.fullmatch(r"[A-Za-z0-9_.-]+", args.tag):
        p.error(f"--tag {args.tag!r}: letters, digits, '.', '_' and '-' only")
    sys.path.insert(0, str(REPO))
    import dataclasses

    import jax

    from bench.gpu import model_overrides
    from train.model import arch

    try:
        overrides = model_overrides(args.model_set)
    except ValueError as e:
        p.error(str(e))
    if overrides:  # this process's `small`, changed before bench.learning reads it
        arch.MODELS["small"] = dataclasses.replace(arch.MODELS["small"], **overrides)

    from bench import learning
    from bench.gpu_check import LEARNING_MIN_S, learning_steps, prep
    from bench.run import RESULTS

    results = Path(args.results) if args.results else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^A-Za-z0-9]+", "-", jax.devices()[0].device_kind).strip("-").lower()
    t0 = time.perf_counter()
    failed, done = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k, seed in enumerate(seeds):
            steps = args.steps
            if args.budget_s:  # this world's share of what is left, as gpu_check's run
                share = (args.budget_s - (time.perf_counter() - t0)) / (len(seeds) - k)
                if share < LEARNING_MIN_S:
                    print(f"[recipe-gpu] seed {seed}: skipped, {share:.0f} s left", file=sys.stderr)
                    failed.append(f"seed {seed} (no time)")
                    continue
                steps = learning_steps(args.rate, share, args.batch_size, 256, POINTS,
                                       most=args.steps)
            raw, shards = f"{tmp}/raw{seed}", f"{tmp}/shards{seed}"
            first = (["import-matrix", *frames, "--out", raw, "--interval", "300", "--unit", "s"]
                     if seed == "seattle" else
                     ["synth", "--out", raw, "--rows", str(args.rows), "--probes", "3000",
                      "--days", "2", "--seed", str(seed), *synth_args])
            prep(*first)
            prep("shards", raw, "--out", shards, "--split", "time+probe", "--row-len", "256",
                 "--quiet")
            print(f"[recipe-gpu] seed {seed}: {steps:,} steps of {args.batch_size} rows of 256",
                  file=sys.stderr, flush=True)
            name = ("seattle" if seed == "seattle" else f"synth{seed}") + (
                f"-{args.tag}" if args.tag else "")
            out = results / f"learning-{device}-small-{name}.json"
            rc = learning.main(["--data", shards, "--model", "small", "--steps", str(steps),
                                "--batch-size", str(args.batch_size), "--lr", "3e-3",
                                "--warmup", str(max(10, steps // 40)),
                                "--loss-weights", "rtt=10,result=10", "--points", str(POINTS),
                                "--queries", str(args.queries), "--run-dir", f"{tmp}/run{seed}",
                                "--out", str(out), "--plot", str(out.with_suffix(".png"))])
            if rc:
                failed.append(f"seed {seed}")
            elif seed != "seattle":
                done.append(Path(f"{tmp}/run{seed}"))
        if len(done) > 1:  # the generated worlds' last checkpoints scored as one
            _pooled(done, results / f"learning-{device}-small-pooled"
                    f"{'-' + args.tag if args.tag else ''}.json")
    print(f"[recipe-gpu] done in {time.perf_counter() - t0:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def _pooled(runs: list[Path], out: Path) -> None:
    """`train pool` of each run's last scored checkpoint (its newest answers file), written
    to ``out``, its verdict lines on stderr."""
    from train.eval.answers import step_of
    from train.eval.pool import format_pooled, pool, write_pooled

    newest = [max((f for f in r.glob("eval/step-*.answers.npz") if step_of(f)), key=step_of)
              for r in runs]
    report = pool([str(f) for f in newest])
    write_pooled(report, out)
    verdict = format_pooled(report).split("\nverdict:")[-1]
    print(f"[recipe-gpu] {len(runs)} worlds pooled, verdict:{verdict}\n[recipe-gpu] wrote {out}",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
