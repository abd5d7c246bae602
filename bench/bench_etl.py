"""`prep shards` end to end: throughput on 10M generated measurements, and peak memory
at two input sizes with the same bucket size, to show memory follows the bucket, not the input.

Each run is the real command in a subprocess (``prep shards --workers 2 --json``), timed
from launch to exit. Peak RSS is the largest single process (main or pool worker), from
the run's own report; ``etl.peak_rss_total_mb`` adds the main process and every worker.
Reference: ping-llm's pipeline does ~108k measurements/s with 4 workers (its published figure).
Inputs are made by ``prep synth`` and cached under data/bench (git-ignored).

Where the time goes: ``etl.stage_share.<stage>``, each stage's share of the CPU seconds
the 10M run's report adds up (``stage_cpu_s``; prep.shards.stages names them), and the
floor in the same run: ``etl.read_parse_measurements_per_s``, the same parquet files read
by the same units on a pool of as many workers, with their addresses parsed by the same
calls (``read_parse``: nothing validated, routed or written), before and after the 10M
run (the mean); ``etl.over_read_parse`` is that rate over the run's (the goal: at most 3).
``etl.write_floor_cpu_s``: the CPU seconds of writing the 10M run's shards alone (their
records written again by the same call, with the same options, and hashed:
``write_again``), and ``etl.over_read_parse_bound`` = 1 + those seconds on both workers
over the floor's time: where a pipeline that only read, parsed and wrote would stand.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from prep.jobs.pool import Pool
from prep.schema.validate import ADDRESS_COLUMNS, BATCH_ROWS, open_parquet, parse_addresses
from prep.shards.bucket import write_shard
from prep.shards.dataset import read_units

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "data" / "bench"  # data/ is git-ignored
PREP = Path(sys.executable).with_name("prep")
BUCKET_ROWS = 312_500  # measurements per bucket, the same at both sizes
SIZES = (2_500_000, 10_000_000)
WORKERS = 2


def _synth(rows: int) -> Path:
    out = DATA / f"synth-{rows}"
    if not (out / ".done").exists():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([str(PREP), "synth", "--out", str(out), "--rows", str(rows),
                        "--probes", "3000", "--days", "2", "--seed", "0"], check=True)
        (out / ".done").touch()
    return out


def _shards(inp: Path, buckets: int, keep: bool = False) -> tuple[dict, float]:
    """The run's summary and wall seconds; with ``keep``, its shards stay in DATA/shards."""
    out = DATA / "shards"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.run([str(PREP), "shards", str(inp), "--out", str(out), "--workers", str(WORKERS),
                        "--buckets", str(buckets), "--seed", "0", "--json", "--quiet"],
                       check=True, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return json.loads(p.stdout.strip().splitlines()[-1]), wall


def write_again(shard: str) -> tuple[int, float, str]:
    """The floor of writing one shard: its records (read first, not timed) written again
    by the very call `prep shards` writes them with (prep.shards.bucket.write_shard: the
    ArrayRecord writer with the manifest's options, then the sha256); (records, CPU s,
    the sha256 of what it wrote: the manifest's)."""
    path = Path(shard)
    reader = ArrayRecordReader(str(path))
    block = np.frombuffer(b"".join(reader.read_all()), np.uint8).reshape(reader.num_records(), -1)
    reader.close()
    compression = json.loads((path.parent.parent / "manifest.json").read_text())["config"][
        "compression"]
    with tempfile.TemporaryDirectory(dir=DATA) as d:
        t0 = time.process_time()
        sha = write_shard(Path(d) / path.name, block, compression)
        return len(block), time.process_time() - t0, sha


def _write_floor_cpu_s(shards: Path) -> float:
    """CPU seconds of ``write_again`` over every shard of ``shards``, summed (on the pool)."""
    files = sorted(str(p) for p in shards.rglob("*.array_record"))
    with Pool(WORKERS, preload=(__name__,)) as pool:
        return sum(cpu for _, cpu, _ in pool.imap_unordered(write_again, files))


def read_parse(unit: list[tuple[str, list[int]]]) -> int:
    """The floor of pass 1 on one unit: its row groups read as `prep shards` reads them
    (prep.schema.validate.validated_batches: the columns, the batch size, the addresses as
    dictionaries) and each batch's addresses parsed (``parse_addresses``, every row's words
    taken); the rows read."""
    rows, cache = 0, {}
    for path, row_groups in unit:
        pf = open_parquet(path, read_dictionary=ADDRESS_COLUMNS)
        for rb in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=row_groups):
            for c in ADDRESS_COLUMNS:
                parse_addresses(rb.column(c), cache).words()
            rows += rb.num_rows
    return rows


def _read_parse_rate(inp: Path) -> float:
    """Measurements/s of ``read_parse`` over ``inp``'s units on WORKERS processes (the pool
    started and warm before the clock starts)."""
    units, total = read_units(sorted(inp.glob("*.parquet")))
    with Pool(WORKERS, preload=(__name__,)) as pool:
        list(pool.imap_unordered(read_parse, [[]] * WORKERS))  # start the workers
        t0 = time.perf_counter()
        rows = sum(pool.imap_unordered(read_parse, units))
        wall = time.perf_counter() - t0
    if rows != total:
        raise RuntimeError(f"read {rows:,} rows of {total:,}")
    return total / wall


def stage_shares(seconds: dict[str, float]) -> dict[str, float]:
    """``etl.stage_share.<stage>``: each stage's share of the seconds the report adds up."""
    total = sum(seconds.values())
    return {f"etl.stage_share.{k}": (v / total if total else 0.0) for k, v in seconds.items()}


def run() -> dict[str, float]:
    DATA.mkdir(parents=True, exist_ok=True)
    inputs = {n: _synth(n) for n in SIZES}
    _shards(inputs[SIZES[0]], 2)  # warm the Numba cache and the page cache; not timed
    metrics: dict[str, float] = {}
    floor = [_read_parse_rate(inputs[SIZES[-1]])]
    for n in SIZES:
        s, wall = _shards(inputs[n], max(1, n // BUCKET_ROWS), keep=n == SIZES[-1])
        rss = s["peak_rss_mb"]
        tag = f"{n // 1_000_000}m" if n % 1_000_000 == 0 else f"{n / 1e6:.1f}m".replace(".", "p")
        metrics[f"etl.peak_rss_mb_{tag}"] = float(max(rss.values()))
        print(f"[bench] etl {n:,} measurements: {wall:.2f} s, {n / wall:,.0f}/s, peak RSS "
              f"{rss}", file=sys.stderr)
    # The last run is the 10M one: throughput and packing figures come from it.
    floor.append(_read_parse_rate(inputs[SIZES[-1]]))
    write_cpu = _write_floor_cpu_s(DATA / "shards")
    shutil.rmtree(DATA / "shards", ignore_errors=True)
    rate, floor_rate = SIZES[-1] / wall, sum(floor) / len(floor)
    # read + parse, then the shards' writing on both workers, nothing else: the least
    # etl.over_read_parse any pipeline that reads these inputs and writes these shards gets
    bound = 1 + (write_cpu / WORKERS) / (SIZES[-1] / floor_rate)
    each = ", ".join(f"{f:,.0f}" for f in floor)
    print(f"[bench] etl read + parse floor {floor_rate:,.0f}/s ({each}), "
          f"{floor_rate / rate:.2f}x the run's rate; writing the shards alone {write_cpu:.2f} "
          f"CPU s: at least {bound:.2f}x with it", file=sys.stderr)
    metrics.update(stage_shares(s["stage_cpu_s"]))
    metrics.update({
        "etl.read_parse_measurements_per_s": float(floor_rate),
        "etl.over_read_parse": float(floor_rate / rate),
        "etl.write_floor_cpu_s": float(write_cpu),
        "etl.over_read_parse_bound": float(bound),
        "etl.measurements_per_s": float(rate),
        "etl.elapsed_s": float(wall),
        "etl.peak_rss_mb": float(max(rss.values())),
        "etl.peak_rss_total_mb": float(rss["main"] + WORKERS * rss["buckets"]),
        "etl.padding_fraction": float(s["padding_fraction"]),
        "etl.rows_over_lower_bound": float(s["rows_over_lower_bound"]),
        "etl.cpu_count": float(os.cpu_count() or 1),
    })
    return metrics


# a checkout's `prep shards` as its console script runs it (``run`` where it has one)
CHECKOUT_PREP = "import sys, prep.cli as c; getattr(c, 'run', c.main)()"


def _checkout_shards(repo: Path, inp: Path, buckets: int) -> dict:
    """The checkout ``repo``'s `prep shards` on ``inp``, 2 workers, in a fresh process: its
    summary's stage CPU seconds and peak RSS, with ``wall_s`` and ``cpu_s`` (of the process
    and its workers) measured here."""
    out = DATA / "shards-ab"
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the checkout's own prep (sys.path[0] is its folder)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", CHECKOUT_PREP, "shards", str(inp), "--out", str(out),
                        "--workers", str(WORKERS), "--buckets", str(buckets), "--seed", "0",
                        "--json", "--quiet"], cwd=repo, env=env, check=True,
                       stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out, ignore_errors=True)
    s = json.loads(p.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, **{f"stage_{k}": v for k, v in s["stage_cpu_s"].items()},
            "peak_rss_mb": float(max(s["peak_rss_mb"].values()))}


def against(other: Path, rounds: int) -> list[dict[str, float]]:
    """Medians of ``_checkout_shards`` for this checkout and ``other`` on the 10M input, the
    two alternating (ABBA...), each warmed by one untimed run (Numba's cache, the page cache)."""
    inp, buckets = _synth(SIZES[-1]), max(1, SIZES[-1] // BUCKET_ROWS)
    repos = [HERE.parent, other]
    for repo in repos:
        _checkout_shards(repo, inp, buckets)
    runs: list[list[dict]] = [[], []]
    for r in range(rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            runs[i].append(_checkout_shards(repos[i], inp, buckets))
    return [{k: statistics.median(x.get(k, 0.0) for x in rs) for k in rs[0]} for rs in runs]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example, a change against the commit before it:\n"
               "  git worktree add ../before HEAD~1\n"
               "  python -m bench.bench_etl --against ../before --rounds 7")
    ap.add_argument("--against", type=Path, help="another checkout, timed by turns in the same run "
                    "(without it: the bench's figures as `make bench` takes them)")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs of each (default 5)")
    args = ap.parse_args(argv)
    if args.against is None:
        print(json.dumps(run(), indent=2))
        return 0
    other = args.against.resolve()
    if not (other / "prep" / "cli.py").is_file():
        ap.error(f"--against {args.against}: not a checkout of this project (no prep/cli.py "
                 "there); make one with `git worktree add DIR REV`")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    ours, theirs = against(other, args.rounds)
    print(f"prep shards, {SIZES[-1]:,} rows, {WORKERS} workers, medians of {args.rounds} runs each")
    print(f"{'':24}{'this checkout':>16}{'--against':>12}{'ratio':>8}")
    stages = sorted((k for k in ours if k.startswith("stage_")), key=lambda k: -ours[k])
    for k in ["wall_s", "cpu_s", "peak_rss_mb"] + stages:
        a, b = ours[k], theirs.get(k, 0.0)
        print(f"{k.removeprefix('stage_'):<24}{a:>16.3f}{b:>12.3f}{a / b if b else float('nan'):>8.3f}")
    print(f"measurements/s: {SIZES[-1] / ours['wall_s']:,.0f} against "
          f"{SIZES[-1] / theirs['wall_s']:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
