"""Faults a run must survive or refuse in one line: shards that are not what the manifest
promises, resumes that would change the run, SIGTERM, damaged files and checkpoints.

Every CLI case asserts the exit code, the one `error:` line (no traceback) and what is on
disk afterwards. Runs are tiny (tests/helpers.py's `small()`), each a second or two.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from click.testing import CliRunner
from helpers import REPO, exit_2_one_line, final_params, records, small

from prep.base.errors import InputError
from prep.cli import main as prep_main
from prep.schema import manifest as mf
from prep.tools import synthetic_shards as synthetic
from train.cli import main as train_main
from train.fit import reader
from train.fit.config import TrainConfig
from train.fit.loop import train

ROW_LEN = 64


def step_dirs(d: Path) -> list[int]:
    """Checkpoint steps on disk (step folders, intact or not)."""
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def write_dataset(d: Path, seed: int = 0) -> Path:
    """64 train rows in shards of 24, 24 and 16 records; 8 test rows."""
    synthetic.write_shards(d, {"train": synthetic.counting_rows(64, ROW_LEN, seed=seed),
                               "test": synthetic.counting_rows(8, ROW_LEN, seed=seed + 1)},
                           rows_per_shard=24)
    return d


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("safety") / "shards")


@pytest.fixture
def copy(shards, tmp_path):
    return Path(shutil.copytree(shards, tmp_path / "data"))


FLAGS = ["--model", "tiny", "--steps", "20", "--batch-size", "4", "--lr", "3e-3",
         "--warmup", "3", "--log-every", "5", "--eval-every", "0", "--ckpt-every", "0"]


def fit(args):
    return CliRunner().invoke(train_main, [str(a) for a in args])


def prep(args):
    return CliRunner().invoke(prep_main, [str(a) for a in args])


def shard(d: Path, i: int, split="train") -> Path:
    return d / split / f"synthetic-{i:05d}.array_record"


def edit_manifest(d: Path, change) -> None:
    m = json.loads((d / mf.MANIFEST_NAME).read_text())
    change(m)
    (d / mf.MANIFEST_NAME).write_text(json.dumps(m))


def stop_at(step, sig=signal.SIGINT):
    return lambda s: s == step and os.kill(os.getpid(), sig)


# --- 4. a manifest names only its own files, and they must be what it promises ----------

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


# --- 5. a resume is bound to its run ----------------------------------------------------

@pytest.fixture(scope="module")
def stopped_run(shards, tmp_path_factory):
    """A run stopped (SIGINT) at step 15 with checkpoints at 5, 10 and 15."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    s = train(small(shards, run, ckpt_every=5), on_step=stop_at(15))
    assert s["interrupted"] and s["step"] == 15
    assert step_dirs(run / "checkpoints") == [5, 10, 15]
    return run


@pytest.fixture(scope="module")
def straight_run(shards, tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    train(small(shards, run, ckpt_every=5))
    return run


@pytest.fixture
def run(stopped_run, tmp_path):
    return Path(shutil.copytree(stopped_run, tmp_path / "run"))


@pytest.mark.parametrize("flags, needle", [
    (["--batch-size", "8"], "--batch-size 8: the run in {run} has 4"),
    (["--seed", "1"], "--seed 1: the run in {run} has 0"),
    (["--lr", "0.01"], "--lr 0.01: the run in {run} has 0.003"),
    (["--model", "base"], "--model base: the run in {run} has tiny"),
    (["--dtype", "bfloat16"], "--dtype bfloat16: the run in {run} has float32"),
    (["--data", "OTHER"], "--data OTHER: not the dataset the run in {run} trained on"),
])
def test_resume_refuses_a_flag_that_differs_from_the_run(shards, run, tmp_path, flags, needle):
    other = write_dataset(tmp_path / "other", seed=7)
    flags = [str(other) if f == "OTHER" else f for f in flags]
    if "--data" not in flags:
        flags = ["--data", shards, *flags]  # the run's own
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    r = fit(["--run-dir", run, "--resume", *flags])
    exit_2_one_line(r, needle.format(run=run).replace("OTHER", str(other)), "--run-dir")
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before  # config.json, metrics and checkpoints untouched


def test_resume_compares_loss_weights_by_their_weights_and_names_an_empty_one():
    """#36 item 22: the same --loss-weights in another order were refused, and an empty
    one read "has  (its config.json)"."""
    from train.fit.runfolder import check_resume

    saved = {"train": {"loss_weights": "rtt=10,result=10"}}
    assert check_resume(saved, TrainConfig(run_dir="r", loss_weights="result=10, rtt=10"),
                        "fp") == []
    with pytest.raises(InputError) as e:
        check_resume({"train": {"loss_weights": ""}},
                     TrainConfig(run_dir="r", loss_weights="rtt=5"), "fp")
    assert str(e.value) == ('--loss-weights rtt=5: the run in r has "" (its config.json); drop '
                            "--loss-weights to resume with the run's own, or start a new --run-dir")


def test_resume_takes_the_runs_own_settings_and_data(run, tmp_path, monkeypatch, straight_run):
    monkeypatch.chdir(tmp_path)  # no ./shards here: --data must come from the run
    saved = json.loads((run / "config.json").read_text())
    r = fit(["--run-dir", run, "--resume", "--ckpt-every", "10"])  # this one may change
    assert r.exit_code == 0, r.output
    assert f"resumed {run} at step 15" in r.stderr and "done: step 20" in r.stdout
    now = json.loads((run / "config.json").read_text())
    assert now["train"] == {**saved["train"], "ckpt_every": 10, "run_dir": str(run),
                            "resume": True}
    assert now["data_fingerprint"] == saved["data_fingerprint"]
    assert step_dirs(run / "checkpoints") == [10, 15, 20]
    # and it is the same run: the losses and parameters of an uninterrupted one
    assert [x["loss"] for x in records(run)] == [x["loss"] for x in records(straight_run)]
    pa, da = final_params(run)
    pb, db = final_params(straight_run)
    assert da == db
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(x, y)


def test_resume_refuses_a_dataset_that_changed_under_the_run(shards, tmp_path):
    data = Path(shutil.copytree(shards, tmp_path / "data"))
    run = tmp_path / "run"
    assert train(small(data, run), on_step=stop_at(3))["step"] == 3
    config = (run / "config.json").read_bytes()
    shutil.rmtree(data)
    write_dataset(data, seed=3)  # rebuilt in place with other rows
    exit_2_one_line(fit(["--run-dir", run, "--resume"]),
                   f"{data}: its shards changed since the run in {run} started")
    assert (run / "config.json").read_bytes() == config
    assert step_dirs(run / "checkpoints") == [3]


def test_a_failed_start_leaves_no_run_and_resume_needs_a_checkpoint(shards, tmp_path):
    run = tmp_path / "run"
    exit_2_one_line(fit(["--data", shards, "--run-dir", run, *FLAGS[:4], "--batch-size", "100"]),
                   "64 rows make no batch of 100")
    assert not run.exists()
    exit_2_one_line(fit(["--data", tmp_path / "nope", "--run-dir", run, *FLAGS]), "prep shards")
    assert not run.exists()
    exit_2_one_line(fit(["--run-dir", run, "--resume"]), f"{run}: no such run folder")
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": {}}))
    (run / "checkpoints").mkdir()
    exit_2_one_line(fit(["--run-dir", run, "--resume"]), f"{run}: no checkpoint to resume")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json"]


# --- 10. SIGTERM is Ctrl-C: finish the step, save, exit 143 ------------------------------

class Unhandled(Exception):
    pass


def _unhandled(*_):
    raise Unhandled("SIGTERM reached the default handler: the process would die unsaved")


def test_sigterm_saves_a_checkpoint_and_exits_143(shards, tmp_path, monkeypatch):
    import train.fit.loop as loop

    real = loop.train
    monkeypatch.setattr(loop, "train", lambda cfg, **kw: real(
        cfg, on_step=stop_at(6, signal.SIGTERM), **kw))
    prev = signal.signal(signal.SIGTERM, _unhandled)  # stands in for "killed" (keeps pytest alive)
    try:
        run = tmp_path / "run"
        r = fit(["--data", shards, "--run-dir", run, *FLAGS])
        assert signal.getsignal(signal.SIGTERM) is _unhandled  # the handler is given back
    finally:
        signal.signal(signal.SIGTERM, prev)
    assert not isinstance(r.exception, Unhandled)
    assert r.exit_code == 143, r.output
    assert "SIGTERM: stopping at step 6 and saving a checkpoint" in r.stderr
    assert "interrupted: step 6" in r.stdout
    assert step_dirs(run / "checkpoints") == [6]
    assert [x["step"] for x in records(run)] == [5, 6]


# xla_cache (tests/conftest.py): the step compiled by the first `train` process below
# (FLAGS' settings, a schedule of 20 steps) is loaded by the next
def _env(xla_cache):
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                JAX_COMPILATION_CACHE_DIR=str(xla_cache),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def test_sigterm_from_outside_to_the_train_command(shards, tmp_path, xla_cache):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.cli", "--data", str(shards), "--run-dir", str(run),
         "--model", "tiny", "--steps", "100000", "--schedule-steps", "20", "--batch-size", "4",
         "--lr", "3e-3", "--warmup", "3", "--log-every", "1", "--eval-every", "0",
         "--ckpt-every", "0"],
        cwd=REPO, env=_env(xla_cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text():
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-2000:]
    steps = step_dirs(run / "checkpoints")
    assert len(steps) == 1 and "interrupted: step" in out
    assert records(run)[-1]["step"] == steps[0]


# --- 11. damaged shards and manifests: one line, not a traceback -------------------------
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


# --- 12. a damaged newest checkpoint: fall back to the newest intact one ----------------

def _truncate_state(p: Path):
    for f in (p / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])


def _flip_state(p: Path):
    """Bits flipped in the middle of the largest array file: it still decodes (to NaNs)."""
    f = max((p / "state").rglob("*"), key=lambda f: f.stat().st_size if f.is_file() else -1)
    b = bytearray(f.read_bytes())
    b[len(b) // 2:len(b) // 2 + 64] = b"\xff" * 64
    f.write_bytes(bytes(b))


DAMAGE = {
    "no-state": (lambda p: shutil.rmtree(p / "state"), "no state/"),
    "no-data": (lambda p: shutil.rmtree(p / "data"), "no data/"),
    "empty": (lambda p: (shutil.rmtree(p), p.mkdir()), "an empty folder"),
    "bad-json": (lambda p: (p / "data" / "metadata").write_text("{bad"), "JSONDecodeError"),
    "truncated": (_truncate_state, "skipping checkpoint 15"),
    "flipped-bits": (_flip_state, "differs from the one saved with it (its bytes changed)"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_resume_falls_back_to_the_newest_intact_checkpoint(run, straight_run, kind):
    damage, why = DAMAGE[kind]
    damage(run / "checkpoints" / "15")
    r = fit(["--run-dir", run, "--resume"])
    assert r.exit_code == 0, r.output
    assert f"skipping checkpoint 15 in {run / 'checkpoints'}: " in r.stderr and why in r.stderr
    assert f"resumed {run} at step 10" in r.stderr and "done: step 20" in r.stdout
    assert step_dirs(run / "checkpoints") == [10, 15, 20]  # 15 written again
    assert step_dirs(run / "checkpoints-damaged") == [15]  # the damaged one kept aside
    assert [x["step"] for x in records(run)] == list(range(1, 21))  # 11-15 not twice
    if kind in ("no-state", "flipped-bits"):  # it is the uninterrupted run, bit for bit
        pa, da = final_params(run)
        pb, db = final_params(straight_run)
        assert da == db
        for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
            np.testing.assert_array_equal(x, y)


def test_no_intact_checkpoint_is_one_line_and_predict_falls_back(run):
    from train.predict import predictor

    shutil.rmtree(run / "checkpoints" / "15" / "state")
    model = predictor.load(run)  # `train eval` / `train predict` load through this
    assert model.step == 10
    with pytest.raises(InputError, match="15: damaged checkpoint \\(no state/\\)"):
        predictor.load(run, step=15)
    for s in (5, 10):
        shutil.rmtree(run / "checkpoints" / str(s) / "data")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    exit_2_one_line(fit(["--run-dir", run, "--resume"]),
                   "no intact checkpoint (15: no state/; 10: no data/; 5: no data/)",
                   "start a new --run-dir")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


# --- deep JSON: one line, not a RecursionError (issue item 10) --------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def test_a_deeply_nested_manifest_or_config_is_one_line(copy, run, tmp_path):
    (copy / mf.MANIFEST_NAME).write_text(DEEP)
    where = copy / mf.MANIFEST_NAME
    exit_2_one_line(prep(["verify", copy]), f"{where}: unreadable manifest (nested too deeply)")
    exit_2_one_line(fit(["--data", copy, "--run-dir", tmp_path / "new", *FLAGS]),
                   f"{where}: unreadable manifest (nested too deeply)")
    assert not (tmp_path / "new").exists()
    (run / "config.json").write_text(DEEP)
    want = f"{run / 'config.json'}: missing or unreadable (nested too deeply)"
    exit_2_one_line(fit(["--run-dir", run, "--resume"]), want)
    exit_2_one_line(fit(["eval", run]), f"{run / 'config.json'}: unreadable (nested too deeply)")
    exit_2_one_line(fit(["predict", run, "--src", "192.0.2.7", "--dst", "192.0.2.8"]),
                   f"{run / 'config.json'}: unreadable (nested too deeply)")


# --- --run-dir that is a file, or under one (issue item 11) ----------------------------

@pytest.mark.parametrize("where", ["file", "under-file"])
def test_a_run_dir_that_is_a_file_is_one_line(shards, tmp_path, where):
    f = tmp_path / "afile"
    f.write_text("x")
    run = f if where == "file" else f / "run"
    for args in ([], ["--resume"]):
        r = fit(["--data", shards, "--run-dir", run, *FLAGS, *args])
        exit_2_one_line(r, f"--run-dir {run}: " + (
            "a file, not a folder" if where == "file" else f"{f} is a file, not a folder"))
    assert f.read_text() == "x"


# --- one trainer per run folder (issue item 8) ------------------------------------------

def test_a_run_that_is_training_is_locked(shards, tmp_path):
    run = tmp_path / "run"
    seen = {}

    def second(step):
        if step == 4:  # checkpoint 2 exists: a resume would find something to take
            seen["resume"] = fit(["--run-dir", run, "--resume"])
            seen["again"] = fit(["--data", shards, "--run-dir", run, *FLAGS])
            seen["files"] = sorted(p.relative_to(run) for p in run.rglob("*"))

    # the schedule of small()'s 20 steps: the step compiled for the runs above, not another
    s = train(small(shards, run, steps=6, schedule_steps=20, ckpt_every=2), on_step=second)
    assert s["step"] == 6 and not s["interrupted"]
    want = f"{run}: another `train` (pid {os.getpid()}) is training this run"
    exit_2_one_line(seen["resume"], want, "wait for it to end")
    exit_2_one_line(seen["again"], want)
    assert step_dirs(run / "checkpoints") == [2, 4, 6]
    assert [x["step"] for x in records(run)] == list(range(1, 7))  # one writer only
    # the lock goes with its holder: the run resumes afterwards
    r = fit(["--run-dir", run, "--resume", "--steps", "8"])
    assert r.exit_code == 0, r.output
    assert "done: step 8" in r.stdout
    assert not (run / ".lock").exists()  # gone with its holder


# --- checksums and non-finite losses (issue item 3) ------------------------------------

def test_a_checkpoint_with_flipped_bits_is_refused_by_eval_and_predict(run):
    from train.predict import predictor

    _flip_state(run / "checkpoints" / "15")
    assert predictor.load(run).step == 10  # falls back
    with pytest.raises(InputError, match="15: damaged checkpoint \\(sha256 of state/.* differs"):
        predictor.load(run, step=15)
    digests = json.loads((run / "checkpoints" / "10" / "sha256.json").read_text())
    assert "data/metadata" in digests and any(k.startswith("state/") for k in digests)


def _poisoned_steps(monkeypatch, at: int):
    """train_step gives NaN parameters and loss from step ``at`` on."""
    import train.fit.loop as loop

    real = loop.step_lib.compile_steps

    def compile_steps(*a, **kw):
        train_step, eval_step = real(*a, **kw)
        calls = [0]

        def poisoned(state, batch):
            state, metrics = train_step(state, batch)
            calls[0] += 1
            if calls[0] >= at:
                state = dict(state, params=jax.tree.map(lambda x: x * np.nan, state["params"]))
                metrics = dict(metrics, loss=metrics["loss"] * np.nan)
            return state, metrics
        return poisoned, eval_step

    monkeypatch.setattr(loop.step_lib, "compile_steps", compile_steps)


@pytest.mark.parametrize("at", [8, 10])  # between checkpoints, and on one
def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
        shards, tmp_path, monkeypatch, at):
    _poisoned_steps(monkeypatch, at)
    run = tmp_path / "run"
    r = fit(["--data", shards, "--run-dir", run, *FLAGS[:-1], "5"])  # checkpoints every 5
    exit_2_one_line(r, f"step {at}: loss nan, gradient norm ",
                   "not finite; training stopped without saving this state; the last good "
                   f"checkpoint is step 5 in {run / 'checkpoints'}: resume from it")
    assert step_dirs(run / "checkpoints") == [5]
    assert [x["step"] for x in records(run)] == [5]
    params, _ = final_params(run)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


# --- Ctrl-C stops at the step under way, and says which (issue item 19) ------------------

def test_ctrl_c_stops_at_the_step_it_names_with_at_most_one_step_in_flight(
        shards, tmp_path, monkeypatch, capsys):
    import train.fit.loop as loop

    real, outs = loop.step_lib.compile_steps, []

    def compile_steps(*a, **kw):
        train_step, eval_step = real(*a, **kw)

        def recorded(state, batch):
            state, metrics = train_step(state, batch)
            outs.append(metrics["loss"])
            return state, metrics
        return recorded, eval_step

    monkeypatch.setattr(loop.step_lib, "compile_steps", compile_steps)
    in_flight = []

    def check(step):
        in_flight.append(sum(not x.is_ready() for x in outs[:step - 1]))
        if step == 6:
            os.kill(os.getpid(), signal.SIGINT)

    s = train(small(shards, tmp_path / "run", steps=20, log_every=100), on_step=check)
    assert s["interrupted"] and s["step"] == 6
    assert "SIGINT: stopping at step 6 and saving a checkpoint" in capsys.readouterr().err
    assert in_flight == [0] * 6  # every step before the one under way is done
    assert step_dirs(tmp_path / "run" / "checkpoints") == [6]


# --- a skipped checkpoint's late read failures are not echoed (issue item 12) -----------

LATE_ECHO = '''
import os, sys
import orbax.checkpoint as ocp
from train.fit.checkpoint import Checkpointer

ck = Checkpointer(sys.argv[1])
step, _, _ = ck.restore_intact()
ck.close()

class Pending:
    def __await__(self):
        yield

# one of the skipped checkpoint's concurrent reads, failing only now (a slow disk): Orbax's
# coroutine is finalized with its TensorStore error, after restore_intact has returned
ns = {}
exec(compile("async def read():\\n    try:\\n        await Pending()\\n    finally:\\n"
             "        raise ValueError('OUT_OF_RANGE: Error reading zarr in OCDBT database')\\n",
             os.path.join(os.path.dirname(ocp.__file__), "late_read.py"), "exec"),
     {"Pending": Pending}, ns)
coro = ns["read"]()
coro.send(None)
del coro
print(f"done: step {step}", flush=True)
'''


def test_no_echoes_of_a_skipped_checkpoints_reads(run):
    _truncate_state(run / "checkpoints" / "15")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", LATE_ECHO, str(run / "checkpoints")], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == "done: step 10\n"
    assert "skipping checkpoint 15" in p.stderr
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


LATE_TASK = '''
import asyncio, gc, os, sys
import orbax.checkpoint as ocp
from train.fit.checkpoint import Checkpointer

Checkpointer(sys.argv[1]).close()
# one of a failed save's other writes, which Orbax gave up: a task that fails with nobody
# awaiting it, collected once its loop is done (asyncio: "Task exception was never
# retrieved"); and a task of someone else's, whose echo must stay
ns = {}
exec(compile("async def write():\\n    raise ValueError('RESOURCE_EXHAUSTED: No space left')\\n",
             os.path.join(os.path.dirname(ocp.__file__), "late_write.py"), "exec"), ns)

async def other():
    raise KeyError("not a checkpoint's")

async def main():
    tasks = [asyncio.ensure_future(ns["write"]()), asyncio.ensure_future(other())]
    await asyncio.sleep(0.01)
    del tasks

loop = asyncio.new_event_loop()
loop.run_until_complete(main())
loop.close()
gc.collect()
print("done", flush=True)
'''


def test_no_echoes_of_a_failed_saves_abandoned_writes(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", LATE_TASK, str(tmp_path / "checkpoints")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "done\n", p.stderr[-3000:]
    assert p.stderr.count("Task exception was never retrieved") == 1, p.stderr[-3000:]
    assert "not a checkpoint's" in p.stderr  # other tasks' echoes pass
    assert "late_write" not in p.stderr and "RESOURCE_EXHAUSTED" not in p.stderr, p.stderr


# --- a full disk under the checkpoints: one line, the last good one kept (issue item 9) ---

@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (one tiny checkpoint fits, two do not); skipped where mount is not
    allowed (not root)."""
    d = tmp_path / "disk"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


# An Orbax write task that fails after the run has stopped is echoed by asyncio ("Task
# exception was never retrieved", in about 1 of 3 runs before the Checkpointer dropped it:
# test_no_echoes_of_a_failed_saves_abandoned_writes).
def test_a_full_disk_under_the_checkpoints_stops_the_run_in_one_line(shards, small_disk,
                                                                    xla_cache):
    run = small_disk / "run"
    p = subprocess.run([sys.executable, "-m", "train.cli", "--data", str(shards), "--run-dir",
                        str(run), *FLAGS[:-1], "5"], cwd=REPO, env=_env(xla_cache),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.splitlines()
    assert lines[-1] == (f"error: {run / 'checkpoints'}: checkpoint 10 not saved: no space "
                         "left on the device; training stopped; the last good "
                         "checkpoint is step 5: free some space, then resume it with "
                         f"`train --run-dir {run} --resume`"), p.stderr[-3000:]
    assert not [x for x in lines if x.startswith("error:")][:-1]
    assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr[-3000:]
    assert sorted(x.name for x in (run / "checkpoints").iterdir()) == ["5"]  # no *-tmp left
    # it stops at the first log line or checkpoint that sees the failed save, not at the end
    assert [x["step"] for x in records(run)] in ([5, 10], [5, 10, 15])
