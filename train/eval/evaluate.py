"""`train eval RUN_DIR`: on the test split, the model against every predictor with its information.

Steps (all on the test split's first epoch, so each measurement counts once):

1. **Next-token loss and accuracy by token role**: the test rows as stored, teacher-forced;
   each counted target (prep.schema.rows) goes under the role of the token it predicts
   (prep.schema.vocab.ROLES).
2. **RTT queries**: every measurement of every test context in ``full`` timestamp mode (an
   unbiased sample of contexts, drawn by a hash) is a query given the measurements before
   it. Contexts are re-encoded with the result block last (train.predict.predictor) and read
   in one teacher-forced pass plus one probe pass for the second RTT byte: P(failed) and the
   exact RTT median, p10 and p90, and the point it is scored by: its band point at the band
   the ``pair_mode`` baseline picks on the train split (its median where that picks the
   median; ``model_median`` beside it). ``partial``/``none`` contexts lack timestamps, so
   they are in step 1 only. ``model_no_context`` encodes each query alone: how much the
   model reads its context.
3. **Baselines**: train-fit (train.eval.baselines: from (source, destination)) and context
   baselines (train.eval.context_baselines: the query's earlier measurements, as the model).
4. **Metrics** (train.eval.metrics) for the model and each baseline, overall, by stratum and
   by context length; intervals resample whole sources (``source_groups``). Truth: each
   measurement's RTT code's bin value. Fewer than 1,000 queries with a reply: a warning.

Warnings are the report's ``warnings``, said once: in the table, or with --json on stderr
(train.cli); ``evaluate`` prints none of its own.

``--max-queries N`` takes test rows in a seeded order until they hold N measurements, and
exactly N RTT queries. The result is a table (train.eval.report), a JSON document (also
``RUN_DIR/eval/step-<S>.json``, or ``step-<S>-q<N>.json`` for a sample), every query's
answers beside it (``step-<S>.answers.npz``, train.eval.answers: what `train pool` scores
across evaluations) and optionally a figure (train.eval.plot).
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import asdict, dataclass

import jax
import numpy as np
from tqdm import tqdm

from prep.base.errors import InputError
from prep.base.signals import stop_on_signals
from prep.schema import manifest as manifest_lib
from prep.schema.splits import more_test_rows
from prep.tokens import rowdecode
from train.eval import answers, baselines, context_baselines, registry
from train.eval import metrics as EM
from train.eval.report import report_path, write_report
from train.fit.reader import dataset_fingerprint, local_copy, read_split
from train.model import model
from train.model.failprior import DST_SHRINK
from train.model.store import local_scope
from train.predict import predictor as P

PREDICTORS = registry.PREDICTORS  # the report's order (train/eval/registry.py)


@dataclass(frozen=True)
class EvalConfig:
    run_dir: str  # a run folder written by `train`
    data: str | None = None  # shards folder; default: the one the run trained on
    step: int | None = None  # checkpoint; default: the latest
    max_queries: int = 0  # 0 = the whole test split
    seed: int = 0  # the sample drawn under max_queries, and the bootstrap's resamples
    batch_size: int | None = None  # rows per forward pass; default: the run's, at most 64


@dataclass(frozen=True)
class Detail:
    """Per query: the measurement (prep.tokens.rowdecode), every predictor's answers, the stratum."""
    queries: rowdecode.RowMeasurements
    rtt_ms: dict  # predictor -> float64[n] point prediction
    p_failed: dict  # predictor -> float64[n]
    model: P.Answers  # the model's quantiles too
    stratum: np.ndarray  # int8[n]: index into train.eval.metrics.STRATA

    def relative_errors(self, stratum: int | None = None) -> dict:
        ok = ~self.queries.failed
        if stratum is not None:
            ok &= self.stratum == stratum
        truth = self.queries.rtt_ms()[ok]
        return {k: np.abs(v[ok] - truth) / np.maximum(truth, 1e-3) for k, v in self.rtt_ms.items()}


def evaluate(cfg: EvalConfig, *, progress: bool = True) -> tuple[dict, Detail]:
    """(report, per-query detail); writes the report under RUN_DIR/eval/."""
    t0 = time.perf_counter()
    pred, data, manifest, fingerprint, trained_on, warnings, trained = _load(cfg)
    rng = np.random.default_rng(cfg.seed)
    log = lambda msg: print(msg, file=sys.stderr, flush=True) if progress else None

    tok, seg = read_split(data, manifest, "test")
    if len(tok) == 0:
        raise _empty_test(data, manifest)
    meas = rowdecode.decode_rows(tok, seg, where=f"{data}/test")
    log(f"train eval: {cfg.run_dir} at step {pred.step} on {data}: {len(tok):,} test rows, "
        f"{len(meas):,} measurements")

    # 1. loss by role over (a seeded sample of) the test rows
    loss_rows = _sample_rows(seg, meas, cfg.max_queries, rng)
    loss = token_loss_by_role(pred, tok[loss_rows], seg[loss_rows],
                              progress=progress)

    # 2. RTT queries: full-mode contexts, re-encoded with the result last; then each alone
    q = full_mode_queries(meas, cfg.max_queries, rng)
    if cfg.max_queries > len(q):  # "exactly N" cannot hold: say so, and name the file by N held
        warnings.append(f"--max-queries {cfg.max_queries:,}: the test split has only "
                        f"{len(q):,} RTT queries; all of them are used")
    qm = meas.take(q)

    # 3. baselines: fit on the train split, and read from the queries' contexts; the band
    # pair_mode picks there is the one the model's point is sought at (train.predict.predictor)
    train, preds, node_known, timing, mode, fail_prior = _baselines(data, manifest, qm,
                                                                     cfg.seed)
    stratum = EM.strata(preds["context_last"][2], node_known)  # known before any truth
    ans, query_rows, query_s = _answer_queries(pred, qm, progress, groups=stratum)
    alone, _, alone_s = _answer_queries(pred, qm, progress, alone=True, groups=stratum)
    every = np.ones(len(q), bool)
    point, picked = _self_picked(ans, stratum)
    point_alone, picked_alone = _self_picked(alone, stratum)
    preds = {"model": (point, ans.p_failed, every),  # its point: per stratum, its own pick
             "model_median": (ans.quantile_ms[:, 1], ans.p_failed, every),  # beside it
             "model_no_context": (point_alone, alone.p_failed, every)} | preds

    # 4. metrics
    truth_ms, failed, history = qm.rtt_ms(), qm.failed, qm.index.astype(np.int64)
    n_rtt = int((~failed).sum())
    if n_rtt < EM.MIN_REPLIES:
        n_all = full_mode_count(meas)  # more than q: --max-queries was the limit, not the split
        fix = (f"raise --max-queries (the test split has {n_all:,} RTT queries)"
               if len(q) < n_all else "evaluate on a larger test split")
        warnings.append(f"only {n_rtt:,} queries have a reply (fewer than "
                        f"{EM.MIN_REPLIES:,}): the medians and their intervals are rough; {fix}")
    groups = source_groups(qm)  # the intervals resample whole sources (train.eval.metrics)
    intervals = {k: (a.quantile_ms[:, 0], a.quantile_ms[:, 2])
                 for k, a in (("model", ans), ("model_no_context", alone))}
    rtt, verdict = score(preds, intervals, truth_ms, failed, history, stratum, groups, cfg.seed)
    result = {
        "run_dir": str(cfg.run_dir), "step": pred.step, "data": str(data),
        "data_fingerprint": fingerprint,
        "data_matches_run": None if trained_on is None else trained_on == fingerprint,
        "split": _split_rule(manifest), "config": asdict(cfg),
        # how the model was trained: its preset and objective (train --loss-weights)
        "trained": trained,
        "test_rows": int(len(tok)), "test_measurements": int(len(meas)),
        "train_measurements": int(len(train)),
        "loss": loss,
        "queries": int(len(q)), "queries_with_rtt": n_rtt,
        # every interval resamples whole source addresses, not single queries
        "sources": int(groups.max()) + 1 if len(groups) else 0,
        "sources_by_stratum": {name: int(len(np.unique(groups[stratum == k])))
                               for k, name in enumerate(EM.STRATA)},
        "query_rows": query_rows,
        # the point each predictor is scored by: the model's and pair_mode's alike, the band
        # point at the band pair_mode picked on the train split (None: the median)
        "point": {"band": mode.band, "band_errors": {str(k): v for k, v in
                                                     mode.band_errors.items()},
                  "model_by_stratum": picked, "model_no_context_by_stratum": picked_alone},
        # the context baselines' P(failed): pseudo-pings of its two beta priors, and the
        # train split's failure rate the context's shrinks toward
        "fail_prior": fail_prior,
        "non_canonical_mass_mean": float(np.nanmean(ans.non_canonical_mass))
        if (~failed).any() else None,
        "warnings": warnings,
        "rtt": rtt,
        "verdict": verdict,  # train.eval.metrics.verdict: the model vs the strongest baseline
        "timing": {"queries_per_s": round(len(q) / max(query_s, 1e-9), 1),
                   "query_s": round(query_s, 3), "no_context_query_s": round(alone_s, 3),
                   **timing, "elapsed_s": round(time.perf_counter() - t0, 3),
                   "device": jax.devices()[0].device_kind},
    }
    other = fingerprint if trained_on is not None and trained_on != fingerprint else ""
    n = len(q) if cfg.max_queries else 0
    # the report and its answers are written together: SIGINT/SIGTERM wait for both, then
    # stop the command (prep.base.signals.Interrupted, published)
    with stop_on_signals(report_path(cfg.run_dir, pred.step, n, other), "train eval") as guard:
        guard.defer = True
        written = write_report(result, cfg.run_dir, pred.step, n, other)
        result["written_to"] = str(written)
        # what `train pool` reads to score this evaluation with others (train.eval.answers)
        result["answers_written_to"] = str(answers.write_answers(
            answers.answers_path(written), preds=preds, intervals=intervals, truth_ms=truth_ms,
            failed=failed, history=history, stratum=stratum, groups=groups,
            about={k: result[k] for k in answers.ABOUT}))
        guard.published = True
    return result, Detail(qm, {k: v[0] for k, v in preds.items()},
                          {k: v[1] for k, v in preds.items()}, ans, stratum)


def score(preds: dict, intervals: dict, truth_ms, failed, history, stratum, groups,
          seed: int) -> tuple[dict, dict]:
    """(rtt, verdict): each predictor's metrics (``preds``: name -> (RTT ms, P(failed),
    covered); ``intervals``: name -> (p10, p90) where it has them) and the verdict, every
    interval resampling whole ``groups``."""
    rtt = {name: EM.metrics(pr, pf, cov, truth_ms, failed, history, stratum, seed=seed,
                            groups=groups, interval=intervals.get(name))
           for name, (pr, pf, cov) in preds.items()}
    baseline_names = [n for n in preds if registry.kind_of(n) != registry.MODEL]
    verdict = EM.verdict({k: v[0] for k, v in preds.items()}, {k: v[1] for k, v in preds.items()},
                         truth_ms, failed, stratum, rtt, baseline_names, seed=seed, groups=groups)
    return rtt, verdict


def source_groups(q: rowdecode.RowMeasurements) -> np.ndarray:
    """int64 per query: the index of its source address (family and bytes) among the
    queries' sources. A probe's queries share its place and its destinations; addresses
    are what the rows keep of the probe (probes behind one NAT address form one group)."""
    key = np.stack([q.family.astype(np.uint64), q.src_hi, q.src_lo], axis=1)
    if not len(key):
        return np.zeros(0, np.int64)
    return np.unique(key, axis=0, return_inverse=True)[1].ravel().astype(np.int64)


def _empty_test(data, manifest: dict) -> InputError:
    return InputError(f"{data}: the test split is empty; "
                      f"{more_test_rows(manifest.get('config', {}))} to evaluate")


def _load(cfg: EvalConfig):
    """The predictor, the data folder and its manifest, its fingerprint, the run's, the
    warnings so far, and how the run trained."""
    pred = P.load(cfg.run_dir, step=cfg.step, batch_size=cfg.batch_size)
    record = P.run_record(cfg.run_dir)
    # a bucket's dataset (s3://, gs://): its local copy, checked by sha256
    data = local_copy(cfg.data or record.get("train", {}).get("data", "shards"))
    manifest = manifest_lib.load_manifest(data)
    if manifest["row_len"] != pred.row_len:
        raise InputError(f"{data}: rows of {manifest['row_len']} tokens, the model reads "
                         f"{pred.row_len}; evaluate on the dataset the run trained on")
    if not manifest.get("counts", {}).get("rows", {}).get("test", 1):
        raise _empty_test(data, manifest)  # before any warning: one line
    fingerprint = dataset_fingerprint(manifest)
    trained_on = record.get("data_fingerprint")
    warnings = []
    if trained_on is not None and trained_on != fingerprint:
        warnings.append(f"{data} is not the dataset this run trained on (its shards differ); "
                        "its test split may hold what the model saw")
    return pred, data, manifest, fingerprint, trained_on, warnings, _trained(record)


def _trained(record: dict) -> dict:
    """The run's model, steps and training objective, and its model's every setting
    (``config``; what `train pool` holds the pooled runs to), from its config.json."""
    t = record.get("train", {})
    return {"model": t.get("model"), "steps": t.get("steps"), "batch_size": t.get("batch_size"),
            "loss_weights": t.get("loss_weights") or "uniform", "config": record.get("model")}


MODEL_BANDS = (None, *baselines.PAIR_MODE_BANDS)  # the model's candidate points (None: median)


def _self_picked(ans: P.Answers, stratum: np.ndarray) -> tuple[np.ndarray, dict]:
    """The model's point per query: in each stratum the band (MODEL_BANDS) whose median
    relative error the model expects least of itself there (train.predict.predictor.
    pick_bands; no truth read), and {stratum: {"band", "expected": {band: error}}}."""
    pick, expected = P.pick_bands(ans.self_cover, ans.self_count)
    n = len(stratum)
    k = np.minimum(stratum.astype(np.int64), len(pick) - 1) if len(pick) else stratum
    point = ans.quantile_ms[:, 1].copy()
    has = ~np.isnan(ans.band_points[:, 0]) if n else np.zeros(0, bool)
    if has.any():
        point[has] = ans.band_points[np.flatnonzero(has), pick[k[has]]]
    picked = {EM.STRATA[g]: {"band": MODEL_BANDS[int(pick[g])],
                             "expected": {str(b): float(expected[g, j])
                                          for j, b in enumerate(MODEL_BANDS)}}
              for g in range(len(pick)) if ans.self_count[g]}
    return point, picked


def _answer_queries(pred: P.Predictor, qm, progress: bool, *, alone: bool = False,
                    groups: np.ndarray | None = None):
    """Step 2: the model's answers to the queries ``qm`` (each alone: as one-measurement
    contexts), with each of MODEL_BANDS' points and how near the model expects them, by
    ``groups`` (the strata), the rows they took, the seconds."""
    contexts, qctx, q_choice, q_rtt = encode_queries(qm, alone=alone)
    qtok, qseg, where = P.pack_contexts(contexts, pred.row_len)
    t_q = time.perf_counter()
    with tqdm(total=len(qtok), unit="row", desc="rtt queries" + (" alone" if alone else ""),
              disable=not progress, file=sys.stderr) as bar:
        ans = pred.answer(qtok, qseg, where[qctx, 0], where[qctx, 1] + q_choice,
                          np.where(q_rtt >= 0, where[qctx, 1] + q_rtt, -1),
                          bands=None if groups is None else MODEL_BANDS, groups=groups,
                          progress=lambda rows, _: bar.update(rows))
    return ans, int(len(qtok)), time.perf_counter() - t_q


def _baselines(data, manifest: dict, qm, seed: int):
    """Step 3: the train split's measurements; every baseline's (point prediction,
    P(failed), covered) per query; whether each query's source is in the train split;
    the seconds taken; the fitted pair_mode (its band); the context baselines' P(failed)
    priors (their pseudo-pings, the train split's rate)."""
    train_tok, train_seg = read_split(data, manifest, "train")
    train = rowdecode.decode_rows(train_tok, train_seg, where=f"{data}/train")
    del train_tok, train_seg
    ids, n_nodes = node_ids([train, qm])
    (tr_src, tr_dst), (q_src, q_dst) = ids
    t_b = time.perf_counter()
    fitted = baselines.fit_all(tr_src, tr_dst, train.rtt_ms(), train.time, train.has_time,
                               n_nodes=n_nodes, seed=seed)
    base = {name: b.predict(q_src, q_dst) for name, b in fitted.items()}
    fit_s = time.perf_counter() - t_b
    t_c = time.perf_counter()
    rate = fitted["global_median"].fail_rate
    # P(failed)'s beta priors, fit on the train split's own contexts (train.eval.context_baselines)
    prior = context_baselines.fit_fail_prior(train.row * 256 + train.segment, tr_dst,
                                             train.failed, rate, seed, train.family)
    ctx = context_baselines.predict(
        qm.row * 256 + qm.segment, q_src, q_dst, qm.rtt_ms(),
        fallback=context_baselines.fallback_chain(fitted, q_src, q_dst),
        fail_rate=rate, fail_prior=prior, vivaldi=fitted["vivaldi"],
        fail_dst=context_baselines.fail_offsets(tr_src, tr_dst, train.failed, n_nodes),
        family=qm.family, knn=context_baselines.knn_table(fitted["pair_median"]),
        krig=context_baselines.krig_table(fitted["pair_median"], tr_src, tr_dst, train.rtt_ms()))
    context_s = time.perf_counter() - t_c
    in_train = np.zeros(n_nodes, bool)
    in_train[tr_src] = in_train[tr_dst] = True
    known = in_train[q_src] & ~local_scope(qm.family, qm.src_hi, qm.src_lo)
    preds = {name: (p.rtt_ms, p.p_fail, p.covered) for name, p in (ctx | base).items()}
    return train, preds, known, {"baselines_s": round(fit_s, 3),
                                 "context_baselines_s": round(context_s, 3)}, \
        fitted["pair_mode"], {**prior._asdict(), "rate": rate, "dst_shrink": DST_SHRINK}


def _sample_rows(seg, meas, max_queries: int, rng) -> np.ndarray:
    """All rows, or rows in a seeded order until they hold max_queries measurements."""
    n = len(seg)
    if not max_queries:
        return np.arange(n)
    order = rng.permutation(n)
    per_row = np.bincount(meas.row, minlength=n)[order]
    k = int(np.searchsorted(np.cumsum(per_row), max_queries)) + 1
    return np.sort(order[:k])


def _full_mode_contexts(meas: rowdecode.RowMeasurements):
    """(starts, ends, keep): each context's span in ``meas``, and the indices of the
    contexts whose every measurement carries its time (full mode)."""
    ctx = meas.row * 256 + meas.segment  # one id per (row, segment)
    starts = np.flatnonzero(np.concatenate([[True], ctx[1:] != ctx[:-1]]))
    ends = np.append(starts[1:], len(ctx))
    all_timed = np.logical_and.reduceat(meas.has_time, starts) if len(starts) else starts
    return starts, ends, np.flatnonzero(all_timed)


def full_mode_count(meas: rowdecode.RowMeasurements) -> int:
    """How many RTT queries the test split holds: full_mode_queries without max_queries."""
    starts, ends, keep = _full_mode_contexts(meas)
    return int((ends[keep] - starts[keep]).sum())


def full_mode_queries(meas: rowdecode.RowMeasurements, max_queries: int, rng) -> np.ndarray:
    """Indices (into ``meas``) of every measurement of the full-mode contexts, in row order;
    with max_queries, exactly that many (or all there are): whole contexts in a seeded order,
    the last one cut to its first measurements (a query reads only the ones before it)."""
    starts, ends, keep = _full_mode_contexts(meas)
    if max_queries:
        keep = rng.permutation(keep)
        total = np.cumsum(ends[keep] - starts[keep])
        k = int(np.searchsorted(total, max_queries)) + 1
        if k <= len(keep):  # the k-th context ends at or past max_queries: cut it there
            ends = ends.copy()
            ends[keep[k - 1]] -= int(total[k - 1]) - max_queries
        keep = np.sort(keep[:k])
    if not len(keep):
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(starts[c], ends[c]) for c in keep])


def encode_queries(qm, *, alone: bool = False):
    """Contexts of the query measurements (result last; ``alone``: each its own context)
    and each query's context and places."""
    cols = [x.tolist() for x in (qm.family, qm.src_hi, qm.src_lo, qm.dst_hi, qm.dst_lo,
                                 qm.time, qm.rtt_code)]
    values = [tuple(v) for v in qm.values.tolist()]  # value fields, if the vocabulary has any
    n = len(qm)
    ctx_id = np.arange(n) if alone else qm.row * 256 + qm.segment
    contexts, q_ctx, q_choice, q_rtt = [], [], [], []
    start = 0
    for i in range(1, n + 1):
        if i < n and ctx_id[i] == ctx_id[start]:
            continue
        ms = [P.Measurement(*(c[j] for c in cols), values[j]) for j in range(start, i)]
        tokens, choice, rtt = P.encode_context(ms)
        q_ctx += [len(contexts)] * (i - start)
        contexts.append(tokens)
        q_choice += choice
        q_rtt += rtt
        start = i
    return (contexts, np.array(q_ctx, np.int64), np.array(q_choice, np.int64),
            np.array(q_rtt, np.int64))


def node_ids(parts):
    """One id per distinct address (family, hi, lo) over sources and destinations of parts."""
    keys = []
    for m in parts:
        for hi, lo in ((m.src_hi, m.src_lo), (m.dst_hi, m.dst_lo)):
            keys.append(np.stack([m.family.astype(np.uint64), hi, lo], axis=1))
    allk = np.concatenate(keys) if keys else np.zeros((0, 3), np.uint64)
    uniq, inv = np.unique(allk, axis=0, return_inverse=True)
    inv = inv.ravel().astype(np.int64)
    out, k = [], 0
    for m in parts:
        n = len(m)
        out.append((inv[k:k + n], inv[k + n:k + 2 * n]))
        k += 2 * n
    return out, len(uniq)


def token_loss_by_role(pred: P.Predictor, tok, seg, *, progress: bool = True) -> dict:
    """Teacher-forced next-token loss and accuracy, overall and by the target's role
    (train.model.model.loss_by_role, as in training)."""
    fn = _compiled_loss(pred.mcfg, pred.attention)
    s_loss, s_right, s_n = (np.zeros(model.N_ROLES) for _ in range(3))
    c_sums = np.zeros(6)  # copied_src's loss, right, n; then copyable_src's
    bs = pred.batch_size
    for r0 in tqdm(range(0, len(tok), bs), unit="batch", desc="loss by role",
                   disable=not progress, file=sys.stderr):
        t, s = P.pad_rows(tok[r0:r0 + bs], bs), P.pad_rows(seg[r0:r0 + bs], bs)
        loss, right, n, *copied = fn(pred.params, t.astype(np.int32), s.astype(np.int32))
        c_sums += np.array([float(x[0]) for x in copied])
        s_loss += np.asarray(loss, np.float64)
        s_right += np.asarray(right, np.float64)
        s_n += np.asarray(n, np.float64)
    n = s_n[1:].sum()
    return {"loss": float(s_loss[1:].sum() / n) if n else None,
            "accuracy": float(s_right[1:].sum() / n) if n else None, "tokens": int(n),
            "rows": int(len(tok)),
            "by_role": {rowdecode.ROLES[k]: {"loss": float(s_loss[k] / s_n[k]),
                                             "accuracy": float(s_right[k] / s_n[k]),
                                             "tokens": int(s_n[k])}
                        for k in range(1, len(rowdecode.ROLES)) if s_n[k]},
            # the source bytes after a context's first measurement: mostly copies of one in
            # front; and those whose address is in front (train.model.model.loss_by_role)
            **{name: {"loss": cl / cn, "accuracy": cr / cn, "tokens": int(cn)} if cn else None
               for name, (cl, cr, cn) in (("copied_src", c_sums[:3]),
                                          ("copyable_src", c_sums[3:]))}}


@functools.lru_cache(maxsize=4)
def _compiled_loss(mcfg, att):
    return jax.jit(functools.partial(model.loss_by_role, cfg=mcfg, attention=att, copied_src=True))


def _split_rule(manifest: dict) -> dict:
    c = manifest.get("config", {})
    rule = {"split": c.get("split", "probe"), "test_fraction": c.get("test_fraction")}
    if c.get("test_from") is not None:
        rule["test_from"] = c["test_from"]
        rule["test_from_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c["test_from"]))
    return rule
