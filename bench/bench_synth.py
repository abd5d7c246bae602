"""`synth.rows_per_s`: `prep synth` end to end (generate + hourly parquet), the `make shards` size.

Also `synth.validate_rows_per_s`: prep.schema.validate over the same files (read + validate), the
first stage of `prep shards` (target: well above the end-to-end ETL rate, etl.measurements_per_s).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from prep.ingest.synth import SynthConfig, synth
from prep.schema import validate

ROWS = 3_000_000


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        cfg = SynthConfig(out=Path(d), rows=ROWS, probes=3_000, days=2, seed=0, overwrite=True)
        best = min(_timed(lambda: synth(cfg)) for _ in range(2))
        t = _timed(lambda: validate.read_validated([d]))
    return {"synth.rows_per_s": ROWS / best, "synth.validate_rows_per_s": ROWS / t}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
