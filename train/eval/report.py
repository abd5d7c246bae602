"""The output of `train eval` (train.eval.evaluate): the table (``format_report``) and the JSON
document in ``RUN_DIR/eval/`` (``write_report``); the figure is train/eval/plot.py.

A baseline that fell back for every query (``covered`` 0) would print a row identical to
its fallback's; the table names its fallback instead, and leaves it out of the strata and
context-length tables. Labels and fallbacks are train/eval/registry.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

from prep.base.atomic import write_atomic
from train.eval.metrics import STRATA
from train.eval.registry import fallback_of, label
from train.predict.predictor import MODE_FIRST_BYTES

W = 22  # the label column


def fell_back(m: dict) -> bool:
    """The baseline answered no query itself."""
    return m["covered"] == 0.0


def _fmt(v, spec):  # a missing value is "-", right-aligned in the column's width
    return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])


def _ci(m: dict, width: int) -> str:
    ci = m.get("median_rel_ci")
    return format("-" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]", f">{width}")


def _pct(v, width: int) -> str:
    return _fmt(None if v is None else 100 * v, f"{width - 2}.1f") + " %"


def format_report(r: dict) -> str:
    split = r["split"]
    rule = split["split"] + (f", test from {split['test_from_iso']}" if "test_from" in split else "")
    lines = [f"train eval {r['run_dir']} at step {r['step']} on {r['data']} (split {rule}): "
             f"{r['queries']:,} RTT queries ({r['queries_with_rtt']:,} with a reply), "
             f"baselines fit on {r['train_measurements']:,} train measurements"]
    lines += [f"warning: {w}" for w in r.get("warnings", [])]
    tr = r.get("trained")
    if tr:
        lines.append(f"model {tr['model']}, {tr['steps']:,} steps of {tr['batch_size']} rows, "
                     f"objective weights by role: {tr['loss_weights']}")
    lines.append("")
    lo = r["loss"]
    if lo["loss"] is not None:
        roles = " | ".join(f"{k} {v['loss']:.3f} ({100 * v['accuracy']:.1f} %)"
                           for k, v in lo["by_role"].items())
        lines += [f"next-token loss {lo['loss']:.4f}, accuracy {100 * lo['accuracy']:.1f} % "
                  f"over {lo['tokens']:,} targets in {lo['rows']:,} test rows", f"  by role: {roles}"]
        cs = lo.get("copied_src")
        if cs:
            lines.append(f"  source bytes after a context's first measurement (a copy of one in "
                         f"front): {cs['loss']:.3f} ({100 * cs['accuracy']:.1f} %) over "
                         f"{cs['tokens']:,} targets")
        ca = lo.get("copyable_src")
        if ca:
            lines.append(f"  of them, those whose address is in front (a dual-stack probe's "
                         f"first source of a family is not): {ca['loss']:.3f} "
                         f"({100 * ca['accuracy']:.1f} %) over {ca['tokens']:,} targets")
        lines.append("")
    pt = r.get("point")
    if pt is not None:
        lines += [point_line(pt), ""]
    if r.get("fail_prior") is not None:
        lines += [fail_prior_line(r["fail_prior"]), ""]
    lines += score_tables(r["rtt"], r.get("verdict"), _resampled(r))
    scored = {k: m for k, m in r["rtt"].items() if not fell_back(m)}
    buckets = list(next(iter(r["rtt"].values()))["by_history"])
    lines += ["", "median relative error by earlier measurements in the context"]
    lines += _sub_table(scored, "by_history", buckets, 9, lambda s: _fmt(s["median_rel"], "9.3f"))
    lines += _calibration(r["rtt"])
    if r.get("non_canonical_mass_mean") is not None:
        lines += ["", f"model: {100 * r['non_canonical_mass_mean']:.1f} % of its first-RTT-byte "
                  "mass (mean) is on codes the tokenizer never writes; quantiles are over the "
                  "others (train/predict/predictor.py)"]
    t = r["timing"]
    lines += ["", f"{t['queries_per_s']:,.0f} queries/s on {t['device']}; the model alone "
              f"(no context) {t.get('no_context_query_s', 0):.1f} s; baselines fit and predicted "
              f"in {t['baselines_s']:.1f} s, context baselines in "
              f"{t.get('context_baselines_s', 0):.2f} s; {t['elapsed_s']:.1f} s in all; "
              f"JSON in {r.get('written_to', '-')}"]
    return "\n".join(lines)


def fail_prior_line(fp: dict) -> str:
    """How the context baselines' P(failed) is reached (train.eval.context_baselines)."""
    if not fp["pair"] and not fp["context"]:
        return ("P(failed) of the context baselines: the context's share of failures to the "
                "destination, else to any, else the train split's rate "
                f"{fp['rate']:.3f} (no train context has two pings to fit priors on)")
    live = ("its failures to any" if fp.get("live") is None
            else f"a live pair's rate {fp['live']:g}")
    dead = ("" if not fp.get("dead") else
            f"; or the pair is dead (fails at {fp['dead_rate']:g}), prior {fp['dead']:g}, "
            "weighed by its pings' likelihood")
    return ("P(failed) of the context baselines: the context's failures to the destination "
            f"over {fp['pair']:g} pseudo-pings of {live}{dead}; else the context's failures "
            f"to any over {fp['context']:g} of the train split's rate {fp['rate']:.3f} (beta "
            "priors fit on the train split's contexts)"
            + (f"; the rate, P(dead) and the live rate each destination's, from its train "
               f"pairs shrunk over {fp['dst_shrink']:g} pairs toward all destinations'"
               if fp.get("dst_shrink") else "")
            + ("; where every earlier ping of the query's family failed, the probe's family "
               "broken (IPv4 prior {:g}, IPv6 {:g}) against each failing on its own".format(
                   *fp["broken"]) if any(fp.get("broken") or ()) else ""))


def point_line(pt: dict) -> str:
    """How the model and pair_mode chose their points (train.eval.baselines.pair_mode;
    train.eval.evaluate._self_picked)."""
    errs = ", ".join(f"{'median' if k == 'None' else k} {v:.4f}"
                     for k, v in pt["band_errors"].items())
    by = pt.get("model_by_stratum")
    if by is None:  # written before the model picked its own point (one band for both)
        picked = ("the median (no pair had 5 replies to score a band)" if not errs else
                  f"the median (median relative error on each pair's latest fifth of its "
                  f"train replies: {errs})" if pt["band"] is None else
                  f"the band point at {pt['band']} (the value the most probability lies "
                  f"within {pt['band']} of; median relative error on each pair's latest fifth "
                  f"of its train replies: {errs})")
        return f"point predictions of the model and pair mode: {picked}"
    scored = f"median relative error on each pair's latest fifth of its train replies: {errs}"
    mode = ("its median (no pair had 5 replies to score a band)" if not errs else
            f"its median ({scored})" if pt["band"] is None else
            f"the centre of its densest window at {pt['band']} (the value the most of its "
            f"replies lie within {pt['band']} of; {scored})")
    model = "; ".join(f"{k} {'its median' if v['band'] is None else 'band ' + str(v['band'])}"
                      f" (expected {v['expected'][str(v['band'])]:.4f})" for k, v in by.items())
    return (f"point predictions: pair mode, per pair {mode}; the model, per stratum the point "
            f"whose median relative error it expects least of itself (counted over the codes "
            f"of its {MODE_FIRST_BYTES} likeliest first RTT bytes, so high where it is "
            f"unsure): {model}")


def score_tables(rtt: dict, verdict: dict | None, resampled: str) -> list[str]:
    """Every predictor's scores, its median relative error by stratum, then the verdict
    lines (``resampled``: how the intervals were drawn, said after their headings); what
    `train eval`'s table and `train pool`'s (train.eval.pool) share."""
    lines = _main_table(rtt)
    scored = {k: m for k, m in rtt.items() if not fell_back(m)}
    lines += ["", "median relative error [95 % interval] by stratum" + resampled]
    lines += _sub_table(scored, "by_stratum", list(STRATA), 24, lambda s: (
        f"{_fmt(s['median_rel'], '.3f')} {_ci(s, 14)}" if s["median_rel"] is not None else "-"))
    return lines + _verdict(verdict, resampled)


def _main_table(rtt: dict) -> list[str]:
    head = (f"{'RTT prediction':<{W}}{'MAE ms':>9}{'med AE ms':>11}{'med rel':>9}"
            f"{'95 % interval':>17}{'p90 rel':>9}{'Brier':>8}{'prec':>7}{'recall':>7}"
            f"{'covered':>9}")
    lines = [head, "-" * len(head)]
    for name, m in rtt.items():
        if fell_back(m):
            lines.append(f"{label(name):<{W}}(fell back for all: = {fallback_of(name)})")
            continue
        lines.append(f"{label(name):<{W}}{_fmt(m['mae_ms'], '9.2f')}"
                     f"{_fmt(m['median_ae_ms'], '11.2f')}{_fmt(m['median_rel'], '9.3f')}"
                     f"{_ci(m, 17)}{_fmt(m['p90_rel'], '9.3f')}{_fmt(m['brier'], '8.4f')}"
                     f"{_fmt(m['fail_precision'], '7.3f')}{_fmt(m['fail_recall'], '7.3f')}"
                     f"{_pct(m['covered'], 9)}")
    lines.append("prec, recall: of P(failed) > 0.5 as a prediction of a failed ping")
    return lines


def _sub_table(rtt: dict, key: str, cols: list, width: int, cell) -> list[str]:
    first = next(iter(rtt.values()))[key]
    total = sum(first[c]["n_rtt"] for c in cols)
    lines = [f"{'':<{W}}" + "".join(f"{c:>{width}}" for c in cols)]
    if key == "by_stratum":  # how the queries split: the strata's shares matter to read them
        lines.append(f"{'queries with a reply':<{W}}" + "".join(
            format(f"{first[c]['n_rtt']:,} ({100 * first[c]['n_rtt'] / max(total, 1):.0f} %)",
                   f">{width}") for c in cols))
    else:
        lines.append(f"{'queries with a reply':<{W}}" + "".join(
            f"{first[c]['n_rtt']:>{width},}" for c in cols))
    for name, m in rtt.items():
        lines.append(f"{label(name):<{W}}" + "".join(
            format(cell(m[key][c]), f">{width}") for c in cols))
    return lines


def _diff(d: dict, spec: str) -> str:
    ci = d["diff_ci"]
    return f"{d['diff']:+{spec}} [{ci[0]:+{spec}}, {ci[1]:+{spec}}]"


WON = {"model": "the model wins", "baseline": "the baseline wins",
       "neither": "no winner (the interval holds 0)"}
FAIL_WON = {"model": "the model's is best", "baseline": "the baseline's is better",
            "neither": "no winner (the interval holds 0)"}


def _resampled(r: dict) -> str:
    """How the intervals were drawn (reports before 2026-11-29 resampled single queries)."""
    if r.get("sources") is None:
        return ""
    by = ", ".join(f"{s} {n:,}" for s, n in r["sources_by_stratum"].items())
    return f"; intervals resample whole sources: {r['sources']:,} ({by})"


def _verdict(v: dict | None, resampled: str = "") -> list[str]:
    """Per scope: who wins on RTTs and by how much, and below it whose P(failed) is best
    against the lowest Brier of the baselines (train.eval.metrics.verdict)."""
    if not v:
        return []
    lines = ["", "verdict: the model minus the strongest baseline, paired on the same queries "
             "[95 % interval]" + resampled]
    for scope, row in v.items():
        head = f"{scope} ({row['n_rtt']:,} with a reply)"
        if row["baseline"] is None:
            lines.append(f"  {head}: no queries")
            continue
        m, a, b, f = row["median_rel"], row["mae_ms"], row["brier"], row.get("failures")
        # below 0.1 (a context's replies to the destination: ~0.02) three decimals hide
        # the difference: -0.000 [-0.001, -0.000]
        r = ".4f" if max(abs(m["model"]), abs(m["baseline"])) < 0.1 else ".3f"
        lines.append(f"  {head}: {WON[row['winner']]}; vs {label(row['baseline'])}: "
                     f"median rel {m['model']:{r}} vs {m['baseline']:{r}}, {_diff(m, r)}; "
                     f"MAE {a['model']:.2f} vs {a['baseline']:.2f} ms, {_diff(a, '.2f')}"
                     + ("" if f else f"; Brier {b['model']:.4f} vs {b['baseline']:.4f}, "
                        f"{_diff(b, '.4f')}"))
        if f:  # P(failed)'s own bar: the lowest Brier (reports before 2026-11-30 lack it)
            fb = f["brier"]
            lines.append(f"    P(failed) ({row['n']:,} queries): {FAIL_WON[f['winner']]}; vs "
                         f"{label(f['baseline'])} (the lowest Brier of the baselines): Brier "
                         f"{fb['model']:.4f} vs {fb['baseline']:.4f}, {_diff(fb, '.4f')}")
    return lines


def _calibration(rtt: dict) -> list[str]:
    out = []
    for name in ("model", "model_no_context"):
        m = rtt.get(name)
        if m is None or m.get("interval_coverage") is None:
            continue
        strata = ", ".join(f"{s} {_pct(m['by_stratum'][s].get('interval_coverage'), 7).strip()}"
                           for s in STRATA if m["by_stratum"][s]["n_rtt"])
        out.append(f"{label(name)}: {100 * m['interval_coverage']:.1f} % of replies inside its "
                   f"[p10, p90] (80 % is calibrated); {strata}")
    return [""] + out if out else []


def report_path(run_dir: str, step: int, max_queries: int = 0, other_data: str = "") -> Path:
    """RUN_DIR/eval/step-<step>.json, or step-<step>-q<N>.json for a sample of N queries,
    and ...-on-<F>.json on a dataset other than the run's (``other_data``: its fingerprint
    F): a sample, or another dataset's evaluation, never overwrites the run's full report
    (the one `train pool` reads for a run folder)."""
    name = (f"step-{step}" + (f"-q{max_queries}" if max_queries else "")
            + (f"-on-{other_data}" if other_data else "") + ".json")
    return Path(run_dir) / "eval" / name


def write_report(result: dict, run_dir: str, step: int, max_queries: int = 0,
                 other_data: str = "") -> Path:
    """Write the report (report_path) whole (temp name, then rename); return its path."""
    out = report_path(run_dir, step, max_queries, other_data)
    out.parent.mkdir(exist_ok=True)
    return write_atomic(out, json.dumps(result, indent=2) + "\n")
