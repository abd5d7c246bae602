"""Queries from files for `train predict`: parquet in, answers out (train.predict.predictor does the work).

- A history file has the input schema of `prep shards` (event_time, src_addr, dst_addr,
  ip_version, rtt; prep.schema.validate checks it): the source probe's earlier measurements,
  which the model reads as the context before the query, oldest first (the most recent
  that fit one row with the query).
- A queries file has ``src_addr``, ``dst_addr`` and optionally ``event_time`` (timestamp
  or Unix seconds; a null time means a query without a timestamp). Each query's history
  is the history rows with its ``src_addr`` from before its time.
- Answers: one row per query with ``rtt_ms`` (median), ``p10_ms``, ``p90_ms``,
  ``p_failed`` and ``history_used`` (earlier measurements in the context).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prep.schema.errors import InputError
from prep.schema.measurements import Measurements
from prep.schema.validate import read_validated
from prep.tokens.reference import rtt_code
from train.predict import predictor as P

ANSWER_COLUMNS = ("rtt_ms", "p10_ms", "p90_ms", "p_failed", "history_used")


def history_of(path: str | None) -> Measurements | None:
    if path is None:
        return None
    m, rejected, rows_in = read_validated([path])
    if rejected:
        print(f"{path}: {sum(rejected.values()):,} of {rows_in:,} history rows rejected "
              f"({', '.join(f'{k} {v:,}' for k, v in sorted(rejected.items()))})", file=sys.stderr)
    return m


def as_context(m: Measurements, idx) -> list[P.Measurement]:
    out = []
    values = m.values()  # value fields, if the vocabulary has any
    for i in np.asarray(idx, np.int64).tolist():
        ms = float(m.rtt[i])
        exponent, mantissa = rtt_code(max(ms, 0.0))
        code = -1 if ms < 0 else (exponent << 11) | mantissa
        out.append(P.Measurement(int(m.family[i]), int(m.src_hi[i]), int(m.src_lo[i]),
                                 int(m.dst_hi[i]), int(m.dst_lo[i]), int(m.time[i]), code,
                                 tuple(values[:, i].tolist())))
    return sorted(out, key=lambda x: x.time)


def predict_one(run_dir, src: str, dst: str, when, history: str | None, *, step=None) -> dict:
    from prep.schema.splits import parse_time

    t = None if when is None else _time(when, parse_time)
    pred = P.load(run_dir, step=step)
    hist = history_of(history)
    ctx = [] if hist is None else as_context(hist, np.arange(len(hist)))
    if t is not None:
        ctx = [h for h in ctx if h.time <= t]
    return pred.predict(src, dst, time=t, history=ctx)


def _time(text, parse_time) -> int:
    try:
        return parse_time(str(text))
    except ValueError as e:
        raise InputError(f"--time {text}: {e}") from None


def predict_file(run_dir, queries: str, history: str | None, out: str | None, *,
                 step=None) -> list[dict]:
    """Answers for every query of the parquet ``queries`` (written to ``out`` if given)."""
    from prep.schema.validate import column_times

    try:
        table = pq.read_table(queries)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{queries}: not a readable parquet file ({str(e).splitlines()[0]}); "
                         "give a parquet of src_addr, dst_addr[, event_time]") from None
    missing = [c for c in ("src_addr", "dst_addr") if c not in table.column_names]
    if missing:
        raise InputError(f"{queries}: no column {', '.join(missing)}; a queries file has "
                         "src_addr, dst_addr and optionally event_time")
    srcs = table.column("src_addr").to_pylist()
    dsts = table.column("dst_addr").to_pylist()
    if "event_time" in table.column_names:
        t, null = column_times(table.column("event_time"))
        times = [None if n else int(v) for v, n in zip(t.tolist(), null.tolist())]
    else:
        times = [None] * len(srcs)
    hist = history_of(history)
    by_src = defaultdict(list)
    if hist is not None:
        for i, key in enumerate(zip(hist.family.tolist(), hist.src_hi.tolist(), hist.src_lo.tolist())):
            by_src[key].append(i)
    pred = P.load(run_dir, step=step)
    items = []
    for k, (s, d, t) in enumerate(zip(srcs, dsts, times)):
        if s is None or d is None:
            raise InputError(f"{queries}: query {k} has no src_addr or dst_addr")
        q = P.query_measurement(s, d, t)
        ctx = as_context(hist, by_src.get((q.family, q.src_hi, q.src_lo), [])) if hist else []
        if t is not None:
            ctx = [h for h in ctx if h.time <= t]
        items.append((s, d, t, ctx))
    answers = pred.predict_many(items)
    for a, (s, d, t, _) in zip(answers, items):
        a.update(src_addr=s, dst_addr=d, time=t)
    if out:
        cols = {"src_addr": srcs, "dst_addr": dsts, "time": times}
        cols.update({c: [a[c] for a in answers] for c in ANSWER_COLUMNS})
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(out) + ".tmp")
        pq.write_table(pa.table(cols), tmp)
        tmp.replace(out)
        print(f"wrote {len(answers):,} answers to {out}", file=sys.stderr)
    return answers
