"""What the repository holds: no generated data, no large files (DESIGN.md: generated data is
git-ignored; large files are never committed). Session 25 committed a Seattle shard folder
(150 MB) and a tool's wheel (10 MB) that .gitignore did not cover; these tests would have
failed on that commit."""

import shutil
import subprocess

import pytest

from helpers import REPO

MAX_FILE_BYTES = 1 << 20  # the largest tracked file today is a 262 KB figure


def _git(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: nothing is tracked to check")
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          timeout=60)


def test_no_tracked_file_is_large():
    names = _git("ls-files", "-z").stdout.split("\0")
    big = sorted((p.stat().st_size, n) for n in names if n
                 for p in [REPO / n] if p.is_file() and p.stat().st_size > MAX_FILE_BYTES)
    assert not big, ("tracked files over 1 MiB (generated data or a tool belongs in "
                     f".gitignore): {[(n, s) for s, n in big]}")


@pytest.mark.parametrize("path", [
    "shards/manifest.json", "shards-256/manifest.json", "shards-seattle/train/x.array_record",
    "seattle-shards/manifest.json", "data/seattle/matrix.parquet", "data/raw/part-0.parquet",
    "runs/demo/config.json", ".venv/bin/python", ".whl/polars-2.1.0-py3-none-any.whl",
    "ruff-0.17.6-py3-none-manylinux_2_17_x86_64.whl", "figure.png",
])
def test_what_the_readme_makes_is_ignored(path):
    # the folders README's commands write into the checkout, and tools fetched beside it
    r = _git("check-ignore", "--no-index", "-q", path)
    assert r.returncode == 0, f"{path} would be committed: add it to .gitignore"


def test_a_source_file_is_not_ignored():
    # the check above can fail: a tracked kind of file is not ignored
    r = _git("check-ignore", "--no-index", "-q", "prep/cli.py")
    assert r.returncode == 1, r.stdout + r.stderr
