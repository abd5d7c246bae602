"""`prep import-atlas` throughput on RIPE Atlas results, beside the stdlib doing the least work.

    import.results_per_s                    the real sample (JSON arrays + a .bz2 dump, 37 files,
                                            7,725 results), best of three, default --workers
    import.results_per_s_jsonl              the real sample's results replicated to 309,000
    import.results_per_s_bz2                (40 copies) in 4 files, as JSON lines and as .jsonl.bz2;
                                            default --workers (one per core), best of two
    import.stdlib_results_per_s_jsonl       the same files, one process: stdlib bz2 (for .bz2)
    import.stdlib_results_per_s_bz2         and json.loads per line, nothing else: the floor
                                            of the importer before this one
    import.speedup_jsonl, import.speedup_bz2    importer rate / stdlib rate, same run
    import.workers                          the processes the importer used
    import.bz2_decompress_results_per_s     the ceiling for .bz2: indexed_bzip2 decompressing the
                                            same files to nothing, on as many processes (no parsing)
    import.bz2_of_ceiling                   import.results_per_s_bz2 / that ceiling
    import.cpu_s_per_file_{jsonl,bz2}       one process's CPU s (best of 3) to import one such file;
    import.cpu_s_decompress_per_file        to only decompress the .bz2 one (less load-sensitive)
    import.bz2_cpu_of_ceiling, import.bz2_cpu_over_parts    decompress / bz2; bz2 / (decompress + jsonl)
    import.cpu_s_decode_per_file            the JSON-lines file only read and decoded (msgspec), no
                                            row built, validated or written: the parser's floor
    import.bz2_cpu_of_ceiling_bound         decompress / (decompress + decode): where an importer
                                            that did nothing past decoding would stand
    import.sample_padding_fraction          the real sample imported (defaults) and packed by
    import.sample_rows_over_lower_bound     `prep shards` with its defaults (buckets from the input)

The .jsonl.bz2 files are the 3.8 MB unit compressed once and written 10 times (one bzip2
stream per copy, as pbzip2 writes them): the same blocks to decompress as one stream of
the whole, without 20 s of compressing in every run.
"""

from __future__ import annotations

import bz2
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from prep.ingest import atlas, atlas_read
from prep.ingest.atlas import AtlasConfig, import_atlas
from prep.jobs.pool import Pool, cores
from prep.shards.bucket import ShardsConfig
from prep.shards.local_runner import run_shards

SAMPLE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "ripe-atlas"
FILES, COPIES = 4, 10  # 4 files x 10 copies x 7,725 results = 309,000


def _unit() -> bytes:
    """Every result of the real sample as JSON lines (the dump's lines as they are)."""
    lines = bz2.decompress((SAMPLE / "dump" / "ping-sample.jsonl.bz2").read_bytes()).splitlines()
    for p in sorted((SAMPLE / "api").glob("*.json")):
        lines += [json.dumps(r).encode() for r in json.loads(p.read_bytes())]
    return b"\n".join(lines) + b"\n"


def _stdlib_rate(folder: Path) -> float:
    """Results/s of stdlib decompression (for .bz2) and json.loads of every line, one process."""
    n, t0 = 0, time.perf_counter()
    for p in sorted(folder.iterdir()):
        with (bz2.open(p, "rb") if p.suffix == ".bz2" else open(p, "rb")) as f:
            for line in f:
                json.loads(line)
                n += 1
    return n / (time.perf_counter() - t0)


def _decompress(path: Path) -> int:
    """The lines of a file, decompressed as the importer reads it (into one reused buffer);
    counted by numpy, at a seventh of ``bytes.count``'s cost (2% of decompressing)."""
    n, buf = 0, bytearray(atlas_read.CHUNK)
    view = memoryview(buf)
    with atlas_read.open_binary(path) as f:
        while k := f.readinto(view):
            n += int(np.count_nonzero(np.frombuffer(buf, np.uint8, k) == 10))
    return n


def _decompress_rate(folder: Path, procs: int) -> float:
    """Results/s of decompressing every file (as the importer opens them), ``procs`` at a time."""
    files = sorted(folder.iterdir())
    with Pool(procs, preload=(__name__,)) as pool:
        list(pool.imap(_decompress, files[:procs]))  # the pool started
        t0 = time.perf_counter()
        n = sum(pool.imap(_decompress, files))
        return n / (time.perf_counter() - t0)


def _cpu_s(fn, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def _cpu_split(folder: Path, out: Path) -> dict[str, float]:
    """CPU seconds in this process for one file: imported from JSON lines, from .bz2, and
    only decompressed; where the .bz2 import's time beyond the ceiling goes."""
    cfg = AtlasConfig(inputs=(), out=out)
    def one(path):
        return lambda: atlas.import_file((path, out / "one.parquet", cfg, atlas_read.CHUNK, True, 1))
    jsonl, bz2_file = folder / "jsonl" / "part0.jsonl", folder / "bz2" / "part0.jsonl.bz2"
    m = {"import.cpu_s_per_file_jsonl": _cpu_s(one(jsonl)),
         "import.cpu_s_per_file_bz2": _cpu_s(one(bz2_file)),
         "import.cpu_s_decompress_per_file": _cpu_s(lambda: _decompress(bz2_file)),
         "import.cpu_s_decode_per_file": _cpu_s(lambda: _decode(jsonl))}
    decompress = m["import.cpu_s_decompress_per_file"]
    m["import.bz2_cpu_of_ceiling"] = decompress / m["import.cpu_s_per_file_bz2"]
    m["import.bz2_cpu_over_parts"] = m["import.cpu_s_per_file_bz2"] / (
        decompress + m["import.cpu_s_per_file_jsonl"])
    decode = m["import.cpu_s_decode_per_file"]
    m["import.bz2_cpu_of_ceiling_bound"] = decompress / (decompress + decode)
    return m


def _decode(path: Path) -> int:
    """The results of a JSON-lines file read and decoded as the importer reads and decodes
    them (atlas_read.read_results: blocks of lines into msgspec structs), nothing else."""
    return sum(len(v) if type(v) is atlas_read.Fast else 1
               for v in atlas_read.read_results(path, strict=False, log=[]))


def _import_rate(folder: Path, out: Path, runs: int) -> tuple[float, int]:
    best, n = float("inf"), 0
    for _ in range(runs):
        t0 = time.perf_counter()
        n = import_atlas(AtlasConfig(inputs=(folder,), out=out, overwrite=True))["results_read"]
        best = min(best, time.perf_counter() - t0)
    return n / best, n


def run() -> dict[str, float]:
    if not SAMPLE.is_dir():
        return {}
    metrics: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        rate, _ = _import_rate(SAMPLE, d / "sample", 3)
        metrics["import.results_per_s"] = rate
        s = run_shards([str(d / "sample")], str(d / "sample-shards"), ShardsConfig(n_buckets=0),
                       workers=min(2, cores()), progress=False)
        metrics["import.sample_padding_fraction"] = s["padding_fraction"]
        metrics["import.sample_rows_over_lower_bound"] = s["rows_over_lower_bound"]

        unit = _unit()
        packed = bz2.compress(unit)
        for kind, data in (("jsonl", unit), ("bz2", packed)):
            (d / kind).mkdir()
            for i in range(FILES):
                (d / kind / f"part{i}.jsonl{'.bz2' if kind == 'bz2' else ''}").write_bytes(data * COPIES)
        for kind in ("jsonl", "bz2"):
            std = _stdlib_rate(d / kind)
            rate, n = _import_rate(d / kind, d / f"out-{kind}", 2)
            assert n == FILES * COPIES * unit.count(b"\n"), n
            metrics[f"import.results_per_s_{kind}"] = rate
            metrics[f"import.stdlib_results_per_s_{kind}"] = std
            metrics[f"import.speedup_{kind}"] = rate / std
        procs = min(cores(), FILES)
        ceiling = _decompress_rate(d / "bz2", procs)
        metrics["import.bz2_decompress_results_per_s"] = ceiling
        metrics["import.bz2_of_ceiling"] = metrics["import.results_per_s_bz2"] / ceiling
        (d / "one").mkdir()
        metrics.update(_cpu_split(d, d / "one"))
    metrics["import.workers"] = float(procs)
    return metrics
