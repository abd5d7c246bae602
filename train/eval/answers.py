"""Per-query answers of one `train eval`, kept beside its report so that several evaluations
can be scored as one (`train pool`, train.eval.pool) without running a model again.

``RUN_DIR/eval/step-<S>.answers.npz`` (``step-<S>-q<N>.answers.npz`` for a sample,
``...-on-<F>.answers.npz`` on a dataset other than the run's), NumPy's compressed archive,
no pickled objects:

    version       int: ANSWERS_VERSION
    names         str[P]: the predictors, in the report's order
    pred_ms       float64[P, n]: each predictor's RTT answer per query
    p_failed      float64[P, n]: its P(failed)
    covered       bool[P, n]: whether it answered the query itself (not its fallback)
    interval_of   str[I]: the predictors with a [p10, p90] (the model, with and without context)
    interval_ms   float64[I, 2, n]: their p10 and p90
    truth_ms      float64[n]: the measured RTT (NaN where the ping failed)
    failed        bool[n]
    history       int64[n]: earlier measurements in the query's context
    stratum       int8[n]: index into train.eval.metrics.STRATA
    source        int64[n]: the query's source among the evaluation's (its bootstrap group)
    about         str: JSON, the report's run_dir, step, data, data_fingerprint,
                  data_matches_run, split, config, trained (how the run trained: its
                  preset, steps, batch, objective and model settings; absent in answers
                  written before 2026-11-30)
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import numpy as np

from prep.base.atomic import replacing
from prep.base.errors import InputError

ANSWERS_VERSION = 1
ABOUT = ("run_dir", "step", "data", "data_fingerprint", "data_matches_run", "split",
         "config", "trained", "point")  # report keys kept
_ARRAYS = ("names", "pred_ms", "p_failed", "covered", "interval_of", "interval_ms", "truth_ms",
           "failed", "history", "stratum", "source", "about", "version")


_NAME = re.compile(r"step-(\d+)(?:-q(\d+))?\.answers\.npz")


def step_of(path: str | Path) -> tuple[int, int] | None:
    """(step, queries: 0 for a whole split) of an answers file's name, None for another
    (an evaluation on other data than the run's, ``...-on-<F>.answers.npz``, among them)."""
    m = _NAME.fullmatch(Path(path).name)
    return (int(m[1]), int(m[2] or 0)) if m else None


def answers_path(report: str | Path) -> Path:
    """The answers file beside a report: step-<S>.json -> step-<S>.answers.npz."""
    report = Path(report)
    return report.with_name(report.name.removesuffix(".json") + ".answers.npz")


def write_answers(path: str | Path, *, preds: dict, intervals: dict, truth_ms, failed, history,
                  stratum, groups, about: dict) -> Path:
    """Write ``path`` whole (temp name, then rename); return it. ``preds``: name ->
    (RTT ms, P(failed), covered); ``intervals``: name -> (p10, p90)."""
    path = Path(path)
    names = list(preds)
    with replacing(path, ".tmp.npz") as tmp:
        np.savez_compressed(
            tmp, version=np.int64(ANSWERS_VERSION), names=np.array(names, dtype=str),
            pred_ms=np.stack([np.asarray(preds[k][0], np.float64) for k in names]),
            p_failed=np.stack([np.asarray(preds[k][1], np.float64) for k in names]),
            covered=np.stack([np.asarray(preds[k][2], bool) for k in names]),
            interval_of=np.array(list(intervals), dtype=str),
            interval_ms=np.stack([np.stack([np.asarray(lo, np.float64), np.asarray(hi, np.float64)])
                                  for lo, hi in intervals.values()]) if intervals else
            np.zeros((0, 2, len(truth_ms))),
            truth_ms=np.asarray(truth_ms, np.float64), failed=np.asarray(failed, bool),
            history=np.asarray(history, np.int64), stratum=np.asarray(stratum, np.int8),
            source=np.asarray(groups, np.int64), about=np.array(json.dumps(about)))
    return path


def read_answers(path: str | Path) -> dict:
    """The arrays of an answers file (``about`` parsed), checked for shape; an InputError
    that names the file and the command that writes one where it is not such a file."""
    path = Path(path)
    hint = "`train eval RUN_DIR` writes one beside its report (RUN_DIR/eval/step-<S>.answers.npz)"
    if not path.is_file():
        raise InputError(f"{path}: no such file; {hint}")
    if path.name.endswith(".json"):
        raise InputError(f"{path}: a report, not its answers; they are "
                         f"{answers_path(path).name} beside it (`train eval` since "
                         "2026-11-29; evaluate again for an older report)")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in _ARRAYS if k not in z.files]
            if missing:
                raise InputError(f"{path}: not the answers of a `train eval` (no "
                                 f"{', '.join(missing)}); {hint}")
            a = {k: z[k] for k in _ARRAYS}
    except (OSError, ValueError, zipfile.BadZipFile):
        raise InputError(f"{path}: not a NumPy archive of answers; {hint}") from None
    if int(a["version"]) != ANSWERS_VERSION:
        raise InputError(f"{path}: answers format {int(a['version'])}, this version reads "
                         f"{ANSWERS_VERSION}; run `train eval` again")
    a["names"] = [str(x) for x in a["names"]]
    a["interval_of"] = [str(x) for x in a["interval_of"]]
    a["about"] = json.loads(str(a["about"]))
    n, p = len(a["truth_ms"]), len(a["names"])
    shapes = {"pred_ms": (p, n), "p_failed": (p, n), "covered": (p, n),
              "interval_ms": (len(a["interval_of"]), 2, n), "failed": (n,), "history": (n,),
              "stratum": (n,), "source": (n,)}
    bad = [k for k, want in shapes.items() if a[k].shape != want]
    if bad:
        raise InputError(f"{path}: {', '.join(bad)} do not match its {n:,} queries and "
                         f"{p} predictors; run `train eval` again")
    return a
