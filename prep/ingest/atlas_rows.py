"""Rows of `prep import-atlas`: decoded results to columns in SCHEMA, or counted rejections.

``convert`` takes one result as the stdlib decodes it (any JSON value, every firmware
variant); ``convert_fast`` a run of ``_Result`` structs (prep.ingest.atlas_json), column by
column, with the same rows and counts (held to it by tests/test_atlas_source.py). Rows
wait in ``Rows`` until prep.ingest.atlas writes them; a value the output column cannot hold
becomes one validation rejects for the right reason (``_FIT``).

Default: one row per result; ``rtt`` is the mean of the replies that are not duplicates,
the result's ``avg`` when it has no ``result`` list, ``-1`` when nothing came back.
``--per-packet``: one row per packet; a timeout ``{"x": "*"}`` is ``-1``, an ``{"error":
...}`` entry (``packet_error``) and a duplicate reply (``duplicate_reply``) are rejected.
``prb_id``, ``msm_id``, ``size`` are kept. Firmware variants (RIPE's result format
documentation): ``addr``/``name`` for ``dst_addr``/``dst_name`` (fw 1), numbers written as
strings and no ``result`` list (fw 0), no ``af`` or ``src_addr`` before fw 4460 (the family
then comes from the address).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import compress

import msgspec
import numpy as np
import pyarrow as pa

SCHEMA = pa.schema([("event_time", pa.timestamp("s", tz="UTC")), ("prb_id", pa.int64()),
                    ("src_addr", pa.string()), ("dst_addr", pa.string()), ("ip_version", pa.int8()),
                    ("rtt", pa.float64()), ("msm_id", pa.int64()), ("size", pa.int64()),
                    ("src_addr_local", pa.string())])
_UNSET = msgspec.UNSET
SMALL_RUN = 256  # fewer fast-path rows than this join the lists (Rows.extend), more make a table


def _num(v, cast=float):
    """A number that firmware 0 may have written as a string; None when absent or not a number.

    An integer too large for a float is infinite, as JSON's 1e400 already is (``bad_rtt``).
    """
    if v is None or isinstance(v, bool):
        return None
    try:
        return cast(v) if cast is float else int(float(v)) if isinstance(v, str) else int(v)
    except OverflowError:
        return (math.inf if v > 0 else -math.inf) if cast is float and isinstance(v, int) else None
    except (TypeError, ValueError):
        return None


def _family(r: dict, dst) -> int | None:
    af = _num(r.get("af"), int)
    if af is not None:
        return af
    for a in (dst, r.get("src_addr"), r.get("from")):
        if isinstance(a, str) and a:
            return 6 if ":" in a else 4 if "." in a else None
    return None


def _public(frm, loc, dst):
    """The source address with --source public: ``from`` when it is a non-empty string,
    unless it and ``dst_addr`` differ in family (an IPv6 address has a ':') while the local
    ``src_addr`` matches ``dst_addr``; else ``src_addr``."""
    if not (isinstance(frm, str) and frm):
        return loc
    if (isinstance(dst, str) and dst and (":" in frm) != (":" in dst)
            and isinstance(loc, str) and loc and (":" in loc) == (":" in dst)):
        return loc
    return frm


class Rows:
    """The rows not yet written, in SCHEMA order: Arrow tables of the earlier ones (``flush``
    converts every FLUSH rows, while their Python values are still in the caches, and frees
    those values for the next rows to reuse), then column lists of the latest."""

    def __init__(self):
        self.cols = [[] for _ in SCHEMA.names]
        self.done: list[pa.Table] = []
        self.n_done = 0

    def add(self, t, prb, src, dst, af, rtt, msm, size, loc):
        for c, v in zip(self.cols, (t, prb, src, dst, af, rtt, msm, size, loc)):
            c.append(v)

    def __len__(self):
        return self.n_done + len(self.cols[5])

    def flush(self, at_least: int = 1) -> None:
        """The rows in the lists to an Arrow table, if there are ``at_least`` of them."""
        if len(self.cols[5]) >= at_least:
            cols, self.cols = self.cols, [[] for _ in SCHEMA.names]
            self._append(cols)

    def extend(self, cols: list) -> None:
        """Rows given whole columns, in SCHEMA order (lists; a float64 array for rtt): a table
        of their own, or, a few (a run between lines the fast path left), to the lists."""
        if len(cols[5]) < SMALL_RUN:
            for c, v in zip(self.cols, cols):
                c += v.tolist() if isinstance(v, np.ndarray) else v
            return
        self.flush()
        self._append(cols)

    def _append(self, cols: list) -> None:
        def col(name, typ, v):
            try:
                return pa.array(v, typ)
            except (OverflowError, UnicodeEncodeError, pa.ArrowException):  # rare: a value the column cannot hold
                return pa.array([_FIT[name](x) for x in v], typ)
        table = pa.table({f.name: col(f.name, f.type, v) for f, v in zip(SCHEMA, cols)})
        self.done.append(table)
        self.n_done += len(table)

    def take(self, k: int) -> pa.Table:
        """A table of the first ``k`` rows, which leave."""
        self.flush()
        table = pa.concat_tables(self.done) if len(self.done) > 1 else self.done[0]
        rest = table.slice(k)
        self.done, self.n_done = ([rest] if len(rest) else []), len(rest)
        return table.slice(0, k).combine_chunks()


_I64 = 2**63
_INF = math.inf


def _text(x):
    """An address as text: a number or an object is no address, nor is "\\ud800" (not UTF-8)."""
    if x is None or (isinstance(x, str) and x.isascii()):
        return x
    return x.encode("utf-8", "replace").decode() if isinstance(x, str) else "?"


# What a value the output column cannot hold becomes: one that validation rejects for the
# right reason (a number past int64 is out of range as a time, not 4/6 as ip_version, a
# bad prb_id; an address that is not text is invalid), and the carried msm_id and size are null.
_FIT = {
    "event_time": lambda x: x if x is None or -_I64 <= x < _I64 else _I64 - 1 if x > 0 else -_I64,
    "prb_id": lambda x: x if x is None or -_I64 <= x < _I64 else -1,
    "src_addr": _text,
    "dst_addr": _text,
    "ip_version": lambda x: x if x is None or -128 <= x < 128 else 0,
    "rtt": lambda x: x,
    "msm_id": lambda x: x if x is None or -_I64 <= x < _I64 else None,
    "size": lambda x: x if x is None or -_I64 <= x < _I64 else None,
    "src_addr_local": _text,
}


@dataclass(frozen=True)
class Mode:
    per_packet: bool
    public: bool  # --source public
    skip_errors: bool  # --errors skip


def convert(r, mode: Mode, rows: Rows, rejected: dict) -> None:
    """Append the row(s) of one decoded result (any JSON value), or count why it has none."""
    def reject(reason, k=1):
        rejected[reason] = rejected.get(reason, 0) + k

    if not isinstance(r, dict):
        return reject("not_a_result")
    if r.get("type", "ping") != "ping":
        return reject("not_ping")
    dst = r.get("dst_addr", r.get("addr"))
    loc = r.get("src_addr")
    src = _public(r.get("from"), loc, dst) if mode.public else r.get("src_addr", r.get("from"))
    t, prb = _num(r.get("timestamp"), int), _num(r.get("prb_id"), int)
    msm, size, af = _num(r.get("msm_id"), int), _num(r.get("size"), int), _family(r, dst)
    packets = r.get("result")
    if packets is None:  # firmware 0: only the summary
        avg = _num(r.get("avg"))
        if avg is None:
            return reject("bad_result")
        return rows.add(t, prb, src, dst, af, -1.0 if avg < 0 else avg, msm, size, loc)
    if not isinstance(packets, list):
        return reject("bad_result")
    if not mode.per_packet:
        replies = [_num(p.get("rtt")) for p in packets
                   if isinstance(p, dict) and "rtt" in p and not p.get("dup")]
        if any(x is None for x in replies):
            return reject("bad_result")
        if replies:
            rtt = _mean(replies)
        elif mode.skip_errors and _only_errors(packets):
            return reject("local_error")
        else:
            rtt = -1.0
        return rows.add(t, prb, src, dst, af, rtt, msm, size, loc)
    if not packets:
        return reject("no_packets")
    for p in packets:
        if not isinstance(p, dict):
            reject("bad_result")
        elif "error" in p:
            reject("packet_error")
        elif p.get("dup"):
            reject("duplicate_reply")
        elif "rtt" in p:
            rtt = _num(p["rtt"])
            rows.add(t, prb, src, dst, af, float("nan") if rtt is None else rtt, msm, size, loc)
        else:  # {"x": "*"}: nothing came back
            rows.add(t, prb, src, dst, af, -1.0, msm, size, loc)


def _only_errors(packets: list) -> bool:
    """Local errors and no reply or timeout: the packet objects (other entries do not
    count) are all ``{"error": ...}`` entries without an ``rtt``, and there is one at least."""
    dicts = [p for p in packets if isinstance(p, dict)]
    return bool(dicts) and all("error" in p and "rtt" not in p for p in dicts)


def _mean(replies: list) -> float:
    """The mean, summed left to right (as ``np.bincount`` sums, in ``convert_fast``; not
    ``sum``, which compensates from Python 3.12); when finite replies overflow the sum, the
    largest (as far out of range)."""
    s = 0.0
    for x in replies:
        s += x
    return max(replies) if s == _INF else s / len(replies)


def convert_fast(rs: list, mode: Mode, rows: Rows, rejected: dict) -> None:
    """What ``convert`` does, for results decoded into ``_Result`` structs: the same rows
    and counts. One row per result: column by column, the packets' means by ``np.bincount``."""
    if not mode.per_packet:
        return _results_fast(rs, mode, rows, rejected)
    _packets_fast(rs, mode, rows, rejected)


def _results_fast(rs: list, mode: Mode, rows: Rows, rejected: dict) -> None:
    n = len(rs)
    pks = [r.result for r in rs]
    counts = np.fromiter(map(len, pks), np.int64, n)
    row = np.repeat(np.arange(n), counts)
    rtt = np.array([None if p.dup else p.rtt for pk in pks for p in pk], np.float64)  # nan: no reply, or a dup
    reply = ~np.isnan(rtt)
    got = np.bincount(row, reply, minlength=n)
    mean = np.bincount(row, np.where(reply, rtt, 0.0), minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = mean / got  # (int64 both when no packet at all)
    mean[got == 0] = -1.0
    over = np.flatnonzero(mean == np.inf)  # finite replies whose sum overflows (rare)
    if len(over):
        start = np.cumsum(counts) - counts
        for i in over.tolist():
            mean[i] = _mean(rtt[start[i]:start[i] + counts[i]][reply[start[i]:start[i] + counts[i]]].tolist())
    if mode.skip_errors:  # among the results with packets but no reply: only local errors?
        unset = _UNSET
        local = [i for i in np.flatnonzero((got == 0) & (counts > 0)).tolist()
                 if all(p.error is not unset and p.rtt is None for p in pks[i])]
        if local:
            rejected["local_error"] = rejected.get("local_error", 0) + len(local)
            keep = np.ones(n, bool)
            keep[local] = False
            rs = list(compress(rs, keep.tolist()))
            mean = mean[keep]
    loc, dst = [r.src_addr for r in rs], [r.dst_addr for r in rs]
    if mode.public:
        src = [f if f and (":" in f) == (":" in d) else _public(f, l, d)
               for f, l, d in zip([r.from_ for r in rs], loc, dst)]
    else:
        src = [l if l is not None else r.from_ for l, r in zip(loc, rs)]
    rows.extend([[r.timestamp for r in rs], [r.prb_id for r in rs], src, dst, [r.af for r in rs],
                 mean, [r.msm_id for r in rs], [r.size for r in rs], loc])


def _packets_fast(rs: list, mode: Mode, rows: Rows, rejected: dict) -> None:
    t_, prb_, src_, dst_, af_, rtt_, msm_, size_, loc_ = (c.append for c in rows.cols)
    public, unset = mode.public, _UNSET
    empty = err = dup = 0
    for r in rs:
        pk = r.result
        if not pk:
            empty += 1
            continue
        loc, dst = r.src_addr, r.dst_addr
        if public:
            src = _public(r.from_, loc, dst)
        else:
            src = loc if loc is not None else r.from_
        t, prb, af, msm, size = r.timestamp, r.prb_id, r.af, r.msm_id, r.size
        for p in pk:
            if p.error is not unset:
                err += 1
            elif p.dup:
                dup += 1
            else:
                t_(t), prb_(prb), src_(src), dst_(dst), af_(af), msm_(msm), size_(size), loc_(loc)
                rtt_(-1.0 if p.rtt is None else p.rtt)
    for reason, k in (("no_packets", empty), ("packet_error", err), ("duplicate_reply", dup)):
        if k:
            rejected[reason] = rejected.get(reason, 0) + k
