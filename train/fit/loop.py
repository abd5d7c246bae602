"""The training loop: read, step, log every N steps, evaluate every M, checkpoint, resume.

Each step reads only the step before's loss and gradient norm, so the host runs at most one
step ahead of the device; a value that is not finite stops the run naming the step, before
anything of it is saved, so the last checkpoint is a good one. The log lines and the eval
sample are train.fit.meter's; the run folder (its lock, config.json, metrics.jsonl and what
a start or resume must agree with) train.fit.runfolder's; checkpoints train.fit.checkpoint's.

The first SIGINT or SIGTERM finishes the step under way, names it, saves a checkpoint
(state + data iterator) and returns; a second aborts at once. With `train --distributed`
(train.fit.multihost) every process runs this loop in step; process 0 alone locks, logs and
writes; a signal on any one stops all after the same step.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from prep.base.errors import InputError
from prep.base.lock import FolderLock
from prep.base.signals import StopSoftly
from prep.schema.splits import more_test_rows
from train.fit import multihost, reader, runfolder
from train.fit import step as step_lib
from train.fit.checkpoint import Checkpointer, step_dirs
from train.fit.config import TrainConfig, preset_text, start_warnings
from train.fit.meter import EvalSample, Meter, format_line
from train.fit.runfolder import RunLog
from train.model import arch, attention, failprior, model
from train.model import store as store_lib
from train.model.arch import ModelConfig, model_config
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


def train(cfg: TrainConfig, *, devices=None, on_step=None, preset: dict | None = None) -> dict:
    """Train per ``cfg``; returns a summary (last loss, eval loss, mean throughput, MFU).

    ``devices``: the mesh (default: all); ``on_step(step)`` runs after each step (tests);
    ``preset``: the settings a --model preset chose (the config line names them).
    The run folder is locked (runfolder.run_lock) from before its config is read to the
    end, by process 0 of a run on several processes (train.fit.multihost), whose refusal
    stops them all.
    """
    run_dir = Path(cfg.run_dir)
    runfolder.check_agree(cfg)  # several processes: the same run, before any of them acts
    runfolder.check_run_dir(run_dir)
    lock = runfolder.run_lock(run_dir)
    # before reading the run: a live trainer may be writing it
    refused = runfolder.take(lock) if multihost.is_primary() and run_dir.is_dir() else None
    multihost.check_all("lock", refused)
    try:
        return _train(cfg, run_dir, lock, devices, on_step, preset)
    finally:
        lock.release()


def _checked_start(cfg: TrainConfig, run_dir: Path):
    """(cfg with its schedule span fixed, the run's config.json record or None, the local
    dataset, its manifest and fingerprint, notes for a resume): everything that can refuse
    a start, checked before anything is written."""
    # train() holds the run's lock already (process 0; a refusal stopped them all)
    saved = runfolder.load_run(run_dir, held=True) if cfg.resume else None
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
    runfolder.check_same_data(cfg, fingerprint)
    notes = runfolder.check_resume(saved, cfg, fingerprint) if saved is not None else []
    reader.require_rows(data, manifest, "train",
                        "rebuild the dataset with `prep shards` from more measurements")
    if cfg.eval_every:
        reader.require_rows(data, manifest, "test", "pass --eval-every 0 to train without "
                            "in-training eval, or " + more_test_rows(manifest.get("config", {})))
    reader.check_data(data, manifest, splits, check=cfg.data_check)
    return cfg, saved, data, manifest, fingerprint, notes


def _train(cfg: TrainConfig, run_dir: Path, lock: FolderLock, devices, on_step, preset) -> dict:
    cfg, saved, data, manifest, fingerprint, notes = _checked_start(cfg, run_dir)
    mcfg = model_config(cfg.model, seq_len=manifest["row_len"])
    tables, store_lines = {}, []
    if saved is not None and isinstance(saved.get("model"), dict):
        # a resume continues the model it began, as config.json has it (its checkpoint holds
        # that model's parameters and stores: a store a run turned off, or a field added to
        # the model since, which a saved config lacks and ModelConfig defaults to off)
        mcfg = ModelConfig(**saved["model"])
    elif mcfg.dst_store or mcfg.pair_store or mcfg.context_fail_anchor:
        # the train split's replies (and failures), before the state
        mcfg, tables, store_lines = _store_tables(mcfg, data, manifest)
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
    per_batch = (impl == "cudnn" and cfg.segment_tables == "batch"
                 and jax.process_count() == 1)
    it = iter(reader.to_device(reader.batches(
        data, "train", batch_size=cfg.batch_size // jax.process_count(), seed=cfg.seed,
        num_workers=cfg.num_workers, manifest=manifest), rows, segments=per_batch))
    ckpt = log = None
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
        refused = runfolder.take(lock, make=True) if primary else None
        multihost.check_all("start", refused)  # and the folder is there for every process
        ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints)
        if saved is not None:
            start, state = _resume(ckpt, state, it, run_dir, notes, say)
        else:
            for line in store_lines:
                say(line)
            state = dict(state, params={**state["params"], **{
                k: jax.device_put(t, rep) for k, t in tables.items()}})
        if primary:
            runfolder.write_json(run_dir / "config.json", {
                "train": dataclasses.asdict(cfg), "model": dataclasses.asdict(mcfg),
                "data_fingerprint": fingerprint, "attention": impl,
                "devices": [str(d) for d in mesh.devices.flat],
                "processes": jax.process_count(), "jax": jax.__version__})
        log = RunLog(run_dir, resumed_at=start if saved is not None else None, say=say)
        return _run(cfg, mcfg, att, mesh, state, it, ckpt, log, eval_sample, start, on_step,
                    per_batch)
    finally:
        it.close()
        if ckpt is not None:
            ckpt.close()
        if log is not None:
            log.close()
        if primary and created and lock.held and runfolder.never_started(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)  # a start that made no step


def _store_tables(mcfg, data, manifest: dict):
    """(mcfg, {field: table}, log lines): the stores (ModelConfig.dst_store, pair_store,
    krig_store) built from the train split (train.model.store). A pair store that no train
    reply finds its reverse pair in (probes pinging targets that never ping back) is not
    read there for the run (its gate would learn nothing, and its lookups cost a quarter of
    a CPU step), nor at a measurement's own pair where no pair has STORE_MIN replies; off
    for the run where neither read is left; a line says so, and the run's config.json
    records it; so it does pair_recent 0, where the train split says a pair's latest replies
    predict no better than all of them (ModelConfig.pair_recent_check); and pair_shared
    where its test probes are its train probes (ModelConfig.pair_shared_by_split)."""
    tok, seg = reader.read_split(data, manifest, "train", sha256=False)
    tables, lines = {}, []
    split = manifest.get("config", {}).get("split", "probe")
    if (mcfg.pair_store and not mcfg.pair_shared and mcfg.pair_shared_by_split
            and split == "time"):
        lines.append("pair store: a NAT address's pairs stored too"
                     + (", their failures read" if mcfg.pair_fail else "")
                     + " (pair_shared for this run: the data set is split by time alone, so its "
                     "test probes are its train probes, whose own history such a pair holds)")
        mcfg = dataclasses.replace(mcfg, pair_shared=True, pair_shared_fail=mcfg.pair_fail)
    # the rows decoded once for the recency check and both pair tables, where they read
    # times or shared addresses (store.build decodes them itself where not given)
    timed_read = mcfg.pair_recent or mcfg.pair_fail or not mcfg.pair_shared
    t = store_lib.timed(tok, seg) if mcfg.pair_store and timed_read else None
    fold = mcfg.gate_fold if mcfg.store_without_fold else 0
    if fold:
        lines.append(f"stores: built without the gate fold's contexts (1 in {fold}, by source), "
                     "on which the gates learn")
    if mcfg.pair_store and mcfg.pair_forward:  # a known probe's pairs stay in it
        lines.append(f"pair store: built without 1 context in {mcfg.pair_forward} (by "
                     "context) instead, on which its read at a measurement's own pair learns")
    if mcfg.pair_store and mcfg.pair_recent and mcfg.pair_recent_check:
        check = store_lib.recency_check(tok, seg, mcfg.pair_recent, pair_fold=mcfg.pair_forward,
                                        without_shared=not mcfg.pair_shared, t=t)
        lines.append(check.line())
        if not check.latest_better:
            mcfg = dataclasses.replace(mcfg, pair_recent=0)
    for key, field in (("dst", "dst_store"), ("pair", "pair_store")):
        if not getattr(mcfg, field):
            continue
        table, summary = store_lib.build(tok, seg, getattr(mcfg, field), key=key,
                                         by_source=key == "dst" and mcfg.store_by_source,
                                         fold=0 if key == "pair" and mcfg.pair_forward
                                         else fold,
                                         pair_fold=mcfg.pair_forward if key == "pair" else 0,
                                         min_count=(mcfg.pair_min if key == "pair"
                                                    else arch.STORE_MIN),
                                         recent=(mcfg.pair_recent if key == "pair"
                                                 and not mcfg.own_latest else 0),
                                         failures=key == "pair" and mcfg.pair_fail,
                                         fail_recent=(mcfg.pair_fail_recent
                                                      if key == "pair" and mcfg.pair_fail
                                                      else 0),
                                         without_shared=key == "pair" and not mcfg.pair_shared,
                                         shared_fails=key == "pair" and _shared_fails(mcfg),
                                         t=t)
        lines.append(summary.line())
        if key == "pair":  # what the data turns off here: arch.SET_BY_DATA
            if mcfg.pair_forward and summary.own == 0:
                lines.append(f"pair store: its read at a measurement's own pair is off for this "
                             f"run (no address pair has {mcfg.pair_min} train replies)"
                             + (", and with it its failures' read" if mcfg.pair_fail else ""))
                mcfg = dataclasses.replace(mcfg, pair_forward=0, pair_fail=False)
                table = table[:, :arch.STORE_K + 2]
            elif mcfg.own_latest:  # the same rows, each pair's latest replies' quantiles
                tables["pair_latest"] = _pair_latest(tok, seg, mcfg, table, t)
                n = mcfg.pair_recent
                lines.append(f"pair store: read at a measurement's own pair over each pair's "
                             f"latest {n} repl{'y' if n == 1 else 'ies'} (a second table), "
                             "at the reverse pair over all of them")
            if summary.answered == 0 and mcfg.pair_forward:
                lines.append("pair store: its read at the reverse pair is off for this run (no "
                             "train reply has its reverse pair, so nothing would teach its "
                             "gate); it is read at a measurement's own pair")
                mcfg = dataclasses.replace(mcfg, pair_reverse=False)
            elif summary.answered == 0:
                lines.append("pair store: off for this run (no train reply has its reverse "
                             "pair, so nothing would teach its gate)")
                mcfg = dataclasses.replace(mcfg, pair_store=0)
                continue
        tables[field] = table
    if mcfg.context_fail and mcfg.context_fail_anchor:  # P(failed)'s start: the rule fit
        tables["fanchor"], line = _anchor_start(tok, seg, mcfg)
        lines.append(line)
    if mcfg.fail_dst and "dst_store" in tables:  # the rule's priors by destination
        tables["fail_dst"], line = store_lib.fail_offsets(tok, seg, tables["dst_store"])
        lines.append(line)
    if mcfg.fail_broken:  # P(broken) per family, on the rule fit above
        tables["fbroken"], line = _broken_start(tok, seg, mcfg, tables["fanchor"])
        lines.append(line)
    if mcfg.dst_store and mcfg.krig_store:  # read through the destination store's medians
        table, noise, summary = store_lib.build_krig(tok, seg, mcfg.krig_store,
                                                     tables["dst_store"], fold=fold)
        lines.append(summary.line())
        tables |= {"krig_store": table, "krig_noise": np.array([noise], np.float32)}
    return mcfg, tables, lines


# rows whose results fit P(failed)'s start (16,384 rows of 256 tokens: ~82k results whose
# destination came first, ~5 s of counting on a CPU; all 244k train rows of the built-in
# world's: 52 s, the same fit)
ANCHOR_ROWS = 16384


def _anchor_start(tok, seg, mcfg) -> tuple[np.ndarray, str]:
    """(fanchor's start, a log line): ModelConfig.context_fail_anchor's rule fit (Brier, the
    context baselines' grids with a constant live rate) on the train rows' results (of at
    most ANCHOR_ROWS rows, a seeded sample), each with its row's counts before it, and
    their failure rate."""
    rows = _anchor_rows(len(tok))
    counts, failed = model.result_fail_counts(tok[rows], seg[rows])
    if not len(failed):
        return np.zeros(6, np.float32), "P(failed): no result in the train rows to fit its start"
    rate = float(failed.mean())
    prior = failprior.fit_counts(counts, failed, rate, live_share=False)
    live = 0.1 if prior.live is None else prior.live
    return failprior.anchor_start(prior, rate, mcfg.context_fail), (
        f"P(failed) starts at the rule that fits the train rows' {len(failed):,} results best: "
        f"their rate {rate:.3f} over {prior.context:g} pseudo-pings (the context's share), "
        f"a pair's {prior.pair:g} of a live {live:g}, dead with prior {prior.dead:g} at "
        f"{prior.dead_rate:g}")


def _anchor_rows(n: int) -> np.ndarray:
    """The train rows P(failed)'s start is fit on: all, or a seeded sample of ANCHOR_ROWS
    (the counts cost a row's T x T match)."""
    rows = np.arange(n)
    if n > ANCHOR_ROWS:
        rows = np.sort(np.random.default_rng(0).choice(rows, ANCHOR_ROWS, replace=False))
    return rows


def _broken_start(tok, seg, mcfg, fanchor: np.ndarray) -> tuple[np.ndarray, str]:
    """(fbroken, a log line): ModelConfig.fail_broken's priors, IPv4's and IPv6's
    (train.model.failprior.fit_broken: the Brier on the results whose context's earlier
    pings of their family all failed), under the rule ``fanchor`` sets, on _anchor_start's
    rows."""
    rows = _anchor_rows(len(tok))
    p, family, n, loglik, failed = model.result_family_chain(tok[rows], seg[rows], fanchor,
                                                              mcfg.context_fail)
    broken = failprior.fit_broken(p, family, n, loglik, failed)
    at = [int(((family == f) & (n > 0)).sum()) for f in (4, 6)]
    return np.asarray(broken, np.float32), (
        f"P(failed): a broken address family at the probe, prior {broken[0]:g} for IPv4 and "
        f"{broken[1]:g} for IPv6, fit on the {at[0]:,} and {at[1]:,} results whose context's "
        f"earlier pings of their family had all failed")


def _shared_fails(mcfg) -> bool:
    """Whether the pair store reads a NAT address's pairs' failures
    (ModelConfig.pair_shared_fail)."""
    return bool(mcfg.pair_fail and mcfg.pair_shared and mcfg.pair_shared_fail)


def _pair_latest(tok, seg, mcfg, table: np.ndarray, t) -> np.ndarray:
    """The pair store's table ``table`` (built over all replies) with each pair's quantiles
    over its latest mcfg.pair_recent replies instead (ModelConfig.pair_recent_own): the
    same rows, as a row's place depends on its pair and its counts alone."""
    latest, _ = store_lib.build(tok, seg, mcfg.pair_store, key="pair",
                                pair_fold=mcfg.pair_forward, min_count=mcfg.pair_min,
                                recent=mcfg.pair_recent,
                                failures=mcfg.pair_fail,
                                fail_recent=mcfg.pair_fail_recent if mcfg.pair_fail else 0,
                                without_shared=not mcfg.pair_shared,
                                shared_fails=_shared_fails(mcfg), t=t)
    K = arch.STORE_K
    if not np.array_equal(latest[:, K:], table[:, K:]):  # counts, checks, failures
        raise RuntimeError("the pair store's latest replies took other rows than all of them")
    return latest[:, :K + 2]


def _resume(ckpt: Checkpointer, state: dict, it, run_dir: Path, notes: list[str], say):
    """(step, state) of the newest intact checkpoint, the data iterator set to it; damaged
    newer ones moved aside, metrics after it dropped. Another model's checkpoint is not
    damage to move aside: one line (Checkpointer.check_model)."""
    ckpt.check_model(ckpt.latest_step(), state["params"])
    start, state, data_state = ckpt.restore_intact(state)
    if ckpt.skipped:
        moved = ckpt.set_aside([s for s, _ in ckpt.skipped], run_dir / "checkpoints-damaged")
        say(f"moved the damaged checkpoints to {', '.join(map(str, moved))}")
    it.set_state(data_state)
    if multihost.is_primary():
        runfolder.trim_metrics(run_dir / "metrics.jsonl", start)
    say(f"resumed {run_dir} at step {start}")
    for n in notes:
        say(f"note: {n}")
    return start, state


def _check_finite(k: int, metrics: dict, ckpt: Checkpointer) -> None:
    """InputError (one line) if step ``k``'s loss or gradient norm is not finite (waits for
    step ``k``); nothing of that state is saved."""
    loss, norm = (float(x) for x in jax.device_get((metrics["loss"], metrics["grad_norm"])))
    if math.isfinite(loss) and math.isfinite(norm):
        return
    good = ckpt.latest_step()
    keep = (f"the last good checkpoint is step {good} in {ckpt.directory}: resume from it "
            "(a lower --lr, or another --seed in a new --run-dir)" if good is not None
            else "no checkpoint was saved; start again with a lower --lr")
    raise InputError(f"step {k}: loss {loss:g}, gradient norm {norm:g}, not finite; "
                     f"training stopped without saving this state; {keep}")


def table_size(segments: int, most: int) -> int:
    """cuDNN's segment-table size for a batch whose fullest row holds ``segments``: the
    smallest power of two that holds them (at least 2: a table of one reads as "not
    packed"), at most ``most`` (the dataset's)."""
    return min(max(2, 1 << max(segments - 1, 0).bit_length()), max(most, 2))


def _run(cfg: TrainConfig, mcfg, att: AttentionConfig, mesh, state: dict, it,
         ckpt: Checkpointer, run_log: RunLog, eval_sample, start: int, on_step,
         per_batch: bool = False) -> dict:
    """The loop proper: steps ``start``..``cfg.steps``, logs, evals, checkpoints; a signal
    (GracefulStop) ends it after the current step with a checkpoint. ``per_batch``: the
    iterator yields (batch, most segments in a row) and each batch runs the step compiled
    for its segment-table size (``table_size``); a step that compiled one is not timed."""
    train_step, eval_step = step_lib.compile_steps(mesh, mcfg, cfg, att)
    tables: dict[int, int] = {}  # table size -> steps run with it
    peak = step_lib.peak_flops()
    flops_of = lambda tok, ctx: model.train_flops(mcfg, tok, ctx)
    primary = multihost.is_primary()  # process 0 logs (train.fit.multihost)
    log = print if primary else (lambda *a, **k: None)
    hosts = f" on {jax.process_count()} processes" if jax.process_count() > 1 else ""
    log(f"model {cfg.model}: {arch.n_params(mcfg):,} parameters, "
        f"{mcfg.n_layers} layers, d_model {mcfg.d_model}, seq {mcfg.seq_len} | attention "
        f"{att.implementation}"
        + (f" (segment tables per batch, up to {att.max_segments})" if per_batch else "")
        + f" | {mesh.size} x {mesh.devices.flat[0].device_kind}{hosts} | "
        f"batch {cfg.batch_size} | {cfg.compute_dtype}", file=sys.stderr)

    meter, step, last, eval_loss = Meter(), start, {}, None

    def log_line():
        rec = {"step": step, **meter.flush(flops_of)}
        if "flops_per_s" in rec:
            rec["mfu"] = rec["flops_per_s"] / (peak * mesh.size) if peak else None
        log(format_line(rec, cfg.steps), flush=True)
        run_log.write(rec)
        return rec

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
            fresh = False
            if per_batch:
                batch, most = batch
                size = table_size(most, att.max_segments)
                fresh = size not in tables
                tables[size] = tables.get(size, 0) + 1
                train_step = step_lib.compile_steps(
                    mesh, mcfg, cfg, dataclasses.replace(att, max_segments=size))[0]
            if fresh and prev is not None:  # the steps before end inside the window's time
                jax.block_until_ready(prev[1]["loss"])
            t_step = time.perf_counter()
            state, metrics = train_step(state, batch)
            step += 1
            if fresh and step > start + 1:  # it compiled: its time leaves the window's
                jax.block_until_ready(metrics["loss"])
                meter.t0 += time.perf_counter() - t_step
            if prev is not None:  # waits for the step before: the host runs at most one
                _check_finite(*prev, ckpt)  # step ahead of the device, so a stop is one away
            prev = (step, metrics)
            meter.add(metrics, wait, timed=step > start + 1 and not fresh)
            if step == start + 1:  # compilation: start the clock after it
                jax.block_until_ready(metrics["loss"])
                meter.t0 = time.perf_counter()
            interval = False
            if step % cfg.log_every == 0 or step == cfg.steps:
                _check_finite(step, metrics, ckpt)
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
                    run_log.write({"step": step, **ev})
                interval = True
            if cfg.ckpt_every and step % cfg.ckpt_every == 0:
                _check_finite(step, metrics, ckpt)  # a checkpoint holds finite states only
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
            _check_finite(*prev, ckpt)
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
            "params": arch.n_params(mcfg), "attention": att.implementation,
            "segment_tables": {str(k): v for k, v in sorted(tables.items())} or None}
