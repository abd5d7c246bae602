"""`train eval --plot x.png|x.pdf`: the relative-error CDFs of the model and the strongest
baselines, overall and one panel per stratum that has queries, beside the run's loss curves.

Each panel draws the model, the ``STRONGEST`` baselines with the lowest median relative
error in that panel, and the global median (the floor every predictor should clear); the
other predictors are in the report's JSON (13 curves hid each other). Every predictor has
one style of its own, fixed by train/eval/registry.py's order (``STYLES``), so a colour
means the same predictor on every figure: the model black and thick, the model without
context black and dashed, context baselines solid, train-fit baselines dashed or dotted.
A stratum with no query gets no panel. Baselines that fell back for every query draw
nothing (their curve is their fallback's). The model's median relative error and its
95 % interval are a shaded band on every CDF panel. One legend below the panels; the
format follows the file name (matplotlib: png, pdf, svg).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from prep.base.atomic import replacing
from prep.base.errors import InputError
from train.eval import registry
from train.eval.metrics import STRATA
from train.eval.report import fell_back, label

if TYPE_CHECKING:
    from train.eval.evaluate import Detail

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
           "tab:pink", "tab:olive", "tab:cyan", "tab:gray", "gold", "teal", "navy")
_DASHES = ("-", "--", "-.", ":")
STRONGEST = 2  # baselines drawn per panel, besides the model and the global median


def _styles() -> dict:
    """One style per predictor, by its place in the registry (not by which are drawn)."""
    out = {"model": dict(color="black", lw=2.4, ls="-"),
           "model_median": dict(color="dimgray", lw=1.6, ls=":"),
           "model_no_context": dict(color="black", lw=1.6, ls="--")}
    others = [n for n in registry.PREDICTORS if n not in out]
    for k, name in enumerate(others):
        ls = "-" if registry.kind_of(name) == registry.CONTEXT else _DASHES[1 + k % 3]
        out[name] = dict(color=_COLORS[k % len(_COLORS)], lw=1.3, ls=ls)
    return out


STYLES = _styles()


def panel_curves(rtt: dict, stratum: str | None) -> list[str]:
    """The predictors one panel draws (registry order): the model, the STRONGEST baselines
    by median relative error there, the global median; none that fell back for all."""
    get = (lambda m: m) if stratum is None else (lambda m: m["by_stratum"][stratum])
    base = [n for n, m in rtt.items() if registry.kind_of(n) != registry.MODEL
            and not fell_back(m) and get(m)["median_rel"] is not None]
    best = sorted(base, key=lambda n: get(rtt[n])["median_rel"])[:STRONGEST]
    keep = {"model", "global_median", *best}
    return [n for n in rtt if n in keep and (n == "model" or n in base)]


def _cdf(ax, detail: Detail, report: dict, stratum: int | None, right: float):
    rel = detail.relative_errors(stratum)
    for name in panel_curves(report["rtt"], None if stratum is None else STRATA[stratum]):
        if len(rel.get(name, ())):
            x = np.sort(np.maximum(rel[name], 1e-4))
            ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=label(name), **STYLES[name])
    m = report["rtt"]["model"]
    if stratum is not None:
        m = m["by_stratum"][STRATA[stratum]]
    if m.get("median_rel_ci"):
        lo, hi = m["median_rel_ci"]
        ax.axvspan(max(lo, 1e-3), max(hi, 1e-3), color="black", alpha=0.12, lw=0,
                   label="model: median rel. error, 95 % interval")
    ax.set_xscale("log")
    ax.set_xlim(1e-3, right)
    ax.set_ylim(0, 1)
    ax.axhline(0.5, color="grey", lw=0.6, ls=":")
    ax.grid(True, which="major", alpha=0.3)


def plot(report: dict, detail: Detail, path: str) -> None:
    """Write the figure to ``path`` whole (its suffix picks the format)."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("--plot needs matplotlib: pip install 'ping-pack[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(report, detail)
    with replacing(path) as tmp:  # a stop while it draws leaves the old file, or none
        fig.savefig(tmp, dpi=150,
                    format=Path(path).suffix[1:] or matplotlib.rcParams["savefig.format"])
    plt.close(fig)


def figure(report: dict, detail: Detail):
    """The matplotlib figure of ``plot``."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rtt = report["rtt"]
    # up to 10x off, or far enough to show the model's interval
    ci = rtt["model"].get("median_rel_ci") or [0.0, 0.0]
    right = max(10.0, 2.0 * ci[1])
    fig = plt.figure(figsize=(13, 9))
    grid = fig.add_gridspec(2, 3, height_ratios=[1.25, 1])
    ax = fig.add_subplot(grid[0, :2])
    _cdf(ax, detail, report, None, right)
    ax.set_xlabel("relative error |predicted - measured| / measured")
    ax.set_ylabel("share of test pings with a reply")
    ax.set_title(f"all queries (n = {report['queries_with_rtt']:,} with a reply)", fontsize=10)
    shown = [(k, s) for k, s in enumerate(STRATA) if rtt["model"]["by_stratum"][s]["n_rtt"]]
    for col, (k, s) in enumerate(shown):
        sub = fig.add_subplot(grid[1, col], sharex=ax)
        _cdf(sub, detail, report, k, right)
        sub.set_title(f"{s} (n = {rtt['model']['by_stratum'][s]['n_rtt']:,})", fontsize=10)
        sub.set_xlabel("relative error")
        if col == 0:
            sub.set_ylabel("share with a reply")
    _loss_panel(fig.add_subplot(grid[0, 2]), report)

    seen = {}  # one legend entry per predictor drawn on any panel, in the registry's order
    for a in fig.axes:
        for h, lab in zip(*a.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    order = [label(n) for n in rtt] + ["model: median rel. error, 95 % interval"]
    labels = [lab for lab in order if lab in seen]
    handles = [seen[lab] for lab in labels]
    notes = [f"each panel: the model, its {STRONGEST} strongest baselines and the global "
             "median; every predictor in the JSON"]
    quiet = [label(n) for n, m in rtt.items() if fell_back(m)]
    if quiet:
        notes.append("fell back for all (not drawn): " + ", ".join(quiet))
    empty = [s for s in STRATA if not rtt["model"]["by_stratum"][s]["n_rtt"]]
    if empty:
        notes.append("no queries (no panel): " + ", ".join(empty))
    for n in notes:
        handles.append(Line2D([], [], color="none"))
        labels.append(n)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    split = report["split"]
    rule = split["split"] + (f", test from {split['test_from_iso']}" if "test_from" in split else "")
    fig.suptitle(f"{Path(report['data']).resolve().name} (split {rule}): N = "
                 f"{report['queries_with_rtt']:,} test pings with a reply, model at step "
                 f"{report['step']}", fontsize=11)
    rows = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, 0.025 * rows + 0.02, 1, 0.97))
    return fig


def _loss_panel(ax, report: dict) -> None:
    steps, loss, eval_steps, eval_loss = [], [], [], []
    metrics_file = Path(report["run_dir"]) / "metrics.jsonl"
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a torn last line of a killed run
            if not isinstance(rec, dict) or "step" not in rec:
                continue
            if "loss" in rec:
                steps.append(rec["step"])
                loss.append(rec["loss"])
            if rec.get("eval_loss") is not None:
                eval_steps.append(rec["step"])
                eval_loss.append(rec["eval_loss"])
    ax.plot(steps, loss, label="train loss", color="tab:blue")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o--", label="eval loss (test sample)", color="tab:red",
                ms=3)
    ax.axvline(report["step"], color="grey", lw=0.6, ls=":")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross-entropy (nats)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("training", fontsize=10)
