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
