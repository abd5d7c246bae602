"""Classic RTT predictors the trained model is scored against.

Each baseline is fit on the train split (``src``, ``dst``: node ids; ``rtt``: ms, -1.0 for a
failed ping; ``time``: Unix seconds where ``has_time``) and answers (src, dst) with a
``Prediction``: an RTT, P(failed), and whether the RTT is its own or the global median it
fell back to. RTTs are fit on successful pings only; failures feed p_fail.

- ``global_median``, ``dst_median``, ``pair_median``: the (numpy) median RTT and failure
  rate of all pings, per destination (where the target is says most), per ordered pair;
  the pair baselines read the reverse pair where a pair has no ping in its direction.
- ``pair_mode``: per ordered pair, the centre of the densest window of its RTTs whose
  ends are within a relative band e of one point (|p - y| <= e y for the most replies y:
  the value most replies are within e of); e = 0 is the most frequent RTT, which matters
  where RTTs are rounded (the Seattle matrices: 10 ms steps). e is picked on the train
  split from PAIR_MODE_BANDS, or the plain median where it does better: each pair's
  earliest four fifths predict its latest fifth, and the choice with the lower median
  relative error over those replies wins. A point for the metric a median relative error
  rewards (the most replies close), where the median is the point half the replies lie
  each side of; p_fail as pair_median's.
- ``pair_last``: the pair's latest successful RTT; p_fail 1 if its latest ping failed.
- ``pair_ema``: per pair, an EMA (alpha 0.3, first value as is) of its successful RTTs in
  time order, and of its failure indicator.
- ``vivaldi``: network coordinates (Dabek et al., "Vivaldi", SIGCOMM 2004): a point in the
  plane plus a height, the access link (section 5.4), RTT(i, j) ~ ||x_i - x_j|| + h_i + h_j,
  fit by replaying the pings as springs with the paper's adaptive timestep (c_c = c_e =
  0.25). Springs move both ends, so a node seen only as a destination has coordinates too.
- ``matrix_factorization``: log RTT ~ mu + b_src + c_dst + <U_src, V_dst>, rank 10, which,
  unlike a metric space, holds asymmetric routes and triangle inequality violations. SGD as
  in DMFSGD (Liao et al., IEEE/ACM ToN 2013) with Koren et al.'s biases (IEEE Computer
  2009), L2, a decaying step and a Huber clip; log space because RTT errors are relative. A
  node seen only as a destination answers its ping to j as j's ping to it.

``pair_last`` and ``pair_ema`` use only timestamped measurements; the coordinate models'
p_fail is the global rate. Kernels: train.eval.coord_kernels; fits are bit-identical by seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from train.eval import coord_kernels as K
from train.eval import registry

BASELINES = registry.names(registry.TRAIN_FIT)  # names, labels, order: train/eval/registry.py
EMA_ALPHA = 0.3
RTT_FLOOR_MS = 1e-3  # 0 ms RTTs exist (loopback-like paths); logs and relative errors need > 0

# Vivaldi: c_c and c_e are the paper's constants (section 3); local errors start at 1.0
# ("know nothing") and, as in Serf's implementation, never exceed that start.
VIVALDI_DIMS, VIVALDI_ROUNDS = 2, 20
VIVALDI_CC = VIVALDI_CE = 0.25
VIVALDI_ERROR0 = 1.0
# Heights start at and are clamped to this (ms; Serf's HeightMin is the same 10 us): the
# height step is proportional to h_i + h_j, so a height of 0 could never grow again.
VIVALDI_HEIGHT_MIN = 0.01

# pair_mode's relative bands (half-widths), and the share of each pair's train replies
# (its latest, in time order) that picks one of them or the median
PAIR_MODE_BANDS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2)
PAIR_MODE_HOLDOUT = 0.2

MF_RANK = 10
MF_EPOCHS = 20
# step lr * decay**epoch: large early steps get near the optimum in a few epochs, small late
# ones keep noisy RTTs from leaving the factors jittering around it (0.2 -> 0.009)
MF_LR = 0.2
MF_DECAY = 0.85
MF_REG = 0.01  # L2, per sample, on biases and factors
MF_HUBER = 1.0  # residuals clipped to +-1 in log space: a 10x RTT spike is one bounded step
MF_INIT = 0.1  # std of the initial factors


@dataclass(frozen=True)
class Prediction:
    """Answers to q queries. Where ``covered`` is False, rtt_ms is the global median; p_fail
    there is the global failure rate unless the baseline knows the pair from failures only
    (the pair baselines: a pair that only ever failed keeps its own p_fail)."""

    rtt_ms: np.ndarray  # float64[q]: the RTT of a successful ping
    p_fail: np.ndarray  # float64[q]: probability that the ping fails
    covered: np.ndarray  # bool[q]: rtt_ms is the baseline's own, not the global median


@dataclass(frozen=True, eq=False)
class Baseline:
    """A fitted predictor: ``predict(src, dst) -> Prediction``. Subclasses give ``_own``,
    their RTT and p_fail for known node ids, NaN where they have none; ``predict`` fills
    those with the global median and failure rate."""
    name: str
    n_nodes: int
    median_ms: float
    fail_rate: float

    def predict(self, src, dst) -> Prediction:
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError("src and dst must be 1-D arrays of one length")
        # ids outside the train id space are nodes the fit never saw
        known = (src >= 0) & (src < self.n_nodes) & (dst >= 0) & (dst < self.n_nodes)
        rtt, p_fail = np.full(len(src), np.nan), np.full(len(src), np.nan)
        if known.any():
            rtt[known], p_fail[known] = self._own(src[known], dst[known])
        covered = ~np.isnan(rtt)
        rtt[~covered] = self.median_ms
        p_fail[np.isnan(p_fail)] = self.fail_rate
        return Prediction(rtt, p_fail, covered)

    def _own(self, src, dst):
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class GlobalMedian(Baseline):
    def predict(self, src, dst) -> Prediction:
        q = len(np.asarray(src))
        return Prediction(np.full(q, self.median_ms), np.full(q, self.fail_rate), np.ones(q, bool))


@dataclass(frozen=True, eq=False)
class PairTable(Baseline):
    """Keyed by the ordered pair; a pair never seen in its own direction answers with the
    reverse one (a round trip crosses the same two ends: the factorization's rule)."""
    keys: np.ndarray  # int64[p], sorted: src * n_nodes + dst
    rtt_ms: np.ndarray  # float64[p], NaN: the pair has no RTT of its own
    p_fail: np.ndarray  # float64[p]

    def _find(self, keys):
        """(rtt, p_fail) of each key, NaN where the table has no such key."""
        if len(self.keys) == 0:
            return np.full(len(keys), np.nan), np.full(len(keys), np.nan)
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        hit = self.keys[pos] == keys
        return (np.where(hit, self.rtt_ms[pos], np.nan),
                np.where(hit, self.p_fail[pos], np.nan))

    def _own(self, src, dst):
        rtt, p_fail = self._find(src * self.n_nodes + dst)
        # the reverse pair where this direction has no ping (neither an RTT nor a failure)
        back = np.isnan(rtt) & np.isnan(p_fail)
        if back.any():
            rtt[back], p_fail[back] = self._find(dst[back] * self.n_nodes + src[back])
        return rtt, p_fail


@dataclass(frozen=True, eq=False)
class DstTable(PairTable):
    """Keyed by the destination alone (keys: dst ids)."""

    def _own(self, src, dst):
        return self._find(dst)


@dataclass(frozen=True, eq=False)
class Vivaldi(Baseline):
    coords: np.ndarray  # float64[n_nodes, dims]
    heights: np.ndarray  # float64[n_nodes]
    trained: np.ndarray  # bool[n_nodes]: the node was in a successful train ping

    def _own(self, src, dst):
        d = (np.linalg.norm(self.coords[src] - self.coords[dst], axis=1)
             + self.heights[src] + self.heights[dst])
        own = self.trained[src] & self.trained[dst]
        return np.where(own, d, np.nan), np.full(len(src), np.nan)


@dataclass(frozen=True, eq=False)
class Factorization(Baseline):
    mu: float
    b: np.ndarray  # float64[n_nodes]: source bias
    c: np.ndarray  # float64[n_nodes]: destination bias
    u: np.ndarray  # float64[n_nodes, rank]: source factors
    v: np.ndarray  # float64[n_nodes, rank]: destination factors
    seen_src: np.ndarray  # bool[n_nodes]
    seen_dst: np.ndarray  # bool[n_nodes]

    def _own(self, src, dst):
        forward = self.seen_src[src] & self.seen_dst[dst]
        # a source never seen as one: the reverse ping, where its destination was a source
        reverse = ~forward & self.seen_dst[src] & self.seen_src[dst]
        i, j = np.where(reverse, dst, src), np.where(reverse, src, dst)
        log_rtt = self.mu + self.b[i] + self.c[j] + np.einsum("qr,qr->q", self.u[i], self.v[j])
        return (np.where(forward | reverse, np.exp(log_rtt), np.nan),
                np.full(len(src), np.nan))


@dataclass(frozen=True)
class _Train:
    src: np.ndarray
    dst: np.ndarray
    rtt: np.ndarray
    time: np.ndarray
    has_time: np.ndarray
    ok: np.ndarray  # the ping succeeded
    n_nodes: int
    median_ms: float
    fail_rate: float

    def common(self, name):
        return dict(name=name, n_nodes=self.n_nodes, median_ms=self.median_ms,
                    fail_rate=self.fail_rate)


def _train(src, dst, rtt, time, has_time, n_nodes) -> _Train:
    src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    rtt, time = np.asarray(rtt, np.float64), np.asarray(time, np.int64)
    has_time = np.asarray(has_time, bool)
    if not (src.ndim == 1 and src.shape == dst.shape == rtt.shape == time.shape == has_time.shape):
        raise ValueError("src, dst, rtt, time and has_time must be 1-D arrays of one length")
    if n_nodes < 1 or len(src) and (min(src.min(), dst.min()) < 0
                                    or max(src.max(), dst.max()) >= n_nodes):
        raise ValueError(f"node ids must lie in [0, n_nodes={n_nodes})")
    ok = rtt >= 0
    if not (np.isfinite(rtt) & (ok | (rtt == -1.0))).all():
        raise ValueError("rtt must be >= 0, or -1.0 for a failed ping")
    if not ok.any():
        raise ValueError("the train set has no successful ping: no RTT to fit")
    return _Train(src, dst, rtt, time, has_time, ok, n_nodes, float(np.median(rtt[ok])),
                  float((~ok).sum() / len(ok)))


def _check_finite(name, *arrays):
    # NaN predictions would pass silently as "not covered": fail loudly instead
    if not all(np.isfinite(a).all() for a in arrays):
        raise FloatingPointError(f"{name} diverged: non-finite parameters")


@njit(cache=True)
def _group_ema(keys, x, alpha):
    """Per run of equal keys (keys sorted, x in time order within a run): the EMA of x,
    first value taken as is. Returns (run keys, EMAs)."""
    out_k = np.empty(len(keys), np.int64)
    out_x = np.empty(len(keys), np.float64)
    m = -1
    for i in range(len(keys)):
        if m < 0 or keys[i] != out_k[m]:
            m += 1
            out_k[m] = keys[i]
            out_x[m] = x[i]
        else:
            out_x[m] = alpha * x[i] + (1.0 - alpha) * out_x[m]
    return out_k[:m + 1], out_x[:m + 1]


def _fit_pair_ema(t: _Train, name: str, alpha: float) -> PairTable:
    keys = t.src * t.n_nodes + t.dst
    idx = np.flatnonzero(t.has_time)
    # stable by time, then stable by pair: time order within a pair, ties in input order
    idx = idx[np.argsort(t.time[idx], kind="stable")]
    idx = idx[np.argsort(keys[idx], kind="stable")]
    pair_keys, p_fail = _group_ema(keys[idx], (~t.ok[idx]).astype(np.float64), alpha)
    ok = idx[t.ok[idx]]
    ok_keys, ok_rtt = _group_ema(keys[ok], t.rtt[ok], alpha)
    rtt = np.full(len(pair_keys), np.nan)
    rtt[np.searchsorted(pair_keys, ok_keys)] = ok_rtt
    return PairTable(**t.common(name), keys=pair_keys, rtt_ms=rtt, p_fail=p_fail)


def _fit_median(t: _Train, name: str) -> PairTable:
    """pair_median (keys: ordered pairs) or dst_median (keys: destinations)."""
    by_dst = name == "dst_median"
    keys = t.dst if by_dst else t.src * t.n_nodes + t.dst
    pair_keys, inv, counts = np.unique(keys, return_inverse=True, return_counts=True)
    p_fail = np.bincount(inv, weights=~t.ok, minlength=len(pair_keys)) / counts
    ok_keys, ok_rtt = keys[t.ok], t.rtt[t.ok]
    o = np.lexsort((ok_rtt, ok_keys))
    ok_keys, ok_rtt = ok_keys[o], ok_rtt[o]
    starts = np.flatnonzero(np.r_[True, ok_keys[1:] != ok_keys[:-1]])
    median = _run_medians(ok_rtt, np.r_[starts, len(ok_keys)])
    rtt = np.full(len(pair_keys), np.nan)
    rtt[np.searchsorted(pair_keys, ok_keys[starts])] = median
    return (DstTable if by_dst else PairTable)(**t.common(name), keys=pair_keys, rtt_ms=rtt,
                                               p_fail=p_fail)


@njit(cache=True)
def _band_points(starts, vals, e):
    """Per run [starts[k], starts[k + 1]) of ascending values: the centre of the feasible
    points [y_b (1 - e), y_a (1 + e)] of the window y_a..y_b holding the most values with
    y_b (1 - e) <= y_a (1 + e); among equal windows, the one whose centre is nearest the
    run's median (in log)."""
    out = np.empty(len(starts) - 1, np.float64)
    for k in range(len(starts) - 1):
        a0, b1 = starts[k], starts[k + 1]
        n = b1 - a0
        med = np.log(max(0.5 * (vals[a0 + (n - 1) // 2] + vals[a0 + n // 2]), 1e-3))
        best, best_p, best_d = -1, 0.0, 0.0
        a = a0
        for b in range(a0, b1):
            while vals[b] * (1.0 - e) > vals[a] * (1.0 + e):
                a += 1
            c = b - a + 1
            p = 0.5 * (vals[b] * (1.0 - e) + vals[a] * (1.0 + e))
            d = abs(np.log(max(p, 1e-3)) - med)
            if c > best or (c == best and d < best_d):
                best, best_p, best_d = c, p, d
        out[k] = best_p
    return out


def _pair_runs(keys, rtt):
    """(sorted unique keys, run starts, values ascending within each key's run)."""
    o = np.lexsort((rtt, keys))
    keys, rtt = keys[o], rtt[o]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return keys[starts], np.r_[starts, len(keys)].astype(np.int64), rtt


def _band_or_median(keys, rtt, e):
    """(unique keys, each key's band point at e, or its median where e is None)."""
    u, starts, vals = _pair_runs(keys, rtt)
    if e is not None:
        return u, _band_points(starts, vals, float(e))
    return u, _run_medians(vals, starts)


def _run_medians(vals, bounds):
    """The median of each sorted run vals[bounds[i]:bounds[i + 1]], np.median's convention:
    the mean of the two middle values (one value when a run's length is odd)."""
    n = np.diff(bounds)
    return (vals[bounds[:-1] + (n - 1) // 2] + vals[bounds[:-1] + n // 2]) / 2


def pick_band(keys, rtt, order) -> tuple[float | None, dict]:
    """pair_mode's band: each pair's replies in ``order`` (time), its earliest
    1 - PAIR_MODE_HOLDOUT fit each candidate (PAIR_MODE_BANDS, None: the median) and its
    latest PAIR_MODE_HOLDOUT score it (median relative error over all such replies; pairs
    with fewer than 5 replies sit out). Returns (the lowest's band, {band: error})."""
    keys, rtt = keys[order], rtt[order]
    o = np.argsort(keys, kind="stable")  # time order within each pair
    keys, rtt = keys[o], rtt[o]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    n = np.diff(np.r_[starts, len(keys)])
    rank = np.arange(len(keys)) - np.repeat(starts, n)
    size = np.repeat(n, n)
    late = (size >= 5) & (rank >= np.ceil(size * (1 - PAIR_MODE_HOLDOUT)))
    early = (size >= 5) & ~late
    if not late.any():
        return None, {}
    errors = {}
    for e in (None, *PAIR_MODE_BANDS):
        u, point = _band_or_median(keys[early], rtt[early], e)
        p = point[np.searchsorted(u, keys[late])]
        truth = rtt[late]
        errors[e] = float(np.median(np.abs(p - truth) / np.maximum(truth, RTT_FLOOR_MS)))
    return min(errors, key=lambda e: (errors[e], e is not None)), errors


@dataclass(frozen=True, eq=False)
class PairMode(PairTable):
    band: float | None  # the band picked on the train split; None: the median
    band_errors: dict  # {band: median relative error on the held-back replies}


def _fit_mode(t: _Train, name: str) -> PairMode:
    keys = t.src * t.n_nodes + t.dst
    median = _fit_median(t, "pair_median")
    ok = np.flatnonzero(t.ok)
    # time order where there is time; input order otherwise (stable sort on 0s)
    order = ok[np.argsort(np.where(t.has_time[ok], t.time[ok], 0), kind="stable")]
    band, errors = pick_band(keys, t.rtt, order)
    u, point = _band_or_median(keys[ok], t.rtt[ok], band)
    rtt = np.full(len(median.keys), np.nan)
    rtt[np.searchsorted(median.keys, u)] = point
    return PairMode(**t.common(name), keys=median.keys, rtt_ms=rtt, p_fail=median.p_fail,
                    band=band, band_errors=errors)


def _fit_vivaldi(t: _Train, *, seed: int, rounds: int = VIVALDI_ROUNDS,
                 dims: int = VIVALDI_DIMS) -> Vivaldi:
    use = t.ok & (t.src != t.dst)  # a node's distance to itself teaches nothing
    src, dst = t.src[use], t.dst[use]
    x, h = K.vivaldi(src, dst, t.rtt[use], t.n_nodes, (dims, rounds, VIVALDI_CC, VIVALDI_CE,
                    VIVALDI_ERROR0, VIVALDI_HEIGHT_MIN, RTT_FLOOR_MS), seed)
    _check_finite("vivaldi", x, h)
    trained = np.zeros(t.n_nodes, bool)
    trained[src] = trained[dst] = True
    return Vivaldi(**t.common("vivaldi"), coords=x, heights=h, trained=trained)


def _fit_factorization(t: _Train, *, seed: int, rank: int = MF_RANK, epochs: int = MF_EPOCHS,
                       lr: float = MF_LR, decay: float = MF_DECAY, reg: float = MF_REG,
                       huber: float = MF_HUBER) -> Factorization:
    src, dst = t.src[t.ok], t.dst[t.ok]
    y = np.log(np.maximum(t.rtt[t.ok], RTT_FLOOR_MS))
    mu, b, c, u, v = K.sgd_factorize(src, dst, y, t.n_nodes,
                                    (rank, epochs, lr, decay, reg, huber, MF_INIT), seed)
    _check_finite("matrix_factorization", b, c, u, v)
    seen_src, seen_dst = np.zeros(t.n_nodes, bool), np.zeros(t.n_nodes, bool)
    seen_src[src] = seen_dst[dst] = True
    return Factorization(**t.common("matrix_factorization"), mu=float(mu), b=b, c=c, u=u, v=v,
                         seen_src=seen_src, seen_dst=seen_dst)


def _fit(name: str, t: _Train, seed: int, options: dict) -> Baseline:
    if name == "vivaldi":
        return _fit_vivaldi(t, seed=seed, **options)
    if name == "matrix_factorization":
        return _fit_factorization(t, seed=seed, **options)
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    if options:
        raise TypeError(f"{name} takes no options, got {sorted(options)}")
    if name == "pair_last":
        return _fit_pair_ema(t, name, 1.0)  # an EMA with alpha 1 is the last value
    if name == "pair_ema":
        return _fit_pair_ema(t, name, EMA_ALPHA)
    if name in ("pair_median", "dst_median"):
        return _fit_median(t, name)
    if name == "pair_mode":
        return _fit_mode(t, name)
    return GlobalMedian(**t.common(name))


def fit(name: str, src, dst, rtt, time, has_time, *, n_nodes: int, seed: int = 0,
        **options) -> Baseline:
    """Fit one baseline. ``options`` go to vivaldi (rounds, dims) or matrix_factorization
    (rank, epochs, lr, decay, reg, huber)."""
    return _fit(name, _train(src, dst, rtt, time, has_time, n_nodes), seed, options)


def fit_all(src, dst, rtt, time, has_time, *, n_nodes: int, seed: int = 0) -> dict[str, Baseline]:
    """Fit every baseline in BASELINES with its default settings."""
    t = _train(src, dst, rtt, time, has_time, n_nodes)
    return {name: _fit(name, t, seed, {}) for name in BASELINES}
