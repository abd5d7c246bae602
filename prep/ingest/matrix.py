"""`prep import-matrix`: latency matrices (one N×N RTT matrix per time frame) to parquet.

The format of the network-coordinate data sets (King, Meridian, PlanetLab, Seattle): each
file is one time frame, N lines of N whitespace-separated numbers; entry (i, j) is the RTT
from node i (source, row) to node j (destination, column), not necessarily symmetric. Every
frame has the same N: node i is the same host in every frame. A frame's number is the last
number in its file's name (``SeattleData_12``: 12), not the order given; a missing number
leaves its interval empty; two files of one number, or numbered and unnumbered names mixed,
are an error; unnumbered names are frames in name order. A folder stands for the files in
it, less hidden ones and README*, LICENSE*, COPYING*, *.md.

Rows (prep.schema.validate's schema), one per entry: frame f (counted from 0 at the lowest
frame number given) covers [start + f*interval, start + (f+1)*interval); source i measures i+1, i+2, ... (mod N), spread over the frame and
staggered between sources (``frame_offsets``); ``node_addresses`` gives node i one stable
public-looking IPv4 address; prb_id = i + 1, msm_id = f + 1; rtt in ms (``--unit``), a
positive entry below half a nanosecond becomes 1 ns, never 0. Rejected, counted by reason
(entries = frames × N² = measurements + sum(rejected)): ``diagonal``, ``missing_rtt``
(<= 0: the data sets' missing value), ``rtt_out_of_range``. A token that is not a finite
number, a ragged or non-square matrix, or frames of different N are an error naming where.

Arrow parses each file (one that fails is re-read to say where). Output: ``DIR/matrix.parquet``,
time-ordered, row groups of whole frames (at least ROW_GROUP rows, so `prep shards` reads it
in parallel), staged and published by prep.jobs.claim (the parquet layout, as `prep
import-atlas`'s output): parquet files already in DIR need ``--overwrite``; anything else
there, or a shards or run folder, is refused.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tqdm import tqdm

from prep.base import sniff
from prep.base.errors import InputError, first_line
from prep.base.tables import TableFile
from prep.base.words import count
from prep.jobs.claim import claim
from prep.schema.hashing import GOLDEN, MASK, mix64
from prep.schema.splits import format_time
from prep.schema.validate import RTT_MAX_MS, TIME_MAX, format_rejected

START = 1_767_225_600  # 2026-01-01T00:00:00Z, as prep synth
UNITS = {"s": 1000.0, "ms": 1.0, "us": 0.001}  # to milliseconds
REASONS = ("diagonal", "missing_rtt", "rtt_out_of_range")
OUT_NAME = "matrix.parquet"
ROW_GROUP = 65_536
_NOT_DATA = re.compile(r"(readme|license|licence|copying).*|.*\.md", re.IGNORECASE)
# IANA special-purpose IPv4 ranges, multicast and reserved: never a node's address. A fixed
# list (not ipaddress.is_global, whose table changes between Python releases), so a node's
# address never changes.
_NOT_PUBLIC = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.31.196.0/24", "192.52.193.0/24",
    "192.88.99.0/24", "192.168.0.0/16", "192.175.48.0/24", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4"))


@dataclass(frozen=True)
class MatrixConfig:
    inputs: tuple[Path, ...]  # matrix files or folders of them
    out: Path  # output folder (DIR/matrix.parquet)
    interval_s: int  # seconds each frame covers
    unit: str  # the matrices' RTT unit: s, ms or us
    start: int = START  # Unix seconds of frame 0's start
    overwrite: bool = False  # replace the parquet files already in out
    progress: bool = True  # tqdm bar of frames on stderr


def natural_key(path: Path) -> list:
    """``frame_2`` before ``frame_10``: digit runs compare as numbers."""
    return [int(s) if i % 2 else s for i, s in enumerate(re.split(r"(\d+)", str(path)))]


def frame_number(path: Path) -> int | None:
    """The last number in the file's name, before a suffix like ``.txt``; None if none."""
    digits = re.findall(r"\d+", re.sub(r"(\.[A-Za-z][A-Za-z0-9]*)+$", "", path.name))
    return int(digits[-1]) if digits else None


def list_frames(paths) -> list[tuple[int, Path]]:
    """The frames' files with their frame (0 for the first number found), in frame order
    (see the module docstring); InputError for a missing path, an input another command
    reads (parquet, Atlas JSON, shards), nothing found, or frames that cannot be told
    apart by their names."""
    found: dict[Path, Path] = {}
    for p in map(Path, paths):
        if p.is_dir():
            k = sniff.kind(p)
            if k in ("shards", "run", "folder:parquet", "folder:atlas"):
                raise InputError(sniff.advice(p, k, "prep import-matrix"))
            files = sorted((f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")
                            and not _NOT_DATA.fullmatch(f.name)), key=natural_key)
        elif p.is_file():
            k = sniff.kind(p)
            if k in ("parquet", "atlas"):
                raise InputError(sniff.advice(p, k, "prep import-matrix"))
            files = [p]
        else:
            raise InputError(f"{p}: no such file or folder; check the path")
        for f in files:
            if f.absolute() in {g.absolute() for g in found.values()}:
                continue  # the same path given twice (a folder and a file in it)
            first = found.setdefault(f.resolve(), f)
            if first is not f:
                raise InputError(f"{first} and {f}: the same file (a link); give each frame "
                                 "once")
    if not found:
        raise InputError(f"{', '.join(map(str, paths))}: no matrix files found; give the "
                         "frames' files (one N×N matrix each) or the folder that holds them "
                         "(folders are not searched recursively)")
    files = sorted(found.values(), key=lambda f: natural_key(f.name) + natural_key(f))
    numbers = [frame_number(f) for f in files]
    if len(files) == 1 or all(k is None for k in numbers):
        return list(enumerate(files))
    if None in numbers:
        bare, numbered = files[numbers.index(None)], next(
            f for f, k in zip(files, numbers) if k is not None)
        raise InputError(f"{bare}: no frame number in its name, but {numbered} has one; a "
                         "frame's number is the last number in its file's name: name every "
                         "frame so (SeattleData_12), or import the others on their own")
    frames = sorted(zip(numbers, files), key=lambda kf: kf[0])
    for (a, fa), (b, fb) in zip(frames, frames[1:]):
        if a == b:
            raise InputError(f"{fa} and {fb}: both frame {a} by their names; give each frame "
                             "once")
    first = frames[0][0]
    return [(k - first, f) for k, f in frames]


def read_matrix(path: Path) -> np.ndarray:
    """One frame: an N×N float64 array, in the file's unit. InputError (file, line,
    column, fix) for a token that is not a finite number, ragged rows, a non-square or
    empty matrix."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({first_line(e)})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a text file (byte {e.start:,} is not UTF-8); a latency "
                         "matrix is N lines of N numbers") from None
    lines = pc.utf8_trim_whitespace(pc.split_pattern(pa.array([text]), "\n").flatten())
    kept = pc.not_equal(lines, "")
    line_no = np.flatnonzero(kept.to_numpy(zero_copy_only=False)) + 1
    if not len(line_no):
        raise InputError(f"{path}: holds no matrix (no numbers); a latency matrix is N "
                         "lines of N numbers")
    tokens = pc.utf8_split_whitespace(lines.filter(kept))
    widths = pc.list_value_length(tokens).to_numpy()
    n = len(line_no)
    if (widths != widths[0]).any():
        bad = int(np.flatnonzero(widths != widths[0])[0])
        raise InputError(f"{path}: line {line_no[bad]} has {widths[bad]:,} entries, line "
                         f"{line_no[0]} has {widths[0]:,}; every row needs one entry per node "
                         "(is the file cut short?)")
    if widths[0] != n:
        raise InputError(f"{path}: {n:,} rows of {widths[0]:,} entries; a latency matrix is "
                         "square (row i = source node i, column j = destination node j)")
    flat = tokens.flatten()
    try:
        values = flat.cast(pa.float64()).to_numpy()
    except pa.ArrowInvalid:
        values = None
    if values is None or not np.isfinite(values).all():
        at = _first_bad(flat) if values is None else int(np.flatnonzero(~np.isfinite(values))[0])
        raise InputError(f"{path}: line {line_no[at // n]}, column {at % n + 1}: "
                         f"{flat[at].as_py()!r} is not a finite number; write a missing "
                         "measurement as 0")
    return values.reshape(n, n)


def _first_bad(flat: pa.Array) -> int:
    """Index of the first token Arrow cannot read as a number (the slow path of an error)."""
    for i, tok in enumerate(flat.to_pylist()):
        try:
            pa.array([tok]).cast(pa.float64())
        except pa.ArrowInvalid:
            return i
    raise AssertionError("no bad token")


def node_addresses(n: int) -> list[str]:
    """Node i's IPv4 address, for i < n: the first of SplitMix64((i << 16 | attempt) +
    GOLDEN)'s top 32 bits, attempt = 0, 1, ..., that is public (not in _NOT_PUBLIC), does
    not end in .0 or .255, and no lower node holds. So node i's address depends on i alone
    (in practice), the same in every frame, run and data set size."""
    taken: set[int] = set()
    out = []
    for i in range(n):
        attempt = 0
        while True:
            a = mix64(((i << 16 | attempt) + GOLDEN) & MASK) >> 32
            ip = ipaddress.IPv4Address(a)
            if (a & 0xFF) not in (0, 255) and a not in taken and not any(
                    ip in net for net in _NOT_PUBLIC):
                break
            attempt += 1
        taken.add(a)
        out.append(str(ip))
    return out


def frame_offsets(n: int, interval_s: int) -> np.ndarray:
    """Seconds into its frame of each entry (i, j), int64 N×N (the diagonal's is unused):
    source i's k-th destination, j = i + 1 + k (mod N), at floor(interval * (k*N + i) /
    (N*(N-1)))."""
    i = np.arange(n)[:, None]
    k = (np.arange(n)[None, :] - i - 1) % n
    return (interval_s * (k * n + i)) // max(n * (n - 1), 1)


def frame_columns(rtt_ms: np.ndarray, frame: int, offsets: np.ndarray, start: int,
                  interval_s: int) -> tuple[dict[str, np.ndarray], Counter]:
    """One frame's measurements as columns (node indices for the addresses), in time order,
    and its rejected entries by reason."""
    n = len(rtt_ms)
    diag = np.eye(n, dtype=bool)
    missing = ~diag & (rtt_ms <= 0)
    too_big = ~diag & (rtt_ms > RTT_MAX_MS)
    keep = ~(diag | missing | too_big)
    src, dst = np.nonzero(keep)
    t = start + frame * interval_s + offsets[src, dst]
    order = np.lexsort((src, t))
    rejected = Counter({"diagonal": n, "missing_rtt": int(missing.sum()),
                        "rtt_out_of_range": int(too_big.sum())})
    # to the nanosecond, and never to 0 (a missing measurement's value) from a positive one
    rtt = np.maximum(np.round(rtt_ms[src, dst][order], 6), 1e-6)
    return {"time": t[order], "src": src[order], "dst": dst[order], "rtt": rtt}, +rejected


def _table(parts: list[dict], frames: list[int], addrs: pa.Array) -> pa.Table:
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    msm = np.repeat(np.asarray(frames, np.int64) + 1, [len(p["time"]) for p in parts])
    return pa.table({
        "event_time": pa.array(cols["time"], pa.timestamp("s", tz="UTC")),
        "prb_id": cols["src"].astype(np.int64) + 1,
        "src_addr": addrs.take(pa.array(cols["src"])),
        "dst_addr": addrs.take(pa.array(cols["dst"])),
        "ip_version": np.full(len(msm), 4, np.int8),
        "rtt": cols["rtt"],
        "msm_id": msm})


def import_matrix(cfg: MatrixConfig) -> dict:
    """Convert every frame into ``cfg.out/matrix.parquet``; returns the summary (also
    printed on stderr). Nothing appears in ``cfg.out`` unless every frame converted."""
    if cfg.unit not in UNITS:
        raise ValueError(f"unit must be one of {tuple(UNITS)}")
    if cfg.interval_s < 1:
        raise ValueError("interval_s must be >= 1")
    t0 = time.perf_counter()
    out = Path(cfg.out)
    frames_of = list_frames(cfg.inputs)
    files = [f for _, f in frames_of]
    end = cfg.start + (frames_of[-1][0] + 1) * cfg.interval_s
    missing = frames_of[-1][0] + 1 - len(files)
    if missing:
        gap = next(a + 1 for (a, _), (b, _) in zip(frames_of, frames_of[1:]) if b > a + 1)
        print(f"note: {count(missing, 'frame')} missing between {files[0]} and {files[-1]} "
              f"(by their names; the first: frame {frame_number(files[0]) + gap}); "
              f"{'its interval holds' if missing == 1 else 'their intervals hold'} no "
              "measurements", file=sys.stderr)
    if cfg.start < 0 or end > TIME_MAX:
        raise InputError(f"--start {cfg.start} and --interval {cfg.interval_s} put the "
                         f"{len(files):,} frames at {format_time(cfg.start)} .. "
                         f"{format_time(end)}; event times must lie in 1970 .. 2099")
    rejected: Counter = Counter()
    written = n = 0
    rtt_sample = []
    with claim(out, layout="parquet", command="prep import-matrix", runner="matrix",
               overwrite=cfg.overwrite) as od:
        parts, frames = [], []
        with TableFile(od.stage / OUT_NAME, compression="zstd", compression_level=1) as writer, \
                tqdm(total=len(files), unit=" frames", desc="import-matrix", file=sys.stderr,
                     disable=not cfg.progress or None) as bar:
            for k, (f, path) in enumerate(frames_of):
                m = read_matrix(path)
                if k == 0:
                    n = len(m)
                    addrs = pa.array(node_addresses(n), pa.string())
                    offsets = frame_offsets(n, cfg.interval_s)
                elif len(m) != n:
                    raise InputError(f"{path}: a {len(m):,}×{len(m):,} matrix, but {files[0]} "
                                     f"is {n:,}×{n:,}; every frame must hold the same nodes in "
                                     "the same order (import each set of frames on its own)")
                cols, rej = frame_columns(m * UNITS[cfg.unit], f, offsets,
                                          cfg.start, cfg.interval_s)
                rejected.update(rej)
                written += len(cols["time"])
                rtt_sample.append(cols["rtt"][:: max(1, len(cols["rtt"]) // 1000)])
                parts.append(cols)
                frames.append(f)
                if sum(len(p["time"]) for p in parts) >= ROW_GROUP or k == len(files) - 1:
                    writer.write(_table(parts, frames, addrs))
                    parts, frames = [], []
                bar.update(1)
        if not written:
            raise InputError(f"import-matrix: no measurements in {len(files):,} frame"
                             f"{'s' if len(files) > 1 else ''} of {n:,} node"
                             f"{'s' if n > 1 else ''} (rejected: {format_rejected(rejected)}); "
                             f"nothing was written to {out}")
        od.publish([OUT_NAME])
    elapsed = time.perf_counter() - t0
    sample = np.concatenate(rtt_sample)
    summary = {"frames": len(files), "nodes": n, "entries": len(files) * n * n,
               "measurements": written, "rejected": dict(sorted(rejected.items())),
               "unit": cfg.unit, "interval_s": cfg.interval_s, "start": cfg.start, "end": end,
               "start_iso": format_time(cfg.start), "end_iso": format_time(end),
               "first_file": str(files[0]), "last_file": str(files[-1]),
               "out": str(out / OUT_NAME), "rtt_p50_ms": float(np.percentile(sample, 50)),
               "rtt_p99_ms": float(np.percentile(sample, 99)), "elapsed_s": round(elapsed, 3)}
    print(format_summary(summary), file=sys.stderr)
    return summary


def format_summary(s: dict) -> str:
    rej = sum(s["rejected"].values())
    files = s["first_file"] if s["frames"] == 1 else f"{s['first_file']} .. {s['last_file']}"
    lines = [
        f"import-matrix: {s['frames']:,} frame{'s' if s['frames'] > 1 else ''} of "
        f"{count(s['nodes'], 'node')} ({files}) in {s['elapsed_s']:.1f} s",
        f"  measurements  {s['measurements']:,} of {s['entries']:,} entries; rejected {rej:,} "
        f"({format_rejected(s['rejected'])})",
        f"  time          {s['start_iso']} .. {s['end_iso']}, {s['interval_s']:,} s a frame",
        f"  rtt           p50 {s['rtt_p50_ms']:,.3f} ms, p99 {s['rtt_p99_ms']:,.3f} ms "
        f"(read as {s['unit']})",
        f"  output        {s['out']}",
        f"  next          {next_command(Path(s['out']).parent)}",
    ]
    warn = unit_warning(s["rtt_p50_ms"], s["unit"])
    if warn:
        lines.append(f"warning: {warn}")
    return "\n".join(lines)


def next_command(data: Path) -> str:
    """The `prep shards` command the summary suggests for the imported folder ``data``: the
    README's for its data sets (data/seattle -> shards-seattle), so two imported sets get
    two shards folders, each matching .gitignore's ``/shards-*/``. Rows of 256: a matrix
    frame's contexts are short, and the small model reads its context on them (README, the
    Seattle walk-through; docs/learning.md)."""
    name = Path(os.path.abspath(data)).name or "matrix"  # "." is the folder it names
    return (f"prep shards {shlex.quote(str(data))} --out {shlex.quote('shards-' + name)} "
            "--split time+probe --row-len 256")


# A wide-area matrix's median RTT lies well inside this range (ms); outside it the unit is
# the likelier mistake: Seattle in seconds read as ms has a median of 0.22 ms.
PLAUSIBLE_P50_MS = (1.0, 5_000.0)
_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}


def unit_warning(p50_ms: float, unit: str) -> str | None:
    """The summary's warning when the median RTT looks like the wrong --unit, naming the
    --unit that would put it in range (None when it looks plausible)."""
    lo, hi = PLAUSIBLE_P50_MS
    if lo <= p50_ms <= hi:
        return None
    order = list(UNITS)  # s, ms, us: each 1000 times the next
    k = order.index(unit) + (-1 if p50_ms < lo else 1)
    side = f"below {lo:g} ms" if p50_ms < lo else f"above {hi:,g} ms"
    fix = (f"if the matrices are in {_NAMES[order[k]]}, pass --unit {order[k]}"
           if 0 <= k < len(order) else "check the matrices' unit (--unit)")
    return (f"a median RTT of {p50_ms:,.3f} ms (read as {unit}) is {side}, unlikely for a "
            f"wide-area latency matrix; {fix}")
