"""`make bench`: every benchmark of ours beside its reference, in one run.

Each ``bench/bench_<part>.py`` defines ``run() -> dict[str, float]`` returning metrics
named ``<part>.<metric>`` (e.g. ``tokenizer.speedup``). This script runs them all (or
the parts named on the command line), prints a table, and writes
``bench/results/latest.json`` with the machine it ran on (CPU count, GPU name).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

from prep.base.atomic import write_atomic

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def machine() -> dict:
    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "processor": platform.processor()}
    with contextlib.suppress(OSError):  # not Linux: no CPU model to report
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    try:
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        info["gpu"] = gpus[0].device_kind if gpus else None
    except Exception:  # jax missing or no backend: no GPU to report
        info["gpu"] = None
    return info


def main(argv: list[str]) -> int:
    known = sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: python -m bench.run [PART ...]   (`make bench`: all of them)\n\n"
              f"{__doc__.strip()}\n\nparts: {' '.join(known)}\n"
              "example: python -m bench.run etl import   # updates those parts of latest.json")
        return 0
    unknown = [a for a in argv if a not in known]
    if unknown:
        print(f"bench.run: no part {', '.join(unknown)}; the parts: {' '.join(known)}",
              file=sys.stderr)
        return 2
    parts = argv or known
    metrics: dict[str, float] = {}
    for part in parts:
        mod = importlib.import_module(f"bench.bench_{part}")
        t0 = time.perf_counter()
        print(f"[bench] {part} ...", file=sys.stderr, flush=True)
        metrics.update(mod.run())
        print(f"[bench] {part} done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    out = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "metrics": metrics}
    RESULTS.mkdir(parents=True, exist_ok=True)
    latest = RESULTS / "latest.json"
    if argv and latest.exists():  # a partial run updates the parts it ran
        old = json.loads(latest.read_text())
        old["metrics"].update(metrics)
        old["machine"], old["time"] = out["machine"], out["time"]
        out = old
    write_atomic(latest, json.dumps(out, indent=2, sort_keys=True) + "\n")
    width = max((len(k) for k in out["metrics"]), default=10)
    for k in sorted(out["metrics"]):
        v = out["metrics"][k]
        print(f"{k:<{width}}  {v:>16,.3f}" if isinstance(v, float) else f"{k:<{width}}  {v!r:>16}")
    print(f"wrote {latest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
