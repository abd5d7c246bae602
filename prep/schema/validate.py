"""Validation: the one gate every entry point (parquet, RIPE Atlas import, synth) passes.

Columns (the input schema): ``event_time`` (timestamp in any unit, tz-aware or naive UTC,
or integer Unix seconds), ``src_addr``, ``dst_addr`` (strings), ``ip_version`` (integer),
``rtt`` (ms; else ``rtt_avg``), optional ``prb_id``, each value field's (integer). A
missing, doubled or mistyped column is an ``InputError`` naming the file and the fix;
everything else is judged per row, and no value is clamped or wrapped on the way in.
Rejection reasons, checked in this order (a row is counted under the first that applies):

    missing_timestamp   event_time is null
    time_out_of_range   event_time before 1970-01-01 or from 2100-01-01 UTC on (TIME_MIN, TIME_MAX)
    empty_src_addr      src_addr is null or ""
    invalid_src_addr    src_addr is not an IPv4/IPv6 address, or carries an IPv6 zone id (%eth0)
    empty_dst_addr      dst_addr is null or ""
    invalid_dst_addr    dst_addr likewise
    bad_ip_version      ip_version is null or not 4/6
    family_mismatch     src_addr or dst_addr is not of the family ip_version says
    bad_rtt             rtt is null, NaN, inf, or negative other than -1
    rtt_out_of_range    rtt above RTT_MAX_MS, the largest RTT the token encoding holds (~50.9 days)
    bad_prb_id          prb_id is negative, or unsigned >= 2**63 (null is fine: the key is src_addr)
    bad_<field>         a value field (vocab.VALUE_FIELDS) is null, negative, or over its width

Every call keeps rows in == accepted rows + sum(rejected.values()). An integer event_time
is Unix seconds: of the time_out_of_range rows, a batch counts those whose integer lands in
range read as milliseconds or microseconds (``misread_times``), so the summary can say that
the unit, not the data, is wrong (``time_unit_hint``). Addresses repeat
heavily, so they are read as Arrow dictionaries (parquet's own dictionary pages) and only
the distinct texts are parsed, with a cache across the batches of one process.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prep.base import storage
from prep.base.errors import InputError, first_line
from prep.schema.measurements import DTYPES, Measurements, addr_words, empty, stable_key
from prep.schema.vocab import VALUE_FIELDS

REASONS = ("missing_timestamp", "time_out_of_range", "empty_src_addr", "invalid_src_addr",
           "empty_dst_addr", "invalid_dst_addr", "bad_ip_version", "family_mismatch", "bad_rtt",
           "rtt_out_of_range", "bad_prb_id") + tuple(f"bad_{f.name}" for f in VALUE_FIELDS)
# Accepted event_time, Unix seconds: 1970-01-01 <= t < 2100-01-01 UTC. No ping predates Unix
# time, and a value outside is a unit mistake (milliseconds read as seconds land near the
# year 55,000) or a sentinel, not a measurement. Inside, a time is a non-negative number
# below 2**32, so the tokens' 8-byte absolute and 4-byte delta timestamps, datetime and
# `prep inspect` all hold it exactly.
TIME_MIN, TIME_MAX = 0, 4_102_444_800
# The RTT encoding's ceiling (prep.tokens.kernel.rtt_code: an 11-bit mantissa times 2**31 µs at most,
# ~50.9 days). Above it the code saturates, so the stored RTT would be silently wrong, and a
# finite RTT near the float maximum becomes inf in µs, which the kernel cannot encode at all.
RTT_MAX_MS = 2047 * 2**31 / 1000
_I64_MAX = 2**63 - 1
REQUIRED = ("event_time", "src_addr", "dst_addr", "ip_version", "rtt") + tuple(
    f.name for f in VALUE_FIELDS)
ADDRESS_COLUMNS = ("src_addr", "dst_addr")
_CACHE_LIMIT = 2_000_000  # distinct addresses kept between batches; bounds memory
_UNIT_DIV = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}
MISREAD_UNITS = (("ms", "milliseconds"), ("us", "microseconds"))  # as misread_times counts


@dataclass(frozen=True)
class Batch:
    source: str
    rows_in: int
    measurements: Measurements
    rejected: dict[str, int]
    misread_times: dict[str, int] = field(default_factory=dict)  # misread_times' counts

    def counts(self) -> dict:
        """rows_in, accepted, rejected and misread_times: what the runners add up
        (prep.shards.dataset.add_read_counts)."""
        return {"rows_in": self.rows_in, "accepted": len(self.measurements),
                "rejected": self.rejected, "misread_times": self.misread_times}


def find_files(paths: Iterable[str | Path], suffixes: tuple[str, ...], none_found: str, *,
               command: str | None = None, kinds: tuple[str, ...] = ()) -> list[Path]:
    """Files named directly, or under folders (recursively) ending in ``suffixes``, sorted.

    Hidden names under a folder are staging areas of interrupted runs (.tmp-synth-…/), never
    input. A missing path, or nothing found (``none_found`` says what to do), is InputError.
    A link under a folder whose target is missing is skipped with a warning on stderr
    (its rows are not read, so the run must say so); one named directly is InputError.
    With ``command``, a folder that is a shards or run folder, a file named directly whose
    content (prep.base.sniff) is not one of ``kinds``, and a folder with nothing to read are
    InputError naming the command that takes what they hold.
    """
    from prep.base import sniff

    paths = list(paths)
    found: set[Path] = set()
    broken: list[Path] = []
    for p in map(Path, paths):
        if command and p.is_dir() and sniff.kind(p) in ("shards", "run"):
            raise InputError(sniff.advice(p, sniff.kind(p), command))
        if command and p.is_file() and kinds and sniff.kind(p) not in kinds:
            raise InputError(sniff.advice(p, sniff.kind(p), command)
                             or f"{p}: not an input of `{command}`")
        if p.is_dir():
            refusal = sniff.unfinished_publish(p, (f"{d.name}/{sniff.PUBLISH}" for d in p.glob(
                ".tmp-*") if (d / sniff.PUBLISH).is_file()))
            if refusal:
                raise InputError(refusal)
            for f in p.rglob("*"):
                if not f.name.endswith(suffixes) or any(
                        part.startswith(".") for part in f.relative_to(p).parts):
                    continue
                if f.is_file():
                    found.add(f)
                elif f.is_symlink() and not f.exists():
                    broken.append(f)
        elif p.is_file():
            found.add(p)
        elif p.is_symlink():
            raise InputError(f"{p}: broken symbolic link ({sniff.broken_link(p)}); fix the "
                             "link or the path")
        else:
            raise InputError(f"{p}: no such file or folder; check the path")
    for f in sorted(broken):
        print(f"warning: {f}: broken symbolic link ({sniff.broken_link(f)}), skipped; fix or "
              "remove the link", file=sys.stderr)
    if not found:
        for p in map(Path, paths):  # say what the folders hold instead, if it is telling
            k = sniff.kind(p) if command and p.is_dir() else "empty"
            if k.removeprefix("folder:") not in ("empty", "unknown"):
                if hint := sniff.advice(p, k, command):
                    raise InputError(hint)
        raise InputError(f"{', '.join(map(str, paths))}: {none_found}")
    first: dict[Path, Path] = {}
    for f in sorted(found):  # one file by two names (a link): its rows would count twice
        seen = first.setdefault(f.resolve(), f)
        if seen is not f:
            raise InputError(f"{seen} and {f}: the same file (a link); give each file once")
    return sorted(found)


def list_inputs(paths: Iterable[str | Path]) -> list[Path]:
    """Parquet files named directly or found under folders (recursively), sorted by path."""
    return find_files(paths, (".parquet",), "no .parquet files found; point at parquet files "
                      "or a folder of them (make some with `prep synth`, or from RIPE Atlas "
                      "results with `prep import-atlas`)", command="prep shards",
                      kinds=("parquet",))


def _resolve_columns(schema: pa.Schema, source: str) -> dict[str, str]:
    """Our column name -> the table's, checking presence and types (InputError otherwise)."""
    names = set(schema.names)
    cols = {c: c for c in REQUIRED}
    twice = [n for n in (*REQUIRED, "rtt_avg", "prb_id") if schema.names.count(n) > 1]
    if twice:
        raise InputError(f"{source}: column {twice[0]} appears {schema.names.count(twice[0])} "
                         "times; keep one (rename or drop the others) before running prep")
    if "rtt" not in names and "rtt_avg" in names:
        cols["rtt"] = "rtt_avg"
    missing = [c for c in REQUIRED if cols[c] not in names]
    if missing:
        raise InputError(f"{source}: missing required column {', '.join(missing)} "
                         f"(needs {', '.join(REQUIRED)}; rtt_avg is accepted for rtt)")
    if "prb_id" in names:
        cols["prb_id"] = "prb_id"
    checks = {
        "event_time": (lambda t: pa.types.is_timestamp(t) or pa.types.is_integer(t),
                       "a timestamp or integer Unix seconds"),
        "src_addr": (_is_text, "a string"), "dst_addr": (_is_text, "a string"),
        "ip_version": (pa.types.is_integer, "an integer (4 or 6)"),
        "rtt": (lambda t: pa.types.is_floating(t) or pa.types.is_integer(t), "a float in ms"),
        "prb_id": (pa.types.is_integer, "an integer"),
        **{f.name: (pa.types.is_integer, "an integer") for f in VALUE_FIELDS},
    }
    for ours, theirs in cols.items():
        t = schema.field(theirs).type
        ok, want = checks[ours]
        if not (ok(t) or pa.types.is_null(t)):
            raise InputError(f"{source}: column {theirs} has type {t}, expected {want}; "
                             "convert it before running prep")
    return cols


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _ints(col, dtype, over: int = _I64_MAX) -> tuple[np.ndarray, np.ndarray]:
    """(values as ``dtype`` with nulls as 0, null mask); uint64 values past int64 become ``over``.

    ``over`` is a value the caller's check rejects, so 2**64 - 1 is refused, never wrapped
    to -1 (or, as a time, to 1969).
    """
    col = pc.cast(col, pa.int64()) if not pa.types.is_integer(col.type) else col
    v = pc.fill_null(col, 0).to_numpy()
    if v.dtype == np.uint64:
        big = v > np.uint64(_I64_MAX)
        v = v.astype(np.int64)
        v[big] = over
    return v.astype(dtype, copy=False), pc.is_null(col).to_numpy(zero_copy_only=False)


def column_times(col) -> tuple[np.ndarray, np.ndarray]:
    t = col.type
    if pa.types.is_null(t):
        return np.zeros(len(col), np.int64), np.ones(len(col), bool)
    if pa.types.is_timestamp(t):
        # Arrow stores tz-aware and naive timestamps alike as UTC ticks since the epoch.
        v, null = _ints(pc.cast(col, pa.int64()), np.int64)
        return v // _UNIT_DIV[t.unit], null
    return _ints(col, np.int64)


@dataclass(frozen=True)
class Addresses:
    """An address column parsed: the distinct ``texts``, the row's text ``idx``, per row its
    ``status`` (0 ok, 1 empty, 2 invalid) and ``family`` (uint8; 0 unless ok), and per
    distinct text its words (``hi_of``, ``lo_of``): ``words`` takes them for the rows kept."""
    texts: list
    idx: np.ndarray
    status: np.ndarray
    family: np.ndarray
    hi_of: np.ndarray
    lo_of: np.ndarray

    def words(self, rows=slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """(hi, lo) uint64 of the rows ``rows`` (a mask or indices; every row by default)."""
        i = self.idx[rows]
        return self.hi_of[i], self.lo_of[i]


def parse_addresses(col, cache: dict) -> Addresses:
    """An address column parsed, each distinct text once; ``cache`` maps text -> (status,
    family, hi, lo). A dictionary column (as ``validated_batches`` reads the addresses:
    parquet stores them so) is used as it comes; any other is dictionary-encoded first."""
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks != 1 and pa.types.is_dictionary(col.type):
            col = pc.cast(col, col.type.value_type)  # one dictionary for all the chunks
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_dictionary(col.type):
        # a null index is the null text, one past the dictionary's entries
        texts = col.dictionary.to_pylist() + [None]
        idx = pc.fill_null(col.indices, len(texts) - 1).to_numpy(zero_copy_only=False)
    else:
        if not pa.types.is_string(col.type) and not pa.types.is_large_string(col.type):
            col = pc.cast(col, pa.string())
        enc = pc.dictionary_encode(col, null_encoding="encode")
        idx = enc.indices.to_numpy(zero_copy_only=False)
        texts = enc.dictionary.to_pylist()
    hits = list(map(cache.get, texts))
    if None in hits:  # texts not met before (a scan in C, the loop only then)
        for i, s in enumerate(texts):
            if hits[i] is None:
                if not s:
                    hit = (1, 0, 0, 0)
                else:
                    try:
                        hit = (0, *addr_words(s))
                    except ValueError:
                        hit = (2, 0, 0, 0)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[s] = hits[i] = hit
    table = np.array(hits, dtype=np.uint64).reshape(len(texts), 4).T  # one row per field
    idx = idx.astype(np.intp)  # numpy gathers by int32 indices at a fraction of the speed
    return Addresses(texts, idx, table[0].astype(np.uint8)[idx], table[1].astype(np.uint8)[idx],
                     table[2], table[3])


def validate_rows(table: pa.Table, *, source: str, _cache: dict | None = None
                  ) -> tuple[np.ndarray, Measurements, dict[str, int]]:
    """(accepted-row mask, accepted Measurements, {reason: count}); used by importers too."""
    cols = _resolve_columns(table.schema, source)
    cache = {} if _cache is None else _cache
    n = table.num_rows
    time, t_null = column_times(table.column(cols["event_time"]))
    src = parse_addresses(table.column(cols["src_addr"]), cache)
    dst = parse_addresses(table.column(cols["dst_addr"]), cache)
    s_st, s_fam, d_st, d_fam = src.status, src.family, dst.status, dst.family
    ipv, ipv_null = _ints(table.column(cols["ip_version"]), np.int64)
    rtt_col = table.column(cols["rtt"])
    rtt = pc.cast(rtt_col, pa.float64()).to_numpy(zero_copy_only=False)  # nulls become NaN
    if "prb_id" in cols:
        prb, prb_null = _ints(table.column(cols["prb_id"]), np.int64, over=-1)
    else:
        prb, prb_null = np.zeros(n, np.int64), np.ones(n, bool)

    checks = [
        t_null, (time < TIME_MIN) | (time >= TIME_MAX),
        s_st == 1, s_st == 2, d_st == 1, d_st == 2,
        ipv_null | ((ipv != 4) & (ipv != 6)),
        (s_fam != ipv) | (d_fam != ipv),
        ~np.isfinite(rtt) | ((rtt < 0) & (rtt != -1.0)),
        rtt > RTT_MAX_MS,
        ~prb_null & (prb < 0),
    ]
    values = [_ints(table.column(cols[f.name]), np.int64, over=-1) for f in VALUE_FIELDS]
    checks += [null | (v < 0) | (v >= 1 << min(8 * f.width, 63))
               for f, (v, null) in zip(VALUE_FIELDS, values)]
    code = np.zeros(n, np.uint8)
    for i in range(len(checks) - 1, -1, -1):  # reverse, so the first reason that applies wins
        code[checks[i]] = i + 1
    counts = np.bincount(code, minlength=len(REASONS) + 1)
    rejected = {r: int(c) for r, c in zip(REASONS, counts[1:]) if c}
    keep = code == 0

    probe = prb.astype(np.uint64)
    if prb_null.any():
        # Only rows without prb_id need the hashed key; hash each distinct src text once.
        keys = np.array([stable_key(s) if s else 0 for s in src.texts], dtype=np.uint64)
        probe = np.where(prb_null, keys[src.idx], probe)
    (src_hi, src_lo), (dst_hi, dst_lo) = src.words(keep), dst.words(keep)
    m = Measurements(probe=probe[keep], time=time[keep], family=s_fam[keep],
                     src_hi=src_hi, src_lo=src_lo, dst_hi=dst_hi, dst_lo=dst_lo,
                     rtt=rtt[keep], **{f.name: v[keep].astype(DTYPES[f.name])
                                       for f, (v, _) in zip(VALUE_FIELDS, values)})
    return keep, m, rejected


def misread_times(col) -> dict[str, int]:
    """Of an integer event_time column's values out of range, how many are in range as
    milliseconds ("ms") or, if not, as microseconds ("us"); {} for a timestamp column."""
    if not pa.types.is_integer(col.type):
        return {}
    time, null = _ints(col, np.int64)
    out = ~null & ((time < TIME_MIN) | (time >= TIME_MAX))
    found = {}
    for unit, _ in MISREAD_UNITS:
        t = time // _UNIT_DIV[unit]
        hit = out & (t >= TIME_MIN) & (t < TIME_MAX)
        if n := int(hit.sum()):
            found[unit] = n
        out &= ~hit
    return found


def time_unit_hint(rejected: dict[str, int], misread: dict[str, int]) -> str | None:
    """What to do when most time_out_of_range rows are integers in range as milliseconds or
    microseconds (``misread``: misread_times' counts added up); None otherwise."""
    n = rejected.get("time_out_of_range", 0)
    for unit, name in MISREAD_UNITS:
        if 2 * misread.get(unit, 0) > n:
            return (f"{misread[unit]:,} of the {n:,} time_out_of_range event_times are in "
                    f"range as {name}: an integer event_time is read as Unix seconds; divide "
                    f"it by {_UNIT_DIV[unit]:,} or store a timestamp")
    return None


def validate_table(table: pa.Table, *, source: str) -> tuple[Measurements, dict[str, int]]:
    """The accepted rows of ``table`` and ``{reason: rejected count}``."""
    _, m, rejected = validate_rows(table, source=source)
    return m, rejected


def open_parquet(path: str | Path, *, read_dictionary: tuple[str, ...] = ()) -> pq.ParquetFile:
    """The file, its columns and their types checked up front (InputError naming it if not).
    A bucket path (``s3://…``) is read in place, by ranged reads (prep.base.storage).
    ``read_dictionary``: columns read as Arrow dictionaries (pyarrow's option)."""
    rd = list(read_dictionary) or None
    try:
        if storage.is_remote(path):
            pf = pq.ParquetFile(storage.open_input_file(storage.Remote.parse(path)),
                                read_dictionary=rd)
        else:
            pf = pq.ParquetFile(path, read_dictionary=rd)
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(e, path, "not a readable parquet file") from None
    _resolve_columns(pf.schema_arrow, str(path))
    return pf


BATCH_ROWS = 1 << 18  # rows validated at once: with a row group, bounds pass 1's memory
_ADDR_CACHE: dict = {}  # per process: each distinct address text parsed once, across files


def format_rejected(rejected: dict[str, int], top: int | None = None) -> str:
    """Rejection counts for people: "reason n, ..." in the order given, or the ``top``
    largest first; "none" when there are none."""
    items = sorted(rejected.items(), key=lambda kv: -kv[1])[:top] if top else rejected.items()
    return ", ".join(f"{k} {v:,}" for k, v in items) or "none"


def validated_batches(path: str | Path, row_groups: list[int] | None = None, *,
                      batch_rows: int = BATCH_ROWS, clock=None) -> Iterator[Batch]:
    """Validated batches of at most ``batch_rows`` rows of one parquet file (of its
    ``row_groups``, all by default), reading only the columns validation uses.
    ``clock``: times the stages "read" and "validate" (prep.shards.stages.StageClock)."""
    clock = clock or _no_clock
    # Addresses repeat: read as dictionaries, each batch's distinct texts come straight
    # from parquet's own dictionary pages instead of being hashed again (parse_addresses).
    pf = open_parquet(path, read_dictionary=ADDRESS_COLUMNS)
    resolved = _resolve_columns(pf.schema_arrow, str(path))
    cols, time_col = sorted(set(resolved.values())), resolved["event_time"]
    try:
        batches = pf.iter_batches(batch_size=batch_rows, row_groups=row_groups, columns=cols)
        while True:
            with clock("read"):
                rb = next(batches, None)
            if rb is None:
                return
            with clock("validate"):
                table = pa.Table.from_batches([rb])
                _, m, rejected = validate_rows(table, source=str(path), _cache=_ADDR_CACHE)
                misread = misread_times(table.column(time_col)) if rejected.get(
                    "time_out_of_range") else {}
            yield Batch(source=str(path), rows_in=rb.num_rows, measurements=m, rejected=rejected,
                        misread_times=misread)
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(e, path, "damaged or truncated parquet") from None


def _no_clock(stage: str):
    return contextlib.nullcontext()


def _unreadable(e: BaseException, path, what: str) -> InputError:
    """The file's own fault, or for a bucket path the storage's (access, network)."""
    if storage.is_remote(path) and (known := storage.known_failure(e, path, "reading it")):
        return known
    return InputError(f"{path}: {what} ({first_line(e)}); re-create or remove it")


def iter_validated(paths: Iterable[str | Path], *, batch_rows: int = 1 << 20) -> Iterator[Batch]:
    """Validated batches of at most ``batch_rows`` rows, file by file, row group by row group."""
    for path in list_inputs(paths):
        yield from validated_batches(path, batch_rows=batch_rows)


def read_validated(paths: Iterable[str | Path]) -> tuple[Measurements, dict[str, int], int]:
    """Every accepted row of every input, the rejected counts by reason, and rows in."""
    parts, rejected, rows_in = [], Counter(), 0
    for b in iter_validated(paths):
        parts.append(b.measurements)
        rows_in += b.rows_in
        rejected.update(b.rejected)
    return (Measurements.concat(parts) if parts else empty()), dict(rejected), rows_in
