"""`train eval RUN_DIR`: the model against classic RTT predictors, on the test split.

Steps (all on the test split's first epoch, so each measurement counts once):

1. **Next-token loss and accuracy by token role.** The test rows exactly as stored (every
   timestamp mode, random block orders), teacher-forced; each counted target (prep.rows:
   the next token in the same segment) is put under the role of the token it predicts
   (prep.vocab.ROLES: block markers, source bytes, destination bytes, timestamp bytes,
   result choice, RTT bytes, and the bytes of each value field).
2. **RTT queries.** Every measurement of every test context in ``full`` timestamp mode
   (all of its measurements timestamped; 40 % of contexts under the default weights, drawn
   by a hash, so an unbiased sample of contexts) is a query given the measurements before
   it in its context. The contexts are re-encoded with the result block last
   (train.predictor.encode_context) and read in one teacher-forced pass, plus one probe
   pass for the second RTT byte: P(failed) and the exact RTT median, p10 and p90
   (train.predictor). Contexts in ``partial``/``none`` mode lack timestamps, so they are
   not queries; they are in step 1.
3. **Baselines** (train.baselines), fit on the train split's first epoch only, predict
   the same queries from (source, destination).
4. **Metrics** for the model and each baseline over the queries with a reply: MAE,
   median absolute error, median and p90 relative error; over all queries the Brier score
   of P(failed); and the same by how many earlier measurements the context held
   (HISTORY_BUCKETS). The truth is each measurement as the shards hold it (RTT at its
   code's bin value, within 1/4096 of the input).

``--max-queries N`` takes test rows (step 1) and full-mode contexts (step 2) in a seeded
random order until each holds N measurements. The result is a table (``format_report``),
a JSON document (also written to ``RUN_DIR/eval/step-<N>.json``) and optionally a PNG
(``plot``), all three in train/eval_report.py.
"""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from prep import manifest as manifest_lib
from prep import rowdecode
from prep.errors import InputError
from train import baselines, model
from train.eval_report import write_report
from train.reader import dataset_fingerprint, read_split
from train import predictor as P

HISTORY_BUCKETS = ((0, 0), (1, 1), (2, 4), (5, 16), (17, None))  # earlier measurements, inclusive
PREDICTORS = ("model",) + baselines.BASELINES


@dataclass(frozen=True)
class EvalConfig:
    run_dir: str  # a run folder written by `train`
    data: str | None = None  # shards folder; default: the one the run trained on
    step: int | None = None  # checkpoint; default: the latest
    max_queries: int = 0  # 0 = the whole test split
    seed: int = 0  # the sample drawn under max_queries
    batch_size: int | None = None  # rows per forward pass; default: the run's, at most 64


@dataclass(frozen=True)
class Detail:
    """Per query: the measurement (prep.rowdecode), and every predictor's answers."""
    queries: rowdecode.RowMeasurements
    rtt_ms: dict  # predictor -> float64[n] point prediction
    p_failed: dict  # predictor -> float64[n]
    model: P.Answers  # the model's quantiles too

    def relative_errors(self) -> dict:
        ok = ~self.queries.failed
        truth = self.queries.rtt_ms()[ok]
        return {k: np.abs(v[ok] - truth) / np.maximum(truth, 1e-3) for k, v in self.rtt_ms.items()}


def evaluate(cfg: EvalConfig, *, progress: bool = True) -> tuple[dict, Detail]:
    """(report, per-query detail); writes the report as RUN_DIR/eval/step-<N>.json."""
    t0 = time.perf_counter()
    pred, data, manifest, fingerprint, trained_on = _load(cfg)
    rng = np.random.default_rng(cfg.seed)
    log = lambda msg: print(msg, file=sys.stderr, flush=True) if progress else None

    tok, seg = read_split(data, manifest, "test")
    if len(tok) == 0:
        raise InputError(f"{data}: the test split is empty; rebuild with `prep shards ... "
                         "--test-fraction 0.1` (or another --split) to evaluate")
    meas, roles = rowdecode.decode_rows_and_roles(tok, seg, where=f"{data}/test")
    log(f"train eval: {cfg.run_dir} at step {pred.step} on {data}: {len(tok):,} test rows, "
        f"{len(meas):,} measurements")

    # 1. loss by role over (a seeded sample of) the test rows
    loss_rows = _sample_rows(seg, meas, cfg.max_queries, rng)
    loss = token_loss_by_role(pred, tok[loss_rows], seg[loss_rows], roles[loss_rows],
                              progress=progress)

    # 2. RTT queries: full-mode contexts, re-encoded with the result last
    q = full_mode_queries(meas, cfg.max_queries, rng)
    ans, query_rows, query_s = _answer_queries(pred, meas, q, progress)

    # 3. baselines fit on the train split
    t_b = time.perf_counter()
    train, qm, preds = _fit_baselines(data, manifest, meas, q, ans, cfg.seed)
    baseline_s = time.perf_counter() - t_b

    # 4. metrics
    truth_ms, failed, history = qm.rtt_ms(), qm.failed, qm.index.astype(np.int64)
    result = {
        "run_dir": str(cfg.run_dir), "step": pred.step, "data": str(data),
        "data_fingerprint": fingerprint,
        "data_matches_run": None if trained_on is None else trained_on == fingerprint,
        "split": _split_rule(manifest), "config": asdict(cfg),
        "test_rows": int(len(tok)), "test_measurements": int(len(meas)),
        "train_measurements": int(len(train)),
        "loss": loss,
        "queries": int(len(q)), "queries_with_rtt": int((~failed).sum()),
        "query_rows": query_rows,
        "non_canonical_mass_mean": float(np.nanmean(ans.non_canonical_mass))
        if (~failed).any() else None,
        "rtt": {name: metrics(pr, pf, cov, truth_ms, failed, history)
                for name, (pr, pf, cov) in preds.items()},
        "timing": {"queries_per_s": round(len(q) / max(query_s, 1e-9), 1),
                   "query_s": round(query_s, 3), "baselines_s": round(baseline_s, 3),
                   "elapsed_s": round(time.perf_counter() - t0, 3),
                   "device": jax.devices()[0].device_kind},
    }
    result["written_to"] = str(write_report(result, cfg.run_dir, pred.step))
    return result, Detail(qm, {k: v[0] for k, v in preds.items()},
                          {k: v[1] for k, v in preds.items()}, ans)


def _load(cfg: EvalConfig):
    """The predictor, the data folder and its manifest, its fingerprint and the run's."""
    pred = P.load(cfg.run_dir, step=cfg.step, batch_size=cfg.batch_size)
    record = P.run_record(cfg.run_dir)
    data = cfg.data or record.get("train", {}).get("data", "shards")
    manifest = manifest_lib.load_manifest(data)
    if manifest["row_len"] != pred.row_len:
        raise InputError(f"{data}: rows of {manifest['row_len']} tokens, the model reads "
                         f"{pred.row_len}; evaluate on the dataset the run trained on")
    fingerprint = dataset_fingerprint(manifest)
    trained_on = record.get("data_fingerprint")
    if trained_on is not None and trained_on != fingerprint:
        print(f"warning: {data} is not the dataset this run trained on (its shards differ); "
              "its test split may hold what the model saw", file=sys.stderr)
    return pred, data, manifest, fingerprint, trained_on


def _answer_queries(pred: P.Predictor, meas, q, progress: bool):
    """Step 2: the model's answers to the queries ``q``, the rows they took, the seconds."""
    contexts, qctx, q_choice, q_rtt = _encode_queries(meas, q)
    qtok, qseg, where = P.pack_contexts(contexts, pred.row_len)
    t_q = time.perf_counter()
    with tqdm(total=len(qtok), unit="row", desc="rtt queries", disable=not progress,
              file=sys.stderr) as bar:
        ans = pred.answer(qtok, qseg, where[qctx, 0], where[qctx, 1] + q_choice,
                          np.where(q_rtt >= 0, where[qctx, 1] + q_rtt, -1),
                          progress=lambda rows, _: bar.update(rows))
    return ans, int(len(qtok)), time.perf_counter() - t_q


def _fit_baselines(data, manifest: dict, meas, q, ans: P.Answers, seed: int):
    """Step 3: the train split's measurements, the queries' and every predictor's
    (point prediction, P(failed), covered) per query."""
    train_tok, train_seg = read_split(data, manifest, "train")
    train = rowdecode.decode_rows(train_tok, train_seg, where=f"{data}/train")
    del train_tok, train_seg
    qm = meas.take(q)
    ids, n_nodes = _node_ids([train, qm])
    (tr_src, tr_dst), (q_src, q_dst) = ids
    fitted = baselines.fit_all(tr_src, tr_dst, train.rtt_ms(), train.time, train.has_time,
                               n_nodes=n_nodes, seed=seed)
    preds = {"model": (ans.rtt_ms, ans.p_failed, np.ones(len(q), bool))}
    for name, b in fitted.items():
        p = b.predict(q_src, q_dst)
        preds[name] = (p.rtt_ms, p.p_fail, p.covered)
    return train, qm, preds


def _sample_rows(seg, meas, max_queries: int, rng) -> np.ndarray:
    """All rows, or rows in a seeded order until they hold max_queries measurements."""
    n = len(seg)
    if not max_queries:
        return np.arange(n)
    order = rng.permutation(n)
    per_row = np.bincount(meas.row, minlength=n)[order]
    k = int(np.searchsorted(np.cumsum(per_row), max_queries)) + 1
    return np.sort(order[:k])


def full_mode_queries(meas: rowdecode.RowMeasurements, max_queries: int, rng) -> np.ndarray:
    """Indices (into ``meas``) of every measurement of the full-mode contexts, whole contexts
    in a seeded order until max_queries (0: all, in row order)."""
    ctx = meas.row * 256 + meas.segment  # one id per (row, segment)
    starts = np.flatnonzero(np.concatenate([[True], ctx[1:] != ctx[:-1]]))
    ends = np.append(starts[1:], len(ctx))
    all_timed = np.logical_and.reduceat(meas.has_time, starts) if len(starts) else starts
    keep = np.flatnonzero(all_timed)
    if max_queries:
        keep = rng.permutation(keep)
        k = int(np.searchsorted(np.cumsum(ends[keep] - starts[keep]), max_queries)) + 1
        keep = np.sort(keep[:k])
    if not len(keep):
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(starts[c], ends[c]) for c in keep])


def _encode_queries(meas, q):
    """Contexts of the query measurements (result last) and each query's context and places."""
    qm = meas.take(q)
    cols = [x.tolist() for x in (qm.family, qm.src_hi, qm.src_lo, qm.dst_hi, qm.dst_lo,
                                 qm.time, qm.rtt_code)]
    values = [tuple(v) for v in qm.values.tolist()]  # value fields, if the vocabulary has any
    ctx_id = (qm.row * 256 + qm.segment)
    contexts, q_ctx, q_choice, q_rtt = [], [], [], []
    start = 0
    for i in range(1, len(q) + 1):
        if i < len(q) and ctx_id[i] == ctx_id[start]:
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


def _node_ids(parts):
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


def token_loss_by_role(pred: P.Predictor, tok, seg, roles, *, progress: bool = True) -> dict:
    """Teacher-forced next-token loss and accuracy, overall and by the target's role."""
    fn = _loss_fn(pred)
    n_roles = len(rowdecode.ROLES)
    s_loss, s_right, s_n = np.zeros(n_roles), np.zeros(n_roles), np.zeros(n_roles)
    bs = pred.batch_size
    for r0 in tqdm(range(0, len(tok), bs), unit="batch", desc="loss by role",
                   disable=not progress, file=sys.stderr):
        t, s = P._pad_rows(tok[r0:r0 + bs], bs), P._pad_rows(seg[r0:r0 + bs], bs)
        ce, right, mask = (np.asarray(x) for x in fn(pred.params, t.astype(np.int32),
                                                    s.astype(np.int32)))
        role = P._pad_rows(roles[r0:r0 + bs], bs)
        target_role = np.concatenate([role[:, 1:], np.zeros_like(role[:, :1])], axis=1)
        target_role = np.where(mask, target_role, 0)
        s_loss += np.bincount(target_role[mask], ce[mask], minlength=n_roles)
        s_right += np.bincount(target_role[mask], right[mask], minlength=n_roles)
        s_n += np.bincount(target_role[mask], minlength=n_roles)
    n = s_n[1:].sum()
    return {"loss": float(s_loss.sum() / n) if n else None,
            "accuracy": float(s_right.sum() / n) if n else None, "tokens": int(n),
            "rows": int(len(tok)),
            "by_role": {rowdecode.ROLES[k]: {"loss": float(s_loss[k] / s_n[k]),
                                             "accuracy": float(s_right[k] / s_n[k]),
                                             "tokens": int(s_n[k])}
                        for k in range(1, n_roles) if s_n[k]}}


def _loss_fn(pred: P.Predictor):
    return _compiled_loss(pred.mcfg, pred.attention)


@functools.lru_cache(maxsize=4)
def _compiled_loss(mcfg, att):
    def f(params, tokens, seg):
        ce, logits, targets, mask = model.token_losses(params, tokens, seg, mcfg, att)
        return ce, (jnp.argmax(logits, axis=-1) == targets), mask
    return jax.jit(f)


def metrics(pred_ms, p_fail, covered, truth_ms, failed, history) -> dict:
    """MAE, median absolute error, median / p90 relative error (queries with a reply),
    Brier score (all), coverage; the same by HISTORY_BUCKETS."""
    def one(sel):
        ok = sel & ~failed
        err = np.abs(pred_ms[ok] - truth_ms[ok])
        rel = err / np.maximum(truth_ms[ok], 1e-3)
        return {"n": int(sel.sum()), "n_rtt": int(ok.sum()),
                "mae_ms": float(err.mean()) if ok.any() else None,
                "median_ae_ms": float(np.median(err)) if ok.any() else None,
                "median_rel": float(np.median(rel)) if ok.any() else None,
                "p90_rel": float(np.quantile(rel, 0.9)) if ok.any() else None,
                "brier": float(np.mean((p_fail[sel] - failed[sel]) ** 2)) if sel.any() else None,
                "covered": float(covered[sel].mean()) if sel.any() else None}
    out = one(np.ones(len(truth_ms), bool))
    out["by_history"] = {_bucket_name(lo, hi): one((history >= lo) & (
        history <= (hi if hi is not None else np.iinfo(np.int64).max)))
        for lo, hi in HISTORY_BUCKETS}
    return out


def _bucket_name(lo, hi) -> str:
    return f"{lo}+" if hi is None else str(lo) if lo == hi else f"{lo}-{hi}"


def _split_rule(manifest: dict) -> dict:
    c = manifest.get("config", {})
    rule = {"split": c.get("split", "probe"), "test_fraction": c.get("test_fraction")}
    if c.get("test_from") is not None:
        rule["test_from"] = c["test_from"]
        rule["test_from_iso"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(c["test_from"]))
    return rule
