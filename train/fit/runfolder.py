"""The run folder: who may write it, what it is bound to, what a start or resume must agree
with, and its records.

    RUN_DIR/.lock            one trainer per run (``run_lock``: prep.base.lock)
    RUN_DIR/config.json      the settings, model shape and dataset fingerprint it runs with
    RUN_DIR/metrics.jsonl    one record per log line and eval (``RunLog``)
    RUN_DIR/checkpoints/     train.fit.checkpoint

A run is bound to its config.json: a resume refuses other settings (config.RUN_BINDING) or
shards (the data fingerprint) in one line (``check_resume``), and redoes the steps after its
checkpoint (``trim_metrics``). With several processes (train.fit.multihost) all must agree
on the settings and the dataset first (``check_agree``, ``check_same_data``); process 0
alone locks and writes. Whatever can refuse a start is checked before the folder is made,
and a start that made no step leaves no folder it made (``never_started``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

from prep.base.atomic import write_atomic
from prep.base.errors import InputError, fs_failure
from prep.base.lock import FolderLock
from train.fit import multihost
from train.fit import step as step_lib
from train.fit.board import MISSING, Board
from train.fit.checkpoint import step_dirs
from train.fit.config import RUN_BINDING, TrainConfig, flag


def check_run_dir(run_dir: str | os.PathLike) -> None:
    """InputError (one line) if ``run_dir`` is a file or lies under one (no folder can be
    made there)."""
    d = Path(run_dir)
    fix = "choose another --run-dir"
    if os.path.lexists(d) and not d.is_dir():
        raise InputError(f"--run-dir {d}: a file, not a folder; {fix}")
    for up in d.absolute().parents:
        if os.path.lexists(up):
            if not up.is_dir():
                raise InputError(f"--run-dir {d}: {up} is a file, not a folder; {fix}")
            break


def load_run(run_dir: str | os.PathLike, *, held: bool = False) -> dict:
    """The config.json record of a run that ``resume`` can continue; InputError (one line)
    if the folder is missing (or a file), has no checkpoint, or no readable config.json.
    A run with no checkpoint yet may be one a live trainer is writing: unless the caller
    holds the run's lock (``held``: train.fit.loop), its line (``run_lock``) says so, not
    that the run never saved one."""
    check_run_dir(run_dir)
    d = Path(run_dir)
    if not d.is_dir():
        raise InputError(f"{d}: no such run folder; start the run without --resume")
    if not step_dirs(d / "checkpoints"):
        if not held and multihost.is_primary():  # process 0 alone locks (train.fit.loop)
            lock = run_lock(d)
            with contextlib.suppress(OSError):  # a folder it cannot lock: the line below
                lock.acquire()  # a live trainer's: InputError, the line a resume gets later
            lock.release()
        raise InputError(f"{d}: no checkpoint to resume (the run never saved one); start it "
                         "again without --resume")
    try:
        record = json.loads((d / "config.json").read_text())
        if not isinstance(record.get("train"), dict):
            raise ValueError("no 'train' settings")
    except (OSError, ValueError, AttributeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise InputError(f"{d / 'config.json'}: missing or unreadable ({why}), so the run's "
                         "settings are unknown; start a new --run-dir") from None
    return record


# What each process of a run may set for itself: where its copy of the dataset lies (held
# to the others' by its fingerprint, ``check_same_data``), its reader's worker processes,
# and how closely it checks its shards
PER_PROCESS = ("data", "num_workers", "data_check")


def check_agree(cfg: TrainConfig) -> None:
    """Several processes (train.fit.multihost): InputError on every one, naming the first
    setting in which a process differs from process 0. Steps, intervals or the model
    differing would hang the collectives or crash in them; the lr, the seed, or the run
    folder differing would train a model no one asked for."""
    mine = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in PER_PROCESS}
    said = [json.loads(v) for v in multihost.gather("settings", json.dumps(mine))]
    for p, theirs in enumerate(said[1:], 1):
        for k in mine:
            if not same_setting(k, theirs.get(k), said[0].get(k)):
                raise InputError(f"{flag(k)} differs between the processes of the run: "
                                 f"{_shown(said[0].get(k))} on process 0, {_shown(theirs.get(k))} "
                                 f"on process {p}; start `train --distributed` on every host "
                                 "with the same settings")


def _shown(v) -> str:
    """A setting's value in a message: "" for an empty one, as a shell would take it."""
    return '""' if v == "" else str(v)


def same_setting(k: str, a, b) -> bool:
    """Whether two values of TrainConfig field ``k`` set the same run: --loss-weights by
    the weights they give (in any order), the others as they are."""
    if k == "loss_weights" and a != b:
        with contextlib.suppress(ValueError, AttributeError):
            return step_lib.role_weights(a) == step_lib.role_weights(b)
    return a == b


def check_same_data(cfg: TrainConfig, fingerprint: str) -> None:
    """Several processes: InputError on every one unless all read the same dataset."""
    said = [json.loads(v) for v in multihost.gather(
        "data", json.dumps({"data": cfg.data, "fingerprint": fingerprint}))]
    for p, theirs in enumerate(said[1:], 1):
        if theirs["fingerprint"] != said[0]["fingerprint"]:
            raise InputError(f"--data differs between the processes of the run: process 0 "
                             f"reads {said[0]['data']} (fingerprint {said[0]['fingerprint']}), "
                             f"process {p} {theirs['data']} (fingerprint "
                             f"{theirs['fingerprint']}); give every process the same dataset")


def check_resume(saved: dict, cfg: TrainConfig, fingerprint: str) -> list[str]:
    """InputError (one line) if ``cfg`` differs from the run's recorded settings in one
    that binds it (config.RUN_BINDING) or reads another dataset (by shard digests); notes
    on the settings that may change (stderr) otherwise."""
    old, run = saved["train"], cfg.run_dir
    for k in RUN_BINDING:
        if k in old and not same_setting(k, old[k], getattr(cfg, k)):
            raise InputError(f"{flag(k)} {_shown(getattr(cfg, k))}: the run in {run} has "
                             f"{_shown(old[k])} (its config.json); drop {flag(k)} to resume "
                             "with the run's own, or start a new --run-dir")
    had = saved.get("data_fingerprint")
    if had is not None and had != fingerprint:
        if os.path.abspath(old.get("data", "")) == os.path.abspath(cfg.data):
            raise InputError(f"{cfg.data}: its shards changed since the run in {run} started "
                             f"(fingerprint {fingerprint}, the run's {had}); resume with the "
                             "dataset it trained on, or start a new --run-dir")
        raise InputError(f"--data {cfg.data}: not the dataset the run in {run} trained on "
                         f"({old.get('data')}: fingerprint {had}, this one {fingerprint}); "
                         "drop --data to resume on the run's own, or start a new --run-dir")
    notes = []
    if had is None:  # (a run started before runs recorded it)
        notes.append(f"the run in {run} recorded no dataset fingerprint (its config.json), so "
                     f"--data {cfg.data} cannot be checked against what it trained on; from "
                     f"here on it is this one's ({fingerprint})")
    span, had_span = cfg.schedule_steps, old.get("schedule_steps") or old.get("steps")
    if had_span is not None and span != had_span:
        notes.append(f"{flag('schedule_steps')} {span} (the run's schedule spanned {had_span}): "
                     f"the learning-rate schedule is re-spanned to {span} steps, so the rate "
                     "rises again from where the old schedule had brought it")
    elif old.get("steps") not in (None, cfg.steps) and cfg.steps > span:
        notes.append(f"{flag('steps')} {cfg.steps} (the run had {old['steps']}): steps after "
                     f"{span} run at the schedule's final rate {cfg.lr * cfg.min_lr_ratio:.2g} "
                     f"(pass {flag('schedule_steps')} {cfg.steps} to re-span it instead)")
    return notes


def write_json(path: Path, obj) -> None:
    """Whole or not at all (temp file + rename)."""
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def trim_metrics(path: Path, step: int) -> None:
    """Drop records after ``step`` (a resume from an earlier checkpoint redoes those steps)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError, RecursionError):
            continue  # a torn last line of a killed run
    write_atomic(path, "".join(x + "\n" for x in keep))


def run_lock(run_dir: Path) -> FolderLock:
    """One trainer per run folder: prep.base.lock on ``RUN_DIR/.lock``."""
    return FolderLock(run_dir, "train", doing="is training this run",
                      stop="stop it (Ctrl-C saves a checkpoint), then --resume")


def take(lock: FolderLock, *, make: bool = False) -> str | None:
    """Lock the run folder (``make``: make it first): None, or the one line of why not:
    another trainer holds it, or its disk takes no folder or file there (full, read-only,
    not writable: prep.base.errors.fs_failure, naming --run-dir)."""
    try:
        if make:
            lock.folder.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except InputError as e:
        return str(e)
    except OSError as e:
        err = fs_failure(e, lock.folder, flag="--run-dir", then=None)
        if err is None:
            raise
        return str(err)
    return None


def never_started(run_dir: Path) -> bool:
    """No checkpoint and no metrics: nothing a resume could take or a person would want."""
    metrics = run_dir / "metrics.jsonl"
    return run_dir.is_dir() and not step_dirs(run_dir / "checkpoints") and \
        (not metrics.is_file() or metrics.stat().st_size == 0)


class RunLog:
    """``metrics.jsonl`` and its TensorBoard twin (train.fit.board), written by process 0
    only: a record a line, flushed as written; a resumed run appends (after
    ``trim_metrics``)."""

    def __init__(self, run_dir: Path, *, resumed_at: int | None, say):
        self.file = self.board = None
        if not multihost.is_primary():
            return
        self.file = open(run_dir / "metrics.jsonl", "a" if resumed_at is not None else "w")
        self.board = Board(run_dir, purge_step=resumed_at + 1 if resumed_at is not None else None)
        if not self.board.available:
            say(MISSING)

    def write(self, rec: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
            self.board.add(rec)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.board.close()
