"""`make bench` part "eval": `train eval`'s RTT queries (tiny model, this machine's CPU) beside
the baselines on the same queries, on the built-in data (`prep synth` defaults, 3M rows)
split with `--split time+probe`.

- ``eval.queries_per_s``: train.predict.predictor's two passes (teacher-forced first-byte and
  P(failed) pass, then the second-byte probes for p10 / median / p90) over whole test
  contexts, after one warm-up batch (compilation). The model is the tiny config with
  untrained parameters: the cost does not depend on what the weights are.
  ``eval.queries_per_s_band``: the same with the band point asked (band 0.02: four more
  probes a query, the likeliest first bytes'), as `train eval` asks it where the train
  split picks a band; ``eval.band_cost``: the ratio of the two times (each the fastest of
  three, run alternately). ``eval.queries_per_s_own_pick``: as `train eval` asks since
  docs/learning.md §8.27, every band of train.eval.evaluate.MODEL_BANDS at once with the
  model's expected coverage per stratum (three strata drawn at random here);
  ``eval.own_pick_cost``: its time over the median's.
- ``eval.baselines_fit_s``: fitting all the train-fit baselines (train.eval.baselines.fit_all)
  on the train split, decoded from its shards; ``eval.baseline_fit_s.<name>`` each alone;
  ``eval.baselines_queries_per_s``: all of them predicting the same queries.
- ``eval.fail_prior_fit_s``: fitting the context baselines' P(failed) priors on the train
  split's contexts (train.eval.context_baselines.fit_fail_prior), as `train eval` does.
- ``eval.context_baselines_queries_per_s``: the five context baselines
  (train.eval.context_baselines, after a compiling call) on the same queries, beside the model's
  ``eval.queries_per_s``: they must cost no more than the model's own pass.
- ``eval.decode_measurements_per_s``: prep.tokens.rowdecode over the train split's rows.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from prep.ingest.synth import SynthConfig, synth
from prep.shards.bucket import ShardsConfig
from prep.shards.local_runner import run_shards
from prep.tokens import rowdecode
from train.eval import baselines, context_baselines
from train.eval import evaluate as E
from train.fit import reader
from train.model import model
from train.model.arch import model_config
from train.predict import predictor as P

ROWS, QUERIES, BATCH = 3_000_000, 2_000, 8


def run() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        synth(SynthConfig(out=d / "raw", rows=ROWS, probes=3_000, days=2, seed=0))
        run_shards([str(d / "raw")], str(d / "shards"), ShardsConfig(seed=0, split="time+probe"),
                   workers=2, progress=False)
        manifest = reader.open_shards(d / "shards")
        test = rowdecode.decode_rows(*reader.read_split(d / "shards", manifest, "test"))
        tok, seg = reader.read_split(d / "shards", manifest, "train")
        t0 = time.perf_counter()
        train = rowdecode.decode_rows(tok, seg)
        decode_s = time.perf_counter() - t0
        del tok, seg

    q = E.full_mode_queries(test, QUERIES, np.random.default_rng(0))
    qm = test.take(q)
    contexts, qctx, q_choice, q_rtt = E.encode_queries(qm)
    mcfg = model_config("tiny", seq_len=manifest["row_len"])
    pred = P.Predictor(jax.device_put(model.init_params(mcfg, 0)), mcfg, batch_size=BATCH)
    qtok, qseg, where = P.pack_contexts(contexts, pred.row_len)
    args = (where[qctx, 0], where[qctx, 1] + q_choice,
            np.where(q_rtt >= 0, where[qctx, 1] + q_rtt, -1))
    warm = args[0] < BATCH  # the first batch of rows: compiles both passes
    pred.answer(qtok[:BATCH], qseg[:BATCH], *(a[warm] for a in args))
    pred.answer(qtok[:BATCH], qseg[:BATCH], *(a[warm] for a in args), band=0.02)
    strata = np.random.default_rng(0).integers(0, 3, len(q))
    asks = {"median": {}, "band": {"band": 0.02},
            "own_pick": {"bands": E.MODEL_BANDS, "groups": strata}}
    pred.answer(qtok[:BATCH], qseg[:BATCH], *(a[warm] for a in args), bands=E.MODEL_BANDS,
                groups=strata[warm])
    times = {k: [] for k in asks}
    for _ in range(3):  # alternating, the fastest of three each: the machine is noisy
        for k, kw in asks.items():
            t0 = time.perf_counter()
            pred.answer(qtok, qseg, *args, **kw)
            times[k].append(time.perf_counter() - t0)
    query_s, band_s, own_s = (min(times[k]) for k in asks)

    (tr, qids), n_nodes = E.node_ids([train, qm])
    cols = (tr[0], tr[1], train.rtt_ms(), train.time, train.has_time)
    baselines.fit_all(*cols, n_nodes=n_nodes, seed=0)  # compile the Numba kernels
    out = {}
    for name in baselines.BASELINES:
        t0 = time.perf_counter()
        baselines.fit(name, *cols, n_nodes=n_nodes, seed=0)
        out[f"eval.baseline_fit_s.{name}"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fitted = baselines.fit_all(*cols, n_nodes=n_nodes, seed=0)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in fitted.values():
        b.predict(*qids)
    predict_s = time.perf_counter() - t0
    ctx_id, q_rtt_ms = qm.row * 256 + qm.segment, qm.rtt_ms()
    fallback = context_baselines.fallback_chain(fitted, *qids)
    rate = fitted["global_median"].fail_rate
    context_baselines.fail_counts(np.zeros(2, np.int64), np.zeros(1), np.zeros(1, bool))
    t0 = time.perf_counter()
    prior = context_baselines.fit_fail_prior(train.row * 256 + train.segment, tr[1],
                                             train.failed, rate)
    prior_s = time.perf_counter() - t0

    def context_answers(k):  # the first k queries
        return context_baselines.predict(
            ctx_id[:k], qids[0][:k], qids[1][:k], q_rtt_ms[:k], fallback=fallback[:k],
            fail_rate=rate, fail_prior=prior, vivaldi=fitted["vivaldi"],
            knn=context_baselines.knn_table(fitted["pair_median"]))

    context_answers(50)  # compile
    t0 = time.perf_counter()
    context_answers(len(q))
    context_s = time.perf_counter() - t0
    return out | {
        "eval.queries": float(len(q)),
        "eval.queries_per_s": len(q) / query_s,
        "eval.queries_per_s_band": len(q) / band_s,
        "eval.band_cost": band_s / query_s,
        "eval.queries_per_s_own_pick": len(q) / own_s,
        "eval.own_pick_cost": own_s / query_s,
        "eval.train_measurements": float(len(train)),
        "eval.baselines_fit_s": fit_s,
        "eval.fail_prior_fit_s": prior_s,
        "eval.baselines_queries_per_s": len(q) / predict_s,
        "eval.context_baselines_queries_per_s": len(q) / context_s,
        "eval.decode_measurements_per_s": len(train) / decode_s,
    }
