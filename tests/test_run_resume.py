"""Resuming a run: a resume is bound to its run's settings and data and takes them back;
past a damaged newest checkpoint it falls back to the newest intact one, and with none left
it refuses in one line; unreadable JSON in the run folder or the manifest is one line too.

Every CLI case asserts the exit code, the one `error:` line (no traceback) and what is on
disk afterwards. Runs are tiny (tests/helpers.py's `small()`), each a second or two.
"""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import (
    FLAGS,
    assert_same_end,
    exit_2_one_line,
    fit,
    prep,
    python_c,
    records,
    small,
    step_dirs,
    stop_at,
    write_dataset,
)

from prep.base.errors import InputError
from prep.schema import manifest as mf
from train.fit.checkpoint import params_mismatch
from train.fit.config import TrainConfig
from train.fit.loop import train

# --- a resume is bound to its run ---------------------------------------------------------

@pytest.fixture(scope="module")
def stopped_run(shards, tmp_path_factory):
    """A run stopped (SIGINT) at step 15 with checkpoints at 5, 10 and 15."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    s = train(small(shards, run, ckpt_every=5), on_step=stop_at(15))
    assert s["interrupted"] and s["step"] == 15
    assert step_dirs(run / "checkpoints") == [5, 10, 15]
    for step in (5, 10, 15):  # each sealed with the digests of all its files (the damage
        d = run / "checkpoints" / str(step)  # tests below read them; a flake once missed 15's)
        files = {f.relative_to(d).as_posix() for f in d.rglob("*") if f.is_file()}
        assert sorted(json.loads((d / "sha256.json").read_text())) == sorted(
            files - {"sha256.json"}), step
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


def test_resume_on_another_dataset_names_both_datasets(shards, run, tmp_path):
    """A user trial asked for it: a run folder's config.json of one dataset, resumed with
    --data of another, is refused naming both (by path and by the fingerprint of its shards)."""
    from train.fit.reader import dataset_fingerprint, open_shards

    other = write_dataset(tmp_path / "other", seed=7)
    fp = {d: dataset_fingerprint(open_shards(d)) for d in (shards, other)}
    assert fp[shards] != fp[other]
    assert exit_2_one_line(fit(["--run-dir", run, "--resume", "--data", other])) == (
        f"error: --data {other}: not the dataset the run in {run} trained on ({shards}: "
        f"fingerprint {fp[shards]}, this one {fp[other]}); drop --data to resume on the run's "
        "own, or start a new --run-dir")
    assert step_dirs(run / "checkpoints") == [5, 10, 15]


def test_resume_compares_loss_weights_by_their_weights_and_names_an_empty_one():
    """#36 item 22: the same --loss-weights in another order were refused, and an empty
    one read "has  (its config.json)"."""
    from train.fit.runfolder import check_resume

    saved = {"train": {"loss_weights": "rtt=10,result=10"}, "data_fingerprint": "fp"}
    assert check_resume(saved, TrainConfig(run_dir="r", loss_weights="result=10, rtt=10"),
                        "fp") == []
    with pytest.raises(InputError) as e:
        check_resume({"train": {"loss_weights": ""}},
                     TrainConfig(run_dir="r", loss_weights="rtt=5"), "fp")
    assert str(e.value) == ('--loss-weights rtt=5: the run in r has "" (its config.json); drop '
                            "--loss-weights to resume with the run's own, or start a new --run-dir")


def test_resume_of_a_run_without_a_fingerprint_says_its_data_is_unchecked():
    """A config.json written before runs recorded their dataset's fingerprint: the resume
    says it cannot check --data, not nothing."""
    from train.fit.runfolder import check_resume

    notes = check_resume({"train": {"data": "shards"}}, TrainConfig(run_dir="r", data="s2"),
                         "ab12")
    assert notes == ["the run in r recorded no dataset fingerprint (its config.json), so --data "
                     "s2 cannot be checked against what it trained on; from here on it is this "
                     "one's (ab12)"]


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
    assert_same_end(run, straight_run)


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


def test_resume_of_a_run_a_live_trainer_writes_says_so_before_its_first_checkpoint(tmp_path):
    """A user trial: `train --resume` of a run another `train` was writing, before its first
    checkpoint, said the run never saved one; its lock says who is training it."""
    import os

    from train.fit.runfolder import run_lock

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": {}}))
    lock = run_lock(run)
    lock.acquire()  # the trainer: this process, through another open file of the lock
    try:
        assert exit_2_one_line(fit(["--run-dir", run, "--resume"])) == (
            f"error: {run}: another `train` (pid {os.getpid()}) is training this run; wait for "
            "it to end, or stop it (Ctrl-C saves a checkpoint), then --resume")
        assert (run / ".lock").read_text() == f"{os.getpid()}\n"  # the trainer's, untouched
    finally:
        lock.release()
    exit_2_one_line(fit(["--run-dir", run, "--resume"]), f"{run}: no checkpoint to resume")
    # train() itself holds the lock when it reads the run: that is no other trainer
    with pytest.raises(InputError, match=f"^{run}: no checkpoint to resume"):
        train(TrainConfig(data=str(tmp_path / "shards"), run_dir=str(run), resume=True))


# --- damaged checkpoints: fall back to the newest intact one, or one line -----------------

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
        assert_same_end(run, straight_run)


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


def test_a_checkpoint_with_flipped_bits_is_refused_by_eval_and_predict(run):
    from train.predict import predictor

    _flip_state(run / "checkpoints" / "15")
    assert predictor.load(run).step == 10  # falls back
    with pytest.raises(InputError, match="15: damaged checkpoint \\(sha256 of state/.* differs"):
        predictor.load(run, step=15)
    digests = json.loads((run / "checkpoints" / "10" / "sha256.json").read_text())
    assert "data/metadata" in digests and any(k.startswith("state/") for k in digests)


def test_predict_past_a_damaged_checkpoint_names_the_step_it_answers_from(run):
    """A user trial: past a damaged newest checkpoint, `train predict` answered from an older
    one and said only that it skipped the damaged one (`train eval` names the step it
    evaluates, a resume the step it resumes)."""
    from train.cli import main

    _flip_state(run / "checkpoints" / "15")
    ping = ["predict", str(run), "--src", "192.0.2.7", "--dst", "193.0.14.129", "--json"]
    r = CliRunner().invoke(main, ping)
    assert r.exit_code == 0, r.output
    skip, note = r.stderr.splitlines()
    assert skip.startswith(f"skipping checkpoint 15 in {run / 'checkpoints'}: sha256 of state/")
    assert skip.endswith("differs from the one saved with it (its bytes changed)")
    assert note == (f"train predict: answering from {run} at step 10, its newest intact "
                    f"checkpoint; resume the run (`train --run-dir {run} --resume`) to set the "
                    "damaged ones aside and train their steps again")
    ten = CliRunner().invoke(main, [*ping, "--step", "10"])
    assert ten.exit_code == 0 and ten.stderr == "", ten.output
    assert json.loads(r.stdout) == json.loads(ten.stdout)
    exit_2_one_line(CliRunner().invoke(main, [*ping, "--step", "15"]),
                    f"error: {run}/checkpoints/15: damaged checkpoint (sha256 of state/",
                    "pick another --step, or resume the run to fall back to an intact one")
    assert step_dirs(run / "checkpoints") == [5, 10, 15]  # predict sets nothing aside


def test_a_checkpoint_of_another_model_than_config_json_is_one_line(run):
    """A user trial: a run folder whose config.json names one model and whose checkpoints
    hold another's parameters ended `train eval` and `train predict` in KeyError: 'wave_in'."""
    from train.cli import main

    cfg = json.loads((run / "config.json").read_text())
    cfg["model"]["byte_features"] = 7  # this model reads wave_in and wave_out
    (run / "config.json").write_text(json.dumps(cfg))
    line = (f"error: {run}/checkpoints/15: the checkpoint at step 15 holds the parameters of "
            "another model than the run's config.json says (missing wave_in, wave_out); do not "
            "mix run folders: keep each run's config.json with the checkpoints it saved")
    for args in (["eval", run], ["predict", run, "--src", "192.0.2.7", "--dst", "193.0.14.129",
                                 "--time", "2026-01-01T12:00:00Z"]):
        assert exit_2_one_line(CliRunner().invoke(main, list(map(str, args)))) == line
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert exit_2_one_line(fit(["--run-dir", run, "--resume"])) == line  # not damage: kept
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    # names and shapes, a few of each
    assert params_mismatch({"a": (2,), "b": {"c": (3, 4)}, "x": (1,), "y": (1,), "z": (1,),
                            "w": (1,)}, {"a": (2,), "b": {"c": (3, 5)}}) == (
        "extra w, x, y and 1 more; b/c (3, 4), the model's (3, 5)")
    assert params_mismatch({"a": (2,), "old": (1,)}, {"a": (2,)}) is None  # unread: no matter


# --- a run a live trainer is saving: `train eval` / `train predict` beside it -------------

PING = ["--src", "192.0.2.7", "--dst", "193.0.14.129", "--json"]


def test_a_checkpoint_rotated_away_as_a_reader_lists_them_is_no_traceback(run, monkeypatch):
    """A user trial: `train eval` of a run whose trainer was saving ended in a
    FileNotFoundError traceback: as a save completed, the trainer's rotation (max_to_keep)
    removed the oldest step folder while Orbax read every step's metadata."""
    from orbax.checkpoint._src.path import step as orbax_step

    from train.cli import main

    real = orbax_step.Metadata.commit_timestamp

    def rotated(self):  # the trainer removes step 5 as the reader gets to it
        if self.step == 5:
            shutil.rmtree(self.path)
        return real.fget(self)

    monkeypatch.setattr(orbax_step.Metadata, "commit_timestamp", property(rotated))
    r = CliRunner().invoke(main, ["predict", str(run), *PING])
    assert r.exit_code == 0 and r.stderr == "", r.output
    given = CliRunner().invoke(main, ["predict", str(run), *PING, "--step", "15"])
    assert json.loads(r.stdout) == json.loads(given.stdout)  # the newest: 15


def test_checkpoints_rotated_away_as_they_are_read_are_not_damage(run, monkeypatch):
    """The newest checkpoint removed while it is read (a trainer that saved as many newer
    ones meanwhile): one line saying to try again, not "damaged" and "start a new
    --run-dir"."""
    import orbax.checkpoint as ocp

    from train.cli import main

    real = ocp.CheckpointManager.restore

    def restore(self, step, *a, **k):  # all three rotated away as the reader starts on 15
        for s in (5, 10, 15):
            shutil.rmtree(run / "checkpoints" / str(s), ignore_errors=True)
        return real(self, step, *a, **k)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
    r = CliRunner().invoke(main, ["predict", str(run), *PING])
    assert exit_2_one_line(r) == (
        f"error: {run / 'checkpoints'}: checkpoints 15, 10, 5 were removed as read: a live "
        "`train` is saving this run and keeps only its newest checkpoints; try again")
    assert "skipping" not in r.stderr and not (run / "checkpoints-damaged").exists()


def test_the_newest_checkpoint_of_a_live_run_is_read_with_a_note_on_its_digests(run):
    """A live trainer writes a step's sha256.json with its next checkpoint: until then its
    newest, complete, is read unverified, and the note says why (it said "an older version
    wrote it, or the run ended before its digests")."""
    from train.cli import main

    (run / "checkpoints" / "15" / "sha256.json").unlink()
    r = CliRunner().invoke(main, ["predict", str(run), *PING])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [
        f"note: checkpoint 15 in {run / 'checkpoints'} has no sha256.json (a live `train` "
        "writes it with its next checkpoint or at its end; a run killed before that, or an "
        "older version, wrote none): restored without checking it"]


# --- a skipped checkpoint's late read failures are not echoed -----------------------------

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
    p = python_c(LATE_ECHO, run / "checkpoints")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == "done: step 10\n"
    assert "skipping checkpoint 15" in p.stderr
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]


# --- deeply nested JSON: one line, not a RecursionError -----------------------------------

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
