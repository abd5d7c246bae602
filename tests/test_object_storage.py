"""Object storage (s3://) against a local S3-compatible server with its IAM checks on
(moto's standalone server on 127.0.0.1, prep/tools/s3_server.py): a round trip equal byte for
byte to the local run, the cache checked by sha256, a killed or failed upload leaving the
old dataset, --overwrite and foreign objects as a local --out, wrong credentials and an
unreachable endpoint as one line; the Beam runner's worker processes reading the inputs from
the bucket and writing the shards into it (never on the driver's disk), byte for byte the
local run, and a worker's failed upload or death leaving the old dataset."""

import hashlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import REPO, TWO_PROCESSES

from prep.base import storage
from prep.base.errors import InputError
from prep.base.storage import Remote
from prep.cli import main
from prep.ingest.synth import SynthConfig, synth
from prep.jobs.remote_out import GEN
from prep.schema import cache
from prep.schema import manifest as mf
from prep.shards.bucket import ShardsConfig
from prep.shards.local_runner import run_shards
from prep.tools import s3_server
from prep.tools import synthetic_shards as synthetic

BUCKET = "pp-test"
SHARDS = ("--quiet", "--workers", "1", "--buckets", "4", "--seed", "5")

pytestmark = pytest.mark.skipif(s3_server.available() is not None,
                                reason=str(s3_server.available()))


@pytest.fixture(scope="module")
def s3():
    with s3_server.S3Server() as server:
        server.make_bucket(BUCKET)
        yield server


@pytest.fixture
def env(s3, tmp_path, monkeypatch):
    """This process reads the server's settings, and a cache of its own."""
    for k, v in s3.env(PING_PACK_CACHE=str(tmp_path / "cache")).items():
        monkeypatch.setenv(k, v)
    return s3.env(PING_PACK_CACHE=str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("s3") / "raw"
    synth(SynthConfig(out=out, rows=20_000, probes=100, days=1, seed=3))
    return out


@pytest.fixture(scope="module")
def local(raw) -> Path:
    """The local run the bucket's must equal."""
    out = raw.parent / "local"
    run_shards([str(raw)], str(out), ShardsConfig(seed=5, n_buckets=4), workers=1,
               progress=False)
    return out


def put_folder(folder: Path, uri: str, *, manifest_last: bool = True) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    files.sort(key=lambda p: manifest_last and p.name == mf.MANIFEST_NAME)
    for p in files:
        storage.upload(p, Remote.parse(uri).child(str(p.relative_to(folder))))


def prep(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


def prep_proc(*args, env, patch: str = "") -> subprocess.CompletedProcess:
    """`prep` in a process of its own (after ``patch``), with the environment ``env``."""
    code = "import os, signal, sys\n" + patch + "\nfrom prep.cli import main\nmain(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=180, env=os.environ | env | {"PYTHONPATH": str(REPO)})


def remote_bytes(s3, key: str) -> bytes:
    return s3.client().get_object(Bucket=BUCKET, Key=key)["Body"].read()


def dataset_keys(s3, prefix: str) -> list[str]:
    """The objects under ``prefix`` (not the empty "folder/" ones pyarrow leaves)."""
    return [k[len(prefix) + 1:] for k in s3.keys(BUCKET, prefix + "/") if not k.endswith("/")]


def comparable(m: dict) -> dict:
    """A manifest without what differs between two runs of the same build: the time it
    took, where the inputs were read from, and the generation its shard paths lead into."""
    m = json.loads(json.dumps(m))
    m.pop("elapsed_s", None)
    m.pop("timing", None)
    for i in m["inputs"]:
        i["name"] = i["name"].rsplit("/", 1)[-1]
    for sp in m["splits"].values():
        for e in sp["shards"]:
            e["path"] = e["path"].split("/", 1)[1] if GEN.fullmatch(e["path"].split("/")[0]) else e["path"]
    return m


def test_round_trip_equals_the_local_run_byte_for_byte(s3, env, raw, local):
    put_folder(raw, f"s3://{BUCKET}/rt/raw")
    storage.write_bytes(Remote.parse(f"s3://{BUCKET}/rt/raw/.tmp-import-1-aaaaaaaaaaaa/x.parquet"),
                        b"not parquet: a hidden staging area, never an input")
    r = prep("shards", f"s3://{BUCKET}/rt/raw", "--out", f"s3://{BUCKET}/rt/ds", *SHARDS)
    assert r.exit_code == 0, r.output

    keys = dataset_keys(s3, "rt/ds")
    gen = keys[0].split("/")[0]
    assert GEN.fullmatch(gen)
    want = sorted(str(p.relative_to(local)) for p in local.rglob("*.array_record"))
    assert len(want) == 8  # 4 buckets x 2 splits
    assert keys == sorted([f"{gen}/.ping-pack-owner", "manifest.json"]
                          + [f"{gen}/{w}" for w in want])
    for w in want:
        assert remote_bytes(s3, f"rt/ds/{gen}/{w}") == (local / w).read_bytes(), w
    remote_m = json.loads(remote_bytes(s3, "rt/ds/manifest.json"))
    local_m = json.loads((local / mf.MANIFEST_NAME).read_text())
    assert comparable(remote_m) == comparable(local_m)
    assert [i["name"] for i in remote_m["inputs"]][0] == f"s3://{BUCKET}/rt/raw/2026-01-01T00.parquet"
    assert len(remote_m["inputs"]) == 24  # the hidden staging object was not read

    r = prep("verify", f"s3://{BUCKET}/rt/ds")
    assert r.exit_code == 0 and f"s3://{BUCKET}/rt/ds: ok" in r.output, r.output

    # train's reader over the cache: the very batches of the local dataset
    from train.fit import reader

    d = reader.local_copy(f"s3://{BUCKET}/rt/ds", ["train"])
    assert d.parent.parent == Path(env["PING_PACK_CACHE"])
    mine, theirs = (iter(reader.batches(x, "train", batch_size=8, seed=1)) for x in (d, local))
    for _ in range(3):
        a, b = next(mine), next(theirs)
        assert np.array_equal(a["tokens"], b["tokens"])
        assert np.array_equal(a["segment_ids"], b["segment_ids"])


def test_cache_reuses_checked_shards_and_catches_damage(s3, env, local, capfd):
    uri = f"s3://{BUCKET}/cache/ds"
    put_folder(local, uri)
    d = cache.local_dataset(uri)
    assert "8 downloaded, 0 reused" in capfd.readouterr().err
    shard = next(d.glob("train/*.array_record"))
    assert shard.read_bytes() == (local / "train" / shard.name).read_bytes()
    assert (d / mf.MANIFEST_NAME).read_bytes() == (local / mf.MANIFEST_NAME).read_bytes()

    cache.local_dataset(uri)
    assert "0 downloaded, 8 reused" in capfd.readouterr().err
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))  # damaged in the cache: downloaded again
    cache.local_dataset(uri)
    assert "1 downloaded, 7 reused" in capfd.readouterr().err
    assert shard.read_bytes() == (local / "train" / shard.name).read_bytes()

    # damaged in the bucket (a checked copy is reused as it is: this one is not there any
    # more): train's copy refuses it, naming the shard; verify lists it
    storage.write_bytes(Remote.parse(f"{uri}/train/{shard.name}"), bytes(data))
    shard.unlink()
    with pytest.raises(InputError, match=rf"{uri}/train/{shard.name}: sha256 differs"):
        cache.local_dataset(uri)
    r = prep("verify", uri)
    assert r.exit_code == 1
    assert f"{uri}/train/{shard.name}: sha256" in r.output


def test_verify_asks_the_bucket_every_time_not_its_warm_cache(s3, env, local):
    """#36 item 17: a warm cache vouched for a shard deleted from the bucket."""
    uri = f"s3://{BUCKET}/warm/ds"
    put_folder(local, uri)
    assert prep("verify", uri).exit_code == 0
    shard = sorted(p.name for p in (local / "train").glob("*.array_record"))[0]
    s3.client().delete_object(Bucket=BUCKET, Key=f"warm/ds/train/{shard}")
    r = prep("verify", uri)
    assert r.exit_code == 1
    assert r.stdout == f"{uri}/train/{shard}: missing (listed in the manifest)\n"
    assert "(0 downloaded, 7 reused, 1 missing from the bucket)" in r.stderr
    with pytest.raises(InputError, match=re.escape(
            f"{uri}/train/{shard}: listed in manifest.json but not in the bucket (1 shard "
            "missing)")):
        cache.local_dataset(uri)

    # put back, then replaced by other bytes of the same size: a new ETag, downloaded again
    put_folder(local, uri)
    assert prep("verify", uri).exit_code == 0
    data = bytearray((local / "train" / shard).read_bytes())
    data[100] ^= 0xFF
    storage.write_bytes(Remote.parse(f"{uri}/train/{shard}"), bytes(data))
    r = prep("verify", uri)
    assert r.exit_code == 1
    assert "(1 downloaded, 7 reused)" in r.stderr
    assert r.stdout.startswith(f"{uri}/train/{shard}: sha256 "), r.output


def test_a_missing_bucket_is_said_at_once_not_after_the_build(s3, env, raw):
    """#36 item 22: found only at upload time, after the whole build; and `verify` / `train`
    called it "no manifest.json"."""
    uri = "s3://pp-no-such-bucket/ds"
    want = "error: s3://pp-no-such-bucket: no such bucket; create it, or check the name\n"
    r = prep("shards", str(raw), "--out", uri, *SHARDS)
    assert (r.exit_code, r.stderr) == (2, want)
    r = prep("verify", uri)
    assert (r.exit_code, r.stderr) == (2, want)
    with pytest.raises(InputError, match=re.escape(want[7:-1])):
        cache.local_dataset(uri)


def test_a_second_run_into_one_prefix_names_the_prefix_not_tmpdir(s3, env, raw):
    """#36 item 22: the refusal of a second run on this machine said "set TMPDIR to a disk
    with room for the output"."""
    from prep.base import lock
    from prep.jobs import remote_out

    uri = f"s3://{BUCKET}/second/ds"
    local = remote_out._local_for(Remote.parse(uri))
    local.mkdir(parents=True, exist_ok=True)
    fd = lock.lock_folder(local, "prep shards")  # a first run, still writing
    try:
        r = prep("shards", str(raw), "--out", uri, *SHARDS)
    finally:
        lock.release(local, fd, True)
    assert r.exit_code == 2
    assert r.stderr == (f"error: {uri} (staged in {local}): another `prep shards` (pid "
                        f"{os.getpid()}) is writing this folder; wait for it to end, or stop "
                        "it, then run again\n")


def test_the_staging_folder_is_one_per_destination(monkeypatch):
    """Two runs into the same URI on two S3-compatible servers (two test suites on one
    machine, each with its server) are two destinations: each stages in a folder of its own,
    and neither is refused as "another `prep shards` is writing this folder"."""
    from prep.jobs import remote_out

    loc = Remote.parse("s3://pp-test/kill/ds")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    default = remote_out._local_for(loc)  # the service's default endpoint: the URI alone
    assert default == remote_out.staging_root() / (
        "s3-pp-test-kill-ds-" + hashlib.sha256(b"s3://pp-test/kill/ds").hexdigest()[:8])
    folders = set()
    for port in (49223, 49224):
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
        folders.add(remote_out._local_for(loc))
        assert remote_out._local_for(loc) in folders  # the same destination, the same folder
    assert len(folders | {default}) == 3
    assert {f.name[:-8] for f in folders} == {"s3-pp-test-kill-ds-"}


def test_a_dataset_needs_overwrite_and_foreign_objects_are_refused(s3, env, raw):
    uri = f"s3://{BUCKET}/ow/ds"
    assert prep("shards", str(raw), "--out", uri, *SHARDS).exit_code == 0
    before = remote_bytes(s3, "ow/ds/manifest.json")
    r = prep("shards", str(raw), "--out", uri, *SHARDS)
    assert r.exit_code == 2
    assert r.output.strip() == (f"error: {uri}: holds a finished dataset (manifest.json); pass "
                                "--overwrite to replace it (the old one stays intact until "
                                "the new one is complete), or use another --out")
    r = prep("shards", str(raw), "--out", uri, *SHARDS[:-1], "6", "--overwrite")
    assert r.exit_code == 0, r.output
    after = dataset_keys(s3, "ow/ds")
    assert remote_bytes(s3, "ow/ds/manifest.json") != before
    assert len({k.split("/")[0] for k in after if k != "manifest.json"}) == 1, after  # old one gone

    storage.write_bytes(Remote.parse(f"s3://{BUCKET}/ow/other/notes.txt"), b"mine")
    r = prep("shards", str(raw), "--out", f"s3://{BUCKET}/ow/other", *SHARDS)
    assert r.exit_code == 2
    assert "holds notes.txt, which `prep shards` did not write" in r.output
    assert dataset_keys(s3, "ow/other") == ["notes.txt"]


# a `prep shards` that dies (SIGKILL) once its third shard is uploaded
# SIGKILL once 3 uploads have finished: counted as they finish, not as they start (uploads
# run on several threads; the 3rd to start finished while the 1st was still in flight on a
# loaded machine, and the run died with 2 shards up)
KILL_MID_UPLOAD = """
import threading, prep.base.storage as st
real, done, lock = st.upload, [0], threading.Lock()
def upload(*a, **k):
    real(*a, **k)
    with lock:
        done[0] += 1
        if done[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
st.upload = upload
"""


def test_killed_upload_leaves_no_manifest_and_the_old_dataset(s3, env, raw, local):
    uri = f"s3://{BUCKET}/kill/ds"
    put_folder(local, uri)  # the old dataset (in the layout of a local folder copied up)
    old = {k: remote_bytes(s3, f"kill/ds/{k}") for k in dataset_keys(s3, "kill/ds")}

    r = prep_proc("shards", str(raw), "--out", uri, *SHARDS[:-1], "6", "--overwrite",
                  env=env, patch=KILL_MID_UPLOAD)
    assert r.returncode == -signal.SIGKILL, r.stderr
    keys = dataset_keys(s3, "kill/ds")
    left = sorted({k.split("/")[0] for k in keys} - {k.split("/")[0] for k in old})
    assert len(left) == 1 and GEN.fullmatch(left[0])  # the killed run's generation...
    assert sum(k.startswith(left[0]) and k.endswith(".array_record") for k in keys) >= 3
    assert {k: remote_bytes(s3, f"kill/ds/{k}") for k in old} == old  # ...and the old dataset
    assert prep("verify", uri).exit_code == 0

    # the next run (this host, the killed pid gone) removes the leftover and publishes
    r = prep("shards", str(raw), "--out", uri, *SHARDS[:-1], "6", "--overwrite")
    assert r.exit_code == 0, r.output
    keys = dataset_keys(s3, "kill/ds")
    tops = {k.split("/")[0] for k in keys} - {"manifest.json"}
    assert len(tops) == 1 and left[0] not in tops and not any(k.startswith("train/") for k in keys)
    assert prep("verify", uri).exit_code == 0


def test_sigterm_mid_upload_removes_it_and_keeps_the_old_dataset(s3, env, raw, local):
    uri = f"s3://{BUCKET}/term/ds"
    put_folder(local, uri)
    old = {k: remote_bytes(s3, f"term/ds/{k}") for k in dataset_keys(s3, "term/ds")}
    # each upload, once done, waits until the run tells it to stop (up to 60 s): the run is
    # still uploading when the signal comes, however late a loaded machine delivers it
    slow = ("import prep.base.storage as st\nreal = st.upload\n"
            "def upload(local, loc, bar=None, stop=None):\n"
            "    real(local, loc, bar, stop); stop.wait(60)\nst.upload = upload\n")
    code = slow + "from prep.cli import main\nmain(sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", "import sys\n" + code, "shards", str(raw),
                             "--out", uri, *SHARDS, "--overwrite"], stderr=subprocess.PIPE,
                            text=True, env=os.environ | env | {"PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while not any(k.endswith(".array_record") and GEN.fullmatch(k.split("/")[0])
                  for k in dataset_keys(s3, "term/ds")):
        assert proc.poll() is None and time.monotonic() < deadline, "no upload seen"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == (f"error: prep shards: stopped by SIGTERM; the "
                                            f"unfinished output was removed and {uri} holds "
                                            "what it held before")
    assert {k: remote_bytes(s3, f"term/ds/{k}") for k in dataset_keys(s3, "term/ds")} == old


def test_failed_upload_is_one_line_and_removes_what_it_uploaded(s3, env, raw, local,
                                                                 monkeypatch):
    uri = f"s3://{BUCKET}/fail/ds"
    put_folder(local, uri)
    old = dataset_keys(s3, "fail/ds")
    real, calls = storage.upload, itertools.count(1)

    def upload(src, loc, *a):
        if next(calls) == 3:
            raise storage.failure(OSError("AWS Error NETWORK_CONNECTION during "
                                          "UploadPart operation: curlCode: 56, Failure when "
                                          "receiving data from the peer"), loc, "uploading to it")
        return real(src, loc, *a)

    monkeypatch.setattr(storage, "upload", upload)
    r = prep("shards", str(raw), "--out", uri, *SHARDS, "--overwrite")
    assert r.exit_code == 2
    start, error = r.output.strip().splitlines()  # the start line, then one line: the error
    assert start.startswith("prep shards: 24 input files")
    assert error.startswith(f"error: {uri}/g") and "cannot reach the storage endpoint" in error
    assert dataset_keys(s3, "fail/ds") == old  # nothing of the failed run stays


def test_wrong_credentials_and_unreachable_endpoint_are_one_line(s3, env, tmp_path):
    uri = f"s3://{BUCKET}/creds"
    bad = env | {"AWS_SECRET_ACCESS_KEY": "wrong" + env["AWS_SECRET_ACCESS_KEY"][5:]}
    r = prep_proc("shards", f"{uri}/raw", "--out", str(tmp_path / "out"), env=bad)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (f"error: {uri}/raw: access denied while listing it (access "
                        "denied); check the credentials (AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials), that "
                        "they may do this, and that the bucket exists\n")
    assert not (tmp_path / "out").exists()

    r = prep_proc("verify", f"{uri}/ds", env=env | {"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG0"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: {uri}/ds/manifest.json: access denied")

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = subprocess.run([sys.executable, "-m", "train.cli", "--data", f"{uri}/ds",
                        "--run-dir", str(tmp_path / "run"), "--device", "cpu"],
                       capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env=os.environ | env | {"AWS_ENDPOINT_URL": closed,
                                               "PYTHONPATH": str(REPO)})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: {uri}/ds/manifest.json: cannot reach the storage "
                               f"endpoint {closed} while reading it")
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_train_on_a_bucket_equals_training_on_the_folder(s3, env, tmp_path):
    from train.fit.checkpoint import Checkpointer
    from train.fit.config import TrainConfig
    from train.fit.loop import train

    d = tmp_path / "shards"
    synthetic.write_shards(d, {"train": synthetic.counting_rows(32, 64, seed=0),
                               "test": synthetic.counting_rows(8, 64, seed=1)})
    uri = f"s3://{BUCKET}/train/ds"
    put_folder(d, uri)
    params = []
    for data, run in ((uri, tmp_path / "run-s3"), (str(d), tmp_path / "run-local")):
        # the optimizer settings of helpers.small(), test_train's and test_run_*'s (lr 3e-3,
        # warmup 3, a schedule of 20 steps): they reuse the step compiled here
        train(TrainConfig(data=data, run_dir=str(run), steps=3, schedule_steps=20, batch_size=4,
                          lr=3e-3, warmup=3, log_every=1, eval_every=2, eval_rows=4,
                          ckpt_every=0))
        ck = Checkpointer(run / "checkpoints")
        params.append(ck.restore(ck.latest_step())[0]["params"])
        ck.close()
    assert json.loads((tmp_path / "run-s3" / "config.json").read_text())["train"]["data"] == uri
    import jax

    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), *params)
    assert all(jax.tree.leaves(same))


def test_import_atlas_reads_and_writes_a_bucket(s3, env, atlas_dir, tmp_path):
    files = sorted(atlas_dir.rglob("*.json"))[:3]
    for f in files:
        storage.upload(f, Remote.parse(f"s3://{BUCKET}/atlas/in/{f.name}"))
    r = prep("import-atlas", *map(str, files), "--out", str(tmp_path / "atlas"), "--workers", "1")
    assert r.exit_code == 0, r.output
    uri = f"s3://{BUCKET}/atlas/out"
    r = prep("import-atlas", f"s3://{BUCKET}/atlas/in", "--out", uri, "--workers", "1")
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "atlas").glob("*.parquet"))
    assert dataset_keys(s3, "atlas/out") == names
    for n in names:
        assert remote_bytes(s3, f"atlas/out/{n}") == (tmp_path / "atlas" / n).read_bytes()
    r = prep("import-atlas", f"s3://{BUCKET}/atlas/in", "--out", uri, "--workers", "1")
    assert r.exit_code == 2 and "pass --overwrite to replace them" in r.output
    r = prep("shards", uri, "--out", f"s3://{BUCKET}/atlas/ds", "--quiet", "--workers", "1")
    assert r.exit_code == 0, r.output
    assert prep("inspect", f"s3://{BUCKET}/atlas/ds", "--rows", "0:1").exit_code == 0


def test_a_publish_cut_off_in_the_bucket_is_refused_until_finished(s3, env, atlas_dir,
                                                                    monkeypatch, tmp_path):
    """#36 item 20: the server died during the publish's copies, and `prep shards` read the
    prefix's mix of new and old parquet files with exit 0."""
    files = sorted(atlas_dir.rglob("*.json"))
    uri = f"s3://{BUCKET}/half/out"
    assert prep("import-atlas", *map(str, files[:3]), "--out", uri, "--workers", "1").exit_code == 0
    real, copies = storage.copy, []

    def copy(src, dst):  # the server goes away after the 2nd copy
        if len(copies) == 2:
            raise InputError(f"{src}: cannot reach the storage endpoint")
        copies.append(dst)
        real(src, dst)

    monkeypatch.setattr(storage, "copy", copy)
    r = prep("import-atlas", *map(str, files[3:]), "--out", uri, "--workers", "1", "--overwrite")
    assert r.exit_code == 2 and len(copies) == 2
    monkeypatch.setattr(storage, "copy", real)
    stage = next(k for k in dataset_keys(s3, "half/out") if k.endswith("/.publish"))
    want = (f"{uri}: holds an unfinished publish ({stage}): the run writing it stopped while "
            "replacing its files, so they are part old, part new; run it again (the same "
            f"command with --out {uri} --overwrite) to finish, then read it")
    r = prep("shards", uri, "--out", f"s3://{BUCKET}/half/ds")
    assert r.exit_code == 2 and r.stderr == f"error: {want}\n"
    assert dataset_keys(s3, "half/ds") == []

    # the next run into the prefix finishes the publish first: then it is the new output
    r = prep("import-atlas", *map(str, files[3:]), "--out", uri, "--workers", "1")
    assert r.exit_code == 2 and "pass --overwrite" in r.output
    names = sorted(r.uri.rsplit("/", 1)[1] for r, _ in storage.remote_inputs(
        [uri], (".parquet",), "prep shards"))
    assert prep("import-atlas", *map(str, files[3:]), "--out", str(tmp_path / "new"),
                "--workers", "1").exit_code == 0
    assert names == dataset_keys(s3, "half/out") == sorted(
        p.name for p in (tmp_path / "new").glob("*.parquet"))


# Beam with --out on a bucket: its workers write into the bucket and read the inputs there,
# sharing no disk with the driver (Dataflow, Flink, Spark), here as 2 worker processes
# (TWO_PROCESSES).


def test_beam_workers_write_into_the_bucket_and_equal_the_local_run(s3, env, raw, local,
                                                                     tmp_path, monkeypatch):
    pytest.importorskip("apache_beam")
    import prep.shards.dataset
    from prep.jobs import remote_out
    from prep.shards import beam_runner, beam_worker

    put_folder(raw, f"s3://{BUCKET}/bw/raw")  # the inputs: in the bucket only
    uri = f"s3://{BUCKET}/bw/ds"
    driver_tmp = tmp_path / "driver-tmp"
    driver_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(driver_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.setattr(prep.shards.dataset, "UNIT_ROWS", 5_000)  # the read spread too

    def refused(*a, **k):
        raise AssertionError("the driver downloaded the inputs")

    monkeypatch.setattr(storage, "download_inputs", refused)
    seen = {}  # what the bucket and the driver's staging held at two moments

    def driver_files() -> list[str]:
        return sorted(str(p.relative_to(driver_tmp)) for p in driver_tmp.rglob("*")
                      if p.is_file())

    real_clear = beam_worker.BucketStage.clear_records

    def clear_records(stage):  # the pipeline has ended; the driver has read the results
        seen["after pipeline"] = (dataset_keys(s3, "bw/ds"), driver_files())
        real_clear(stage)

    real_publish = remote_out.RemoteDataset.publish

    def publish(od, manifest):
        seen["before manifest"] = (dataset_keys(s3, "bw/ds"), driver_files())
        real_publish(od, manifest)

    monkeypatch.setattr(beam_worker.BucketStage, "clear_records", clear_records)
    monkeypatch.setattr(remote_out.RemoteDataset, "publish", publish)
    passes = beam_runner.BeamPasses(*beam_runner.beam_options(TWO_PROCESSES))
    beam_runner.build([f"s3://{BUCKET}/bw/raw"], uri, ShardsConfig(seed=5, n_buckets=4), passes)

    want = sorted(str(p.relative_to(local)) for p in local.rglob("*.array_record"))
    assert len(want) == 8
    keys, local_files = seen["after pipeline"]
    gen = keys[0].split("/")[0]
    assert GEN.fullmatch(gen)
    # the workers' shards and results, in the run's generation in the bucket...
    assert sorted(k for k in keys if k.endswith(".array_record")) == [f"{gen}/{w}" for w in want]
    assert sorted(k.split("/", 2)[1] for k in keys if k.endswith(".json")) == (
        ["read"] * 5 + ["results"] * 4)  # 20,000 rows in units of 5,000; 4 buckets
    assert "manifest.json" not in keys
    # ...and nothing on the driver's disk but its own lock and marker: no shard, no input
    assert local_files and all(f.startswith("ping-pack-out/") and f.endswith(
        (".lock", ".ping-pack-owner")) for f in local_files), local_files
    keys, local_files = seen["before manifest"]  # the results removed; still no manifest
    assert keys == sorted([f"{gen}/.ping-pack-owner"] + [f"{gen}/{w}" for w in want])
    # two processes did the reading and the buckets, and neither was this one
    assert len(passes.workers) == 2
    assert f"{socket.gethostname()}:{os.getpid()}" not in passes.workers

    # the published dataset: the local run's, byte for byte
    assert dataset_keys(s3, "bw/ds") == sorted(["manifest.json", f"{gen}/.ping-pack-owner"]
                                               + [f"{gen}/{w}" for w in want])
    for w in want:
        assert remote_bytes(s3, f"bw/ds/{gen}/{w}") == (local / w).read_bytes(), w
    remote_m = json.loads(remote_bytes(s3, "bw/ds/manifest.json"))
    assert comparable(remote_m) == comparable(json.loads((local / mf.MANIFEST_NAME).read_text()))
    assert remote_m["inputs"][0]["name"] == f"s3://{BUCKET}/bw/raw/2026-01-01T00.parquet"
    assert remote_m["timing"]["beam_runner"] == "FnApiRunner, multi_processing, 2 workers"
    assert not (driver_tmp / "ping-pack-out").exists() or not any(
        (driver_tmp / "ping-pack-out").iterdir())  # the local staging is gone


# run in each Beam worker process (sitecustomize): a shard upload that fails, or a worker
# that dies (SIGKILL) once its first shard is in the bucket
WORKER_HOOK = """
import os, signal
import prep.base.storage as st
real = st.upload
def upload(local, loc, *a):
    if os.environ["HOOK"] == "kill":
        real(local, loc, *a)
        os.kill(os.getpid(), signal.SIGKILL)
    raise st.failure(OSError("AWS Error NETWORK_CONNECTION during UploadPart operation: "
                             "curlCode: 56, Failure when receiving data from the peer"),
                     loc, "uploading to it")
st.upload = upload
"""


@pytest.mark.parametrize("hook", ["fail", "kill"])
def test_a_beam_worker_failing_or_killed_leaves_no_manifest_and_the_old_dataset(
        s3, env, raw, local, tmp_path, monkeypatch, hook):
    pytest.importorskip("apache_beam")
    from prep.jobs import remote_out
    from prep.shards import beam_runner

    uri = f"s3://{BUCKET}/bf-{hook}/ds"
    put_folder(local, uri)  # the old dataset
    old = {k: remote_bytes(s3, f"bf-{hook}/ds/{k}") for k in dataset_keys(s3, f"bf-{hook}/ds")}
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(WORKER_HOOK)
    monkeypatch.setenv("PYTHONPATH", f"{hooks}{os.pathsep}{REPO}")  # the workers' only
    monkeypatch.setenv("HOOK", hook)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the workers' log goes
    monkeypatch.setattr(tempfile, "tempdir", None)
    removed = []  # what the failed run removed from the bucket: its generation
    real_remove = remote_out._remove_tree

    def remove_tree(loc):
        removed.append((loc.key.rsplit("/", 1)[-1], sorted(storage.list_files(loc))))
        real_remove(loc)

    monkeypatch.setattr(remote_out, "_remove_tree", remove_tree)
    passes = beam_runner.BeamPasses(*beam_runner.beam_options(
        TWO_PROCESSES[:1] + ["direct_num_workers=1"]))  # one worker process: it fails first
    with pytest.raises(InputError) as e:
        beam_runner.build([str(raw)], uri, ShardsConfig(seed=6, n_buckets=4), passes,
                          overwrite=True)
    line, log = str(e.value).rsplit("; the workers' log: ", 1)
    assert Path(log).parent == tmp_path and "\n" not in line
    if hook == "fail":  # the worker's own line, naming the object it could not upload
        assert re.fullmatch(
            rf"{uri}/g\d{{8}}T\d{{6}}Z-[0-9a-f]{{12}}/t[a-z]+/shard-b0000\d-e0\.array_record: "
            rf"cannot reach the storage endpoint {s3.url} while uploading to it \(AWS Error "
            r"NETWORK_CONNECTION .*\); check AWS_ENDPOINT_URL, the network and that the server "
            r"runs \(on a Beam worker; nothing was published\)", line), line
    else:
        assert line == ("a Beam worker process exited mid-run (killed by signal SIGKILL, e.g. "
                        "by the OOM killer); nothing was published; re-run `prep shards`, with "
                        "more --buckets if it ran out of memory")
    [(gen, held)] = removed
    assert GEN.fullmatch(gen) and ".ping-pack-owner" in held
    if hook == "kill":  # the worker's first shards (uploaded at once) had reached the bucket
        assert 1 <= sum(h.endswith(".array_record") for h in held) <= 2, held
    assert {k: remote_bytes(s3, f"bf-{hook}/ds/{k}")
            for k in dataset_keys(s3, f"bf-{hook}/ds")} == old  # nothing else stays


def test_a_generation_written_after_its_run_gave_up_is_named_and_left(s3, env, raw):
    # a cluster's workers may outlive their driver and write into a generation that the
    # driver's failed run had already removed (marker and all)
    uri = f"s3://{BUCKET}/late/ds"
    late = "g20260101T000000Z-0123456789ab/train/shard-b00000-e0.array_record"
    storage.write_bytes(Remote.parse(f"{uri}/{late}"), b"a late shard")
    r = prep("shards", str(raw), "--out", uri, *SHARDS)
    assert r.exit_code == 0, r.output
    assert (f"note: {uri}/g20260101T000000Z-0123456789ab/ has no owner marker: what the "
            "workers of a Beam job wrote after its run had given up; left alone") in r.output
    assert late in dataset_keys(s3, "late/ds") and "manifest.json" in dataset_keys(s3, "late/ds")
    assert prep("verify", uri).exit_code == 0


def test_aws_s3_out_of_reach_says_what_failed_and_what_to_set(monkeypatch):
    # a user trial without a network: "cannot reach the storage endpoint the service's
    # default endpoint ...; check AWS_ENDPOINT_URL, the network and that the server runs",
    # for AWS's own endpoint, where no server of theirs runs. The error is pyarrow's, as it
    # came on a machine that cannot resolve the bucket's host name.
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    e = OSError("When listing objects under key 'data/' in bucket 'fake-bucket': AWS Error "
                "NETWORK_CONNECTION during ListObjectsV2 operation: curlCode: 6, Could not "
                "resolve hostname; Details: Could not resolve host: "
                "fake-bucket.s3.us-east-1.amazonaws.com")
    assert str(storage.failure(e, Remote.parse("s3://fake-bucket/data"), "listing it")) == (
        "s3://fake-bucket/data: cannot reach AWS S3 while listing it (Could not resolve host: "
        "fake-bucket.s3.us-east-1.amazonaws.com); check the network connection, or, for an "
        "S3-compatible server (MinIO, Ceph), set AWS_ENDPOINT_URL to its URL (none is set)")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert str(storage.failure(e, Remote.parse("s3://fake-bucket/data"), "listing it")) == (
        "s3://fake-bucket/data: cannot reach the storage endpoint http://127.0.0.1:9 while "
        "listing it (Could not resolve host: fake-bucket.s3.us-east-1.amazonaws.com); check "
        "AWS_ENDPOINT_URL, the network and that the server runs")


@pytest.mark.parametrize("args, name, output", [
    (["analyze-padding", "s3://fake-bucket/data"], "INPUT", False),
    (["import-matrix", "s3://fake-bucket/m", "--out", "m", "--interval", "1", "--unit", "s"],
     "INPUTS...", False),
    (["import-matrix", "m.txt", "--out", "gs://fake-bucket/m", "--interval", "1", "--unit", "s"],
     "--out", True),
    (["synth", "--out", "s3://fake-bucket/raw", "--rows", "10"], "--out", True),
], ids=["analyze-padding", "import-matrix", "import-matrix-out", "synth"])
def test_a_command_of_local_paths_refuses_a_bucket_path_in_one_line(tmp_path, monkeypatch,
                                                                    args, name, output):
    # a user trial: analyze-padding said "Path 's3://…' does not exist", import-matrix
    # "s3:/fake-bucket/m: no such file or folder", synth made a folder s3:/fake-bucket here
    # and ended in a traceback (pyarrow's "Missing bucket name in S3 URI")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.txt").write_text("0 1\n1 0\n")
    uri = next(a for a in args if "://" in a)
    copy = "gcloud storage cp --recursive" if uri.startswith("gs") else "aws s3 cp --recursive"
    fix = (f"this command writes a local folder only, not a bucket; write one, then upload it "
           f"(`{copy} DIR {uri}`)" if output else
           f"this command reads local files only, not a bucket; copy them here first "
           f"(`{copy} {uri} DIR`) and give DIR")
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '{name}': {uri}: {fix}; prep shards, import-atlas, verify, "
        "inspect and train take bucket paths")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.txt"]
