"""A run's dataset must be what its manifest promises: a shard path that leads outside the
folder, shards swapped or taken from another build, a damaged shard, a malformed manifest are
each refused in one line, before a run folder is made, by `train` and the `prep` tools alike.

Every CLI case asserts the exit code, the one `error:` line (no traceback) and what is on
disk afterwards.
"""

import json
import shutil
from pathlib import Path

import pytest
from helpers import FLAGS, exit_2_one_line, fit, prep, step_dirs, write_dataset

from prep.base.errors import InputError
from prep.schema import manifest as mf
from train.fit import reader


def shard(d: Path, i: int, split="train") -> Path:
    return d / split / f"synthetic-{i:05d}.array_record"


def edit_manifest(d: Path, change) -> None:
    m = json.loads((d / mf.MANIFEST_NAME).read_text())
    change(m)
    (d / mf.MANIFEST_NAME).write_text(json.dumps(m))


# --- a manifest names only its own files, and they must be what it promises ---------------

@pytest.mark.parametrize("bad", ["../../../../etc/passwd", "/etc/passwd", "symlink"])
def test_shard_paths_must_stay_inside_the_dataset(copy, tmp_path, bad):
    if bad == "symlink":  # a shard replaced by a link to a file outside the folder
        outside = tmp_path / "elsewhere.array_record"
        shutil.move(shard(copy, 0), outside)
        shard(copy, 0).symlink_to(outside)
        rel = "train/synthetic-00000.array_record"
    else:
        rel = bad
        edit_manifest(copy, lambda m: m["splits"]["train"]["shards"][0].update(path=bad))
    with pytest.raises(InputError, match="leads outside"):
        mf.load_manifest(copy)
    run = tmp_path / "run"
    for result in (fit(["--data", copy, "--run-dir", run, *FLAGS]),
                   prep(["verify", copy]), prep(["inspect", copy, "--rows", "0:1"]),
                   prep(["analyze-padding", copy])):
        exit_2_one_line(result, f"shard path {rel!r} leads outside {copy}", "prep shards")
    assert not run.exists()


def test_shards_that_differ_from_the_manifest_are_refused_at_open(copy, shards, tmp_path):
    run = tmp_path / "run"
    # two shards of 24 and 16 records swapped
    a, c = shard(copy, 0), shard(copy, 2)
    tmp = copy / "x"
    a.rename(tmp), c.rename(a), tmp.rename(c)
    want = f"{a}: 16 records, manifest.json lists 24; run `prep verify"
    exit_2_one_line(fit(["--data", copy, "--run-dir", run, *FLAGS]), want, "prep shards")
    exit_2_one_line(prep(["inspect", copy, "--rows", "0:1"]), want)
    exit_2_one_line(prep(["analyze-padding", copy]), want)
    with pytest.raises(InputError, match="16 records, manifest.json lists 24"):
        reader.read_split(copy, mf.load_manifest(copy), "train")  # `train eval`'s reader
    assert not run.exists()

    # a shard of the same size from another build: only its digest tells
    other = write_dataset(tmp_path / "other", seed=5)
    shutil.rmtree(copy)
    shutil.copytree(shards, copy)
    shutil.copy(shard(other, 1), shard(copy, 1))
    want = f"{shard(copy, 1)}: sha256 "
    exit_2_one_line(fit(["--data", copy, "--run-dir", run, *FLAGS]), want, "prep verify")
    exit_2_one_line(prep(["analyze-padding", copy]), want)
    with pytest.raises(InputError, match="sha256 .* differs"):
        reader.read_split(copy, mf.load_manifest(copy), "train")
    assert not run.exists()

    # a size recorded in the manifest is held to as well
    shutil.copy(shard(shards, 1), shard(copy, 1))
    edit_manifest(copy, lambda m: m["splits"]["train"]["shards"][2].update(size=12345))
    exit_2_one_line(fit(["--data", copy, "--run-dir", run, *FLAGS]),
                   f"{shard(copy, 2)}: {shard(copy, 2).stat().st_size:,} bytes, "
                   "manifest.json lists 12,345")
    assert not run.exists()


# --- damaged shards and malformed manifests: one line, not a traceback --------------------
# (`prep verify` on a half-truncated shard: tests/test_verify.py)

@pytest.mark.parametrize("damage", ["missing", "truncated", "empty", "corrupted-record"])
def test_train_names_a_damaged_shard(copy, tmp_path, damage):
    s = shard(copy, 1)
    data = s.read_bytes()
    if damage == "missing":
        s.unlink()
        want = f"{s}: missing (listed in manifest.json)"
    elif damage == "truncated":
        s.write_bytes(data[:len(data) // 2])
        want = f"{s}: not a readable ArrayRecord file"
    elif damage == "empty":
        s.write_bytes(b"")
        want = f"{s}: not a readable ArrayRecord file"
    else:  # one chunk's bytes flipped: record count intact, the digest and the read fail
        b = bytearray(data)
        b[300] ^= 0xFF
        s.write_bytes(bytes(b))
        want = f"{s}: sha256 "
    run = tmp_path / "run"
    exit_2_one_line(fit(["--data", copy, "--run-dir", run, *FLAGS]), want, "prep verify")
    assert not run.exists()
    if damage == "corrupted-record":  # without the digest check, the read names it
        r = fit(["--data", copy, "--run-dir", run, *FLAGS, "--check-data", "counts"])
        exit_2_one_line(r, f"{s}#", "unreadable record", "prep verify")
        assert not step_dirs(run / "checkpoints")


@pytest.mark.parametrize("change, needle", [
    (lambda m: m.pop("splits"), "no 'splits'"),
    (lambda m: m.update(row_len="64"), "row_len is '64', not a positive int"),
    (lambda m: m["splits"]["train"]["shards"][0].pop("records"), "'records' is None"),
])
def test_a_malformed_manifest_is_one_line(copy, tmp_path, change, needle):
    edit_manifest(copy, change)
    run = tmp_path / "run"
    exit_2_one_line(fit(["--data", copy, "--run-dir", run, *FLAGS]), needle, "prep shards")
    exit_2_one_line(prep(["verify", copy]), needle)
    exit_2_one_line(prep(["inspect", copy]), needle)
    assert not run.exists()
