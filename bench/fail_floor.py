"""What P(failed) can be won in a `prep synth` world: one run's evaluation queries scored by
what no predictor can know, by what a predictor could at best know, and by the rules beside
the model (docs/learning.md section 8.32).

`prep synth` draws each stream's (probe, target, family) failure rate once
(prep.ingest.synth: FAIL_SCALE x Beta(FAIL_BETA), FIREWALLED of the user streams near 1,
every IPv6 stream of a probe with broken IPv6 at 1). On the queries of a `train eval` of a
run on that world's shards (its answers file, train.eval.answers), per stratum, the Brier of:

- ``oracle``: each query's true rate (its stream's, from the generator: no predictor has it);
- ``bayes``: the posterior mean given what the query's context holds, under the generator's
  priors: the pair's earlier pings and failures, whether the destination is a root server
  (built-in streams are never firewalled), and for IPv6 the context's IPv6 pings (one reply
  says the probe's IPv6 works; all failed weigh broken IPv6 against each stream's failing);
  ``bayes_no_kind``: the same without the destination's kind; ``bayes_no_family``: without
  the context's IPv6 pings (each stream alone: what a probe's broken IPv6 is worth);
- ``rule``: the context baselines' rule (train.model.failprior, the eval's fitted FailPrior)
  with one prior for all destinations; ``rule_dst_prior``: with each destination's from the
  train split (failprior.dst_offsets: the rate its pairs fail at, each pair once, the share
  of them that is dead and a live pair's rate, each shrunk toward all destinations');
  ``rule_family``: that, and where every earlier ping of the query's family failed, the
  probe's family broken (failprior.broken_shares, the eval's fitted FailPrior.broken): the
  context baselines' P(failed) since 2026-12-02;
- ``model`` and the lowest-Brier baseline, from the answers.

    python -m bench.fail_floor --data shards-256 --answers runs/X/eval/step-2400.answers.npz
    python -m bench.fail_floor --data shards-256-s1 --synth-seed 1 --answers ...

Writes ``bench/results/fail-floor-world<seed>.json`` (``--out``) with the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from ipaddress import ip_address
from pathlib import Path

import numpy as np
from scipy import stats

from bench.run import RESULTS, machine
from prep.ingest import synth as S
from prep.schema import manifest as manifest_lib
from prep.tokens import rowdecode
from train.eval import context_baselines as CB
from train.eval import evaluate as E
from train.eval import metrics as EM
from train.fit.reader import read_split
from train.model.failprior import DST_SHRINK, FailPrior, broken_shares, fail_shares

GRID = 20_000  # equal-mass points of a live stream's rate (the posterior's integral)


def _hilo(addr: str) -> tuple[int, int]:
    if not addr:
        return (0, 0)
    v = int(ip_address(addr))
    return (v >> 64, v & ((1 << 64) - 1))


def world_fail_p(cfg: S.SynthConfig) -> tuple[dict, set]:
    """({(src_hi, src_lo, dst_hi, dst_lo, unix time): the row's true failure rate}, the root
    servers' (hi, lo)) of the world ``cfg`` generates."""
    cols = S.generate(cfg)
    hl = np.array([_hilo(a) for a in cols["pool"]], np.uint64)
    src, dst = hl[cols["src"]], hl[cols["dst"]]
    key = np.column_stack([src, dst, cols["time"].astype(np.uint64)])
    rates = {tuple(k): p for k, p in zip(key.tolist(), cols["fail_p"].tolist())}
    return rates, {_hilo(a) for a in S.ROOTS_V4 + S.ROOTS_V6}


class StreamPrior:
    """A live stream's rate as `prep synth` draws it, on an equal-mass grid; ``user``: the
    firewalled mixture too."""

    def __init__(self, grid: int = GRID):
        u = stats.beta.ppf((np.arange(grid) + 0.5) / grid, *S.FAIL_BETA)
        self.p = u * S.FAIL_SCALE

    def predict(self, failed: int, pings: int, user: bool | None) -> tuple[float, float]:
        """(P(the next ping fails), the likelihood of ``failed`` of ``pings``) for a stream to
        a user target (True), a root (False), or either with even odds (None)."""
        if user is None:
            a, la = self.predict(failed, pings, False)
            b, lb = self.predict(failed, pings, True)
            return (a * la + b * lb) / (la + lb), 0.5 * (la + lb)
        lik = self.p ** failed * (1.0 - self.p) ** (pings - failed)
        m0, m1 = lik.mean(), (lik * self.p).mean()
        if not user:
            return m1 / m0, m0
        f, q = S.FIREWALLED
        lf = q ** failed * (1.0 - q) ** (pings - failed)
        m = (1.0 - f) * m0 + f * lf
        return ((1.0 - f) * m1 + f * lf * q) / m, m


def bayes_fail(starts, dst, family, failed, is_root, prior: StreamPrior, kind: bool = True,
               broken: bool = True):
    """float64[n]: per query (contexts from ``starts``, context order) the posterior mean of
    its failing given its context's earlier measurements under `prep synth`'s priors:
    ``dst`` ids, ``family`` 4/6, ``failed`` and ``is_root`` per measurement; ``kind``: whether
    the destination's kind (root or user target) is known; ``broken``: whether the context's
    IPv6 pings weigh the probe's broken IPv6 (else each stream alone)."""
    n = len(dst)
    out = np.empty(n)
    cache: dict = {}

    def pred(f, k, user):
        key = (f, k, user)
        if key not in cache:
            cache[key] = prior.predict(f, k, user)
        return cache[key]

    for c in range(len(starts) - 1):
        a, b = starts[c], starts[c + 1]
        for i in range(a, b):
            prev = np.arange(a, i)
            same = prev[dst[prev] == dst[i]]
            user = (not is_root[i]) if kind else None
            p_live = pred(int(failed[same].sum()), len(same), user)[0]
            six = prev[family[prev] == 6]
            if not broken or family[i] != 6 or (~failed[six]).any():
                out[i] = p_live  # IPv4, or a reply says the probe's IPv6 works
                continue
            # every IPv6 ping so far failed: broken IPv6 (each stream fails) against each
            # stream's own failing, the query's pair among them
            like = 1.0
            for d in np.unique(dst[six]):
                m = int((dst[six] == d).sum())
                like *= pred(m, m, (not is_root[six][dst[six] == d][0]) if kind else None)[1]
            w = S.V6_BROKEN / (S.V6_BROKEN + (1.0 - S.V6_BROKEN) * like)
            out[i] = w + (1.0 - w) * p_live
    return out


def floor(data: Path, answers_path: Path, cfg: S.SynthConfig, log=print) -> dict:
    """The report: per stratum the Brier of each rule above on the answers' queries."""
    ans = np.load(answers_path)
    about = json.loads(str(ans["about"]))
    manifest = manifest_lib.load_manifest(data)
    tok, seg = read_split(data, manifest, "test")
    meas = rowdecode.decode_rows(tok, seg, where=f"{data}/test")
    if about["config"].get("max_queries"):
        raise SystemExit("the answers are of a sample (--max-queries): evaluate the whole "
                         "test split (train eval RUN_DIR, no --max-queries)")
    qm = meas.take(E.full_mode_queries(meas, 0, None))
    failed, stratum = ans["failed"], ans["stratum"]
    if len(qm) != len(failed) or not np.array_equal(qm.failed, failed):
        raise SystemExit(f"{answers_path}: its queries are not {data}'s test split's (the "
                         f"answers of `train eval RUN_DIR --data {data}` are)")
    log(f"fail_floor: {len(qm):,} queries of {data}; generating world {cfg.seed} ...")
    rates, roots = world_fail_p(cfg)
    keys = zip(qm.src_hi.tolist(), qm.src_lo.tolist(), qm.dst_hi.tolist(), qm.dst_lo.tolist(),
               qm.time.tolist())
    p_true = np.array([rates.get(k, np.nan) for k in keys])
    if np.isnan(p_true).mean() > 0.01:
        raise SystemExit(f"{np.isnan(p_true).mean():.1%} of the queries are not rows of "
                         f"`prep synth --seed {cfg.seed}`'s world (--synth-seed, --rows, ...)")
    is_root = np.array([(h, l) in roots for h, l in zip(qm.dst_hi.tolist(), qm.dst_lo.tolist())])

    t_tok, t_seg = read_split(data, manifest, "train")
    tm = rowdecode.decode_rows(t_tok, t_seg, where=f"{data}/train")
    ((t_src, t_dst), (_, q_dst)), n_nodes = E.node_ids([tm, qm])  # as `train eval` does
    off = CB.fail_offsets(t_src, t_dst, tm.failed, n_nodes)[:, q_dst]

    ctx = qm.row.astype(np.int64) * 256 + qm.segment
    starts = CB.context_starts(ctx)
    counts = CB.fail_counts(starts, q_dst, failed)
    report = json.loads(Path(str(answers_path).replace(".answers.npz", ".json")).read_text())
    fpd = report["fail_prior"]
    fp = FailPrior(fpd["pair"], fpd["context"], fpd["dead"], fpd["dead_rate"], fpd["live"],
                   tuple(fpd.get("broken") or (0.0, 0.0)))
    rule_dst = fail_shares(counts, fpd["rate"], fp, off)
    chain = CB.family_chain(starts, qm.family, failed, rule_dst)
    sp = StreamPrior()
    names = [str(x) for x in ans["names"]]
    preds = {
        "oracle": p_true,
        "bayes": bayes_fail(starts, q_dst, qm.family, failed, is_root, sp),
        "bayes_no_kind": bayes_fail(starts, q_dst, qm.family, failed, is_root, sp, kind=False),
        "bayes_no_family": bayes_fail(starts, q_dst, qm.family, failed, is_root, sp,
                                      broken=False),
        "rule_family": broken_shares(rule_dst, qm.family, *chain, fp.broken),
        "rule_dst_prior": rule_dst,
        "rule": fail_shares(counts, fpd["rate"], fp),
        "model": ans["p_failed"][names.index("model")],
    }
    base_names = [k for k in names if not k.startswith("model")]
    out = {}
    for s, name in [(None, "all")] + list(enumerate(EM.STRATA)):
        sel = np.ones(len(failed), bool) if s is None else stratum == s
        if not sel.any():
            continue
        y = failed[sel].astype(float)
        row = {"n": int(sel.sum()), "failed": float(y.mean()),
               "root_share": float(is_root[sel].mean()),
               "ipv6_share": float((qm.family[sel] == 6).mean())}
        row |= {k: float(np.mean((v[sel] - y) ** 2)) for k, v in preds.items()}
        briers = {k: float(np.mean((ans["p_failed"][names.index(k)][sel] - y) ** 2))
                  for k in base_names}
        best = min(briers, key=briers.get)
        row["best_baseline"], row["best_baseline_brier"] = best, briers[best]
        out[name] = row
    return {"data": str(data), "answers": str(answers_path), "world": vars(cfg) | {"out": None},
            "run": about.get("run_dir"), "step": about.get("step"), "fail_prior": fpd,
            "dst_shrink": DST_SHRINK, "strata": out}


def main(argv=None) -> int:
    class Fmt(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Defaults shown, and the examples' line breaks kept."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.fail_floor", description=__doc__.split("\n\n")[0],
        formatter_class=Fmt, epilog="examples (the built-in world; world 1):\n"
        "  python -m bench.fail_floor --data shards-256 \\\n"
        "      --answers runs/X/eval/step-2400.answers.npz\n"
        "  python -m bench.fail_floor --data shards-256-s1 --synth-seed 1 \\\n"
        "      --answers runs/Y/eval/step-2400.answers.npz")
    ap.add_argument("--data", type=Path, required=True, help="the world's shards")
    ap.add_argument("--answers", type=Path, required=True,
                    help="a whole-split `train eval`'s RUN_DIR/eval/step-S.answers.npz")
    ap.add_argument("--synth-seed", type=int, default=0, help="prep synth --seed of the world")
    ap.add_argument("--rows", type=int, default=3_000_000, help="prep synth --rows")
    ap.add_argument("--probes", type=int, default=3_000, help="prep synth --probes")
    ap.add_argument("--days", type=int, default=2, help="prep synth --days")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: bench/results/fail-floor-world<seed>.json")
    a = ap.parse_args(argv)
    if not (a.data / "manifest.json").is_file():
        ap.error(f"--data {a.data}: no shards there (prep shards writes them)")
    if not a.answers.is_file():
        ap.error(f"--answers {a.answers}: no such file (train eval RUN_DIR writes "
                 "RUN_DIR/eval/step-S.answers.npz)")
    t0 = time.perf_counter()
    cfg = S.SynthConfig(out=Path("."), rows=a.rows, probes=a.probes, days=a.days,
                        seed=a.synth_seed)
    res = floor(a.data, a.answers, cfg, log=lambda m: print(m, file=sys.stderr))
    res |= {"machine": machine(), "elapsed_s": round(time.perf_counter() - t0, 1)}
    out = a.out or RESULTS / f"fail-floor-world{a.synth_seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    cols = ("oracle", "bayes", "bayes_no_kind", "bayes_no_family", "rule", "rule_dst_prior",
            "rule_family", "model", "best_baseline_brier")
    print(f"{'Brier':<16}" + "".join(f"{c[:14]:>15}" for c in ("n",) + cols))
    for name, row in res["strata"].items():
        print(f"{name:<16}{row['n']:>15,}" + "".join(f"{row[c]:>15.4f}" for c in cols))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
