"""The output folder of `prep import-atlas` and `prep synth` (prep/jobs/parquet_out.py):

1. two runs into one --out: the second is refused at once naming the first's pid, and the
   first publishes every row it counts;
2. a folder holding other files is refused without --overwrite (an unrelated parquet file
   survives), anything but parquet files always, a dataset always (it still verifies);
7. a run killed before or during its publish leaves nothing that looks finished, and the
   next run cleans up (and finishes a publish that had begun);
9. a full disk or a read-only folder is one line, exit 2, and leaves no folder behind.
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from helpers import ATLAS, one_line_error, read_only, wait_for

from prep.cli import main
from prep.base.lock import lock_folder, release
from prep.tools.verify import verify_dir

API = ATLAS / "api"
N_FILES = 36  # the API downloads
ROWS = 3_092  # the rows they make (3,092 results, none rejected)
SYNTH = ["--rows", "3000", "--probes", "30", "--days", "1"]


def atlas(out: Path, *extra: str):
    return CliRunner().invoke(main, ["import-atlas", str(API), "--out", str(out),
                                     "--workers", "1", *extra])


def synth(out: Path, *extra: str):
    return CliRunner().invoke(main, ["synth", "--out", str(out), *SYNTH, *extra])


def rows_in(out: Path) -> int:
    return sum(pq.read_metadata(p).num_rows for p in out.glob("*.parquet"))


def in_process(args: list[str], patch: str) -> subprocess.Popen:
    """`prep ARGS` in a process of its own, after ``patch``."""
    code = "import os, signal, sys, time\n" + patch + "\nfrom prep.cli import main\nmain(sys.argv[1:])"
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


# --- 1. one writer at a time --------------------------------------------------------------

def test_a_second_import_is_refused_and_the_first_publishes_every_row(tmp_path):
    out = tmp_path / "out"
    # the first run waits 2 s before it publishes: its staged files are complete by then
    slow = ("import prep.jobs.parquet_out as p\nreal = p.ParquetOut.publish\n"
            "def publish(self, names):\n    time.sleep(2); real(self, names)\n"
            "p.ParquetOut.publish = publish")
    first = in_process(["import-atlas", str(API), "--out", str(out), "--workers", "2", "--json"],
                       slow)
    wait_for(lambda: len(list(out.glob(".tmp-import-*/*.parquet"))) == N_FILES, 60,
             "the first run's staged files")
    t = time.monotonic()
    r = atlas(out)
    assert r.exit_code == 2 and time.monotonic() - t < 5
    one_line_error(r, str(out), "another `prep import-atlas`", f"pid {first.pid}")
    stdout, stderr = first.communicate(timeout=60)
    assert first.returncode == 0, stderr
    assert json.loads(stdout)["rows_written"] == ROWS == rows_in(out)
    assert len(list(out.glob("*.parquet"))) == N_FILES
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".parquet")) == []


@pytest.mark.parametrize("command", ["import-atlas", "synth"])
def test_a_locked_folder_is_refused_at_once(tmp_path, command):
    out = tmp_path / "out"
    out.mkdir()
    fd = lock_folder(out, "test")  # as a live run holds it
    try:
        r = atlas(out) if command == "import-atlas" else synth(out)
    finally:
        release(out, fd, made=False)
    assert r.exit_code == 2
    one_line_error(r, str(out), f"another `prep {command}`", f"pid {os.getpid()}")
    assert list(out.iterdir()) == []


# --- 2. --overwrite, and never into a dataset ---------------------------------------------

def test_an_unrelated_parquet_file_is_replaced_only_with_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    theirs = pa.table({"x": [1, 2, 3]})
    pq.write_table(theirs, out / "ping.parquet")
    (out / "2026-01-01T00.parquet").write_bytes((out / "ping.parquet").read_bytes())
    for run in (atlas, synth):
        r = run(out)
        assert r.exit_code == 2, r.output
        one_line_error(r, str(out), "not empty (holds 2 parquet files: 2026-01-01T00.parquet",
                       "--overwrite")
        assert pq.read_table(out / "ping.parquet").equals(theirs)
    r = atlas(out, "--overwrite")
    assert r.exit_code == 0, r.output
    # the sample's ping.json makes a ping.parquet of its own: theirs is replaced, not mixed in
    assert "rtt" in pq.read_schema(out / "ping.parquet").names
    assert not (out / "2026-01-01T00.parquet").exists() and rows_in(out) == ROWS
    r = synth(out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == [
        f"2026-01-01T{h:02d}.parquet" for h in range(24)]
    assert rows_in(out) == 3000


def test_other_files_and_datasets_are_refused_even_with_overwrite(tmp_path, builtin_shards):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for run in (atlas, synth):
        r = run(out, "--overwrite")
        assert r.exit_code == 2, r.output
        one_line_error(r, str(out), "holds notes.txt", "did not write")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]

    dataset = tmp_path / "shards"
    shutil.copytree(builtin_shards, dataset)
    before = {p: p.read_bytes() for p in dataset.rglob("*") if p.is_file()}
    for run, cmd in ((atlas, "import-atlas"), (synth, "synth")):
        r = run(dataset, "--overwrite")
        assert r.exit_code == 2, r.output
        one_line_error(r, str(dataset), "is a shards folder", f"prep {cmd} writes parquet",
                       "never into a dataset")
    assert {p: p.read_bytes() for p in dataset.rglob("*") if p.is_file()} == before
    assert verify_dir(dataset) == []


# --- 7. killed: nothing that looks finished; the next run cleans up -----------------------

def test_killed_before_publishing_leaves_nothing_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "out"
    die = ("import prep.jobs.parquet_out as p\n"
           "p.ParquetOut.publish = lambda self, names: os.kill(os.getpid(), signal.SIGKILL)")
    proc = in_process(["import-atlas", str(API), "--out", str(out), "--workers", "2"], die)
    proc.communicate(timeout=60)
    assert proc.returncode == -9
    assert not list(out.glob("*.parquet"))  # nothing a reader would take as output
    assert len(list(out.glob(".tmp-import-*/*.parquet"))) == N_FILES
    r = atlas(out)  # no --overwrite needed: nothing was published
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".parquet")) == []
    assert rows_in(out) == ROWS


def test_killed_during_the_publish_is_finished_by_the_next_run(tmp_path):
    out = tmp_path / "out"
    assert synth(out).exit_code == 0
    old = sorted(p.name for p in out.iterdir())
    # the new run (other --days, so other files) dies after its third rename into out
    die = ("import prep.jobs.parquet_out as p\nreal, n = os.replace, [0]\n"
           "def replace(a, b):\n"
           "    if str(b).endswith('.parquet') and '.tmp-' not in str(b):\n"
           "        n[0] += 1\n"
           "        if n[0] == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
           "    real(a, b)\n"
           "p.os.replace = replace")
    proc = in_process(["synth", "--out", str(out), "--rows", "3000", "--probes", "30",
                       "--days", "2", "--overwrite"], die)
    proc.communicate(timeout=60)
    assert proc.returncode == -9
    # until then no reader takes the mix of old and new files (#36 item 20)
    stage = next(out.glob(".tmp-*")).name
    r = CliRunner().invoke(main, ["shards", str(out), "--out", str(tmp_path / "ds")])
    assert r.exit_code == 2 and not (tmp_path / "ds").exists()
    assert r.stderr == (f"error: {out}: holds an unfinished publish ({stage}/.publish): the run "
                        "writing it stopped while replacing its files, so they are part old, "
                        f"part new; run it again (the same command with --out {out} "
                        "--overwrite) to finish, then read it\n")
    # The next run, even without --overwrite, first finishes the publish that had begun.
    r = synth(out)
    assert r.exit_code == 2
    one_line_error(r, "--overwrite")
    new = sorted(p.name for p in out.iterdir())
    assert new == [f"2026-01-0{d}T{h:02d}.parquet" for d in (1, 2) for h in range(24)] != old
    assert rows_in(out) == 3000


# --- 9. the file system says no -----------------------------------------------------------

def test_full_disk_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    for run, where in ((atlas, (pq.ParquetWriter, "write_table")), (synth, (pq, "write_table"))):
        out = tmp_path / "new"
        with monkeypatch.context() as m:
            m.setattr(*where, full)
            r = run(out)
        assert r.exit_code == 2, r.output
        one_line_error(r, str(out), "no space left on the device", "free some space",
                       "nothing of this run was published")
        assert not out.exists()


def test_read_only_folder_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    for run in (atlas, synth):
        with read_only(monkeypatch, out):
            r = run(out)
        assert r.exit_code == 2, r.output
        one_line_error(r, str(out), "read-only file system", "writable")
        assert list(out.iterdir()) == []
