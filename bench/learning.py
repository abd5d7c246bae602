"""Learning curve: does the model read its context, and after how many tokens does it
beat the predictors that read the same context? One command, one JSON.

Trains one config with the real trainer (train.fit.loop.train), saving K checkpoints spread
over the run, and evaluates each with `train eval`'s machinery (train.eval.evaluate, the same
queries at every point: a seeded sample of --queries full-mode queries) against every
baseline, context baselines included. Writes ``bench/results/learning-<device>-<model>.json``:
per checkpoint the tokens trained, the loss by role, and the model's and each baseline's
median relative error with its 95 % interval, overall and per stratum (pair_in_context,
node_known, cold); and the throughput. ``--plot`` draws error by stratum against tokens,
baselines as horizontal lines.

    python -m bench.learning --data shards-256 --model small            # the CPU recipe
    python -m bench.learning --data shards --model base --steps 4000    # make gpu-check
    python -m bench.learning --score runs/learn-s0 --plot s0.png   # a finished run's checkpoints
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import time
from pathlib import Path

from bench.run import RESULTS, machine

BASELINES = ("context_last", "context_ema", "context_median", "context_vivaldi", "context_knn",
             "context_krig", "dst_median", "matrix_factorization", "global_median")


def curve_point(report: dict, tokens: int) -> dict:
    """What a learning curve keeps of one `train eval` report."""
    keep = ("model", "model_no_context") + BASELINES
    rtt = report["rtt"]
    point = {"step": report["step"], "tokens": tokens,
             "loss_by_role": {k: v["loss"] for k, v in report["loss"]["by_role"].items()},
             "loss": report["loss"]["loss"],
             "copied_src_accuracy": (report["loss"].get("copied_src") or {}).get("accuracy"),
             "copyable_src_accuracy":
                 (report["loss"].get("copyable_src") or {}).get("accuracy")}
    for name in keep:
        m = rtt[name]
        point[name] = {"all": m["median_rel"], "ci": m["median_rel_ci"],
                       **{s: v["median_rel"] for s, v in m["by_stratum"].items()},
                       "stratum_ci": {s: v["median_rel_ci"] for s, v in m["by_stratum"].items()}}
    # the intervals resample whole sources (train.eval.metrics): how many each scope holds
    point["sources"] = {"all": report.get("sources"), **(report.get("sources_by_stratum") or {})}
    # per scope, the model minus the strongest baseline on the same queries, paired intervals
    # (train eval's verdict lines; a GPU run's per-query errors do not come back)
    point["verdict"] = {scope: {"n_rtt": v["n_rtt"], "baseline": v["baseline"],
                                "winner": v.get("winner"),
                                **{k: {"diff": v[k]["diff"], "diff_ci": v[k]["diff_ci"]}
                                   for k in ("median_rel", "mae_ms") if k in v},
                                # P(failed) against the lowest Brier (reports since 2026-11-30)
                                **({"failures": {"baseline": f["baseline"],
                                                 "winner": f["winner"],
                                                 "diff": f["brier"]["diff"],
                                                 "diff_ci": f["brier"]["diff_ci"]}}
                                   if (f := v.get("failures")) else {})}
                        for scope, v in report["verdict"].items()}
    return point


def main(argv: list[str] | None = None) -> int:
    head, _, examples = __doc__.partition("\n\n    python")
    first = " ".join(head.split("\n\n")[0].split())  # the first paragraph, rewrapped
    p = argparse.ArgumentParser(description=textwrap.fill(first, 79),
                                epilog="examples:\n    python" + examples.rstrip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="a shards folder (prep shards); required unless --score")
    p.add_argument("--score", metavar="RUN_DIR", default=None,
                   help="score the checkpoints of a finished run instead of training one "
                        "(its config.json says what ran; train it with --ckpt-every its "
                        "steps / --points) [none]")
    p.add_argument("--model", default="small", help="tiny, small or base [small]")
    p.add_argument("--steps", type=int, help="default: the model's CPU/GPU preset")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--loss-weights")
    p.add_argument("--points", type=int, default=4, help="checkpoints evaluated [4]")
    p.add_argument("--queries", type=int, default=5000, help="RTT queries per point [5000]")
    p.add_argument("--run-dir", default=None, help="[runs/learning-<model>-<time>]")
    p.add_argument("--plot", default=None, help="a PNG or PDF of error against tokens")
    p.add_argument("--out", default=None, help="JSON path [bench/results/learning-<device>-<model>.json]")
    args = p.parse_args(argv)
    if args.score is None and args.data is None:
        p.error("give --data (a shards folder to train on) or --score RUN_DIR")
    if args.score is not None and not (Path(args.score) / "config.json").is_file():
        p.error(f"--score {args.score}: no config.json there (a run folder `train` wrote)")

    import jax

    from train.eval.evaluate import EvalConfig, evaluate
    from train.fit.checkpoint import step_dirs
    from train.fit.config import TrainConfig, defaults_for
    from train.fit.loop import train

    platform = jax.devices()[0].platform
    settings = defaults_for(platform, jax.device_count(), model=args.model)
    for k in ("steps", "batch_size", "lr", "warmup", "loss_weights"):
        if getattr(args, k) is not None:
            settings[k] = getattr(args, k)
    steps = settings["steps"]
    every = max(1, steps // args.points)
    if args.score is None:
        run_dir = args.run_dir or f"runs/learning-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}"
        settings.update(model=args.model, ckpt_every=every, eval_every=0,
                        log_every=max(1, every // 4), keep_checkpoints=args.points + 1)
        cfg = TrainConfig(data=args.data, run_dir=run_dir, **settings)
        print(f"[learning] {cfg.model} on {cfg.data}: {steps} steps of {cfg.batch_size} rows, "
              f"checkpoints every {every}; run in {run_dir}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        summary = train(cfg)
        train_s = time.perf_counter() - t0
    else:  # its own throughput as it logged it (beside other work, it is that work's too)
        run_dir = args.score
        cfg = TrainConfig(**json.loads((Path(run_dir) / "config.json").read_text())["train"])
        logged = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()
                  if '"tokens_per_s"' in line]
        rates = [m["tokens_per_s"] for m in logged if m.get("tokens_per_s")]
        summary = {"tokens_per_s": sum(rates) / len(rates) if rates else None, "mfu": None}
        train_s = None
        print(f"[learning] scoring the checkpoints of {run_dir} ({cfg.model} on {cfg.data})",
              file=sys.stderr, flush=True)
    record = json.loads((Path(run_dir) / "config.json").read_text())
    row_len = record["model"]["seq_len"]
    device = jax.devices()[0].device_kind
    path = Path(args.out or RESULTS / f"learning-{re.sub(r'[^A-Za-z0-9]+', '-', device).strip('-').lower()}-{args.model}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    points = []
    saved = sorted(step_dirs(Path(run_dir) / "checkpoints"))
    for step in saved[-1:] + saved[:-1]:  # the last first: a run cut short keeps its end
        report, _ = evaluate(EvalConfig(run_dir=run_dir, step=step, max_queries=args.queries),
                             progress=False)
        m = curve_point(report, step * cfg.batch_size * row_len)
        points = sorted(points + [m], key=lambda q: q["step"])
        print(f"[learning] step {step:,} ({m['tokens'] / 1e6:.1f}M row tokens): model "
              f"{m['model']['all']:.3f} | no context {m['model_no_context']['all']:.3f} | "
              f"context_last {m['context_last']['all']:.3f} | context_median "
              f"{m['context_median']['all']:.3f}", file=sys.stderr, flush=True)
        out = {"machine": machine(), "device": device, "config": record,
               "train_s": None if train_s is None else round(train_s, 1),
               "scored": args.score, "tokens_per_s": summary["tokens_per_s"],
               "mfu": summary["mfu"], "queries": report["queries"],
               "queries_with_rtt": report["queries_with_rtt"],
               "n_by_stratum": {s: v["n_rtt"] for s, v in report["rtt"]["model"]["by_stratum"].items()},
               "points": points}
        # after every point: a run cut short keeps the points it scored
        path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"[learning] wrote {path}", file=sys.stderr)
    if args.plot:
        plot(out, args.plot)
        print(f"[learning] wrote {args.plot}", file=sys.stderr)
    return 0


def plot(curve: dict, path: str) -> None:
    """Median relative error by stratum against training tokens; baselines as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    strata = ["all"] + [s for s, n in curve["n_by_stratum"].items() if n]  # none: no panel
    fig, axes = plt.subplots(1, len(strata), figsize=(3.3 * len(strata), 3.4), sharey=True)
    x = [p["tokens"] / 1e6 for p in curve["points"]]
    styles = {"context_last": ("tab:green", "--"), "context_ema": ("tab:olive", (0, (3, 1, 1, 1))),
              "context_median": ("tab:orange", ":"),
              "matrix_factorization": ("tab:cyan", (0, (4, 2))),
              "context_vivaldi": ("tab:purple", "-."), "context_knn": ("tab:pink", (0, (2, 1))),
              "context_krig": ("tab:blue", (0, (6, 2, 1, 2))),
              "dst_median": ("tab:brown", (0, (1, 3))),
              "global_median": ("grey", (0, (5, 5)))}
    for ax, s in zip(axes, strata):
        ax.plot(x, [p["model"][s] for p in curve["points"]], "o-", color="black", lw=2,
                label="model")
        ax.plot(x, [p["model_no_context"][s] for p in curve["points"]], "s-", color="tab:red",
                lw=1.2, ms=3, label="model, query alone")
        last = curve["points"][-1]
        for name, (color, ls) in styles.items():
            if name in last and last[name][s] is not None:
                ax.axhline(last[name][s], color=color, ls=ls, lw=1.2, label=name.replace("_", " "))
        n = sum(curve["n_by_stratum"].values()) if s == "all" else curve["n_by_stratum"][s]
        ax.set_title(f"{s.replace('_', ' ')} (n = {n:,})", fontsize=9)
        ax.set_xlabel("training tokens (M)")
        if x[0] > 0 and x[-1] / x[0] > 30:  # points from the first steps on: a log axis
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        if s == "all":
            ax.fill_between(x, [p["model"]["ci"][0] for p in curve["points"]],
                            [p["model"]["ci"][1] for p in curve["points"]], color="black",
                            alpha=0.15, lw=0, label="model, 95 % interval")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks([0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median relative error")
    h, lab = axes[0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=(len(lab) + 1) // 2, fontsize=8, frameon=False)
    cfg = curve["config"]
    fig.suptitle(f"{cfg['train']['model']} on {Path(cfg['train']['data']).name} "
                 f"({curve['device']}): error by stratum against training tokens", fontsize=10)
    fig.tight_layout(rect=(0, 0.13, 1, 0.95))  # two legend rows below the panels
    fig.savefig(path, dpi=150)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
