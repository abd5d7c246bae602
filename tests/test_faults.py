"""Fault injection on `prep shards` (prep/jobs/outdir.py's guarantees), seeded rounds of:

(a) a run, into a folder that sometimes holds a finished dataset (``--overwrite``), killed
    with SIGKILL or SIGTERM at a random moment;
(b) a run whose random worker is killed (SIGKILL, as the OOM killer does, or SIGTERM);
(c) two runs into the same folder at once;
(d) now and then, a folder holding a file `prep shards` did not write.

After each round the folder is exactly one of: the old finished dataset (byte-identical),
a new finished dataset of this round that `prep verify` accepts, or no dataset (no
manifest.json, nothing in train/ or test/); the one exception, a kill inside the swap's
microseconds (SIGKILL only), is no dataset too (no manifest.json) and the next run must
finish it. Nothing foreign is deleted, every command ends within a time bound, and every
error is one line without a traceback.
"""

import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import PREP, children, dataset_bytes, error_lines, one_line_error, running

from prep.schema import manifest as mf
from prep.tools.verify import verify_dir

ROUNDS = 12  # about 2.5 s each; the seeded schedule runs every kind of fault (asserted)
TIMEOUT_S = 60  # any one command
START_LINE = "input files"  # printed once the run holds the folder and its workers run
OURS = re.compile(r"\.lock|\.tmp-shards-\d+-[0-9a-f]{12}|\.old-\d+-[0-9a-f]{12}")


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "raw"
    subprocess.run([str(PREP), "synth", "--out", str(out), "--rows", "50000", "--probes", "200",
                    "--days", "1"], check=True, capture_output=True, timeout=TIMEOUT_S)
    return out


def start(raw: Path, out: Path, seed: int, buckets: int) -> subprocess.Popen:
    cmd = [str(PREP), "shards", str(raw), "--out", str(out), "--quiet", "--overwrite",
           "--workers", "2", "--buckets", str(buckets), "--seed", str(seed)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> str:
    """Wait (bounded) for ``proc``; its stderr. Never a traceback."""
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"{proc.args}: still running after {TIMEOUT_S} s")
    assert "Traceback" not in err, err
    return err


def wait_gone(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"workers {pids} still running"
        time.sleep(0.01)


def classify(out: Path, old: dict | None, seeds: set[int]) -> str:
    """old | new | none | mid-swap, or fail: the folder is never anything else."""
    if not out.exists():
        return "none"
    for p in out.iterdir():
        assert p.name in ("manifest.json", "train", "test") or OURS.fullmatch(p.name), p
    if (out / mf.MANIFEST_NAME).exists():
        if old is not None and dataset_bytes(out) == old:
            return "old"
        assert verify_dir(out) == []
        assert mf.load_manifest(out)["seed"] in seeds
        return "new"
    if not list(out.glob("train/*")) and not list(out.glob("test/*")):
        return "none"
    # Shards without a manifest: only a swap cut short between two renames, whose staging
    # folder still holds the complete new dataset and its manifest.
    assert list(out.glob(".old-*")), sorted(p.name for p in out.rglob("*"))
    assert any((d / mf.MANIFEST_NAME).is_file() for d in out.glob(".tmp-shards-*"))
    return "mid-swap"


def clean_run(raw: Path, out: Path, seed: int) -> None:
    """An uninterrupted run: it completes, and leaves exactly a verified dataset."""
    proc = start(raw, out, seed, 8)
    err = finish(proc)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "test", "train"]
    assert verify_dir(out) == [] and mf.load_manifest(out)["seed"] == seed


@pytest.mark.slow
def test_random_faults(raw, tmp_path):
    rng = random.Random(20260101)
    out = tmp_path / "out"
    # Things that are not ours: a neighbour file and another dataset beside --out.
    (tmp_path / "notes.txt").write_text("keep me")
    other = tmp_path / "other"
    clean_run(raw, other, 1)
    theirs = dataset_bytes(other)
    seed = 100
    seen = []
    t_end = time.monotonic() + 150  # a bound on the whole trial
    for _ in range(ROUNDS):
        seed += 1
        old = dataset_bytes(out) if (out / mf.MANIFEST_NAME).exists() else None
        kind = rng.choice(["kill", "kill", "kill", "worker", "worker", "two"])
        if rng.random() < 0.1:
            kind = "foreign"
        buckets = rng.choice([4, 8, 16])

        if kind == "kill":
            sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
            proc = start(raw, out, seed, buckets)
            time.sleep(rng.uniform(0.2, 1.8))
            workers = children(proc.pid)
            proc.send_signal(sig)
            proc.wait(timeout=TIMEOUT_S)  # not communicate(): orphans would hold its pipes
            wait_gone(workers, 3.0)  # they stop with the driver, SIGKILLed or not
            err = finish(proc)
            rc = proc.returncode
            state = classify(out, old, {seed})
            if rc == 0:
                assert state == "new"
            elif sig == signal.SIGTERM:
                if START_LINE in err and "done in" not in err:
                    assert rc == 143, err
                else:
                    assert rc in (143, -signal.SIGTERM), err
                if rc == 143:
                    line = one_line_error(err, "stopped by SIGTERM")
                    if "holds what it held before" in line:
                        assert state == ("old" if old else "none")
                assert state != "mid-swap"  # SIGTERM waits for the end of the swap
            else:
                assert rc == -signal.SIGKILL and error_lines(err) == []
                assert state in (("old" if old else "none"), "new", "mid-swap")
            seen.append((kind, signal.Signals(sig).name, rc, state))

        elif kind == "worker":
            sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
            proc = start(raw, out, seed, buckets)
            deadline = time.monotonic() + TIMEOUT_S
            while len(children(proc.pid)) < 2 and proc.poll() is None:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 1.2))
            workers = children(proc.pid)
            if workers:
                try:
                    os.kill(rng.choice(workers), sig)
                except ProcessLookupError:
                    pass  # it had finished
            err = finish(proc)
            rc = proc.returncode
            wait_gone(workers, 3.0)
            state = classify(out, old, {seed})
            if rc == 0:
                assert state == "new"
            else:
                assert rc == 2, err
                words = ["worker process", signal.Signals(sig).name, "nothing was published"]
                if sig == signal.SIGKILL:
                    words += ["--buckets", "--workers"]
                one_line_error(err, *words)
                assert state == ("old" if old else "none")
            seen.append((kind, signal.Signals(sig).name, rc, state))

        elif kind == "two":
            a = start(raw, out, seed, buckets)
            time.sleep(rng.uniform(0.0, 1.5))
            seed += 1
            b = start(raw, out, seed, buckets)
            errs = {a: finish(a), b: finish(b)}
            codes = (a.returncode, b.returncode)
            assert 0 in codes and set(codes) <= {0, 2}, (codes, errs)
            for p, q in ((a, b), (b, a)):
                if p.returncode == 2:
                    one_line_error(errs[p], "another `prep shards`", f"pid {q.pid}")
            won = {seed - 1 if p is a else seed for p in (a, b) if p.returncode == 0}
            state = classify(out, old, won)
            assert state == "new"
            seen.append((kind, "", codes, state))

        else:  # foreign
            out.mkdir(exist_ok=True)
            (out / ".tmp-mywork").mkdir()
            (out / ".tmp-mywork" / "thesis.tex").write_text("mine")
            proc = start(raw, out, seed, buckets)
            err = finish(proc)
            assert proc.returncode == 2
            one_line_error(err, ".tmp-mywork", "did not write")
            assert (out / ".tmp-mywork" / "thesis.tex").read_text() == "mine"
            shutil.rmtree(out / ".tmp-mywork")
            state = classify(out, old, set())
            assert state == ("old" if old else "none")
            seen.append((kind, "", proc.returncode, state))

        # Nothing foreign touched.
        assert (tmp_path / "notes.txt").read_text() == "keep me"
        assert dataset_bytes(other) == theirs
        # A swap cut short is finished by the next run; otherwise sometimes run one to
        # completion, so that the next round finds a dataset to replace (or not).
        if state == "mid-swap" or rng.random() < 0.3:
            seed += 1
            clean_run(raw, out, seed)
        assert time.monotonic() < t_end, seen
    print(seen)
    states = {s[3] for s in seen}
    assert "new" in states and ({"old", "none"} & states), seen
    assert {s[0] for s in seen} == {"kill", "worker", "two", "foreign"}, seen  # every kind ran


# --- item 20: what a line says ----------------------------------------------------------

def test_a_symlink_loop_is_named_as_one_not_as_a_missing_target(raw, tmp_path):
    from click.testing import CliRunner

    from prep.cli import main

    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    loop = f"a loop of symbolic links: {a} -> {b} -> … never reaches a file or folder"
    for args in (["shards", str(a), "--out", str(tmp_path / "x")],  # an input
                 ["shards", str(raw), "--out", str(a)],  # --out of prep shards
                 ["synth", "--out", str(a), "--rows", "10"],  # --out of the importers
                 ["import-atlas", str(a), "--out", str(tmp_path / "y")]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 2, r.output
        line = one_line_error(r.output, loop)
        assert "does not exist" not in line, line
    d = tmp_path / "inputs"  # under a folder: skipped, with a warning that says so
    d.mkdir()
    shutil.copy(next(raw.glob("*.parquet")), d / "ok.parquet")
    (d / "c.parquet").symlink_to(d / "c.parquet")
    r = CliRunner().invoke(main, ["analyze-padding", str(d), "--grain-sample", "10"])
    assert r.exit_code == 0, r.output
    assert (f"warning: {d / 'c.parquet'}: broken symbolic link (a loop of symbolic links: "
            f"{d / 'c.parquet'} -> {d / 'c.parquet'} -> …") in r.stderr


def test_counts_of_one_are_singular(raw, tmp_path):
    from click.testing import CliRunner

    from prep.cli import main
    from prep.tools.inspect_rows import format_row

    r = CliRunner().invoke(main, ["synth", "--out", str(tmp_path / "one"), "--rows", "1",
                                  "--probes", "1", "--days", "1"])
    assert r.exit_code == 0, r.output
    assert f"synth: 1 row from 1 probe over 1 day in 1 file -> {tmp_path / 'one'} |" in r.stderr
    atlas = Path(__file__).resolve().parent / "fixtures" / "ripe-atlas" / "api" / "ping.json"
    r = CliRunner().invoke(main, ["import-atlas", str(atlas), "--out", str(tmp_path / "a"),
                                  "--workers", "1"])
    assert r.exit_code == 0, r.output
    assert "results from 1 file -> " in r.stderr
    # a row holding one segment of one measurement (a made-up row: 12 tokens, IPv4, failed)
    from prep.schema import vocab as v
    b = [v.BYTE_OFFSET + x for x in (192, 0, 2, 7, 193, 0, 14, 129)]
    toks = [v.MEASUREMENT_START, v.SRC_IPV4, *b[:4], v.DST_IPV4, *b[4:], v.FAILED]
    row = {"split": "test", "row": 0, "shard": "s", "record": 0,
           "tokens": np.array(toks + [0] * 4, np.uint16),
           "segment_ids": np.array([1] * len(toks) + [0] * 4, np.uint8)}
    text = format_row(row)
    assert text.splitlines()[0] == "test row 0 (s #0): 1 segment, 12 tokens, 4 padding"
    assert text.splitlines()[1] == ("  segment 1: 1 measurement, 12 tokens, no timestamps (its "
                                    "timestamp mode)")
