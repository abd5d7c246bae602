"""`prep shards` end to end: throughput on 10M generated measurements, and peak memory
at two input sizes with the same bucket size, to show memory follows the bucket, not the input.

Each run is the real command in a subprocess (``prep shards --workers 2 --json``), timed
from launch to exit. Peak RSS is the largest single process (main or pool worker), from
the run's own report; ``etl.peak_rss_total_mb`` adds the main process and every worker.
Reference: ping-llm's pipeline does ~108k measurements/s with 4 workers (its published figure).
Inputs are made by ``prep synth`` and cached under data/bench (git-ignored).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

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


def _shards(inp: Path, buckets: int) -> tuple[dict, float]:
    out = DATA / "shards"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.run([str(PREP), "shards", str(inp), "--out", str(out), "--workers", str(WORKERS),
                        "--buckets", str(buckets), "--seed", "0", "--json", "--quiet"],
                       check=True, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(p.stdout.strip().splitlines()[-1]), wall


def run() -> dict[str, float]:
    DATA.mkdir(parents=True, exist_ok=True)
    inputs = {n: _synth(n) for n in SIZES}
    _shards(inputs[SIZES[0]], 2)  # warm the Numba cache and the page cache; not timed
    metrics: dict[str, float] = {}
    for n in SIZES:
        s, wall = _shards(inputs[n], max(1, n // BUCKET_ROWS))
        rss = s["peak_rss_mb"]
        tag = f"{n // 1_000_000}m" if n % 1_000_000 == 0 else f"{n / 1e6:.1f}m".replace(".", "p")
        metrics[f"etl.peak_rss_mb_{tag}"] = float(max(rss.values()))
        print(f"[bench] etl {n:,} measurements: {wall:.2f} s, {n / wall:,.0f}/s, peak RSS "
              f"{rss}", file=sys.stderr)
    # The last run is the 10M one: throughput and packing figures come from it.
    metrics.update({
        "etl.measurements_per_s": float(SIZES[-1] / wall),
        "etl.elapsed_s": float(wall),
        "etl.peak_rss_mb": float(max(rss.values())),
        "etl.peak_rss_total_mb": float(rss["main"] + WORKERS * rss["buckets"]),
        "etl.padding_fraction": float(s["padding_fraction"]),
        "etl.rows_over_lower_bound": float(s["rows_over_lower_bound"]),
        "etl.cpu_count": float(os.cpu_count() or 1),
    })
    return metrics


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
