"""The `train` command as a new user meets it: `train --help` reads like `prep --help`
(the commands listed, an example each), a failed start prints nothing about a run it
never made, and `train eval` finds runs the way `--resume` does. All without a model: each
test takes a second or two."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from train.cli import main


def _train(args):
    return CliRunner().invoke(main, args, prog_name="train")


def _section(text: str, title: str) -> list[str]:
    """The lines after ``title`` up to the next blank line."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_help_lists_the_commands_with_an_example_each(flag):
    r = _train([flag])
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == "Usage: train [OPTIONS] [COMMAND] [ARGS]..."
    assert [line.split()[0] for line in _section(r.output, "Commands:")] == [
        "eval", "fit", "pool", "predict"]
    examples = _section(r.output, "  Examples, one per command:")
    assert [line.split()[:2] for line in examples] == [
        ["train", "--data"], ["train", "eval"], ["train", "pool"], ["train", "predict"]]
    assert "`train ARGS` is `train fit ARGS`" in " ".join(r.output.split())


def test_train_fit_help_names_itself_the_default_with_examples():
    for args in (["fit", "--help"], ["--data", "x", "--help"]):
        r = _train(args)
        assert r.exit_code == 0, r.output
        assert r.output.splitlines()[0] == "Usage: train [fit] [OPTIONS]"
        assert _section(r.output, "  Examples:")[0].split()[:3] == ["train", "--data", "shards/"]


def test_a_start_that_fails_prints_no_config_of_a_run_it_never_makes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _train(["--data", str(tmp_path / "nonexist"), "--device", "cpu"])
    assert r.exit_code == 2, r.output
    assert not any(line.startswith("config:") for line in r.output.splitlines()), r.output
    assert r.stderr.splitlines()[-1].startswith(f"error: {tmp_path / 'nonexist'}")
    assert not (tmp_path / "runs").exists()


def _fake_run(d, mtime):
    """A run folder whose one checkpoint (step 10) was saved at ``mtime``."""
    (d / "checkpoints" / "10").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"train": {}, "model": {}}))
    os.utime(d / "checkpoints" / "10", (mtime, mtime))


def test_eval_of_a_folder_of_runs_lists_them_and_names_the_argument(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fake_run(tmp_path / "runs" / "tiny-a", 1_000_000)
    _fake_run(tmp_path / "runs" / "tiny-b", 2_000_000)
    r = _train(["eval", "runs"])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [(
        "error: runs: not a run folder (no config.json or checkpoints/); give RUN_DIR, the "
        "folder of one run: runs/tiny-b, runs/tiny-a (newest first)")]


def test_eval_without_a_run_takes_the_newest_as_resume_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _train(["eval"])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [(
        "error: no run with checkpoints under runs/; give RUN_DIR, e.g. "
        "train eval runs/tiny-20261123-101500")]


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "Invalid value for '--steps': 0 is not in the range x>=1."),
    (["--batch-size", "0"], "Invalid value for '--batch-size': 0 is not in the range x>=1."),
    (["--batch-size", "-1"], "Invalid value for '--batch-size': -1 is not in the range x>=1."),
    (["--log-every", "0"], "Invalid value for '--log-every': 0 is not in the range x>=1."),
    (["--eval-rows", "0"], "Invalid value for '--eval-rows': 0 is not in the range x>=1."),
    (["--warmup", "-1"], "Invalid value for '--warmup': -1 is not in the range x>=0."),
])
def test_counts_out_of_range_are_one_line_and_exit_2_before_any_run(tmp_path, monkeypatch,
                                                                     args, message):
    # issue 36, items 6 and 7: --steps 0 said "done ... in runs/s0" with no runs/s0;
    # --batch-size 0 / -1 were a ZeroDivisionError / StopIteration traceback
    monkeypatch.chdir(tmp_path)
    r = _train(["--data", "shards", "--run-dir", "runs/s0", "--device", "cpu", *args])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[-1] == f"Error: {message}"
    assert "Traceback" not in r.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("value, message", [
    ("-1", "-1.0 is not in the range x>0."),
    ("0", "0.0 is not in the range x>0."),
    ("nan", "nan is not a finite number."),
    ("inf", "inf is not a finite number."),
])
def test_a_learning_rate_that_is_not_positive_and_finite_is_refused(tmp_path, monkeypatch,
                                                                    value, message):
    # a user trial: --lr -1 trained by gradient ascent to the end (exit 0); nan and inf
    # failed later
    monkeypatch.chdir(tmp_path)
    r = _train(["--data", "shards", "--run-dir", "runs/s0", "--device", "cpu", "--lr", value])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[-1] == f"Error: Invalid value for '--lr': {message}"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("field, value, message", [
    ("weight_decay", -0.1, "weight_decay (config.json): -0.1 is not in the range x>=0."),
    ("b1", 1.0, "b1 (config.json): 1.0 is not in the range 0<=x<1."),
    ("b2", -0.5, "b2 (config.json): -0.5 is not in the range 0<=x<1."),
    ("grad_clip", 0.0, "grad_clip (config.json): 0.0 is not in the range x>0."),
    ("min_lr_ratio", float("nan"), "min_lr_ratio (config.json): nan is not a finite number."),
    ("lr", float("-inf"), "--lr: -inf is not in the range x>0."),
])
def test_float_settings_without_a_flag_are_held_to_their_range(field, value, message):
    # what click never sees (a resumed run's config.json, the library) meets the same rule
    from prep.base.errors import InputError
    from train.fit.config import TrainConfig

    with pytest.raises(InputError) as e:
        TrainConfig(**{field: value})
    assert str(e.value) == message


@pytest.mark.parametrize("args", [
    ["--data", "shards", "--run-dir", "runs/s0", "--device", "cpu", "--seed", "-5"],
    ["eval", "runs/s0", "--seed", "-1"],
    ["pool", "runs/s0", "--seed", "-1"],
])
def test_a_negative_seed_is_refused_by_every_command(tmp_path, monkeypatch, args):
    # a user trial: `train --seed -5` and `train eval RUN --seed -1` were a ValueError
    # traceback (numpy: expected non-negative integer)
    monkeypatch.chdir(tmp_path)
    r = _train(args)
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[-1] == (
        f"Error: Invalid value for '--seed': {args[-1]} is not in the range x>=0.")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("plot, why", [
    ("none/x.png", "none/x.png: no such folder none; make it first, or name a file in a "
                   "folder that exists"),
    ("afile/x.png", "afile/x.png: afile is a file, not a folder; name a file in a folder"),
    ("x.foo", "x.foo: matplotlib writes no .foo file; end the name in .png, .pdf or .svg"),
    ("ro/x", "ro/x.png: read-only file system; name a file in a folder you can write"),
], ids=["no-folder", "under-a-file", "suffix", "read-only"])
def test_a_plot_eval_cannot_write_is_refused_before_the_evaluation(tmp_path, monkeypatch, plot,
                                                                  why):
    # a user trial: FileNotFoundError / OSError tracebacks once the evaluation (minutes) was
    # done; here the run folder is not even read
    from helpers import read_only

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "ro").mkdir()
    with read_only(monkeypatch, tmp_path / "ro"):
        r = _train(["eval", "runs/none", "--plot", plot])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[-1] == f"Error: Invalid value for '--plot': {why}"
    assert list((tmp_path / "ro").iterdir()) == []


def test_a_plot_without_a_suffix_is_the_png_matplotlib_writes(tmp_path, monkeypatch):
    from prep.base.plotfile import PlotFile

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.b").mkdir()
    assert [PlotFile().convert(p, None, None) for p in ("x", "x.", "a.b/x", "x.PDF")] == [
        "x.png", "x.png", "a.b/x.png", "x.PDF"]


@pytest.mark.parametrize("args, message", [
    (["--queries", "gone.parquet", "--out", "a.parquet"],
     "--queries gone.parquet: no such file; check the path"),
    (["--queries", "d", "--out", "a.parquet"], "--queries d: a folder; --queries takes one "
                                               "parquet file"),
    (["--src", "192.0.2.7", "--dst", "193.0.14.129", "--history", "d"],
     "--history d: a folder; --history takes one parquet file"),
    (["--src", "192.0.2.7", "--dst", "193.0.14.129", "--history", "gone.parquet"],
     "--history gone.parquet: no such file; check the path"),
], ids=["queries-missing", "queries-folder", "history-folder", "history-missing"])
def test_predict_files_that_are_not_there_or_folders_are_one_line(tmp_path, monkeypatch, args,
                                                                  message):
    # a user trial: a missing --queries was "not a readable parquet file"; a --history
    # folder was click's usage and "File 'd' is a directory."; both before any model loads
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    r = _train(["predict", "runs/none", *args])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [f"error: {message}"]


def test_the_newest_run_is_the_one_that_saved_last_not_the_one_last_touched(tmp_path,
                                                                            monkeypatch):
    # issue 36, item 5: "newest" was the run folder's mtime, which a refused resume (its
    # lock file) or an eval (eval/) moves, so a bare `train eval` / `train --resume` took
    # the run last looked at
    monkeypatch.chdir(tmp_path)
    _fake_run(tmp_path / "runs" / "tiny-a", 1_000_000)
    _fake_run(tmp_path / "runs" / "tiny-b", 2_000_000)
    (tmp_path / "runs" / "tiny-a" / "eval").mkdir()  # a later eval of the older run
    os.utime(tmp_path / "runs" / "tiny-b", (2_000_000, 2_000_000))  # folders: a touched last
    os.utime(tmp_path / "runs" / "tiny-a", (3_000_000, 3_000_000))
    from train.cli import _newest_run

    assert _newest_run() == Path("runs") / "tiny-b"
    r = _train(["eval", "runs"])
    assert r.stderr.splitlines()[-1].endswith("runs/tiny-b, runs/tiny-a (newest first)")
