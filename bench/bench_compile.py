"""Numba kernels' first compile: what a new user's first `prep shards`, and every test
process of a fresh checkout, waits for before any work.

Each figure is one fresh Python process that imports prep and runs
``prep.shards.kernels.warm_kernels`` (the planner, packer and encoder on a tiny bucket, as
`prep shards` does before its passes), timed inside the process from just before that call:

- ``cold_s``: with an empty Numba cache (NUMBA_CACHE_DIR a new temp folder), best of
  ``--repeat`` (default 2): everything compiled, in one process; ``cold_cpu_s`` its CPU
  seconds (on a shared machine the wall time also counts the others' load);
  ``cold_two_s``, ``cold_two_cpu_s``: the same with warm_kernels' second process (what
  `prep shards` does with a core idle), its CPU included;
- ``cached_s``: again in a new process on the cache the cold run filled: machine code
  loaded, nothing compiled (the reference: what every later run pays);
- ``cold_over_cached``: the ratio of the two;
- ``setup_s``: `prep kernels`, the step `make setup` runs, on an empty cache: the whole
  command, Python's start included, with the processes it picks (``setup_processes``: 2
  when a core is idle); ``after_setup_s``: then a first `prep shards`' kernels, as above,
  and ``after_setup_compiled`` the kernels it compiled (0: it loaded them all).

``python -m bench.bench_compile --against DIR`` also times the checkout at DIR (another
worktree, e.g. the commit before a change) in the same run, alternating with this one,
and prints both: an A/B on the same machine at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the timed part runs in the child: ``prep`` is the checkout it starts in (sys.path[0])
CHILD = """import inspect, json, resource, sys, tempfile, time
try:
    import prep.shards.kernels as b
except ImportError:  # a checkout before prep/shards/kernels.py
    import prep.shards.bucket as b
# processes (argv[1]) where this checkout's warm_kernels takes it
kw = {"processes": int(sys.argv[1])} if "processes" in inspect.signature(b.warm_kernels).parameters else {}
t, c = time.perf_counter(), time.process_time()
with tempfile.TemporaryDirectory() as d:
    ready = b.warm_kernels(d, **kw)
kids = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"s": time.perf_counter() - t,
                  "cpu_s": time.process_time() - c + kids.ru_utime + kids.ru_stime,
                  "compiled": len(ready.compiled) if ready else float("nan")}))
"""
# `prep kernels` as `make setup` runs it
SETUP = "from prep.cli import main; main(['kernels'])"


def warm_seconds(repo: Path, cache: Path, processes: int = 1) -> dict[str, float]:
    """Seconds of warm_kernels in a fresh process of the checkout ``repo``, Numba caching
    into ``cache``: {"s": wall, "cpu_s": CPU of the process and of those it started}."""
    env = os.environ | {"NUMBA_CACHE_DIR": str(cache)}
    env.pop("PYTHONPATH", None)  # the checkout's own prep, not this one's
    r = subprocess.run([sys.executable, "-c", CHILD, str(processes)], cwd=repo, env=env, text=True,
                       capture_output=True)
    if r.returncode:
        raise RuntimeError(f"warm_kernels failed in {repo}:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def setup_seconds(repo: Path, cache: Path) -> dict[str, float]:
    """`prep kernels` of the checkout ``repo`` in a new process, Numba caching into
    ``cache``: {"s": wall, Python's start included, "processes": those it compiled on};
    NaN for a checkout without it."""
    env = os.environ | {"NUMBA_CACHE_DIR": str(cache)}
    env.pop("PYTHONPATH", None)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", SETUP], cwd=repo, env=env, text=True,
                       capture_output=True)
    s = time.perf_counter() - t
    said = re.search(r"kernels compiled in [0-9.]+ s \(\d+ on (\d+) process", r.stderr)
    if r.returncode or not said:
        if "No such command 'kernels'" in r.stderr:
            return {"s": float("nan"), "processes": float("nan")}
        raise RuntimeError(f"prep kernels failed or compiled nothing in {repo}:\n"
                           f"{r.stderr[-2000:]}")
    return {"s": s, "processes": int(said.group(1))}


def measure(repos: list[Path], repeat: int) -> list[dict[str, float]]:
    """Best cold and best cached seconds per checkout, the checkouts taking turns."""
    best = [dict.fromkeys(["cold_s", "cold_cpu_s", "cold_two_s", "cold_two_cpu_s", "cached_s",
                           "setup_s", "after_setup_s"], float("inf")) for _ in repos]
    for _ in range(repeat):
        for repo, b in zip(repos, best):
            for procs, key in ((1, "cold"), (2, "cold_two")):
                with tempfile.TemporaryDirectory(prefix="numba-cold-") as d:
                    cold = warm_seconds(repo, Path(d), procs)
                    b[f"{key}_s"] = min(b[f"{key}_s"], cold["s"])
                    b[f"{key}_cpu_s"] = min(b[f"{key}_cpu_s"], cold["cpu_s"])
                    b["cached_s"] = min(b["cached_s"], warm_seconds(repo, Path(d))["s"])
            with tempfile.TemporaryDirectory(prefix="numba-setup-") as d:
                setup = setup_seconds(repo, Path(d))
                if not setup["s"] >= b["setup_s"]:  # faster, or NaN: no `prep kernels`
                    b["setup_s"], b["setup_processes"] = setup["s"], setup["processes"]
                nan = {"s": float("nan"), "compiled": float("nan")}
                after = nan if setup["s"] != setup["s"] else warm_seconds(repo, Path(d))
                if not after["s"] >= b["after_setup_s"]:
                    b["after_setup_s"], b["after_setup_compiled"] = after["s"], after["compiled"]
    for b in best:
        b["cold_over_cached"] = b["cold_s"] / b["cached_s"]
    return best


def run(repeat: int = 2) -> dict[str, float]:
    (ours,) = measure([REPO], repeat)
    return {f"compile.{k}": v for k, v in ours.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", type=Path, help="another checkout, timed in the same run")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    repos = [REPO] + ([args.against.resolve()] if args.against else [])
    for repo, fig in zip(repos, measure(repos, args.repeat)):
        print(f"{str(repo):<40} " + "  ".join(f"{k} {v:8.2f}" for k, v in fig.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
