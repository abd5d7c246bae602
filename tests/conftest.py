import fcntl
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the real RIPE Atlas sample (38 files, 7,725 results; its README says where each came
# from), shipped with the tests so that a clone without ../shared runs the same suite
ATLAS = REPO / "tests" / "fixtures" / "ripe-atlas"
# set by pytest-xdist in each of `make test`'s worker processes
WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def pytest_collection_modifyitems(config, items):
    """Modules that hold a test marked slow run first (in their order; the rest after, in
    theirs). `make test` hands whole modules to its workers (--dist loadfile): the long ones
    start early and the short ones fill in at the end, instead of one worker finishing
    alone with a minute-long module."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable


def shared_tmp(tmp_path_factory) -> Path:
    """A folder that every worker of this run sees (the run's temporary folder; each worker
    gets a folder of its own below it), or this process's when it runs alone."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


@pytest.fixture(scope="session", autouse=True)
def numba_kernels(tmp_path_factory):
    """With workers: prep's kernels compiled before any test, by one worker while the others
    wait, as `prep shards` does on a cold cache (prep.shards.bucket.warm_kernels). On a
    fresh checkout each worker's first tests and every `prep` they start would otherwise
    compile the packer at once (a minute each on 2 cores) and run past their time bounds.
    Alone, a test compiles what it calls, as before."""
    if not WORKER:
        return
    from prep.shards.bucket import warm_kernels

    with open(shared_tmp(tmp_path_factory) / "numba-kernels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        warm_kernels(str(tmp_path_factory.mktemp("warm-kernels")))  # cached: loads them


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory) -> Path:
    """A persistent compilation cache for the whole run (every worker and the `train`
    processes the tests start): a step compiled once, in any of them, is loaded by the rest."""
    d = shared_tmp(tmp_path_factory) / "xla-cache"
    d.mkdir(exist_ok=True)
    return d


@pytest.fixture(scope="session", autouse=True)
def persistent_xla_cache(xla_cache):
    """Every compile of the run goes to xla_cache: the tests' own (jax, if imported already,
    is told; one imported later reads the environment) and those of the processes they start."""
    os.environ.update(JAX_COMPILATION_CACHE_DIR=str(xla_cache),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    if "jax" in sys.modules:
        import jax
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", str(xla_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        compilation_cache.reset_cache()  # read the settings again at the next compile


@pytest.fixture(scope="session")
def atlas_dir() -> Path:
    assert ATLAS.is_dir(), f"{ATLAS} is missing from the checkout"
    return ATLAS


@pytest.fixture(scope="session")
def builtin_shards(tmp_path_factory):
    """The real pipeline (prep synth -> prep shards) on a small built-in-style dataset."""
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    d = tmp_path_factory.mktemp("builtin")
    synth(SynthConfig(out=d / "raw", rows=12_000, probes=100, days=1, seed=0))
    run_shards([str(d / "raw")], str(d / "shards"), ShardsConfig(seed=0, row_len=128),
               workers=1, progress=False)
    return d / "shards"
