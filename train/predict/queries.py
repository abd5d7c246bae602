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
  ``p90_ms``, ``p_failed`` and ``history_used`` (earlier measurements in the context);
  with a band (``--band``), ``point_ms`` last: the band point there
  (train.predict.predictor).
- Queries (a file's, or the one of ``--src``, answered as a file of it) are answered a
  piece (PIECE queries) at a time, under a progress bar of queries: each piece's answers
  are appended to ``OUT.part`` (renamed to ``OUT`` when all are there) and printed
  (``--json``) as they come, so memory holds one piece's contexts and an interrupted or
  failed run leaves the old ``OUT`` (or none), never a part of it.
  SIGINT and SIGTERM raise prep.base.signals.Interrupted (``published`` once ``OUT`` is
  there: a signal after the last answer waits for the rename); `train predict` makes it
  one line and exit 128 + the signal.
- A query's context is found by bisection in its source's history (sorted by time once),
  and only its newest ``row_len // 12`` measurements are kept: no measurement is shorter
  than 12 tokens, so older ones cannot fit its row.
"""

from __future__ import annotations

import bisect
import contextlib
import json
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
from prep.base.words import count
from prep.base.tables import TableFile
from prep.schema.manifest import MAX_GAP_S
from prep.schema.measurements import Measurements, addr_text
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
POINT_FIELD = pa.field("point_ms", pa.float64())  # with a band, after ANSWERS_SCHEMA's
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


def run_max_gap(run_dir) -> tuple[int, str]:
    """(seconds, where from): the silence after which `prep shards` cut the contexts the
    run trained on (its dataset's ``max_gap_s``; 0: never), or `prep shards`' default
    where no manifest of that dataset here says it."""
    data = P.run_record(run_dir).get("train", {}).get("data")
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, KeyError):
        gap = json.loads((Path(data) / "manifest.json").read_text())["config"]["max_gap_s"]
        return int(gap), f"the run's dataset {data}"
    return MAX_GAP_S, "`prep shards`' default (no manifest of the run's dataset here says it)"


class Histories:
    """The history rows of each query's source, sorted by time once; ``context(q)`` is the
    rows before the query's time (all of them for a query without a time), the newest
    ``keep`` at most, and none from before a silence longer than ``max_gap`` seconds (0:
    none is too long): a training context never spans one (`prep shards --max-gap`), the
    query's own distance from the newest row included. ``cut`` counts the queries that lost
    rows so. Rows of no query's source are left out, with their count on stderr, and sources
    whose rows come from several probes (``prb_id``: an address that hosts behind a NAT
    share) are named there: the model reads them as one probe's."""

    def __init__(self, hist: Measurements | None, path: str | None, sources: set, keep: int,
                 max_gap: int = 0):
        self.keep, self.max_gap, self.cut, self.of_src, self.times = keep, max_gap, 0, {}, {}
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
        shared = {key: n for key in sources
                  if (n := len(np.unique(hist.probe[by_src.get(key, [])]))) > 1}
        if shared:
            key, n = max(shared.items(), key=lambda kv: kv[1])
            print(f"{path}: the history rows of {len(shared):,} query source(s) come from "
                  f"several probes (prb_id; e.g. {addr_text(*key)}: {n}), an address hosts "
                  "behind a NAT share; the model reads them as one probe's context; give "
                  "each probe's rows alone", file=sys.stderr)
        for key in sources:
            ctx = as_context(hist, by_src.get(key, []))
            self.of_src[key], self.times[key] = ctx, [h.time for h in ctx]

    def context(self, q: P.Measurement) -> list[P.Measurement]:
        key = (q.family, q.src_hi, q.src_lo)
        ctx = self.of_src.get(key, [])
        if not ctx:
            return []
        t = self.times[key]
        end = len(ctx) if q.time is None else bisect.bisect_right(t, q.time)
        lo = max(0, end - self.keep)
        if self.max_gap and end:
            if q.time is not None and q.time - t[end - 1] > self.max_gap:
                lo = end
            else:
                lo = next((j for j in range(end - 1, lo, -1)
                           if t[j] - t[j - 1] > self.max_gap), lo)
            self.cut += lo > max(0, end - self.keep)
        return ctx[lo:end]

    def say_cut(self, path, gap: int, where: str) -> None:
        """One line on stderr if any query's history stopped at a silence."""
        if self.cut:
            print(f"{path}: {self.cut:,} queries read their history only from after its last "
                  f"silence of more than {gap:,} s (training contexts are cut there; the gap "
                  f"from {where})", file=sys.stderr)


def load_model(run_dir, step: int | None) -> P.Predictor:
    """P.load; where it passed over a damaged newest checkpoint (each named on stderr with
    why), one more line says which step answers and what sets the damaged ones aside."""
    pred = P.load(run_dir, step=step)
    if pred.skipped:
        print(f"train predict: answering from {run_dir} at step {pred.step}, its newest intact "
              f"checkpoint; resume the run (`train --run-dir {run_dir} --resume`) to set the "
              "damaged ones aside and train their steps again", file=sys.stderr)
    return pred


def predict_one(run_dir, src: str, dst: str, when, history: str | None, *, step=None,
                out: str | None = None, band: float | None = None) -> dict:
    """The answer to one query (``when``: ISO-8601 or Unix seconds, or None), as a queries
    file of it is answered (``answer``): written to ``out`` too if given."""
    t = None if when is None else _time(when)
    got = []
    answer(run_dir, [P.query_measurement(src, dst, t)], [src], [dst], [t], history, out,
           step=step, emit=got.extend, progress=False, band=band)
    return got[0]


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
                 step=None, emit=None, progress: bool = True, band: float | None = None) -> int:
    """Answer every query of the parquet ``queries`` (``answer``). Returns the number of
    answers."""
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
        qs.append(P.query_measurement(s, d, t, where=f"{queries}: query {k}"))
    answer(run_dir, qs, srcs, dsts, times, history, out, step=step, emit=emit,
           progress=progress, band=band)
    return len(qs)


def answer(run_dir, qs: list[P.Measurement], srcs: list[str], dsts: list[str],
           times: list[int | None], history: str | None, out: str | None, *, step=None,
           emit=None, progress: bool = True, band: float | None = None) -> None:
    """Answer the queries ``qs`` (their ``srcs``, ``dsts`` and ``times`` as given), a piece
    at a time (module docstring): appended to ``out`` if given, each piece's answers
    (dicts, with src_addr, dst_addr and event_time) passed to ``emit`` if given; with
    ``band``, each one's band point there too (``point_ms``)."""
    pred = load_model(run_dir, step)
    gap, where = run_max_gap(run_dir)
    hist = Histories(history_of(history), history, {(q.family, q.src_hi, q.src_lo) for q in qs},
                     pred.max_history, gap)
    schema, columns = ANSWERS_SCHEMA, ANSWER_COLUMNS
    if band is not None:
        schema, columns = schema.append(POINT_FIELD), columns + ("point_ms",)
    with stop_on_signals(Path(out) if out else None, "train predict") as guard:
        with tqdm(total=len(qs), unit=" queries", desc="predict", file=sys.stderr,
                  disable=not progress or None) as bar, (
                replacing(out, ".part") if out else contextlib.nullcontext()) as part, (
                TableFile(part, schema) if out else contextlib.nullcontext()) as writer:
            for a in range(0, len(qs), PIECE):
                b = min(a + PIECE, len(qs))
                answers = pred.predict_measurements([(q, hist.context(q)) for q in qs[a:b]],
                                                    band=band,
                                                    progress=lambda _rows, n: bar.update(n))
                if writer is not None:
                    cols = [srcs[a:b], dsts[a:b], times[a:b]]
                    cols += [[x[c] for x in answers] for c in columns]
                    writer.write(pa.table(cols, schema=schema))
                if emit is not None:
                    for x, s, d, t in zip(answers, srcs[a:b], dsts[a:b], times[a:b]):
                        x.update(src_addr=s, dst_addr=d,
                                 event_time=None if t is None else format_time(t))
                    emit(answers)
            # all answered: a stop from here waits for the rename and the lines below, then
            # says the answers were published (Interrupted)
            guard.defer, guard.published = True, bool(out)
        hist.say_cut(history, gap, where)
        if out:
            print(f"wrote {count(len(qs), 'answer')} to {out}", file=sys.stderr)



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
