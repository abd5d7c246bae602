"""`prep import-atlas`: RIPE Atlas ping results to parquet, in the input schema of `prep shards`.

Inputs: JSON arrays (the results API), JSON lines, bzip2 (the daily dumps) or gzip; folders
are searched recursively and the format is sniffed from the content, not the name
(prep.ingest.atlas_read streams it). prep.ingest.atlas_rows turns each result into a row (with
``--per-packet``, one per packet) across the firmware variants of RIPE's result format;
every row passes prep.schema.validate, so the output holds only rows `prep shards` accepts.

``--source`` (AtlasConfig.source): ``public`` takes the probe's public address, ``from``
(else ``src_addr``), or ``src_addr`` where only that one is of ``dst_addr``'s family; ``local``
takes ``src_addr`` (often private), else ``from``. The result's ``src_addr`` is kept as
``src_addr_local`` either way. ``--errors`` (AtlasConfig.errors): a result of only local
``{"error": ...}`` packets and no timeout says nothing about the path, so ``skip`` rejects it
as ``local_error`` and ``failed`` makes it an rtt -1 row. The importer's rejection reasons,
on top of validate's, are in the README ("Rejection reasons"); every result is counted:
rows_in == rows_written + sum(rejected.values()).

Files are converted in parallel, one task per file (the biggest first), on ``workers``
processes; each writes its own parquet file in row groups of BATCH rows, so the output bytes
and counts do not depend on ``workers``. msgspec decodes into structs where it can, else the
stdlib ``json`` with the same result (prep.ingest.atlas_json); indexed_bzip2 decompresses .bz2,
on several threads when there are fewer files than workers. The garbage collector is off
while a file converts: the rows hold no cycles. The output folder is claimed, staged and
published by prep.jobs.parquet_out.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from prep.base import storage
from prep.base.errors import InputError, first_line, fs_failure
from prep.base.words import count
from prep.ingest import atlas_read
from prep.ingest.atlas_json import MALFORMED, Fast
from prep.ingest.atlas_read import read_results
from prep.ingest.atlas_rows import SCHEMA, Mode, Rows, convert, convert_fast
from prep.jobs.claim import claim
from prep.jobs.pool import Pool, WorkerDied, cores
from prep.schema.validate import find_files, format_rejected, validate_rows

BATCH = 65_536  # rows per parquet write (a row group: rows BATCH*i .. BATCH*(i+1)-1 before validation)
FLUSH = 2_048  # rows converted to Arrow at a time (atlas_rows.Rows.flush; about a CHUNK of results)
SUFFIXES = (".json", ".jsonl", ".ndjson", ".bz2", ".gz")
SOURCES = ("public", "local")
ERRORS = ("skip", "failed")
MAX_LOGGED = 20  # malformed lines logged one by one; the rest only counted
_FAST = True  # the msgspec path (tests turn it off to compare with the stdlib path)


@dataclass(frozen=True)
class AtlasConfig:
    inputs: tuple[Path | str, ...]  # files or folders; s3:// or gs:// objects or prefixes (str)
    out: Path | str  # output folder (or s3:// / gs:// prefix): one parquet file per input file
    per_packet: bool = False  # one row per packet instead of one per result
    strict: bool = False  # a malformed JSON line is an InputError, not a rejected row
    source: str = "public"  # src_addr: "public" (from, else src_addr) or "local" (src_addr, else from)
    errors: str = "skip"  # a result with only local errors: "skip" (local_error) or "failed" (rtt -1)
    workers: int = 0  # processes, one file each; 0: one per core
    overwrite: bool = False  # replace the parquet files already in out


def list_atlas_inputs(paths) -> list[Path]:
    """Result files (JSON, JSON lines, .bz2/.gz dumps) named directly or found under folders."""
    return find_files(paths, SUFFIXES, f"no RIPE Atlas result files ({', '.join(SUFFIXES)}) found",
                      # a file of no known kind goes to the importer, which counts its
                      # lines as malformed_json (and fails if nothing is left)
                      command="prep import-atlas", kinds=("atlas", "unknown", "empty"))


def _output_names(files: list[Path]) -> list[str]:
    names, seen = [], set()
    for f in files:
        stem = f.name
        for suffix in (".bz2", ".gz", ".jsonl", ".ndjson", ".json"):
            stem = stem.removesuffix(suffix)
        name, i = f"{stem}.parquet", 2
        while name in seen:
            name, i = f"{stem}-{i}.parquet", i + 1
        seen.add(name)
        names.append(name)
    return names


_ADDR_CACHE: dict = {}  # per process, across files: each distinct address text parsed once


def import_file(task) -> dict:
    """Convert one file into ``out_file``; its counts, and its first MAX_LOGGED log lines.

    The cyclic garbage collector is off meanwhile: the rows make no cycles, and its passes
    over the many young objects (a list per result) cost as much as the decoding.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _import_one(*task)
    finally:
        if enabled:
            gc.enable()


def _import_one(path: Path, out_file: Path, cfg: AtlasConfig, chunk: int, fast: bool,
                threads: int) -> dict:
    mode = Mode(cfg.per_packet, cfg.source == "public", cfg.errors == "skip")
    results_read, rows_in, rows_written = 0, 0, 0
    mine: dict[str, int] = {}  # the importer's rejections
    checked: Counter = Counter()  # validation's
    log: list[str] = []
    rows = Rows()
    with pq.ParquetWriter(out_file, SCHEMA, compression="zstd") as writer:
        def write(k):
            nonlocal rows_in, rows_written
            for _ in range(k // BATCH + (k % BATCH > 0)):
                table = rows.take(min(BATCH, k))
                k -= len(table)
                keep, _, why = validate_rows(table, source=str(path), _cache=_ADDR_CACHE)
                try:  # inside the reader's try below: a failed write is not a bad input
                    writer.write_table(table if keep.all() else table.filter(pa.array(keep)))
                except OSError as e:
                    raise (fs_failure(e, cfg.out) or InputError(
                        f"{out_file}: cannot write ({first_line(e)})")) from None
                rows_in += len(table)
                rows_written += int(keep.sum())
                checked.update(why)

        try:
            for v in read_results(path, cfg.strict, log, chunk=chunk, fast=fast, threads=threads):
                if type(v) is Fast:
                    results_read += len(v)
                    convert_fast(v, mode, rows, mine)
                else:
                    results_read += 1
                    if v is MALFORMED:
                        mine["malformed_json"] = mine.get("malformed_json", 0) + 1
                    else:
                        convert(v, mode, rows, mine)
                rows.flush(at_least=FLUSH)
                if len(rows) >= BATCH:
                    n = len(rows)
                    write(n - n % BATCH)
        except (OSError, EOFError, zlib.error) as e:
            raise InputError(f"{path}: unreadable or truncated ({e}); "
                             "download the file again") from None
        except RuntimeError as e:  # indexed_bzip2's, often just "std::exception"
            if isinstance(e, RecursionError):
                raise
            why = "damaged or incomplete bzip2 data" if str(e) == "std::exception" else f"bzip2: {e}"
            raise InputError(f"{path}: unreadable or truncated ({why}); "
                             "download the file again") from None
        if len(rows):
            write(len(rows))
    rejected = dict(checked + Counter(mine))
    return {"results_read": results_read, "rows_in": rows_in + sum(mine.values()),
            "rows_written": rows_written, "rejected": rejected, "log": log[:MAX_LOGGED],
            "logged": len(log)}


def _work(path: Path) -> int:
    """About how much work a file is: its size, a compressed one's times its usual ratio."""
    try:
        with open(path, "rb") as f:
            magic = f.read(3)
        return path.stat().st_size * (10 if magic == b"BZh" or magic[:2] == b"\x1f\x8b" else 1)
    except OSError:
        return 0


@contextlib.contextmanager
def _tasks_run(procs: int, tasks: list, out: Path):
    """The results of ``import_file`` over ``tasks``, in order, on ``procs`` processes
    (in this one for 1); a worker's InputError is raised here, and the pool stops with it."""
    if procs <= 1:
        yield map(import_file, tasks)
        return
    try:
        with Pool(procs, preload=(__name__,)) as pool:
            # The biggest files first, so that no big one is left running alone at the end;
            # the results still come in file order.
            order = sorted(range(len(tasks)), key=lambda i: -_work(tasks[i][0]))
            yield pool.imap(import_file, tasks, [str(t[0]) for t in tasks], order)
    except WorkerDied as e:
        raise InputError(f"import-atlas: {e.what}; nothing was written to {out}; run again"
                         + (", with fewer --workers" if e.oom else "")) from None


def _nothing_written(files: list[Path], results: int, rejected: dict, out: Path) -> str:
    where = f"{files[0]}" if len(files) == 1 else f"{len(files)} files"
    if not results:
        why = f"{where} hold{'s' if len(files) == 1 else ''} no JSON values"
    else:
        top = format_rejected(rejected, top=3)
        why = (f"all {results:,} values" if results > 1 else "the one value") + f" read from {where} were rejected ({top})"
        if rejected.get("malformed_json", 0) + rejected.get("not_a_result", 0) >= sum(rejected.values()) / 2:
            why += "; are these RIPE Atlas ping results (JSON from the results API or a daily dump)?"
        elif rejected.get("not_ping"):
            why += "; only ping measurements are imported"
    return f"import-atlas: no rows written: {why}; nothing was written to {out}"


def import_atlas(cfg: AtlasConfig) -> dict:
    """Convert every input; all output files appear together at the end, or none do."""
    if cfg.source not in SOURCES or cfg.errors not in ERRORS:
        raise ValueError(f"source must be one of {SOURCES} and errors one of {ERRORS}")
    t0 = time.perf_counter()
    remote = storage.remote_inputs([str(p) for p in cfg.inputs], SUFFIXES, "prep import-atlas")
    local = [p for p in cfg.inputs if not storage.is_remote(str(p))]
    files = list_atlas_inputs(local) if local or not remote else []
    results_read = rows_in = rows_written = logged = 0
    rejected: Counter = Counter()
    log: list[str] = []
    with claim(str(cfg.out), layout="parquet", command="prep import-atlas", runner="import",
               overwrite=cfg.overwrite, progress=sys.stderr.isatty()) as od:
        if remote:  # into the staging folder: removed with it, whatever happens
            files = sorted(files + list_atlas_inputs(storage.download_inputs(
                remote, od.stage / ".inputs", progress=sys.stderr.isatty())))
        names = _output_names(files)
        workers = cfg.workers if cfg.workers > 0 else cores()
        procs = min(workers, len(files))
        threads = max(1, workers // procs)  # decompression threads of a .bz2 file
        tasks = [(path, od.stage / name, cfg, atlas_read.CHUNK, _FAST, threads)  # CHUNK, _FAST: tests set them
                 for path, name in zip(files, names)]
        with _tasks_run(procs, tasks, cfg.out) as results, contextlib.ExitStack() as stack:
            # a bar only on a terminal: tqdm starts a thread even when disabled, and a
            # later run in this process would then start its workers by a fork server
            bar = stack.enter_context(tqdm(total=len(files), unit=" files", desc="import-atlas",
                                           file=sys.stderr)) if sys.stderr.isatty() else None
            for res in results:
                results_read += res["results_read"]
                rows_in += res["rows_in"]
                rows_written += res["rows_written"]
                rejected.update(res["rejected"])
                log += res["log"][:MAX_LOGGED - len(log)]
                logged += res["logged"]
                if bar is not None:
                    bar.update(1)
        for line in log:
            print(line, file=sys.stderr)
        if logged > MAX_LOGGED:
            print(f"... and {logged - MAX_LOGGED:,} more malformed JSON lines", file=sys.stderr)
        if not rows_written:  # a finished-looking empty dataset is worse than an error
            raise InputError(_nothing_written(files, results_read, rejected, cfg.out))
        od.publish(names)
    elapsed = time.perf_counter() - t0
    summary = {"files": len(files), "results_read": results_read, "rows_in": rows_in,
               "rows_written": rows_written, "rejected": dict(sorted(rejected.items())),
               "per_packet": cfg.per_packet, "source": cfg.source, "errors": cfg.errors,
               "elapsed_s": round(elapsed, 3),
               "results_per_s": round(results_read / max(elapsed, 1e-9), 1)}
    why = format_rejected(summary["rejected"])
    print(f"import-atlas: {count(results_read, 'result')} from {count(len(files), 'file')} -> "
          f"{count(rows_written, 'row')} in {cfg.out} | rejected {sum(rejected.values()):,} ({why}) | "
          f"{elapsed:.1f}s, {summary['results_per_s']:,.0f} results/s on {procs} "
          f"process{'es' if procs > 1 else ''}", file=sys.stderr)
    return summary
