import fcntl
import os
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("helpers")  # its asserts report like a test's own

# set by pytest-xdist in each of `make test`'s worker processes
WORKER = os.environ.get("PYTEST_XDIST_WORKER")


# The longest modules (seconds on 2 shared cores, 2026-11-30), longest first: `make test`'s
# workers take whole modules (--dist loadfile), each holding the next one while it runs (gw0
# the 1st and 3rd, gw1 the 2nd and 4th, then whichever is free), so the long ones end early
# and the short ones fill in at the end. (test_store, alphabetically late and not marked
# slow, once started last and ran alone for two minutes.)
FIRST = ["test_knows_destinations.py",  # 200-280 (three learning runs)
         "test_store.py",  # 150-200 (compiles of small's forward)
         "test_reads_context.py",  # 110-140
         "test_value_field.py",  # 25-170 (its own kernels: compiled where not cached)
         "test_train_multihost.py",  # 80-110 (no prep kernel)
         "test_object_storage.py",  # 45-50
         "test_evaluate.py",  # 30-120
         "test_objective.py",  # 45
         "test_faults.py",  # 25-85
         "test_copy.py"]  # 20-55


def pytest_collection_modifyitems(config, items):
    """FIRST's modules first, in that order, then those with a test marked slow, then the
    rest (each module's tests in their order)."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}

    def rank(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST) + (item.path not in slow)

    items.sort(key=rank)  # stable


def shared_tmp(tmp_path_factory) -> Path:
    """A folder that every worker of this run sees (the run's temporary folder; each worker
    gets a folder of its own below it), or this process's when it runs alone."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


@pytest.fixture(scope="session")
def numba_kernels(tmp_path_factory):
    """With workers: prep's kernels ready before the tests that need them, loaded from the
    cache `make test`'s `make setup` filled (prep.shards.kernels), or compiled by the first
    worker to get here while the others wait, as `prep shards` does on a cold cache. Else
    each worker and every `prep` they start would compile the packer at once (a minute each
    on 2 busy cores) and run past their time bounds. Alone, a test compiles (or loads) what
    it calls."""
    if not WORKER:
        return
    from prep.shards.kernels import warm_kernels

    with open(shared_tmp(tmp_path_factory) / "numba-kernels.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        warm_kernels(str(tmp_path_factory.mktemp("warm-kernels")))  # cached: loads them


@pytest.fixture(scope="module", autouse=True)
def _kernels_before_the_module(request):
    """Before a module's own fixtures, unless it is marked no_kernel_warmup."""
    if request.node.get_closest_marker("no_kernel_warmup") is None:
        request.getfixturevalue("numba_kernels")


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


@pytest.fixture
def no_cuda_probes(monkeypatch):
    """The cuDNN wrapper asks the CUDA runtime for cuDNN's version and the GPU's compute
    capability while tracing; there is none here, so answer as a Hopper GPU with cuDNN 9.6
    would."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda *a, **k: 90600)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a, **k: True)
    if hasattr(cudnn, "is_cuda_compute_capability_equal"):
        monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda *a, **k: False)


@pytest.fixture(scope="session")
def atlas_dir() -> Path:
    from helpers import ATLAS  # here: helpers imports prep, which the modules import later

    assert ATLAS.is_dir(), f"{ATLAS} is missing from the checkout"
    return ATLAS


@pytest.fixture(scope="session")
def builtin_shards(tmp_path_factory, numba_kernels):
    """The real pipeline (prep synth -> prep shards) on a small built-in-style dataset."""
    from prep.ingest.synth import SynthConfig, synth
    from prep.shards.bucket import ShardsConfig
    from prep.shards.local_runner import run_shards

    d = tmp_path_factory.mktemp("builtin")
    synth(SynthConfig(out=d / "raw", rows=12_000, probes=100, days=1, seed=0))
    run_shards([str(d / "raw")], str(d / "shards"), ShardsConfig(seed=0, row_len=128),
               workers=1, progress=False)
    return d / "shards"


# --- the run-safety tests' dataset (tests/test_run_*.py) ---------------------------------

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A tiny dataset (tests/helpers.py's ``write_dataset``), one per test module; modules
    with a ``shards`` fixture of their own use theirs."""
    from helpers import write_dataset

    return write_dataset(tmp_path_factory.mktemp("safety") / "shards")


@pytest.fixture
def copy(shards, tmp_path):
    """A test's own copy of ``shards``, to damage."""
    import shutil

    return Path(shutil.copytree(shards, tmp_path / "data"))
