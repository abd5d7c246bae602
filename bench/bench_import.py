"""`import.results_per_s`: `prep import-atlas` on the real RIPE Atlas sample (JSON arrays + bz2 dump).

Pure-Python JSON decoding dominates; the number is per result, best of three runs.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from prep.atlas import AtlasConfig, import_atlas

SAMPLE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "ripe-atlas"


def run() -> dict[str, float]:
    if not SAMPLE.is_dir():
        return {}
    best, n = float("inf"), 0
    with tempfile.TemporaryDirectory() as d:
        for _ in range(3):
            cfg = AtlasConfig(inputs=(SAMPLE / "api", SAMPLE / "dump"), out=Path(d))
            t0 = time.perf_counter()
            n = import_atlas(cfg)["results_read"]
            best = min(best, time.perf_counter() - t0)
    return {"import.results_per_s": n / best}
