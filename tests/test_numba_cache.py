"""The Numba cache folder is named after the sources of prep/: an edit anywhere there (a
cost in prep/tokens/costs.py, a helper in prep/pack/fill.py) compiles the kernels afresh
instead of running machine code cached for the old sources."""

import os
import time

import prep


def test_cache_folder_follows_every_source(tmp_path):
    (tmp_path / "a.py").write_text("X = 1\n")
    (tmp_path / "b.py").write_text("Y = 2\n")
    first = prep._numba_cache_dir(tmp_path)
    assert first == prep._numba_cache_dir(tmp_path)
    (tmp_path / "b.py").write_text("Y = 3\n")  # not the file that defines the kernel
    second = prep._numba_cache_dir(tmp_path)
    assert second != first and os.path.basename(second).startswith("numba-")


def test_cache_folder_follows_the_subpackages(tmp_path):
    """The kernels live in prep/tokens and prep/pack and import prep/schema: an edit in any
    subpackage must name a new folder, and so must moving a module between them."""
    (tmp_path / "tokens").mkdir()
    (tmp_path / "pack").mkdir()
    (tmp_path / "tokens" / "costs.py").write_text("X = 1\n")
    first = prep._numba_cache_dir(tmp_path)
    (tmp_path / "tokens" / "costs.py").write_text("X = 2\n")
    second = prep._numba_cache_dir(tmp_path)
    (tmp_path / "tokens" / "costs.py").rename(tmp_path / "pack" / "costs.py")
    third = prep._numba_cache_dir(tmp_path)
    assert len({first, second, third}) == 3


def test_old_cache_folders_are_pruned_after_a_day(tmp_path):
    (tmp_path / "a.py").write_text("X = 1\n")
    old, recent = tmp_path / "__pycache__" / "numba-old", tmp_path / "__pycache__" / "numba-new"
    for d in (old, recent):
        d.mkdir(parents=True)
    os.utime(old, (time.time() - 2 * 86_400,) * 2)
    current = prep._numba_cache_dir(tmp_path)
    assert not old.exists() and recent.exists()
    assert current.startswith(str(tmp_path / "__pycache__" / "numba-"))


def test_this_process_uses_the_folder_of_these_sources():
    import numba
    import pytest

    if os.environ.get("NUMBA_CACHE_DIR") != prep._numba_cache_dir():
        pytest.skip("NUMBA_CACHE_DIR was set by the environment")
    assert numba.config.CACHE_DIR == prep._numba_cache_dir()


# every kernel warm_kernels compiles: those Python calls and the helpers they call
# (prep.base.jit; an inlined helper is typed inside its callers, never compiled alone)
KERNELS = [
    "prep.pack.closing.close_gap", "prep.pack.closing.demand", "prep.pack.closing.fresh",
    "prep.pack.closing.place", "prep.pack.closing.refresh_quota",
    "prep.pack.closing.rest_table", "prep.pack.closing.step", "prep.pack.closing.take_single",
    "prep.pack.fill._close_row", "prep.pack.fill._fill_rows", "prep.pack.fill._find_window",
    "prep.pack.fill._free_rows", "prep.pack.fill._lay_kept", "prep.pack.fill._long_run",
    "prep.pack.fill._open_donor",
    "prep.pack.packing._best_fit", "prep.pack.packing._cumulative",
    "prep.pack.packing._lengths", "prep.pack.packing._longest_first",
    "prep.pack.packing._plen", "prep.pack.packing._renumber", "prep.pack.packing._tree_ge",
    "prep.pack.planner_kernels._radix_pass_all",
    "prep.pack.planner_kernels.argsort_probe_time", "prep.pack.planner_kernels.body_price",
    "prep.pack.planner_kernels.cut_contexts", "prep.pack.planner_kernels.history_index",
    "prep.pack.repack._by_row", "prep.pack.repack._pool", "prep.pack.repack._subset",
    "prep.pack.repack._take", "prep.pack.repack.repack",
    "prep.pack.supply.cheapest_fills", "prep.pack.supply.slack_target",
    "prep.shards.bucket._place_rows",
    "prep.tokens.costs.piece_lengths_kernel",
    "prep.tokens.kernel.encode_kernel",
]


def test_each_kernel_compiles_once_and_then_loads(tmp_path):
    """A cold compile of what `prep shards` runs (prep.shards.kernels.warm_kernels, which
    `make setup` runs through `prep kernels`) makes one machine-code version of each kernel
    and helper, compiled in either of its processes: a literal argument at a call inside a
    kernel (a counter starting at 0, a flag True) would make a second one, seconds each.
    After it, a new process (`prep kernels` again, as `prep shards` and each test process
    run it) loads them all: Numba's counters show no compile, and no cache file is written."""
    import json
    import subprocess
    import sys

    dump = ("print(json.dumps({d.py_func.__module__ + '.' + d.py_func.__qualname__:\n"
            "                  [len(d.signatures), sum(d.stats.cache_hits.values()),\n"
            "                   sum(d.stats.cache_misses.values())] for d in gc.get_objects()\n"
            "                  if isinstance(d, CPUDispatcher) and d.signatures\n"
            "                  and d.py_func.__module__.startswith('prep.')}))\n")
    code = ("import gc, json, sys\n"
            "from numba.core.registry import CPUDispatcher\n"
            "from prep.shards.kernels import warm_kernels\n"
            "ready = warm_kernels(sys.argv[1], processes=2)\n"
            "print(json.dumps([ready.compiled, ready.loaded]))\n" + dump)
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # cold: nothing cached
    root = os.path.dirname(prep.__path__[0])
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, text=True,
                       capture_output=True, check=True, cwd=root)
    *_, said, versions = r.stdout.splitlines()
    versions = json.loads(versions)
    # (those the second process compiled, this one loaded; the helpers they call come inside)
    assert {v[0] for v in versions.values()} == {1} and set(versions) <= set(KERNELS)
    # what it says it did: every one compiled, in one process or the other
    assert json.loads(said) == [sorted(KERNELS), []]
    # one cached version of each, wherever compiled: the types warm_kernels' second process
    # compiled the packer for are those process_bucket runs with (else a second is here)
    files = {f: f.stat().st_mtime_ns for f in (tmp_path / "numba").rglob("*") if f.is_file()}
    cached = [f.name.split("-")[0] for f in files if f.suffix == ".nbc"]
    assert sorted(cached) == sorted(k.split(".", 2)[2] for k in KERNELS)

    code = ("import gc, json\n"
            "from numba.core.registry import CPUDispatcher\n"
            "from prep.cli import main\n"
            "main(['kernels'], standalone_mode=False)\n" + dump)
    r = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                       capture_output=True, check=True, cwd=root)
    versions = json.loads(r.stdout.splitlines()[-1])
    assert versions and all(hits == 1 and misses == 0 for _, hits, misses in versions.values())
    assert r.stderr.startswith("prep kernels: kernels loaded from Numba's cache in ")
    assert r.stderr.endswith(f" s ({len(versions)}; none compiled)\n")
    assert {f: f.stat().st_mtime_ns for f in files} == files
    assert set((tmp_path / "numba").rglob("*")) >= set(files)


def test_a_stale_or_foreign_cache_compiles_afresh(tmp_path, monkeypatch):
    """Numba's cache is missed, never used wrong, and the counters prep.base.jit.cache_use
    reads (what `prep kernels` and `prep shards` say) tell a load from a compile: an edit of
    the kernel's file, or an index another Numba wrote, compiles afresh. The same bytes with
    a new time (a fresh clone, a checkout) load from Numba 0.68, which stamps a file with a
    hash of its bytes; before, with its time and size, they compile."""
    import importlib
    import sys

    import numba

    from prep.base.jit import cache_use

    src = tmp_path / "tiny_kernel.py"
    src.write_text("from prep.base.jit import kernel\n\n\n@kernel\ndef add_one(x):\n"
                   "    return x + 1\n")
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "numba"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tiny_kernel", raising=False)

    def first_call() -> tuple[int, int]:
        """(loaded, compiled) by a new dispatcher of add_one, as in a new process."""
        sys.modules.pop("tiny_kernel", None)
        assert importlib.import_module("tiny_kernel").add_one(1) == 2
        return cache_use()["tiny_kernel.add_one"]

    assert first_call() == (0, 1)
    assert first_call() == (1, 0)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    content_stamped = tuple(map(int, numba.__version__.split(".")[:2])) >= (0, 68)
    assert first_call() == ((1, 0) if content_stamped else (0, 1))
    src.write_text(src.read_text() + "# an edit outside the kernel\n")
    assert first_call() == (0, 1)
    assert first_call() == (1, 0)
    monkeypatch.setattr(numba, "__version__", "0.0.0")  # the index was another Numba's
    assert first_call() == (0, 1)
    sys.modules.pop("tiny_kernel", None)


def test_a_helper_called_from_python_runs_as_python():
    """A helper has no CPython wrapper (prep.base.jit): called from Python, as the kernels'
    plain-Python twins call it, it runs its Python source instead of crashing the process,
    and compiles nothing."""
    import numpy as np

    from prep.pack.closing import N_TABLE, SCARCE, WINDOW_MAX, scarce_at

    cum, table = np.array([0, 3, 5, 205]), np.zeros((N_TABLE, WINDOW_MAX + 1), np.int64)
    table[SCARCE, 2] = 1
    assert [scarce_at(cum, table, i) for i in range(3)] == [False, True, False]
    assert scarce_at.signatures == []


def test_idle_cores_is_a_share_of_the_cores():
    """What `prep kernels` and a cold `prep shards` read to split the compile over 2
    processes (prep.shards.kernels.warm_kernels): idle cores now, between none and all."""
    from prep.shards.kernels import idle_cores

    assert 0 <= idle_cores(0.05) <= (os.cpu_count() or 1)


_NO_BLAS_SCRIPT = '''
import multiprocessing, sys

def child(answer):
    from prep.base.jit import no_blas_in_worker
    from prep.pack.packing import context_lengths
    if answer:
        no_blas_in_worker()
    lens = context_lengths([0, 1], [1, 3], [12, 14, 38], [False] * 3, [0] * 3)
    return [int(x) for x in lens], "scipy.linalg" in sys.modules

if __name__ == "__main__":
    import numba.np.linalg
    from prep.base.jit import no_blas_in_worker
    probe = numba.np.linalg.ensure_blas
    no_blas_in_worker()
    print(numba.np.linalg.ensure_blas is probe)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(pool.map(child, [True])[0])
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(pool.map(child, [False])[0])
'''


def test_a_pool_worker_runs_kernels_without_numbas_blas_probe(tmp_path):
    """prep.base.jit.no_blas_in_worker: in a pool worker, the first kernel runs without
    Numba's BLAS probe importing scipy.linalg (which it does in a worker that does not
    answer it); in the main process it changes nothing."""
    import subprocess
    import sys

    script = tmp_path / "no_blas.py"
    script.write_text(_NO_BLAS_SCRIPT)
    root = os.path.dirname(prep.__path__[0])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         check=True, env=os.environ | {"PYTHONPATH": root}).stdout
    assert out.splitlines() == ["True", "([12, 52], False)", "([12, 52], True)"]


def test_a_process_that_says_it_is_a_worker_runs_kernels_without_numbas_blas_probe(tmp_path):
    """no_blas_in_worker(True): a process started on its own that says it is a worker (a
    Beam SDK worker process: prep.shards.beam_worker.BucketFn.setup) is one too."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from prep.base.jit import no_blas_in_worker\n"
            "from prep.pack.packing import context_lengths\n"
            "no_blas_in_worker(sys.argv[1] == 'worker')\n"
            "lens = context_lengths([0, 1], [1, 3], [12, 14, 38], [False] * 3, [0] * 3)\n"
            "print([int(x) for x in lens], 'scipy.linalg' in sys.modules)\n")
    root = os.path.dirname(prep.__path__[0])
    said = [subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True,
                           check=True, env=os.environ | {"PYTHONPATH": root}).stdout.strip()
            for arg in ("worker", "driver")]
    assert said == ["[12, 52] False", "[12, 52] True"]
