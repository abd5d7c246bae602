"""The training loop: read, step, log every N steps, evaluate every M, checkpoint, resume.

One log line per ``log_every`` steps, e.g.

    step   200/300 | loss 2.7314 | 41.2 ms | 198,513 tok/s | mfu - | wait 0.4% | lr 1.1e-03

loss averaged over those steps, real (non-padding) tokens/s, MFU (FLOPs on real tokens,
train.model.model; "-" where the device's peak is unknown) and the share of wall time spent
waiting for a batch; the first step (compilation) is left out. The same numbers go to
``RUN_DIR/metrics.jsonl`` (with ``eval_loss`` every ``eval_every`` steps) and TensorBoard
(train.fit.board). Each step reads only the step before's loss and gradient norm, so the
host runs at most one step ahead of the device; a value that is not finite stops the run
naming the step, before anything of it is saved, so the last checkpoint is a good one.

The first SIGINT or SIGTERM finishes the step under way, names it, saves a checkpoint
(state + data iterator) and returns; a second aborts at once. One trainer per run folder
(``RUN_DIR/.lock``, ``run_lock``; a second is one line naming the holder's pid), and a run is
bound to its config.json: ``resume`` takes the newest intact checkpoint (damaged ones named
and moved to ``checkpoints-damaged/``) and refuses other settings (config.RUN_BINDING) or
shards (``data_fingerprint``). Whatever can refuse a start is checked before the run folder
is made, and a start that fails leaves no folder it made.

With `train --distributed` (train.fit.multihost) every process runs this loop in step;
process 0 alone locks, logs and writes; a signal on any one stops all after the same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from prep.base.atomic import write_atomic
from prep.base.errors import InputError
from prep.base.lock import FolderLock
from prep.base.signals import StopSoftly
from train.fit import multihost, reader
from train.fit import step as step_lib
from train.fit.board import MISSING, Board
from train.fit.checkpoint import Checkpointer, step_dirs
from train.fit.config import RUN_BINDING, TrainConfig, flag, preset_text, start_warnings
from train.model import attention, model
from train.model.arch import model_config
from train.model.attention import AttentionConfig


class GracefulStop(StopSoftly):
    """SIGINT or SIGTERM: the loop saves and leaves after the step under way; a second
    one aborts."""

    def announce(self, step: int, signum: int | None = None) -> None:
        """Say where the run stops (``signum``: the signal that stopped it, on whichever
        process it came; this one's by default)."""
        again = " (again to abort)" if self.requested else ""
        print(f"{signal.Signals(signum or self.signum).name}: stopping at step {step} and "
              f"saving a checkpoint{again}", file=sys.stderr, flush=True)


class Meter:
    """Device metrics of the steps since the last log line, plus host-side timings."""

    def __init__(self):
        self.totals = {"time": 0.0, "wait": 0.0, "tokens": 0.0, "flops": 0.0}
        self.reset()

    def reset(self):
        self.pending, self.timed, self.wait, self.t0 = [], [], 0.0, time.perf_counter()

    def add(self, metrics: dict, wait: float, timed: bool):
        self.pending.append(metrics)
        self.timed.append(timed)
        self.wait += wait if timed else 0.0

    def flush(self, flops_of) -> dict:
        """Fetch (the one host sync) and summarize; timed steps exclude compilation."""
        fetched = jax.device_get(self.pending)
        elapsed = time.perf_counter() - self.t0
        n_timed = sum(self.timed)
        out = {"loss": sum(float(m["loss"]) for m in fetched) / len(fetched),
               "grad_norm": float(fetched[-1]["grad_norm"]), "lr": float(fetched[-1]["lr"])}
        if n_timed:
            timed = [m for m, t in zip(fetched, self.timed) if t]
            tokens = sum(float(m["tokens"]) for m in timed)
            flops = sum(flops_of(float(m["tokens"]), float(m["attn_ctx"])) for m in timed)
            for k, v in (("time", elapsed), ("wait", self.wait), ("tokens", tokens),
                         ("flops", flops)):
                self.totals[k] += v
            out.update(step_ms=1e3 * elapsed / n_timed, tokens_per_s=tokens / elapsed,
                       flops_per_s=flops / elapsed, data_wait=self.wait / elapsed)
        self.reset()
        return out


def _fmt(rec: dict, steps: int) -> str:
    mfu = f"{100 * rec['mfu']:.1f}%" if rec.get("mfu") is not None else "-"
    timing = (f"{rec['step_ms']:.1f} ms | {rec['tokens_per_s']:,.0f} tok/s | mfu {mfu} | "
              f"wait {100 * rec['data_wait']:.1f}%" if "step_ms" in rec else "(compiling)")
    return (f"step {rec['step']:>{len(str(steps))}}/{steps} | loss {rec['loss']:.4f} | "
            f"{timing} | lr {rec['lr']:.1e}")


class EvalSample:
    """A fixed, seeded sample of ``cfg.eval_rows`` test rows, read once, with the role of
    every target (prep.tokens.rowdecode); each eval runs the current parameters over all of it."""

    def __init__(self, cfg: TrainConfig, data: Path, manifest: dict, rows_sharding):
        from prep.schema.rows import RowFormatError
        from prep.tokens import rowdecode

        tok, seg = reader.read_split(data, manifest, "test", sha256=False)  # checked at start
        pick = np.random.default_rng([cfg.seed, 0xE7A1]).permutation(len(tok))[:cfg.eval_rows]
        tok, seg = tok[np.sort(pick)], seg[np.sort(pick)]
        try:  # the roles themselves are read on the device (train.model.model.loss_by_role)
            rowdecode.token_roles(tok, seg)
            self.roles_known = True
        except RowFormatError:  # rows that are not measurements (synthetic test shards)
            self.roles_known = False
        self.n_rows, self.sharding = len(tok), rows_sharding
        # global batches of cfg.batch_size rows, this process's contiguous part of each (as
        # the train batches), the last padded (padding rows count nothing)
        self.pi, self.pc = jax.process_index(), jax.process_count()
        self.batch = max(1, cfg.batch_size // self.pc)
        self.arrays = [tok, seg]

    def __call__(self, params, eval_step) -> dict | None:
        from prep.tokens.rowdecode import ROLES

        if not self.n_rows:
            return None
        total = count = 0
        tok, seg = self.arrays
        for r0 in range(0, max(len(tok), 1), self.batch * self.pc):
            lo = r0 + self.pi * self.batch
            part = {k: _pad(a[lo:lo + self.batch], self.batch) for k, a in
                    zip(("tokens", "segment_ids"), (tok, seg))}
            batch = {k: jax.make_array_from_process_local_data(self.sharding, v)
                     for k, v in part.items()}
            s, c = eval_step(params, batch)
            total, count = total + s, count + c
        total, count = np.asarray(total, np.float64), np.asarray(count, np.float64)
        if not count.sum():
            return None
        out = {"eval_loss": float(total.sum() / count.sum()), "eval_rows": self.n_rows}
        if self.roles_known:
            out["eval_loss_by_role"] = {ROLES[k]: float(total[k] / count[k])
                                        for k in range(1, len(ROLES)) if count[k]}
        return out


def _pad(a: np.ndarray, n: int) -> np.ndarray:
    return a if len(a) == n else np.concatenate([a, np.zeros((n - len(a),) + a.shape[1:], a.dtype)])


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


def load_run(run_dir: str | os.PathLike) -> dict:
    """The config.json record of a run that ``resume`` can continue; InputError (one line)
    if the folder is missing (or a file), has no checkpoint, or no readable config.json."""
    check_run_dir(run_dir)
    d = Path(run_dir)
    if not d.is_dir():
        raise InputError(f"{d}: no such run folder; start the run without --resume")
    if not step_dirs(d / "checkpoints"):
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


def _write_json(path: Path, obj) -> None:
    """Whole or not at all (temp file + rename)."""
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def _trim_metrics(path: Path, step: int) -> None:
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


def train(cfg: TrainConfig, *, devices=None, on_step=None, preset: dict | None = None) -> dict:
    """Train per ``cfg``; returns a summary (last loss, eval loss, mean throughput, MFU).

    ``devices``: the mesh (default: all); ``on_step(step)`` runs after each step (tests);
    ``preset``: the settings a --model preset chose (the config line names them).
    The run folder is locked (``run_lock``) from before its config is read to the end, by
    process 0 of a run on several processes (train.fit.multihost), whose refusal stops
    them all.
    """
    run_dir = Path(cfg.run_dir)
    check_agree(cfg)  # several processes: the same run, before any of them acts on it
    check_run_dir(run_dir)
    lock = run_lock(run_dir)
    refused = None
    if multihost.is_primary() and run_dir.is_dir():  # before reading the run: a live
        try:                                         # trainer may be writing it
            lock.acquire()
        except InputError as e:
            refused = str(e)
    multihost.check_all("lock", refused)
    try:
        return _train(cfg, run_dir, lock, devices, on_step, preset)
    finally:
        lock.release()


def _train(cfg: TrainConfig, run_dir: Path, lock: FolderLock, devices, on_step, preset) -> dict:
    saved = load_run(run_dir) if cfg.resume else None
    if not cfg.schedule_steps:  # fixed for the run's life: its own, or this start's --steps
        old = saved["train"] if saved is not None else {}
        cfg = dataclasses.replace(cfg, schedule_steps=int(
            old.get("schedule_steps") or old.get("steps") or cfg.steps))
    if not cfg.resume and step_dirs(run_dir / "checkpoints"):
        raise InputError(f"{run_dir} already holds a run at step "
                         f"{max(step_dirs(run_dir / 'checkpoints'))}; pass --resume to "
                         "continue it, or choose another --run-dir")
    try:
        step_lib.role_weights(cfg.loss_weights)
    except ValueError as e:
        raise InputError(str(e)) from None
    splits = ["train"] + (["test"] if cfg.eval_every else [])
    data = reader.local_copy(cfg.data, splits)  # a bucket's dataset: its checked local copy
    manifest = reader.open_shards(data)
    fingerprint = reader.dataset_fingerprint(manifest)
    check_same_data(cfg, fingerprint)
    notes = check_resume(saved, cfg, fingerprint) if saved is not None else []
    reader.require_rows(data, manifest, "train",
                        "rebuild the dataset with `prep shards` from more measurements")
    if cfg.eval_every:
        reader.require_rows(data, manifest, "test", "pass --eval-every 0 to train without "
                            "in-training eval, or rebuild with `prep shards --test-fraction` above 0")
    reader.check_data(data, manifest, splits, check=cfg.data_check)
    mcfg = model_config(cfg.model, seq_len=manifest["row_len"])
    impl = attention.resolve(cfg.attention, bias=bool(mcfg.match_dst))
    # max_segments sizes cuDNN's per-row segment tables; the JAX wrapper treats a table
    # of one segment as "not packed", so it is at least 2
    att = AttentionConfig(impl, max_segments=max(2, reader.max_segments(manifest)),
                          dtype=cfg.compute_dtype)
    mesh = step_lib.make_mesh(devices)
    rep, rows = step_lib.shardings(mesh)
    if cfg.batch_size % mesh.size:
        raise InputError(f"--batch-size {cfg.batch_size} does not split over {mesh.size} "
                         f"devices; use a multiple of {mesh.size}")
    state = step_lib.init_state(mcfg, step_lib.make_optimizer(cfg, mcfg), cfg.seed, rep)
    it = iter(reader.to_device(reader.batches(
        data, "train", batch_size=cfg.batch_size // jax.process_count(), seed=cfg.seed,
        num_workers=cfg.num_workers, manifest=manifest), rows))
    ckpt = metrics_file = board = None
    primary = multihost.is_primary()  # writes the run folder's own files, and logs
    say = (lambda msg: print(msg, file=sys.stderr)) if primary else (lambda msg: None)
    created = not run_dir.exists()
    start = 0
    try:
        eval_sample = EvalSample(cfg, data, manifest, rows) if cfg.eval_every else None
        # the run starts here: nothing above wrote anything (nor printed the config)
        say("config: " + ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
        if preset:  # where those values came from: a preset sets more than its name says
            say(f"preset {cfg.model} set: {preset_text(preset)} (flags given override them)")
        for w in start_warnings(cfg, manifest["row_len"], jax.devices()[0].platform):
            say(f"warning: {w}")
        refused = None
        if primary:
            run_dir.mkdir(parents=True, exist_ok=True)
            try:
                lock.acquire()
            except InputError as e:
                refused = str(e)
        multihost.check_all("start", refused)  # and the folder is there for every process
        ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints)
        if saved is not None:
            start, state, data_state = ckpt.restore_intact(state)
            if ckpt.skipped:
                moved = ckpt.set_aside([s for s, _ in ckpt.skipped], run_dir / "checkpoints-damaged")
                say(f"moved the damaged checkpoints to {', '.join(map(str, moved))}")
            it.set_state(data_state)
            if primary:
                _trim_metrics(run_dir / "metrics.jsonl", start)
            say(f"resumed {run_dir} at step {start}")
            for n in notes:
                say(f"note: {n}")
        if primary:
            _write_json(run_dir / "config.json", {
                "train": dataclasses.asdict(cfg), "model": dataclasses.asdict(mcfg),
                "data_fingerprint": fingerprint, "attention": impl,
                "devices": [str(d) for d in mesh.devices.flat],
                "processes": jax.process_count(), "jax": jax.__version__})
            metrics_file = open(run_dir / "metrics.jsonl", "a" if saved is not None else "w")
            board = Board(run_dir, purge_step=start + 1 if saved is not None else None)
            if not board.available:
                say(MISSING)
        return _run(cfg, mcfg, att, mesh, state, it, ckpt, metrics_file, eval_sample, start,
                    on_step, board)
    finally:
        it.close()
        if ckpt is not None:
            ckpt.close()
        if metrics_file is not None:
            metrics_file.close()
        if board is not None:
            board.close()
        if primary and created and lock.held and _never_started(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)  # a start that made no step


def _never_started(run_dir: Path) -> bool:
    """No checkpoint and no metrics: nothing a resume could take or a person would want."""
    metrics = run_dir / "metrics.jsonl"
    return run_dir.is_dir() and not step_dirs(run_dir / "checkpoints") and \
        (not metrics.is_file() or metrics.stat().st_size == 0)


def _run(cfg: TrainConfig, mcfg, att: AttentionConfig, mesh, state: dict, it,
         ckpt: Checkpointer, metrics_file, eval_sample, start: int, on_step,
         board: Board | None = None) -> dict:
    """The loop proper: steps ``start``..``cfg.steps``, logs, evals, checkpoints; a signal
    (GracefulStop) ends it after the current step with a checkpoint."""
    train_step, eval_step = step_lib.compile_steps(mesh, mcfg, cfg, att)
    peak = step_lib.peak_flops()
    flops_of = lambda tok, ctx: model.train_flops(mcfg, tok, ctx)
    primary = metrics_file is not None  # process 0 logs (train.fit.multihost)
    log = print if primary else (lambda *a, **k: None)
    hosts = f" on {jax.process_count()} processes" if jax.process_count() > 1 else ""
    log(f"model {cfg.model}: {model.count_params(state['params']):,} parameters, "
        f"{mcfg.n_layers} layers, d_model {mcfg.d_model}, seq {mcfg.seq_len} | attention "
        f"{att.implementation} | {mesh.size} x {mesh.devices.flat[0].device_kind}{hosts} | "
        f"batch {cfg.batch_size} | {cfg.compute_dtype}", file=sys.stderr)

    meter, step, last, eval_loss = Meter(), start, {}, None

    def write(rec):
        if primary:
            metrics_file.write(json.dumps(rec) + "\n")
            metrics_file.flush()
            if board is not None:
                board.add(rec)

    def log_line():
        rec = {"step": step, **meter.flush(flops_of)}
        if "flops_per_s" in rec:
            rec["mfu"] = rec["flops_per_s"] / (peak * mesh.size) if peak else None
        log(_fmt(rec, cfg.steps), flush=True)
        write(rec)
        return rec

    def finite(k: int, metrics: dict) -> None:
        """InputError (one line) if step ``k``'s loss or gradient norm is not finite (waits
        for step ``k``); nothing of that state is saved."""
        loss, norm = (float(x) for x in jax.device_get((metrics["loss"], metrics["grad_norm"])))
        if math.isfinite(loss) and math.isfinite(norm):
            return
        good = ckpt.latest_step()
        keep = (f"the last good checkpoint is step {good} in {ckpt.directory}: resume from it "
                "(a lower --lr, or another --seed in a new --run-dir)" if good is not None
                else "no checkpoint was saved; start again with a lower --lr")
        raise InputError(f"step {k}: loss {loss:g}, gradient norm {norm:g}, not finite; "
                         f"training stopped without saving this state; {keep}")

    prev = None  # (step, metrics) of the step before the one under way
    vote = multihost.StopVote()  # a signal on any process stops all after the same step
    with GracefulStop() as stop:
        while step < cfg.steps:
            target = vote.target_for(step, stop.requested, stop.signum)
            if target is not None and step >= target:
                break
            t0 = time.perf_counter()
            batch = next(it)
            wait = time.perf_counter() - t0
            state, metrics = train_step(state, batch)
            step += 1
            if prev is not None:  # waits for the step before: the host runs at most one
                finite(*prev)     # step ahead of the device, so a stop is one step away
            prev = (step, metrics)
            meter.add(metrics, wait, timed=step > start + 1)
            if step == start + 1:  # compilation: start the clock after it
                jax.block_until_ready(metrics["loss"])
                meter.t0 = time.perf_counter()
            interval = False
            if step % cfg.log_every == 0 or step == cfg.steps:
                finite(step, metrics)
                last = log_line()
                ckpt.check()  # a save that failed in the background stops the run here
                interval = True
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                ev = eval_sample(state["params"], eval_step)
                if ev is not None:
                    eval_loss = ev["eval_loss"]
                    roles = " | ".join(f"{k} {v:.3f}" for k, v in
                                       ev.get("eval_loss_by_role", {}).items())
                    log(f"step {step} | eval loss {eval_loss:.4f} on {ev['eval_rows']:,} "
                        f"test rows" + (f" | {roles}" if roles else ""), flush=True)
                    write({"step": step, **ev})
                interval = True
            if cfg.ckpt_every and step % cfg.ckpt_every == 0:
                finite(step, metrics)  # a checkpoint holds finite states only
                ckpt.save(step, state, it.get_state())
                interval = True
            if interval:  # keep eval and checkpoint time out of the next timings
                meter.reset()
            if on_step is not None:
                on_step(step)
        # a signal from here on aborts (second signal): the checkpoint below is the exit
        if vote.target_for(step, stop.requested, stop.signum) is not None and primary:
            stop.announce(step, vote.signum)
        if prev is not None:
            finite(*prev)
        if meter.pending:  # stopped between log lines: log the steps since the last one
            last = log_line()
        if step > start:
            ckpt.save(step, state, it.get_state())
        ckpt.wait()
        signum = vote.signum
    t = meter.totals
    return {"step": step, "loss": last.get("loss"), "eval_loss": eval_loss,
            "interrupted": signum is not None,
            "signal": signal.Signals(signum).name if signum is not None else None,
            "exit_code": 128 + signum if signum is not None else 0,
            "run_dir": str(cfg.run_dir),
            "tokens_per_s": t["tokens"] / t["time"] if t["time"] else None,
            "data_wait": t["wait"] / t["time"] if t["time"] else None,
            "mfu": t["flops"] / t["time"] / (peak * mesh.size) if t["time"] and peak else None,
            "params": model.count_params(state["params"]), "attention": att.implementation}

