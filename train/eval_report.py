"""The output of `train eval` (train.evaluate): the table (``format_report``), the JSON
document in ``RUN_DIR/eval/step-<N>.json`` (``write_report``) and the PNG (``plot``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prep.errors import InputError

if TYPE_CHECKING:
    from train.evaluate import Detail

LABELS = {"model": "model", "global_median": "global median", "pair_last": "pair last-seen",
          "pair_ema": "pair EMA (0.3)", "pair_median": "pair median", "vivaldi": "Vivaldi",
          "matrix_factorization": "matrix factorization"}


def format_report(r: dict) -> str:
    split = r["split"]
    rule = split["split"] + (f", test from {split['test_from_iso']}" if "test_from" in split else "")
    lines = [f"train eval {r['run_dir']} at step {r['step']} on {r['data']} (split {rule}): "
             f"{r['queries']:,} RTT queries ({r['queries_with_rtt']:,} with a reply), "
             f"baselines fit on {r['train_measurements']:,} train measurements", ""]
    lo = r["loss"]
    if lo["loss"] is not None:
        roles = " | ".join(f"{k} {v['loss']:.3f} ({100 * v['accuracy']:.1f} %)"
                           for k, v in lo["by_role"].items())
        lines += [f"next-token loss {lo['loss']:.4f}, accuracy {100 * lo['accuracy']:.1f} % "
                  f"over {lo['tokens']:,} targets in {lo['rows']:,} test rows", f"  by role: {roles}", ""]
    head = f"{'RTT prediction':<22}{'MAE ms':>9}{'med AE ms':>11}{'med rel':>9}{'p90 rel':>9}" \
           f"{'Brier':>8}{'covered':>9}"
    lines += [head, "-" * len(head)]
    def fmt(v, spec):  # a missing value is "-", right-aligned in the column's width
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])
    for name, m in r["rtt"].items():
        lines.append(f"{LABELS.get(name, name):<22}{fmt(m['mae_ms'], '9.2f')}"
                     f"{fmt(m['median_ae_ms'], '11.2f')}{fmt(m['median_rel'], '9.3f')}"
                     f"{fmt(m['p90_rel'], '9.3f')}{fmt(m['brier'], '8.4f')}"
                     f"{fmt(None if m['covered'] is None else 100 * m['covered'], '8.1f')}%")
    buckets = list(next(iter(r["rtt"].values()))["by_history"])
    lines += ["", "median relative error by earlier measurements in the context",
              f"{'':<22}" + "".join(f"{b:>9}" for b in buckets)]
    first = next(iter(r["rtt"].values()))["by_history"]
    lines.append(f"{'queries with a reply':<22}" + "".join(f"{first[b]['n_rtt']:>9,}" for b in buckets))
    for name, m in r["rtt"].items():
        lines.append(f"{LABELS.get(name, name):<22}" + "".join(
            f"{fmt(m['by_history'][b]['median_rel'], '9.3f')}" for b in buckets))
    if r.get("non_canonical_mass_mean") is not None:
        lines += ["", f"model: {100 * r['non_canonical_mass_mean']:.1f} % of its first-RTT-byte "
                  "mass (mean) is on codes the tokenizer never writes; quantiles are over the "
                  "others (train/predictor.py)"]
    t = r["timing"]
    lines += ["", f"{t['queries_per_s']:,.0f} queries/s on {t['device']}; baselines fit and "
              f"predicted in {t['baselines_s']:.1f} s; {t['elapsed_s']:.1f} s in all; "
              f"JSON in {r.get('written_to', '-')}"]
    return "\n".join(lines)


def write_report(result: dict, run_dir: str, step: int) -> Path:
    """Write the report as RUN_DIR/eval/step-<step>.json; return that path."""
    out = Path(run_dir) / "eval" / f"step-{step}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def plot(report: dict, detail: Detail, path: str) -> None:
    """PNG: the relative-error CDF of the model and each baseline, and the run's loss curves."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'ping-pack[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    styles = {"model": dict(color="black", lw=2.2)}
    for name, rel in detail.relative_errors().items():
        if not len(rel):
            continue
        x = np.sort(np.maximum(rel, 1e-4))
        y = np.arange(1, len(x) + 1) / len(x)
        med = report["rtt"][name]["median_rel"]
        ax.plot(x, y, label=f"{LABELS.get(name, name)} (median {med:.3f})",
                **styles.get(name, dict(lw=1.3)))
    ax.set_xscale("log")
    ax.set_xlim(1e-3, 10)
    ax.set_xlabel("relative error |predicted - measured| / measured")
    ax.set_ylabel("share of test pings with a reply")
    ax.axhline(0.5, color="grey", lw=0.6, ls=":")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("RTT prediction error (CDF)", fontsize=10)

    steps, loss, eval_steps, eval_loss = [], [], [], []
    metrics_file = Path(report["run_dir"]) / "metrics.jsonl"
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            rec = json.loads(line)
            if "loss" in rec:
                steps.append(rec["step"])
                loss.append(rec["loss"])
            if rec.get("eval_loss") is not None:
                eval_steps.append(rec["step"])
                eval_loss.append(rec["eval_loss"])
    ax2.plot(steps, loss, label="train loss", color="tab:blue")
    if eval_steps:
        ax2.plot(eval_steps, eval_loss, "o-", label="eval loss (test sample)", color="tab:red", ms=3)
    ax2.axvline(report["step"], color="grey", lw=0.6, ls=":")
    ax2.set_xlabel("step")
    ax2.set_ylabel("next-token cross-entropy (nats)")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    ax2.set_title("training", fontsize=10)

    split = report["split"]
    rule = split["split"] + (f", test from {split['test_from_iso']}" if "test_from" in split else "")
    fig.suptitle(f"{Path(report['data']).resolve().name} (split {rule}): N = "
                 f"{report['queries_with_rtt']:,} test pings with a reply, "
                 f"{report['queries']:,} queries; model at step {report['step']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
