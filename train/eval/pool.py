"""`train pool`: several evaluations scored as one, from the per-query answers each
`train eval` keeps (train.eval.answers): e.g. one run per generated world, to say whether
the model wins in a stratum across worlds where one world's interval holds 0.

The queries of all inputs are put together and scored as `train eval` scores one test split
(train.eval.evaluate.score: every predictor's metrics, by stratum and by context length,
and the verdict), with the intervals resampling whole (input, source) pairs: a source of
one world and a source of another are different probes, and each probe's queries move
together. Inputs must be of different test splits: two evaluations of one (two runs, one
run twice, or two samples of it) would count a query or a probe twice, as if independent,
and are refused.
Predictors that not every input has are left out, with a warning. Runs that did not train
alike (another preset, steps, batch, objective or model setting) are named in a warning: the
pooled `model` is then several models; settings that `train` sets from a run's data (off
where it cannot teach them, on where its test probes are known:
train.model.arch.SET_BY_DATA) in a warning of their own.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from prep.base.atomic import write_atomic
from prep.base.errors import InputError
from prep.base.words import count
from train.eval import metrics as EM
from train.eval.answers import read_answers, step_of
from train.eval.evaluate import score
from train.eval.report import score_tables
from train.model.arch import SET_BY_DATA


def resolve(arg: str) -> Path:
    """An answers file, or a run folder's: the answers of its newest whole-split
    evaluation (eval/step-<S>.answers.npz, S the largest)."""
    p = Path(arg)
    if not p.is_dir():
        return p
    found = sorted(((s[0], f) for f in (p / "eval").glob("step-*.answers.npz")
                    if (s := step_of(f)) and s[1] == 0), reverse=True)
    if not found and not (p / "config.json").is_file():
        raise InputError(f"{p}: not a run folder (no config.json); name runs that `train "
                         "eval` has evaluated, or their eval/step-<S>.answers.npz")
    if not found:
        raise InputError(f"{p}: no answers of a whole-split evaluation under {p}/eval; run "
                         f"`train eval {p}` first (or name a step-<S>-q<N>.answers.npz)")
    return found[0][1]


def pool(paths: list[str], *, seed: int = 0) -> dict:
    """The pooled report: ``inputs`` (each one's file, run, step, data and counts), the
    pooled counts, ``warnings``, ``rtt`` and ``verdict`` as in `train eval`'s report."""
    if not paths:
        raise InputError("train pool: name at least one answers file or run folder")
    files = [resolve(p) for p in paths]
    loaded = [read_answers(f) for f in files]
    seen: dict[str, Path] = {}
    for f, a in zip(files, loaded):
        key = a["about"].get("data_fingerprint")
        if key in seen:  # one test split: the same queries, or samples of the same probes
            raise InputError(
                f"{seen[key]} and {f} hold queries of the same test split (of "
                f"{a['about'].get('data')}): pooled, a query or a probe would count twice as "
                "if independent; pool evaluations of different datasets (e.g. one per "
                "`prep synth --seed`)")
        seen[key] = f
    common = [n for n in loaded[0]["names"] if all(n in a["names"] for a in loaded)]
    if "model" not in common:
        raise InputError(f"{files[0]}: no model answers; run `train eval` again")
    warnings = []
    for f, a in zip(files, loaded):  # `train eval RUN --data OTHER` said so; say it again
        if a["about"].get("data_matches_run") is False:
            warnings.append(f"{f}: evaluated on {a['about'].get('data')}, not the dataset its "
                            "run trained on; its test split may hold what the model saw")
    warnings += _trained_alike(files, loaded)
    points = {str(f): _point_rule(a["about"]) for f, a in zip(files, loaded)}
    if len(set(points.values())) > 1:  # `model` would be several points under one name
        rules = {r: [f for f, x in points.items() if x == r] for r in points.values()}
        warnings.append("the model's point differs between inputs, so the pooled `model` mixes "
                        "them: " + "; ".join(f"{r} ({', '.join(fs)})" for r, fs in rules.items())
                        + "; run `train eval` on the older ones again to score them alike")
    left = sorted({n for a in loaded for n in a["names"]} - set(common))
    if left:
        warnings.append(f"left out, not in every input: {', '.join(left)}")
    cat = lambda key: np.concatenate([a[key] for a in loaded])
    take = lambda a, key, n: a[key][a["names"].index(n)]
    preds = {n: tuple(np.concatenate([take(a, k, n) for a in loaded])
                      for k in ("pred_ms", "p_failed", "covered")) for n in common}
    both = [n for n in common if all(n in a["interval_of"] for a in loaded)]
    intervals = {n: tuple(np.concatenate([a["interval_ms"][a["interval_of"].index(n)][j]
                                          for a in loaded]) for j in (0, 1)) for n in both}
    # (input, source) as one label: the bootstrap draws whole probes of whole worlds
    offsets = np.cumsum([0] + [int(a["source"].max()) + 1 if len(a["source"]) else 0
                               for a in loaded])
    groups = np.concatenate([a["source"] + off for a, off in zip(loaded, offsets)])
    truth, failed, history, stratum = (cat("truth_ms"), cat("failed"), cat("history"),
                                       cat("stratum"))
    n_rtt = int((~failed).sum())
    if n_rtt < EM.MIN_REPLIES:
        warnings.append(f"only {n_rtt:,} queries have a reply (fewer than "
                        f"{EM.MIN_REPLIES:,}): the medians and their intervals are rough")
    rtt, verdict = score(preds, intervals, truth, failed, history, stratum, groups, seed)
    inputs = [{"answers": str(f), **{k: a["about"].get(k) for k in ("run_dir", "step", "data",
                                                                     "data_fingerprint")},
               "point": _point_rule(a["about"]),
               "queries": int(len(a["truth_ms"])), "queries_with_rtt": int((~a["failed"]).sum()),
               "sources": int(len(np.unique(a["source"])))} for f, a in zip(files, loaded)]
    return {"inputs": inputs, "queries": int(len(truth)), "queries_with_rtt": n_rtt,
            "sources": int(len(np.unique(groups))),
            "sources_by_stratum": {name: int(len(np.unique(groups[stratum == k])))
                                   for k, name in enumerate(EM.STRATA)},
            "seed": seed, "warnings": warnings, "rtt": rtt, "verdict": verdict}


def _point_rule(about: dict) -> str:
    """The point an evaluation scored its `model` by (train.eval.evaluate's ``point``)."""
    if "point" not in about:
        return "its median (written before 2026-12-01)"
    if "model_by_stratum" in about["point"]:  # one rule, whatever each input picked
        return "its own pick per stratum"
    band = about["point"]["band"]
    return "its median" if band is None else f"its band point at {band}"


def _trained_alike(files: list[Path], loaded: list[dict]) -> list[str]:
    """Warnings where the pooled runs did not train alike (preset, steps, batch, objective,
    any model setting): the pooled `model` then mixes several models, one per input; and
    where an input's answers predate the record that says."""
    settings, unknown = {}, []
    for f, a in zip(files, loaded):
        t = a["about"].get("trained")
        if not t or t.get("config") is None:
            unknown.append(str(f))
            continue
        settings[str(f)] = {k: t.get(k) for k in ("model", "steps", "batch_size",
                                                   "loss_weights")} | t["config"]
    out = []
    if unknown and len(files) > 1:
        out.append(f"{', '.join(unknown)}: written before answers said how the run trained, so "
                   "the pooled runs cannot be checked for one recipe; run `train eval` on "
                   f"{'them' if len(unknown) > 1 else 'it'} again to check")
    diffs, by_data = [], []
    for k in dict.fromkeys(k for v in settings.values() for k in v):  # first-seen order
        by = {}
        for f, v in settings.items():
            by.setdefault(json.dumps(v.get(k)), []).append(f)
        if len(by) > 1:
            (by_data if k in SET_BY_DATA else diffs).append(
                f"{k} " + ", ".join(f"{val} ({', '.join(fs)})" for val, fs in by.items()))
    if diffs:
        out.append("the pooled runs did not train alike, so the pooled `model` is several "
                   "models: " + "; ".join(diffs))
    if by_data:
        out.append("the pooled runs differ in what `train` sets from a run's data (one "
                   "recipe, other data): " + "; ".join(by_data))
    return out


def format_pooled(r: dict) -> str:
    """The pooled report as text: the inputs, then `train eval`'s tables and verdict."""
    lines = [f"train pool: {count(len(r['inputs']), 'evaluation')}, {r['queries']:,} RTT "
             f"queries ({r['queries_with_rtt']:,} with a reply)"]
    for i in r["inputs"]:
        lines.append(f"  {i['answers']}: {i['run_dir']} at step {i['step']} on {i['data']}, "
                     f"{i['queries']:,} queries ({i['queries_with_rtt']:,} with a reply), "
                     f"{i['sources']:,} sources; the model's point: {i['point']}")
    lines += [f"warning: {w}" for w in r["warnings"]]
    by = ", ".join(f"{s} {n:,}" for s, n in r["sources_by_stratum"].items())
    resampled = (f"; intervals resample whole (evaluation, source) pairs: {r['sources']:,} "
                 f"({by})")
    return "\n".join(lines + [""] + score_tables(r["rtt"], r["verdict"], resampled))


def write_pooled(r: dict, out: str | Path) -> Path:
    """Write the pooled report to ``out`` whole (temp name, then rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, json.dumps(r, indent=2) + "\n")
