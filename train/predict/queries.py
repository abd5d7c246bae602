"""Queries from files for `train predict`: parquet in, answers out (train.predict.predictor does the work).

- A history file has the input schema of `prep shards` (event_time, src_addr, dst_addr,
  ip_version, rtt; prep.schema.validate checks it): earlier measurements, which the model
  reads as the context before a query, oldest first (the most recent that fit one row
  with the query). One rule for a single query (``--src``) and a queries file: a query
  reads the history rows with its ``src_addr`` from before its time; rows of no query's
  source are left out, and their count goes to stderr.
- A queries file has ``src_addr``, ``dst_addr`` and optionally ``event_time`` (timestamp
  or Unix seconds; a null time means a query without a timestamp).
- Times, from ``--time`` or ``event_time``, are held to the range `prep` accepts
  (prep.schema.validate.TIME_MIN <= t < TIME_MAX): outside it is one line, never wrapped.
- Answers: one row per query with ``src_addr``, ``dst_addr``, ``event_time`` (the input
  schema's name and type: a UTC timestamp of seconds, null for a query without one, so an
  answers file reads back as a queries file), ``rtt_ms`` (median), ``p10_ms``,
  ``p90_ms``, ``p_failed`` and ``history_used`` (earlier measurements in the context).
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
from prep.schema.splits import format_time, parse_time
from prep.schema.validate import TIME_MAX, TIME_MIN, column_times, read_validated
from prep.tokens.reference import rtt_code
from train.predict import predictor as P

ANSWER_COLUMNS = ("rtt_ms", "p10_ms", "p90_ms", "p_failed", "history_used")
TIME_TYPE = pa.timestamp("s", tz="UTC")  # the answers' event_time
TIME_RANGE = "1970-01-01 <= t < 2100-01-01 UTC, the times `prep` accepts"


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


def contexts_of(hist: Measurements | None, path: str | None,
                queries: list[P.Measurement]) -> list[list[P.Measurement]]:
    """Each query's context: the rows of ``hist`` with its source, from before its time
    (all of them for a query without a time). Rows of no query's source are left out, with
    their count on stderr."""
    if hist is None:
        return [[] for _ in queries]
    by_src = defaultdict(list)
    for i, key in enumerate(zip(hist.family.tolist(), hist.src_hi.tolist(), hist.src_lo.tolist())):
        by_src[key].append(i)
    wanted = {(q.family, q.src_hi, q.src_lo) for q in queries}
    left_out = sum(len(rows) for key, rows in by_src.items() if key not in wanted)
    if left_out:
        print(f"{path}: {left_out:,} of {len(hist):,} history rows left out (their src_addr "
              "is no query's source)", file=sys.stderr)
    of_src = {key: as_context(hist, by_src.get(key, [])) for key in wanted}
    out = []
    for q in queries:
        ctx = of_src[(q.family, q.src_hi, q.src_lo)]
        out.append(ctx if q.time is None else [h for h in ctx if h.time <= q.time])
    return out


def predict_one(run_dir, src: str, dst: str, when, history: str | None, *, step=None) -> dict:
    """The answer to one query (``when``: ISO-8601 or Unix seconds, or None)."""
    t = None if when is None else _time(when)
    q = P.query_measurement(src, dst, t)
    ctx = contexts_of(history_of(history), history, [q])[0]
    return P.load(run_dir, step=step).predict(src, dst, time=t, history=ctx)


def _time(text) -> int:
    try:
        t = parse_time(str(text))
    except ValueError as e:
        raise InputError(f"--time {text}: {e}") from None
    if not TIME_MIN <= t < TIME_MAX:
        raise InputError(f"--time {text}: outside {TIME_RANGE}")
    return t


def predict_file(run_dir, queries: str, history: str | None, out: str | None, *,
                 step=None) -> list[dict]:
    """Answers for every query of the parquet ``queries`` (written to ``out`` if given)."""
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
    times = _times(table, queries)
    qs = []
    for k, (s, d, t) in enumerate(zip(srcs, dsts, times)):
        if s is None or d is None:
            raise InputError(f"{queries}: query {k} has no src_addr or dst_addr")
        qs.append(P.query_measurement(s, d, t))
    ctxs = contexts_of(history_of(history), history, qs)
    pred = P.load(run_dir, step=step)
    answers = pred.predict_many(list(zip(srcs, dsts, times, ctxs)))
    for a, s, d, t in zip(answers, srcs, dsts, times):
        a.update(src_addr=s, dst_addr=d, event_time=None if t is None else format_time(t))
    if out:
        cols = {"src_addr": srcs, "dst_addr": dsts, "event_time": pa.array(times, TIME_TYPE)}
        cols.update({c: [a[c] for a in answers] for c in ANSWER_COLUMNS})
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(out) + ".tmp")
        pq.write_table(pa.table(cols), tmp)
        tmp.replace(out)
        print(f"wrote {len(answers):,} answers to {out}", file=sys.stderr)
    return answers


def _times(table: pa.Table, path) -> list[int | None]:
    """The queries' Unix seconds (None: no time), each in the range `prep` accepts."""
    if "event_time" not in table.column_names:
        return [None] * table.num_rows
    try:
        t, null = column_times(table.column("event_time"))
    except pa.ArrowException as e:
        raise InputError(f"{path}: event_time is not a time ({str(e).splitlines()[0]}); give "
                         "a timestamp or Unix seconds") from None
    times = [None if n else int(v) for v, n in zip(t.tolist(), null.tolist())]
    for k, v in enumerate(times):
        if v is not None and not TIME_MIN <= v < TIME_MAX:
            raise InputError(f"{path}: query {k} has event_time {v}, outside {TIME_RANGE}")
    return times
