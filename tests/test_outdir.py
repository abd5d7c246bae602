"""The output folder's lifecycle (prep/jobs/outdir.py): one test per fault of the fault-injection
trial, each asserting the exit code, the one-line message and what is on disk after.

1. a second writer is refused at once (the lock), the first completes;
2. a finished dataset is replaced only with --overwrite, and survives a failed re-run;
3. nothing is deleted that `prep shards` did not write;
13. no shard of an unfinished run is ever in train/ or test/, killed between any two
    renames of the swap included;
9. a worker killed (OOM killer) stops the run with one line;
10. SIGTERM/SIGINT stop cleanly (exit 143/130), a SIGKILLed driver takes its workers along;
11. disk full, a read-only or a dangling-symlink --out are one line, exit 2.
"""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import (
    PREP,
    REPO,
    children,
    dataset_bytes,
    one_line_error,
    read_only,
    running,
    wait_for,
)

from prep.cli import main
from prep.ingest.synth import SynthConfig, synth
from prep.schema import manifest as mf
from prep.shards.bucket import ShardsConfig
from prep.shards.local_runner import run_shards
from prep.tools.verify import verify_dir

CFG = ShardsConfig(n_buckets=8)
# `prep shards` with each bucket lingering after its shards are written, so that a kill
# lands mid-run (SLOW_S seconds; the same patch the fault trial uses).
SLOW = ("import os, sys, time, prep.shards.local_runner as s; from prep.cli import main\n"
        "real = s.process_bucket\n"
        "def slow(*a, **k):\n    r = real(*a, **k); time.sleep(float(os.environ['SLOW_S'])); return r\n"
        "s.process_bucket = slow; main(sys.argv[1:])")


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("outdir") / "raw"
    synth(SynthConfig(out=out, rows=20_000, probes=100, days=1, seed=3))
    return out


# --- helpers ----------------------------------------------------------------------------

def shards_cmd(raw: Path, out: Path, *args: str) -> list[str]:
    return [str(PREP), "shards", str(raw), "--out", str(out), "--quiet", *args]


def start_slow(raw: Path, out: Path, *args: str, slow_s: float = 0.3) -> subprocess.Popen:
    cmd = [sys.executable, "-c", SLOW, "shards", str(raw), "--out", str(out), "--quiet", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"SLOW_S": str(slow_s)}, start_new_session=True)


def staged_shards(out: Path) -> list[Path]:
    return list(out.glob(".tmp-*/train/*.array_record"))


def invoke(*args: str):
    return CliRunner().invoke(main, ["shards", *args, "--quiet"])


# --- 1. two writers -----------------------------------------------------------------

def test_second_writer_is_refused_at_once_and_the_first_completes(raw, tmp_path):
    out = tmp_path / "out"
    # 1.5 s a bucket, 4 buckets a worker: the first run is still staging when the second,
    # whose start (imports, a cold Numba cache) took over 1 s in a fresh clone, is refused
    first = start_slow(raw, out, "--seed", "1", "--buckets", "8", "--workers", "2", slow_s=1.5)
    wait_for(lambda: staged_shards(out), what="the first run's shards")
    t = time.monotonic()
    second = subprocess.run(shards_cmd(raw, out, "--seed", "2", "--workers", "2"),
                            capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t < 20  # at once: no waiting for the first run
    assert second.returncode == 2
    one_line_error(second, str(out), f"pid {first.pid}", "another `prep shards`")
    assert staged_shards(out)  # the first run's staging folder is untouched
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    m = mf.load_manifest(out)
    assert m["seed"] == 1 and m["counts"]["rows_in"] == 20_000 and verify_dir(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test", "train"]


def test_dead_runs_leftovers_are_removed(raw, tmp_path):
    from prep.base.lock import LOCK_NAME
    from prep.jobs.owned import make_owned_dir

    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone
    token = "0123456789ab"
    stage = out / f".tmp-shards-{dead.pid}-{token}"
    make_owned_dir(stage, "staging", dead.pid, token)
    (stage / "train").mkdir()
    (stage / "train" / "shard-b00000-e0.array_record").write_bytes(b"half")
    old = out / f".old-{dead.pid}-{token}"
    make_owned_dir(old, "old", dead.pid, token)
    (out / ".tmp-shards-1-ffffffffffff").mkdir()  # killed between mkdir and its marker
    (out / LOCK_NAME).write_text(f"{dead.pid}\n")  # a SIGKILLed run's lock file
    r = invoke(str(raw), "--out", str(out), "--workers", "1")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test", "train"]
    assert verify_dir(out) == []


# --- 2. replace only when asked, and only once the new dataset is complete --------------

def test_finished_dataset_needs_overwrite_and_survives_a_failed_rerun(raw, tmp_path):
    out = tmp_path / "out"
    run_shards([str(raw)], str(out), CFG, progress=False)
    old = dataset_bytes(out)
    r = invoke(str(raw), "--out", str(out), "--seed", "5")
    assert r.exit_code == 2
    one_line_error(r, str(out), "--overwrite", "finished dataset")
    assert dataset_bytes(out) == old

    # A re-run with --overwrite that meets damaged input half-way: the old dataset stays.
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in sorted(raw.glob("*.parquet"))[:3]:
        (bad / f.name).write_bytes(f.read_bytes())
    good = (bad / f.name).read_bytes()
    (bad / "zz.parquet").write_bytes(good[:4] + bytes(b ^ 0x55 for b in good[4:400]) + good[400:])
    r = invoke(str(bad), "--out", str(out), "--overwrite", "--workers", "2", "--buckets", "8")
    assert r.exit_code == 2
    one_line_error(r, "zz.parquet")
    assert dataset_bytes(out) == old and verify_dir(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test", "train"]

    r = invoke(str(raw), "--out", str(out), "--overwrite", "--seed", "5", "--buckets", "8",
               "--workers", "2")
    assert r.exit_code == 0, r.output
    assert mf.load_manifest(out)["seed"] == 5 and verify_dir(out) == []
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test", "train"]
    # `make shards` replaces the dataset it made before.
    recipe = (REPO / "Makefile").read_text().split("\nshards:")[1].split("\n\n")[0]
    assert "prep shards" in recipe and "--overwrite" in recipe


# --- 13. no shard of an unfinished run in train/ or test/ ------------------------------

def _killed_at(raw_args: list[str], patch: str) -> subprocess.CompletedProcess:
    """`prep shards` in a process of its own, after ``patch`` (which, here, SIGKILLs it
    at a chosen point, or fakes a full disk)."""
    code = ("import os, signal, sys\n" + patch +
            "\nfrom prep.cli import main\nmain(sys.argv[1:])")
    return subprocess.run([sys.executable, "-c", code, "shards", *raw_args],
                          capture_output=True, text=True, timeout=120)


def test_killed_before_the_manifest_leaves_no_shard_in_train_or_test(raw, tmp_path):
    out = tmp_path / "out"
    patch = ("import prep.schema.manifest as mf\n"
             "def die(*a, **k):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
             "mf.write_manifest = die")
    r = _killed_at([str(raw), "--out", str(out), "--quiet", "--workers", "2", "--buckets", "8"],
                   patch)
    assert r.returncode == -signal.SIGKILL
    assert not (out / mf.MANIFEST_NAME).exists()
    assert not list(out.glob("train/*")) and not list(out.glob("test/*"))
    assert list(out.glob(".tmp-*/train/*.array_record"))  # all were staged, none published
    r = invoke(str(raw), "--out", str(out), "--workers", "1", "--buckets", "8")
    assert r.exit_code == 0, r.output
    assert verify_dir(out) == [] and not list(out.glob(".tmp-*"))


@pytest.mark.parametrize("renames", range(6))
def test_killed_between_any_two_renames_of_the_swap(raw, tmp_path, renames):
    """Over an old dataset the swap is 6 renames: manifest out, train out, train in, test
    out, test in, manifest in. Killed after any of them, the folder is the old dataset or
    no dataset, and the next run finishes the swap: the new dataset, never a mix."""
    out = tmp_path / "out"
    run_shards([str(raw)], str(out), CFG, progress=False)
    old = dataset_bytes(out)
    patch = ("import prep.jobs.outdir as o\nreal, n = o._rename, [0]\n"
             "def rename(a, b):\n"
             f"    if n[0] == {renames}: os.kill(os.getpid(), signal.SIGKILL)\n"
             "    n[0] += 1; real(a, b)\n"
             "o._rename = rename")
    args = [str(raw), "--out", str(out), "--quiet", "--workers", "1", "--buckets", "8",
            "--seed", "9", "--overwrite"]
    r = _killed_at(args, patch)
    assert r.returncode == -signal.SIGKILL, r.stderr
    if renames == 0:
        assert dataset_bytes(out) == old  # killed before the swap began: the old dataset
    else:
        assert not (out / mf.MANIFEST_NAME).exists()  # no dataset for any reader
        with pytest.raises(Exception, match="no manifest.json"):
            verify_dir(out)
    # The next run, even without --overwrite, first finishes a swap that had begun.
    r = invoke(str(raw), "--out", str(out), "--workers", "1")
    assert r.exit_code == 2
    one_line_error(r, "--overwrite")
    assert verify_dir(out) == []
    assert mf.load_manifest(out)["seed"] == (0 if renames == 0 else 9)
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test", "train"]


# --- 3. delete only what we wrote -------------------------------------------------------

def test_deletes_nothing_it_did_not_write(raw, tmp_path):
    out = tmp_path / "out"
    run_shards([str(raw)], str(out), CFG, progress=False)
    old = dataset_bytes(out)
    for name in (".tmp-mywork", ".tmp-12345", ".tmp-shards-1-0123456789ab"):
        (out / name).mkdir()
        (out / name / "thesis.tex").write_text("keep me")
        for extra in ([], ["--overwrite"]):
            r = invoke(str(raw), "--out", str(out), *extra)
            assert r.exit_code == 2
            one_line_error(r, str(out), name, "did not write")
            assert (out / name / "thesis.tex").read_text() == "keep me"
            assert dataset_bytes(out) == old
        (out / name / "thesis.tex").unlink()
        (out / name).rmdir()

    # train/ a symlink to another dataset's train/: refused, that dataset untouched.
    other = tmp_path / "other"
    run_shards([str(raw)], str(other), ShardsConfig(n_buckets=4, seed=3), progress=False)
    theirs = dataset_bytes(other)
    link = tmp_path / "linked"
    link.mkdir()
    (link / "train").symlink_to(other / "train")
    for extra in ([], ["--overwrite"]):
        r = invoke(str(raw), "--out", str(link), *extra)
        assert r.exit_code == 2
        one_line_error(r, str(link), "train/ is a symlink")
        assert dataset_bytes(other) == theirs and verify_dir(other) == []
    (out / "train" / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        r = invoke(str(raw), "--out", str(out), *extra)
        assert r.exit_code == 2
        one_line_error(r, "notes.txt")
        assert (out / "train" / "notes.txt").read_text() == "mine"


# --- 9. a worker dies -------------------------------------------------------------------

def test_killed_worker_stops_the_run_with_one_line(raw, tmp_path):
    out = tmp_path / "out"
    proc = start_slow(raw, out, "--workers", "2", "--buckets", "8", slow_s=0.5)
    wait_for(lambda: staged_shards(out), what="the first shards")
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # today's multiprocessing.Pool waits forever
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the run did not notice its dead worker")
    assert proc.returncode == 2
    one_line_error(proc_result(proc, err), str(out), f"pid {workers[0]}", "SIGKILL",
                   "--buckets", "--workers")
    wait_for(lambda: not any(running(w) for w in workers), 5, "the other worker")
    assert not out.exists()  # the run made --out: no dataset, no staging folder, no lock, no folder


def proc_result(proc, stderr: str) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)


# --- 10. the driver is stopped ----------------------------------------------------------

@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_stop_workers_and_clean_up(raw, tmp_path, sig, code):
    out = tmp_path / "out"
    proc = start_slow(raw, out, "--workers", "2", "--buckets", "8", slow_s=0.5)
    wait_for(lambda: staged_shards(out), what="the first shards")
    workers = children(proc.pid)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the whole process group
    else:
        os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    one_line_error(proc_result(proc, err), f"stopped by {signal.Signals(sig).name}",
                   f"{out} holds what it held before")
    assert not any(running(w) for w in workers)
    assert not out.exists()  # the run made --out: no dataset, no staging folder, no lock, no folder


def test_sigkilled_driver_takes_its_workers_along(raw, tmp_path):
    out = tmp_path / "out"
    proc = start_slow(raw, out, "--workers", "2", "--buckets", "8", slow_s=3.0)
    wait_for(lambda: staged_shards(out), what="the first shards")
    workers = children(proc.pid)
    assert workers
    os.kill(proc.pid, signal.SIGKILL)  # the driver only, as the OOM killer would
    proc.wait(timeout=30)  # not communicate(): orphans would hold its pipes open
    # Orphans would sleep on for seconds and then write more shards.
    wait_for(lambda: not any(running(w) for w in workers), 1.5, "the orphaned workers")
    proc.communicate(timeout=30)
    assert not (out / mf.MANIFEST_NAME).exists()
    assert not list(out.glob("train/*")) and not list(out.glob("test/*"))
    r = invoke(str(raw), "--out", str(out), "--workers", "1", "--buckets", "8")
    assert r.exit_code == 0, r.output
    assert verify_dir(out) == [] and not list(out.glob(".tmp-*"))


# --- 11. the file system says no ----------------------------------------------------------

def test_disk_full_is_one_line_and_keeps_the_old_dataset(raw, tmp_path, monkeypatch):
    import prep.shards.bucket

    class FullDisk:  # ArrayRecord's own words when write() meets ENOSPC
        def __init__(self, path, options):
            self.path = path

        def write(self, record):
            pass

        def close(self):
            raise RuntimeError(f"write() failed: No space left on device; writing {self.path}; "
                               "at byte 0; Failed to close chunk_writer")

    def full_manifest(d, m):
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(d) / "manifest.json.tmp"))

    # Arrow's spill writer in the pool's workers: in a process of its own, whose workers
    # are forked (pytest's may come from a fork server, without the patch).
    full_spill = ("import errno, pyarrow as pa\n"
                  "def full(*a, **k):\n"
                  "    raise OSError(errno.ENOSPC, 'No space left on device')\n"
                  "pa.ipc.new_stream = full")

    def run_full(fake, out, *extra):
        args = [str(raw), "--out", str(out), "--buckets", "8", *extra]
        if isinstance(fake, str):
            r = _killed_at(args + ["--quiet", "--workers", "2"], fake)
            assert r.returncode == 2, r.stderr
        else:
            with monkeypatch.context() as m:
                m.setattr(*fake)
                r = invoke(*args, "--workers", "1")
            assert r.exit_code == 2, r.output
        one_line_error(r, str(out), "no space left", "free some space")

    fakes = [(prep.shards.bucket, "ArrayRecordWriter", FullDisk), full_spill,
             (mf, "write_manifest", full_manifest)]
    for i, fake in enumerate(fakes):
        out = tmp_path / f"new{i}"
        run_full(fake, out)
        assert not out.exists()  # nothing half-written, no staging folder, no new folder

    out = tmp_path / "out"
    run_shards([str(raw)], str(out), CFG, progress=False)
    old = dataset_bytes(out)
    for fake in fakes:
        run_full(fake, out, "--overwrite")
        assert dataset_bytes(out) == old and verify_dir(out) == []
        assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test", "train"]


def test_read_only_and_dangling_symlink_out_are_one_line(raw, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    def run_ro(*extra):
        with read_only(monkeypatch, out):
            r = invoke(str(raw), "--out", str(out), *extra)
        assert r.exit_code == 2, r.output
        one_line_error(r, str(out), "read-only file system", "writable")

    run_ro()
    assert list(out.iterdir()) == []
    run_shards([str(raw)], str(out), CFG, progress=False)
    old = dataset_bytes(out)
    run_ro("--overwrite")
    assert dataset_bytes(out) == old

    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    r = invoke(str(raw), "--out", str(dangling))
    assert r.exit_code == 2, r.output
    one_line_error(r, str(dangling), "nowhere", "does not exist")
    assert not (tmp_path / "nowhere").exists() and dangling.is_symlink()


# --- a failed run into a new folder leaves no folder ---------------------------------------

def test_a_failed_run_removes_the_folder_it_made_and_keeps_one_it_did_not(raw, tmp_path):
    import pyarrow.parquet as pq

    bad = tmp_path / "bad"
    bad.mkdir()
    pq.write_table(pq.read_table(next(raw.glob("*.parquet"))).drop(["rtt"]), bad / "x.parquet")
    out = tmp_path / "new" / "out"
    r = invoke(str(bad), "--out", str(out), "--workers", "1")
    assert r.exit_code == 2
    line = one_line_error(r, "missing required column rtt")
    assert not out.exists() and (tmp_path / "new").is_dir()  # --out itself only
    out.mkdir()
    r = invoke(str(bad), "--out", str(out), "--workers", "1")
    assert r.exit_code == 2 and one_line_error(r) == line
    assert out.is_dir() and list(out.iterdir()) == []  # the user's folder stays
