"""The Numba kernels `prep shards` runs: compiled once into Numba's cache, loaded after.

Compiling them takes seconds (`make bench`: compile.cold_s in one process, cold_two_s with
warm_kernels' second process); loading their cached machine code, a fraction of one
(compile.cached_s). So `make setup` runs `prep kernels`, which compiles them into the cache
(compile.setup_s), and a new user's first `prep shards` and each test process load them
(compile.after_setup_s; `prep shards` lets each worker load what it runs, and loads nothing
in its driver). `prep kernels` says what it did, from Numba's own counters
(prep.base.jit.cache_use): "kernels loaded from Numba's cache in 0.3 s (17; none
compiled)" or "kernels compiled in 7.4 s (36 on 2 processes; ...)".

A cache is missed, never used wrong: its folder is named after the sources of prep/ and
train/ (prep/__init__.py), and in it Numba keys each kernel on its file (a hash of its bytes
from Numba 0.68, its time and size before), the kernel's bytecode, Numba's version, the
Python version (in the file name) and the CPU. A fresh clone without `make setup` (no
folder), an edit, another Numba, Python or CPU (and before 0.68, a checkout that rewrites
a file): the kernels compile afresh, before the passes, and the command says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prep.base.jit import cache_use
from prep.base.words import count
from prep.pack.contexts import epoch_seed, plan_contexts
from prep.pack.packing import pack
from prep.pack.repack import repack
from prep.schema.measurements import Measurements
from prep.shards.bucket import process_bucket
from prep.shards.config import ShardsConfig
from prep.tokens.kernel import encode_pieces


@dataclass(frozen=True)
class KernelsReady:
    """What warm_kernels did: the kernels and helpers (prep.base.jit) compiled, in either
    process, and those only loaded from Numba's cache."""
    compiled: tuple[str, ...]
    loaded: tuple[str, ...]
    processes: int

    def says(self, seconds: float) -> str:
        if self.compiled:
            loaded = f", {len(self.loaded)} loaded from Numba's cache" if self.loaded else ""
            return (f"kernels compiled in {seconds:.1f} s ({len(self.compiled)} on "
                    f"{count(self.processes, 'process', 'processes')}{loaded}; "
                    "Numba caches them for later runs)")
        if self.loaded:
            return (f"kernels loaded from Numba's cache in {seconds:.1f} s "
                    f"({len(self.loaded)}; none compiled)")
        return f"kernels already loaded in this process ({seconds:.1f} s)"


def compile_kernels(stage: Path | None, says: str, *,
                    only_missing: bool = False) -> tuple[float, int | None]:
    """Compile (or load) pass 2's kernels here, before the passes, rather than in every
    worker under a progress bar standing at 0, and say which on stderr: (the seconds it
    took, which the summary's rate leaves out; how many it compiled). `prep kernels` is
    this alone (``stage`` None: a temporary folder). ``only_missing`` (`prep shards`): with
    the cache filled, load nothing here and say nothing, as every run after the first (each
    worker loads what it runs; loading here too cost a run 0.3-0.4 s and its driver 70 MB):
    (0.0, None)."""
    if only_missing and kernels_cached():
        return 0.0, None
    if not kernels_cached():
        print(f"{says}: compiling kernels (once; Numba caches them for later runs)",
              file=sys.stderr)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=stage) as d:
        ready = warm_kernels(d)
    took = time.perf_counter() - t
    print(f"{says}: {ready.says(took)}", file=sys.stderr)
    return took, len(ready.compiled)


def kernels_cached() -> bool:
    """Whether Numba's cache folder (prep/__init__.py names it) holds compiled kernels: on
    the first run after an install or an edit of prep/ it holds none. (Only a guess at
    what Numba will load: ``KernelsReady`` says what it did.)"""
    import numba

    d = Path(numba.config.CACHE_DIR or "")
    return bool(numba.config.CACHE_DIR) and d.is_dir() and any(d.rglob("*.nbi"))


def warm_kernels(tmp: str, processes: int | None = None) -> KernelsReady:
    """Compile pass 2's kernels (planner, packer, encoder) once, on a tiny bucket of both
    families, failures and gaps, writing its shards under ``tmp``: Numba caches the
    machine code, so the workers load it instead of each compiling it under a progress bar.

    With ``processes`` 2, a second process compiles the packer's steps 1-4 (step 4,
    prep.pack.fill, is half the work; ``warm_packer``) while this one compiles the planner,
    the encoder and steps 5-6; the bucket's run then loads them all from the cache (and
    compiles whatever it finds missing). None picks 2 when nothing is cached yet and a core
    is idle now (``idle_cores``): on busy cores the second process only adds its start and
    the Numba library code both compile, ~2.5 s of CPU."""
    before = cache_use()
    m = _tiny_bucket()
    cfg = ShardsConfig(n_buckets=1, test_fraction=0.3)
    if processes is None:
        processes = 2 if not kernels_cached() and idle_cores() >= 0.75 else 1
    child, child_compiled = None, []
    if processes > 1:
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this prep/
        child = subprocess.Popen([sys.executable, "-c", _WARM_PACKER, root], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        plan = plan_contexts(m, cfg.context_config(), epoch_seed(cfg.seed, 0))
        encode_pieces(plan.sorted, plan, plan.ctx_start, plan.ctx_end, epoch_seed(cfg.seed, 0))
        # then the packer's steps after step 4 (steps 1-3 load what the other one cached)
        p = pack(*_made_up_contexts(), split=False)
        repack(p.piece_len, p.piece_row, p.n_rows, cfg.row_len)
    finally:
        if child is not None:
            out, err = child.communicate()
            if child.returncode:
                raise RuntimeError(f"compiling the packer's kernels failed:\n{err[-2000:]}")
            child_compiled = json.loads(out.splitlines()[-1])
    process_bucket(0, m, cfg, tmp)
    after = cache_use()
    compiled = {k for k, (_, c) in after.items() if c > before.get(k, (0, 0))[1]}
    compiled |= set(child_compiled)
    loaded = {k for k, (h, _) in after.items() if h > before.get(k, (0, 0))[0]} - compiled
    return KernelsReady(tuple(sorted(compiled)), tuple(sorted(loaded)), processes)


def idle_cores(window_s: float = 0.25) -> float:
    """The cores that sat idle over the next ``window_s`` (/proc/stat). Not the load
    average: `make setup` runs `prep kernels` just after pip, whose minute of work keeps
    that above 1 for a minute after it ends. Elsewhere: the cores less the load average."""
    def ticks():
        with open("/proc/stat") as f:
            t = [int(x) for x in f.readline().split()[1:]]
        return t[3] + t[4], sum(t[:8])  # idle + iowait; all but guest time
    try:
        idle0, total0 = ticks()
        time.sleep(window_s)
        idle1, total1 = ticks()
    except OSError:  # not Linux
        return (os.cpu_count() or 1) - os.getloadavg()[0]
    return (os.cpu_count() or 1) * (idle1 - idle0) / max(total1 - total0, 1)


# the second process of warm_kernels: this checkout's prep (argv[1]), the same cache folder
_WARM_PACKER = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from prep.shards.kernels import warm_packer; warm_packer()")


def warm_packer() -> None:
    """Compile the packer's kernels: ``pack`` on made-up contexts (``pack`` gives any input
    the same types, so these are the versions ``process_bucket`` runs). Prints the names of
    those it compiled, a JSON list, for warm_kernels' count."""
    pack(*_made_up_contexts())
    print(json.dumps(sorted(k for k, (_, c) in cache_use().items() if c)))


def _made_up_contexts():
    """30 contexts of 20 measurements, every other one timestamped: its rows are the ones
    step 4 fills from the others'."""
    has_ts = np.repeat(np.arange(30) % 2 == 0, 20)
    bounds = np.arange(0, 601, 20)
    return bounds[:-1], bounds[1:], 14 + np.arange(600) * 7 % 26, has_ts, np.where(has_ts, 7, 0)


def _tiny_bucket() -> Measurements:
    """400 measurements of 7 probes: both families, failures, a gap past the window."""
    from dataclasses import fields

    n = 400
    i = np.arange(n)
    six = i % 3 == 0
    cols = dict(probe=i % 7 + 1, time=1_767_225_600 + i * 97 + (i > 300) * 200_000,
                family=np.where(six, 6, 4), src_hi=np.where(six, 0x2001_0db8 << 32, 0),
                src_lo=0xC000_0200 + i % 7, dst_hi=np.where(six, 0x2001_0db8 << 32, 0),
                dst_lo=0xC100_0000 + i % 11, rtt=np.where(i % 5 == 0, -1.0, 1.0 + i * 0.37))
    return Measurements(**{f.name: np.asarray(cols.get(f.name, i % 200 + 1),  # a value field
                                              f.metadata["dtype"]) for f in fields(Measurements)})
