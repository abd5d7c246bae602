"""P(failed) from a context's counts: a pair dead or live, shrunk toward the context's share,
shrunk toward a rate (``FailPrior``, ``fail_shares``), and the grid fit of its priors on
measurements whose counts are known (``fit_counts``). The context baselines' rule
(train.eval.context_baselines, fit on the train split's contexts) and where the model's
P(failed) starts (ModelConfig.context_fail_anchor: train.fit's run start fits it on the
train rows' counts, ``anchor_start``)."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy.special import gammaln

# the beta priors' strengths (pseudo-pings) fit_counts tries, for the pair's failures
# (toward the context's) and the context's (toward the train split's)
FAIL_STRENGTHS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
# and for the pair's dead-or-live mixture: its prior P(dead), a dead pair's failure rate, a
# live pair's mean rate (besides the context's share), on at most FIT_SAMPLE measurements
DEAD_PRIORS = (0.02, 0.05, 0.1, 0.2)
DEAD_RATES = (0.9, 0.95, 0.98, 0.99, 0.995)
LIVE_RATES = (0.05, 0.1, 0.15, 0.2, 0.3)
FIT_SAMPLE = 200_000
# ModelConfig.context_fail_anchor's constants where no fit sets them (logits, or logs of
# pseudo-pings; train.model.model.anchor_rule): the rate 0.12 over 16 pseudo-pings (the
# context's share), a live pair's rate 0.1, a dead pair's prior 0.05 and rate 0.97, near
# what fit_counts finds on `prep synth`'s worlds (docs/learning.md section 8.30); the pair's
# pseudo-pings: context_fail's. A run fits them on its train rows at its start
# (anchor_start, train.fit.loop)
FAIL_ANCHOR = (math.log(0.12 / 0.88), math.log(16.0), math.log(0.1 / 0.9), 0.0,
               math.log(0.05 / 0.95), math.log(0.97 / 0.03))
# A destination's own priors (``dst_offsets``; the context baselines' rule and
# ModelConfig.fail_dst): from the train split's pairs to it, each pair once, shrunk toward all
# destinations' over DST_SHRINK pairs; a pair with >= DEAD_MIN pings of which >= DEAD_SHARE
# failed counts as dead (a firewalled target's: docs/learning.md section 8.32)
DST_SHRINK = 20.0
DEAD_MIN, DEAD_SHARE = 3, 0.9
# A family broken at the probe (``broken_shares``: every ping of it fails, e.g. IPv6 with no
# route): the prior probabilities fit_broken tries, per family
BROKEN_PRIORS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)


class FailPrior(NamedTuple):
    """P(failed)'s priors (fail_shares). The context's share of failures over ``context``
    pseudo-pings of the train split's rate; the pair's over ``pair`` pseudo-pings of the
    live rate: ``live``, or that share where it is None. With ``dead`` > 0 a pair is dead
    (it fails at ``dead_rate``) with that prior probability, else live, weighed by the
    likelihood of its pings (the live one's beta-binomial): P(failed) = w dead_rate +
    (1 - w) (failed + pair live) / (pings + pair), w the posterior P(dead)."""
    pair: float = 0.0
    context: float = 0.0
    dead: float = 0.0
    dead_rate: float = 0.99
    live: float | None = None
    # (IPv4, IPv6): the prior probability that the probe's family is broken, where each of
    # the context's earlier pings of the query's family failed (broken_shares)
    broken: tuple[float, float] = (0.0, 0.0)


def fail_shares(counts: np.ndarray, rate: float, prior: FailPrior,
                off: np.ndarray | None = None) -> np.ndarray:
    """P(failed) per measurement from its counts, float[4, n]: how many of its context's
    earlier measurements to its destination failed and how many there are, then the same
    over every destination (train.eval.context_baselines.fail_counts). The context's share
    of failures over (failed + s_c rate) / (pings + s_c), the pair's as FailPrior says, each
    the one before it where it has no ping (s_c, s_p = prior.context, prior.pair). ``off``
    (float[3, n], ``dst_offsets`` of each measurement's destination): the rate's, P(dead)'s
    and a constant live rate's logits moved by them."""
    f_p, n_p, f_c, n_c = counts
    dead, live = prior.dead, prior.live
    if off is not None:
        rate = shift(rate, off[0])
        dead = shift(dead, off[1]) if dead else dead
        live = shift(live, off[2]) if live is not None else live
    with np.errstate(invalid="ignore", divide="ignore"):
        ctx = np.where(n_c > 0, (f_c + prior.context * rate) / (n_c + prior.context), rate)
        pair = _pair_share(f_p, n_p, ctx if live is None else live, prior, dead)
    return np.where(n_p > 0, pair, ctx)


def shift(p, off) -> np.ndarray:
    """sigmoid(logit(p) + off), p kept in (1e-6, 1 - 1e-6)."""
    p = np.clip(p, 1e-6, 1.0 - 1e-6)
    return 1.0 / (1.0 + np.exp(-(np.log(p / (1.0 - p)) + off)))


def _pair_share(f, n, live, prior: FailPrior, dead=None) -> np.ndarray:
    """The pair's P(failed) from its counts (f of n): FailPrior's rule (``dead``: P(dead)
    per measurement instead of prior.dead)."""
    s = prior.pair
    share = (f + s * live) / (n + s)
    dead_p = prior.dead if dead is None else dead
    if not prior.dead:
        return share
    m = np.clip(live, 1e-4, 1 - 1e-4)
    a, b = s * m, s * (1 - m)
    alive = gammaln(f + a) + gammaln(n - f + b) - gammaln(n + s) - gammaln(a) - gammaln(b) \
        + gammaln(s)
    dead = f * np.log(prior.dead_rate) + (n - f) * np.log1p(-prior.dead_rate)
    w = 1.0 / (1.0 + np.exp(np.clip(alive - dead - np.log(dead_p / (1 - dead_p)),
                                    -700, 700)))
    return w * prior.dead_rate + (1 - w) * share


def pair_counts(src, dst, failed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst, failed, pings) per ordered (src, dst) pair of the measurements given (ids or
    hashes, int), in key order."""
    keys = np.column_stack([np.asarray(src, np.int64), np.asarray(dst, np.int64)])
    if not len(keys):
        return np.zeros(0, np.int64), np.zeros(0), np.zeros(0)
    pair, inv = np.unique(keys, axis=0, return_inverse=True)
    inv = inv.ravel()
    return (pair[:, 1], np.bincount(inv, np.asarray(failed, np.float64), len(pair)),
            np.bincount(inv, minlength=len(pair)).astype(np.float64))


def dst_offsets(pair_dst, pair_failed, pair_pings, n_dst: int,
                shrink: float = DST_SHRINK) -> np.ndarray:
    """float32[3, n_dst]: per destination id (< n_dst; ``pair_counts``' pairs to it) the
    logit offsets, from all destinations', of the rate its pairs fail at (each pair's share
    once), the share of its pairs with >= DEAD_MIN pings that are dead (>= DEAD_SHARE of them
    failed) and the mean share of the others, each shrunk toward all destinations' over
    ``shrink`` pairs (0 for a destination with none)."""
    d = np.asarray(pair_dst, np.int64)
    out = np.zeros((3, n_dst), np.float32)
    if not len(d):
        return out
    share = np.asarray(pair_failed, np.float64) / np.asarray(pair_pings, np.float64)
    seen = np.asarray(pair_pings) >= DEAD_MIN
    dead = seen & (share >= DEAD_SHARE)
    live = seen & ~dead
    for k, (value, weight) in enumerate(((share, np.ones(len(d), bool)), (dead, seen),
                                         (share, live))):
        if not weight.any():
            continue
        g = float(np.mean(value[weight]))
        s = np.bincount(d, np.where(weight, value, 0.0), n_dst)
        w = np.bincount(d, weight.astype(np.float64), n_dst)
        own = (s + shrink * g) / (w + shrink)
        out[k] = _lg(own) - _lg(g)
    return out


def _lg(p):
    p = np.clip(p, 1e-4, 1.0 - 1e-4)
    return np.log(p / (1.0 - p))


def broken_shares(p, family, n_fam, loglik, broken) -> np.ndarray:
    """P(failed) where every one of the context's ``n_fam`` (>= 1) earlier pings of the
    query's ``family`` (4 or 6) failed: the family broken at the probe (each ping fails),
    prior ``broken`` (FailPrior.broken, per family), against each failing on its own, whose
    likelihood is exp(``loglik``) (the sum of their own P(failed)'s logs, the chain of the
    rule's answers): w + (1 - w) p, w the posterior P(broken); ``p`` elsewhere."""
    b = np.where(np.asarray(family) == 6, broken[1], broken[0])
    on = (np.asarray(n_fam) > 0) & (b > 0)
    bb = np.clip(b, 1e-9, 1.0 - 1e-9)
    w = 1.0 / (1.0 + np.exp(np.clip(np.log1p(-bb) - np.log(bb) + loglik, -700, 700)))
    return np.where(on, w + (1.0 - w) * p, p)


def fit_broken(p, family, n_fam, loglik, failed) -> tuple[float, float]:
    """FailPrior.broken: per family, the BROKEN_PRIORS value whose broken_shares score the
    lowest Brier on the measurements whose context's earlier pings of their family all
    failed (``n_fam`` > 0; 0 where there are none)."""
    y = np.asarray(failed, np.float64)
    family = np.asarray(family)
    out = []
    for fam in (4, 6):
        sel = (family == fam) & (np.asarray(n_fam) > 0)
        if not sel.any():
            out.append(0.0)
            continue
        out.append(min(BROKEN_PRIORS, key=lambda b: float(np.mean(
            (broken_shares(p[sel], family[sel], n_fam[sel], loglik[sel], (b, b))
             - y[sel]) ** 2))))
    return tuple(out)


def fit_counts(counts: np.ndarray, failed, rate: float, seed: int = 0, *,
               live_share: bool = True) -> FailPrior:
    """The FailPrior whose fail_shares score the lowest Brier on measurements with these
    ``counts`` (fail_shares'), over those with an earlier one; the plain shares where there
    is none. First (pair, context) of FAIL_STRENGTHS, no dead pairs; then, on the
    measurements whose pair has an earlier ping (at most FIT_SAMPLE, seeded; with none, the
    first's), the pair's rule again: the beta alone or the dead-or-live mixture, over
    FAIL_STRENGTHS x DEAD_PRIORS x DEAD_RATES x (the context's share where ``live_share``,
    LIVE_RATES)."""
    counts = np.asarray(counts, np.float64)
    keep = counts[3] > 0
    if not keep.any():
        return FailPrior()
    counts, y = counts[:, keep], np.asarray(failed, np.float64)[keep]
    best = min((float(np.mean((fail_shares(counts, rate, FailPrior(sp, sc)) - y) ** 2)), sp, sc)
               for sp in FAIL_STRENGTHS for sc in FAIL_STRENGTHS)
    s_c = best[2]
    pair = np.flatnonzero(counts[1] > 0)
    if not len(pair):  # no context pings a destination twice: nothing to weigh a pair by
        return FailPrior(best[1], s_c)
    if len(pair) > FIT_SAMPLE:
        pair = np.sort(np.random.default_rng(seed).choice(pair, FIT_SAMPLE, replace=False))
    counts, y = counts[:, pair], y[pair]
    shares = fail_shares(np.stack([0 * counts[0], 0 * counts[1], counts[2], counts[3]]), rate,
                         FailPrior(0.0, s_c))
    # a constant live rate: the counts' distinct (failed, pings) suffice
    fn, inv = np.unique(counts[:2].T, axis=0, return_inverse=True)
    inv = inv.ravel()
    k, y1 = np.bincount(inv, minlength=len(fn)), np.bincount(inv, y, minlength=len(fn))

    def brier_const(p):  # mean (p - y)^2 from the groups' sums
        return float((k * p * p - 2 * p * y1).sum() + y.sum()) / len(y)
    cands = []
    if live_share:
        cands.append((float(np.mean((_pair_share(counts[0], counts[1], shares,
                                                 FailPrior(best[1], s_c)) - y) ** 2)),
                      FailPrior(best[1], s_c)))
    for sp in FAIL_STRENGTHS:
        for pd in DEAD_PRIORS:
            for q in DEAD_RATES:
                if live_share:
                    fp = FailPrior(sp, s_c, pd, q)
                    cands.append((float(np.mean((_pair_share(counts[0], counts[1], shares, fp)
                                                 - y) ** 2)), fp))
                for live in LIVE_RATES:
                    fp = FailPrior(sp, s_c, pd, q, live)
                    cands.append((brier_const(_pair_share(fn[:, 0], fn[:, 1], live, fp)), fp))
    return min(cands, key=lambda c: c[0])[1]


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def anchor_start(prior: FailPrior, rate: float, strength: float) -> np.ndarray:
    """float32[6]: ModelConfig.context_fail_anchor's constants (train.model.model.anchor_rule:
    the rate's logit, the log of the context's pseudo-pings, the live rate's logit, the log
    of the pair's pseudo-pings over ``strength``, P(dead)'s logit and the dead rate's) for
    ``prior`` (a constant live rate; without one 0.1) and ``rate``, as offsets from
    FAIL_ANCHOR's. A prior with no dead pairs: P(dead) 1e-4."""
    live = 0.1 if prior.live is None else prior.live
    rate = min(max(rate, 1e-4), 1 - 1e-4)
    c = (_logit(rate), math.log(max(prior.context, 0.5)), _logit(live),
         math.log(max(prior.pair, 0.5) / strength), _logit(max(prior.dead, 1e-4)),
         _logit(prior.dead_rate))
    return (np.asarray(c) - np.asarray(FAIL_ANCHOR)).astype(np.float32)
