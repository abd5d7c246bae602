"""Where the time of `prep shards` goes: seconds per stage, for the manifest's ``timing``.

A ``StageClock`` adds up, around the calls the run makes anyway, wall seconds (``stage_s``)
and the process's CPU seconds (``process_time``, Arrow's threads included: ``stage_cpu_s``,
which other processes do not inflate). A pool task returns its clock's ``state()`` as plain
data; the driver adds them up over the workers (``add``). The stages, in data order:

    pass 1 (workers)   read      parquet pages decoded into Arrow batches
                       validate  address parsing and the row checks (prep.schema.validate)
                       route     bucket hash, sort by bucket, columns gathered
                       spill     Arrow IPC writes of each bucket's rows (uncompressed)
    pass 2 (workers)   load      a bucket's spill files read back and joined
                       split     train/test masks and each split's row numbers
                       plan      the split's rows taken in (probe, time) order, context cuts,
                                 costs (prep.pack.contexts)
                       pack      rows packed (prep.pack.packing)
                       encode    tokens, straight into the rows' records (prep.tokens.kernel)
                       assemble  the records' headers, segment ids and padding
                       write     ArrayRecord file and its sha256
    both               task      the rest of a task (its start, the result)
    driver             main_*    the driver's own work (listing, the units, the manifest)

A worker's stages add up to its tasks' seconds (``task``: what the others leave over).
Numba loads a worker's cached kernels on their first call, inside ``plan``, ``pack``,
``encode`` and ``assemble``. The driver's CPU seconds include its input-hashing thread.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

WORKER_STAGES = ("read", "validate", "route", "spill", "load", "split", "plan", "pack",
                 "encode", "assemble", "write", "task")
MAIN_STAGES = ("main_prepare", "main_units", "main_compile", "main_manifest")
STAGES = WORKER_STAGES + MAIN_STAGES


class StageClock:
    """Seconds per stage; ``with clock("read"): ...`` adds the block's wall seconds to
    ``seconds["read"]`` and its CPU seconds to ``cpu["read"]``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def now(self) -> tuple[float, float]:
        """(wall, CPU) seconds now: a start for ``since``."""
        return time.perf_counter(), time.process_time()

    def since(self, stage: str, start: tuple[float, float]) -> None:
        """Add the seconds from ``start`` (``now()``) to ``stage``."""
        t, c = self.now()
        self._add(stage, t - start[0], c - start[1])

    def _add(self, stage: str, wall: float, cpu: float) -> None:
        if stage not in STAGES:
            raise KeyError(f"unknown stage {stage!r}")
        self.seconds[stage] = self.seconds.get(stage, 0.0) + wall
        self.cpu[stage] = self.cpu.get(stage, 0.0) + cpu

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        if stage not in STAGES:
            raise KeyError(f"unknown stage {stage!r}")
        t, c = self.now()
        try:
            yield
        finally:
            t1, c1 = self.now()
            self._add(stage, t1 - t, c1 - c)

    @contextmanager
    def task(self) -> Iterator[None]:
        """A whole pool task: what its timed stages leave over goes to "task"."""
        (t, c), wall, cpu = self.now(), sum(self.seconds.values()), sum(self.cpu.values())
        try:
            yield
        finally:
            t1, c1 = self.now()
            self._add("task", t1 - t - (sum(self.seconds.values()) - wall),
                      c1 - c - (sum(self.cpu.values()) - cpu))

    def state(self) -> dict[str, dict[str, float]]:
        """What a pool task returns (plain data), for ``add``."""
        return {"stage_s": self.seconds, "stage_cpu_s": self.cpu}

    def add(self, state: dict[str, dict[str, float]]) -> None:
        for stage, wall in state.get("stage_s", {}).items():
            self._add(stage, wall, state.get("stage_cpu_s", {}).get(stage, 0.0))

    def report(self) -> dict[str, dict[str, float]]:
        """``stage_s`` and ``stage_cpu_s``: every stage, in STAGES order, rounded to µs
        (0.0 for the stages not met)."""
        return {name: {k: round(d.get(k, 0.0), 6) for k in STAGES}
                for name, d in (("stage_s", self.seconds), ("stage_cpu_s", self.cpu))}
