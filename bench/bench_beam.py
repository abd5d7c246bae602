"""Beam runner (in-process FnApiRunner) beside the local runner on the same 1M measurements."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def run() -> dict[str, float]:
    try:
        import apache_beam  # noqa: F401
    except ImportError:
        return {}
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.beam_runner import run_beam
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    rows = 1_000_000
    cfg = ShardsConfig()
    with tempfile.TemporaryDirectory() as d:
        raw = str(Path(d) / "raw")
        synth(SynthConfig(out=raw, rows=rows, probes=1000, days=1, seed=2))
        run_shards([raw], str(Path(d) / "warm"), cfg, workers=1, progress=False)  # Numba cache
        t = time.perf_counter()
        run_shards([raw], str(Path(d) / "local"), cfg, workers=1, progress=False)
        local = time.perf_counter() - t
        t = time.perf_counter()
        run_beam([raw], str(Path(d) / "beam"), cfg, progress=False)
        beam = time.perf_counter() - t
        same = all((Path(d) / "local" / p.relative_to(Path(d) / "beam")).read_bytes() == p.read_bytes()
                   for p in (Path(d) / "beam").rglob("*.array_record"))
    return {"beam.measurements_per_s": rows / beam,
            "beam.local_1worker_measurements_per_s": rows / local,
            "beam.slowdown_vs_local": beam / local,
            "beam.identical_shards": float(same)}
