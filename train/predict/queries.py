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
- A queries file is answered a piece (PIECE queries) at a time, under a progress bar of
  queries: each piece's answers are appended to ``OUT.part`` (renamed to ``OUT`` when all
  are there) and printed (``--json``) as they come, so memory holds one piece's contexts
  and an interrupted or failed run leaves the old ``OUT`` (or none), never a part of it.
  SIGINT and SIGTERM stop it with one line (prep.base.signals), exit 128 + the signal.
- A query's context is found by bisection in its source's history (sorted by time once),
  and only its newest ``row_len // 12`` measurements are kept: no measurement is shorter
  than 12 tokens, so older ones cannot fit its row.
"""

from __future__ import annotations

import bisect
import contextlib
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from prep.base.atomic import replacing
from prep.base.errors import InputError
from prep.base.signals import stop_on_signals
from prep.base.tables import TableFile
from prep.schema.measurements import Measurements
from prep.schema.splits import format_time, parse_time
from prep.schema.validate import TIME_MAX, TIME_MIN, column_times, read_validated
from prep.tokens.reference import rtt_code
from train.predict import predictor as P

ANSWER_COLUMNS = ("rtt_ms", "p10_ms", "p90_ms", "p_failed", "history_used")
TIME_TYPE = pa.timestamp("s", tz="UTC")  # the answers' event_time
ANSWERS_SCHEMA = pa.schema([("src_addr", pa.string()), ("dst_addr", pa.string()),
                            ("event_time", TIME_TYPE), ("rtt_ms", pa.float64()),
                            ("p10_ms", pa.float64()), ("p90_ms", pa.float64()),
                            ("p_failed", pa.float64()), ("history_used", pa.int64())])
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


class Histories:
    """The history rows of each query's source, sorted by time once; ``context(q)`` is the
    rows before the query's time (all of them for a query without a time), the newest
    ``keep`` at most. Rows of no query's source are left out, with their count on stderr."""

    def __init__(self, hist: Measurements | None, path: str | None, sources: set, keep: int):
        self.keep, self.of_src, self.times = keep, {}, {}
        if hist is None:
            return
        by_src = defaultdict(list)
        for i, key in enumerate(zip(hist.family.tolist(), hist.src_hi.tolist(),
                                    hist.src_lo.tolist())):
            by_src[key].append(i)
        left_out = sum(len(rows) for key, rows in by_src.items() if key not in sources)
        if left_out:
            print(f"{path}: {left_out:,} of {len(hist):,} history rows left out (their "
                  "src_addr is no query's source)", file=sys.stderr)
        for key in sources:
            ctx = as_context(hist, by_src.get(key, []))
            self.of_src[key], self.times[key] = ctx, [h.time for h in ctx]

    def context(self, q: P.Measurement) -> list[P.Measurement]:
        key = (q.family, q.src_hi, q.src_lo)
        ctx = self.of_src.get(key, [])
        if not ctx:
            return []
        end = len(ctx) if q.time is None else bisect.bisect_right(self.times[key], q.time)
        return ctx[max(0, end - self.keep):end]


def predict_one(run_dir, src: str, dst: str, when, history: str | None, *, step=None) -> dict:
    """The answer to one query (``when``: ISO-8601 or Unix seconds, or None)."""
    t = None if when is None else _time(when)
    q = P.query_measurement(src, dst, t)
    pred = P.load(run_dir, step=step)
    ctx = Histories(history_of(history), history, {(q.family, q.src_hi, q.src_lo)},
                    pred.max_history).context(q)
    return pred.predict(src, dst, time=t, history=ctx)


def _time(text) -> int:
    try:
        t = parse_time(str(text))
    except ValueError as e:
        raise InputError(f"--time {text}: {e}") from None
    if not TIME_MIN <= t < TIME_MAX:
        raise InputError(f"--time {text}: outside {TIME_RANGE}")
    return t


PIECE = 16_384  # queries answered, written and printed at a time


def predict_file(run_dir, queries: str, history: str | None, out: str | None, *,
                 step=None, emit=None, progress: bool = True) -> int:
    """Answer every query of the parquet ``queries``, a piece at a time (module docstring):
    appended to ``out`` if given, each piece's answers (dicts) passed to ``emit`` if
    given. Returns the number of answers."""
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
    del table
    qs = []
    for k, (s, d, t) in enumerate(zip(srcs, dsts, times)):
        if s is None or d is None:
            raise InputError(f"{queries}: query {k} has no src_addr or dst_addr")
        qs.append(P.query_measurement(s, d, t))
    pred = P.load(run_dir, step=step)
    hist = Histories(history_of(history), history, {(q.family, q.src_hi, q.src_lo) for q in qs},
                     pred.max_history)
    with stop_on_signals(Path(out) if out else None, "train predict"), tqdm(
            total=len(qs), unit=" queries", desc="predict", file=sys.stderr,
            disable=not progress or None) as bar, (
            replacing(out, ".part") if out else contextlib.nullcontext()) as part, (
            TableFile(part, ANSWERS_SCHEMA) if out else contextlib.nullcontext()) as writer:
        for a in range(0, len(qs), PIECE):
            b = min(a + PIECE, len(qs))
            answers = pred.predict_measurements([(q, hist.context(q)) for q in qs[a:b]],
                                                progress=lambda _rows, n: bar.update(n))
            if writer is not None:
                cols = [srcs[a:b], dsts[a:b], times[a:b]]
                cols += [[x[c] for x in answers] for c in ANSWER_COLUMNS]
                writer.write(pa.table(cols, schema=ANSWERS_SCHEMA))
            if emit is not None:
                for x, s, d, t in zip(answers, srcs[a:b], dsts[a:b], times[a:b]):
                    x.update(src_addr=s, dst_addr=d,
                             event_time=None if t is None else format_time(t))
                emit(answers)
    if out:
        print(f"wrote {len(qs):,} answers to {out}", file=sys.stderr)
    return len(qs)



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
