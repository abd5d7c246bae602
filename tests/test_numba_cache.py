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
    "prep.tokens.costs.piece_lengths_kernel",
    "prep.tokens.kernel.encode_kernel",
]


def test_each_kernel_compiles_once(tmp_path):
    """A cold compile of what `prep shards` runs (prep.shards.bucket.warm_kernels) makes one
    machine-code version of each kernel and helper, compiled in either of its processes: a
    literal argument at a call inside a kernel (a counter starting at 0, a flag True) would
    make a second one, seconds each."""
    import json
    import subprocess
    import sys

    code = ("import gc, json, sys\n"
            "from numba.core.registry import CPUDispatcher\n"
            "from prep.shards.bucket import warm_kernels\n"
            "warm_kernels(sys.argv[1], processes=2)\n"
            "print(json.dumps({d.py_func.__module__ + '.' + d.py_func.__qualname__:\n"
            "                  len(d.signatures) for d in gc.get_objects()\n"
            "                  if isinstance(d, CPUDispatcher) and d.signatures\n"
            "                  and d.py_func.__module__.startswith('prep.')}))\n")
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # cold: nothing cached
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, text=True,
                       capture_output=True, check=True, cwd=os.path.dirname(prep.__path__[0]))
    versions = json.loads(r.stdout.splitlines()[-1])
    # (those the second process compiled, this one loaded; the helpers they call come inside)
    assert set(versions.values()) == {1} and set(versions) <= set(KERNELS)
    # one cached version of each, wherever compiled: the types warm_kernels' second process
    # compiled the packer for are those process_bucket runs with (else a second is here)
    cached = [f.name.split("-")[0] for f in (tmp_path / "numba").rglob("*.nbc")]
    assert sorted(cached) == sorted(k.split(".", 2)[2] for k in KERNELS)

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
