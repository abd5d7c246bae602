"""Ask a trained model for RTTs: ``load(run_dir).predict(src, dst, time=..., history=...)``.

    >>> from train.predict.predictor import load
    >>> model = load("runs/tiny-20261123-101500")
    >>> model.predict("192.0.2.7", "193.0.14.129", time=1767312000)   # Unix seconds
    {'rtt_ms': …, 'p10_ms': …, 'p90_ms': …, 'p_failed': …, 'history_used': 0, …}

A query is one measurement whose result is unknown, written as in training in ``full``
timestamp mode with the result block last (``MEASUREMENT_START, source, destination,
timestamp, RTT_START``), after the probe's history in the same context. History carries its
value fields (prep.schema.vocab.VALUE_FIELDS) before the result; a `train predict` query
has none. From the model's next-token distributions:

- ``p_failed`` = P(FAILED) / (P(FAILED) + P(RTT_START)) at the result position;
- the RTT is the two bytes ``EEEEEMMM MMMMMMMM`` after RTT_START (µs = mantissa ×
  2^exponent), over the "canonical" codes the tokenizer writes (exponent 0, or mantissa >=
  1024). On those, code order is value order, so quantile q is exact in two steps: the
  first-byte distribution (over the 132 canonical first bytes) gives the byte b1* where the
  cumulative probability reaches q; one probe pass (train.model.model.forward) gives the
  second byte's distribution given b1* (at most three for median, p10 and p90);
  tests/test_predictor.py holds this to a brute force. A code reports its bin's value
  (prep.tokens.decode.rtt_ms); ``non_canonical_mass`` is the first-byte mass off the
  canonical bytes (near 0 for a trained model). `train eval` scores with the same machinery,
  the true results standing in the row (teacher forcing).
- with ``band`` e (``answer``; `train predict --band`), also the **band point**: the code
  value p that the most probability lies within e of (|p - y| <= e y), sought over the
  codes of the MODE_FIRST_BYTES likeliest first bytes (one probe pass each, with the
  quantiles'): the point a median relative error rewards, where the median is the point
  half the mass lies each side of. e = 0: the likeliest code.
- with ``bands`` and ``groups`` (`train eval`: the strata), every band's point and, per
  group, the model's own P(|p - y| <= t y) at each (COVER_T), summed over the group's
  queries: ``pick_bands`` takes, per group, the band whose median relative error the model
  expects least of itself (docs/learning.md §8.27).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from prep.base.errors import InputError, first_line
from prep.schema import vocab as V
from prep.schema.measurements import addr_words
from prep.tokens.reference import addr_block, result_block, timestamp_block, value_block
from train.model import arch, attention, model
from train.model.arch import ModelConfig

B = V.BYTE_OFFSET
QUANTILES = (0.1, 0.5, 0.9)
MODE_FIRST_BYTES = 4  # the band point is sought among these likeliest first bytes' codes
# the relative errors t at which a query's own P(|p - y| <= t y) is read (``self_cover``)
COVER_T = np.exp(np.linspace(np.log(1e-3), np.log(2.0), 200))
UNKNOWN = -2  # rtt_code of a query: its result is what we ask for


def _canonical_first_bytes() -> np.ndarray:
    """First bytes of canonical RTT codes in value order: exponent 0 (mantissa bits 0-7),
    then for each exponent 1..31 mantissa high bits 4-7 (mantissa >= 1024)."""
    out = list(range(8))
    for e in range(1, 32):
        out += [(e << 3) | hi for hi in range(4, 8)]
    return np.array(out, np.int64)


CANONICAL_B1 = _canonical_first_bytes()  # 132 first bytes, ascending values


def code_ms(code) -> np.ndarray:
    """ms of RTT codes (the bin's value: mantissa × 2^exponent µs)."""
    code = np.asarray(code, np.int64)
    return (code & 0x7FF) * np.exp2(code >> 11) / 1000.0


# --- encoding queries ------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    """One measurement of a query context; ``rtt_code`` -1 = failed, UNKNOWN = to predict."""
    family: int
    src_hi: int
    src_lo: int
    dst_hi: int
    dst_lo: int
    time: int | None
    rtt_code: int
    values: tuple = ()  # its value fields (prep.schema.vocab.VALUE_FIELDS), where known


def encode_context(ms: list[Measurement]) -> tuple[list[int], list[int], list[int]]:
    """(tokens, choice_pos, rtt_pos): a context in full mode, blocks source, destination,
    timestamp, value fields, result, each as the tokenizer writes it (prep.tokens.reference's
    block helpers). choice_pos[i]: the position whose next token is measurement i's result
    header; rtt_pos[i]: its RTT_START (-1 if it failed).

    Value blocks (prep.schema.vocab.VALUE_FIELDS) are written where a measurement has ``values``:
    history and `train eval`'s queries have them, a query of `train predict` does not.
    """
    tokens, choice, rtt = [], [], []
    prev = None
    for m in ms:
        tokens.append(V.MEASUREMENT_START)
        tokens += addr_block(V.SRC_IPV4, m.family, int(m.src_hi), int(m.src_lo))
        tokens += addr_block(V.DST_IPV4, m.family, int(m.dst_hi), int(m.dst_lo))
        if m.time is not None:
            if prev is not None and m.time < prev:
                raise InputError(f"time {m.time} is before the previous measurement's {prev}; "
                                 "a context runs oldest first")
            tokens += timestamp_block(prev, m.time)
            prev = m.time
        for k, v in enumerate(m.values):
            tokens += value_block(k, int(v))
        choice.append(len(tokens) - 1)
        rtt.append(-1 if m.rtt_code == -1 else len(tokens))
        # the query's result is what the model is asked for: its header alone
        tokens += [V.RTT_START] if m.rtt_code == UNKNOWN else result_block(m.rtt_code)
    return tokens, choice, rtt


def pack_contexts(contexts: list[list[int]], row_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32[R, L], segment_ids int32[R, L], row_start int64[n, 2]): contexts laid
    in rows in order (next fit: a context that does not fit starts a new row); row_start[i]
    is context i's (row, offset)."""
    where, r, off = [], 0, 0
    for c in contexts:
        if len(c) > row_len:
            raise ValueError(f"a context of {len(c)} tokens is longer than a row ({row_len})")
        if off + len(c) > row_len:
            r, off = r + 1, 0
        where.append((r, off))
        off += len(c)
    n_rows = r + 1 if contexts else 0
    tok = np.zeros((n_rows, row_len), np.int32)
    seg = np.zeros((n_rows, row_len), np.int32)
    last = {}
    for c, (r, o) in zip(contexts, where):
        last[r] = last.get(r, 0) + 1
        tok[r, o:o + len(c)] = c
        seg[r, o:o + len(c)] = last[r]
    return tok, seg, np.array(where, np.int64).reshape(-1, 2)


# --- the model's answers ---------------------------------------------------------------

@dataclass(frozen=True)
class Answers:
    """Per query: P(failed), the RTT quantiles (ms) of QUANTILES, the canonical codes."""
    p_failed: np.ndarray  # float64[n]
    quantile_ms: np.ndarray  # float64[n, 3]: p10, median, p90 (NaN where not asked)
    quantile_code: np.ndarray  # int64[n, 3]
    non_canonical_mass: np.ndarray  # float64[n]: first-byte mass off the canonical codes
    # float64[n]: the band point (ms; module docstring) where a band was asked, else NaN
    point_ms: np.ndarray | None = None
    # with ``bands`` (answer): float64[n, len(bands)] each band's point (None: the median),
    # and per group float64[G, len(bands), len(COVER_T)] the sum over its queries of the
    # model's own P(|p - y| <= t y) at that point, with the queries counted, int64[G]
    band_points: np.ndarray | None = None
    self_cover: np.ndarray | None = None
    self_count: np.ndarray | None = None

    @property
    def rtt_ms(self) -> np.ndarray:
        """The point prediction: the band point where one was asked, else the median."""
        med = self.quantile_ms[:, 1]
        return med if self.point_ms is None else np.where(np.isnan(self.point_ms), med,
                                                          self.point_ms)


class Predictor:
    """A trained model's parameters and the two jitted passes behind every answer."""

    def __init__(self, params: dict, mcfg: ModelConfig, *, compute_dtype: str = "float32",
                 attention_impl: str = "auto", batch_size: int = 8, run_dir: str | None = None,
                 step: int | None = None, skipped: tuple = ()):
        self.params, self.mcfg, self.batch_size = params, mcfg, batch_size
        self.run_dir, self.step = run_dir, step
        self.skipped = skipped  # (step, why) of the damaged newer checkpoints load passed over
        impl = attention.resolve(attention_impl, bias=bool(mcfg.match_dst))
        self.attention = attention.AttentionConfig(
            impl, max_segments=max(2, mcfg.seq_len // 12 + 1), dtype=compute_dtype)
        self.row_len = mcfg.seq_len

    @property
    def _gather(self):
        return _compiled(self.mcfg, self.attention)[0]

    @property
    def _probe(self):
        return _compiled(self.mcfg, self.attention)[1]

    def answer(self, tok: np.ndarray, seg: np.ndarray, q_row: np.ndarray, q_choice: np.ndarray,
               q_rtt: np.ndarray, *, band: float | None = None, bands: tuple | None = None,
               groups: np.ndarray | None = None, progress=None) -> Answers:
        """Answers for queries (row, choice position, RTT_START position or -1) over rows;
        with ``band``, each one's band point too (module docstring); with ``bands`` (None in
        it: the median) and ``groups`` (int[n], 0..G-1), each band's point and, per group,
        how near the model expects them to be (Answers.self_cover; ``pick_bands``)."""
        n = len(q_row)
        p_failed = np.full(n, np.nan)
        codes = np.full((n, len(QUANTILES)), -1, np.int64)
        off_mass = np.full(n, np.nan)
        point = None if band is None else np.full(n, np.nan)
        multi = None
        if bands is not None:
            g = int(groups.max()) + 1 if len(groups) else 0
            multi = (tuple(bands), np.asarray(groups, np.int64),
                     np.full((n, len(bands)), np.nan),
                     np.zeros((g, len(bands), len(COVER_T))), np.zeros(g, np.int64))
        order = np.argsort(q_row, kind="stable")
        bounds = np.searchsorted(q_row[order], np.arange(len(tok) + 1))
        for r0 in range(0, len(tok), self.batch_size):
            r1 = min(r0 + self.batch_size, len(tok))
            qs = order[bounds[r0]:bounds[r1]]
            if len(qs):
                self._answer_batch(tok, seg, r0, r1, qs, q_row, q_choice, q_rtt, p_failed,
                                   codes, off_mass, band, point, multi)
            if progress is not None:
                progress(r1 - r0, len(qs))
        ms = np.where(codes >= 0, code_ms(np.maximum(codes, 0)), np.nan)
        extra = () if multi is None else multi[2:]
        return Answers(p_failed, ms, codes, off_mass, point, *extra)

    def _answer_batch(self, tok, seg, r0, r1, qs, q_row, q_choice, q_rtt, p_failed, codes,
                      off_mass, band=None, point=None, multi=None):
        bs = self.batch_size
        rows = q_row[qs] - r0
        slot = np.arange(len(qs)) - np.searchsorted(rows, rows)  # index among its row's queries
        width = _bucket(2 * int(slot.max()) + 2)
        pos = np.zeros((bs, width), np.int32)
        pos[rows, 2 * slot] = q_choice[qs]
        pos[rows, 2 * slot + 1] = np.maximum(q_rtt[qs], 0)
        t, s = pad_rows(tok[r0:r1], bs), pad_rows(seg[r0:r1], bs)
        lp = np.asarray(self._gather(self.params, t, s, pos), np.float64)
        lp_choice, lp_b1 = lp[rows, 2 * slot], lp[rows, 2 * slot + 1]
        p_fail, p_rtt = np.exp(lp_choice[:, V.FAILED]), np.exp(lp_choice[:, V.RTT_START])
        p_failed[qs] = p_fail / (p_fail + p_rtt)

        want = q_rtt[qs] >= 0
        if not want.any():
            return
        first = first_byte_quantiles(lp_b1[want])
        b1, before, p_b1, off = first
        qw = qs[want]
        off_mass[qw] = off
        # probes: the first bytes a query needs (its quantiles', then with a band its
        # MODE_FIRST_BYTES likeliest), anchored at its RTT_START
        top, p_top = ((None, None) if band is None and multi is None
                      else likeliest_first_bytes(lp_b1[want]))
        asked = b1 if top is None else np.concatenate([b1, top], axis=1)
        k = asked.shape[1]
        rw = rows[want]
        pslot = np.arange(len(qw)) - np.searchsorted(rw, rw)
        pwidth = _bucket(k * int(pslot.max()) + k)
        p_tok = np.zeros((bs, pwidth), np.int32)
        p_prev = np.zeros((bs, pwidth), np.int32)
        cols = k * pslot[:, None] + np.arange(k)
        p_tok[rw[:, None], cols] = B + asked
        p_prev[rw[:, None], cols] = q_rtt[qw][:, None]
        lp2 = np.asarray(self._probe(self.params, t, s, p_tok, p_prev), np.float64)
        lp2 = lp2[rw[:, None], cols]
        nq = len(QUANTILES)
        b2 = second_byte_quantiles(lp2[:, :nq], before, p_b1)
        codes[qw] = (b1 << 8) | b2
        if band is not None:
            point[qw] = band_point(top, p_top, lp2[:, nq:], band)
        if multi is not None:
            bands, groups, points, cover, count = multi
            pts, cov = band_points_covered(top, p_top, lp2[:, nq:], bands,
                                           code_ms(codes[qw, 1]))
            points[qw] = pts
            np.add.at(cover, groups[qw], cov)
            np.add.at(count, groups[qw], 1)

    # --- one query at a time ---------------------------------------------------------------
    def predict(self, src: str, dst: str, *, time: int | None = None,
                history: list[Measurement] | None = None) -> dict:
        """RTT median, p10, p90 (ms) and P(failed) of one ping from ``src`` to ``dst``."""
        return self.predict_many([(src, dst, time, history or [])])[0]

    @property
    def max_history(self) -> int:
        """The most history measurements that can share a row with a query (none is
        shorter than 12 tokens)."""
        return self.row_len // 12

    def predict_many(self, queries, *, progress=None) -> list[dict]:
        """``predict`` for many (src, dst, time or None, history list) at once, batched;
        ``progress(rows, queries)`` after each batch of rows."""
        return self.predict_measurements(
            [(query_measurement(src, dst, t), hist) for src, dst, t, hist in queries],
            progress=progress)

    def predict_measurements(self, queries, *, band: float | None = None,
                             progress=None) -> list[dict]:
        """``predict_many`` for (query measurement, history list) pairs; with ``band``, each
        answer's ``point_ms`` too: its band point there (module docstring)."""
        contexts, q_choice, q_rtt, dropped = [], [], [], []
        for q, hist in queries:
            hist = sorted(hist, key=lambda m: -1 if m.time is None else m.time)
            tokens, choice, rtt, kept = self._fit_row(hist, q)
            contexts.append(tokens)
            q_choice.append(choice)
            q_rtt.append(rtt)
            dropped.append(len(hist) - kept)
        tok, seg, where = pack_contexts(contexts, self.row_len)
        ans = self.answer(tok, seg, where[:, 0], where[:, 1] + np.array(q_choice, np.int64),
                          where[:, 1] + np.array(q_rtt, np.int64), band=band,
                          progress=progress)
        out = []
        for i in range(len(queries)):
            out.append({"rtt_ms": float(ans.quantile_ms[i, 1]),
                        "p10_ms": float(ans.quantile_ms[i, 0]),
                        "p90_ms": float(ans.quantile_ms[i, 2]),
                        "p_failed": float(ans.p_failed[i]),
                        "history_used": len(queries[i][1]) - dropped[i],
                        "non_canonical_mass": float(ans.non_canonical_mass[i])})
            if band is not None:
                out[-1]["point_ms"] = float(ans.point_ms[i])
        return out

    def _fit_row(self, hist: list[Measurement], q: Measurement):
        """The query after as much of its history (the most recent) as fits one row.

        Dropping the oldest measurement shortens a context (by 12 tokens or more, less at
        most the 7 its successor's timestamp grows by, delta to absolute), so the first
        that fits is found by bisection: a few encodings, not one per measurement."""
        lo = max(0, len(hist) - self.max_history)  # older ones than this cannot fit
        hi, best = len(hist), None  # the query alone always fits
        while lo < hi:  # the smallest start in [lo, hi] whose context fits
            mid = (lo + hi) // 2
            enc = encode_context(hist[mid:] + [q])
            if len(enc[0]) <= self.row_len:
                hi, best = mid, enc
            else:
                lo = mid + 1
        tokens, choice, rtt = best or encode_context([q])
        return tokens, choice[-1], rtt[-1], len(hist) - hi


@functools.lru_cache(maxsize=4)
def _compiled(mcfg: ModelConfig, att: attention.AttentionConfig):
    """(pass 1: log-probabilities at chosen positions, pass 2: of probes after chosen
    positions), jitted once per model shape and attention settings in a process."""

    def gather(params, tokens, seg, pos):
        logits = model.forward(params, tokens, seg, mcfg, att)
        return jax.nn.log_softmax(jnp.take_along_axis(logits, pos[:, :, None], axis=1))

    def probe(params, tokens, seg, p_tok, p_prev):
        _, logits = model.forward(params, tokens, seg, mcfg, att, probes=(p_tok, p_prev))
        return jax.nn.log_softmax(logits)

    return jax.jit(gather), jax.jit(probe)


_addr_words = functools.lru_cache(maxsize=1 << 16)(addr_words)  # queries repeat addresses


def query_measurement(src: str, dst: str, time: int | None, *,
                      where: str | None = None) -> Measurement:
    """The query measurement of (src, dst, time); InputError for a bad address, naming it
    by its flag (--src, --dst), or by ``where`` (a queries file's "FILE: query K") and its
    column."""
    names = ("--src", "--dst") if where is None else ("src_addr", "dst_addr")
    fix = ("give IPv4 or IPv6 addresses, e.g. --src 192.0.2.7 --dst 193.0.14.129"
           if where is None else "give IPv4 or IPv6 addresses in src_addr and dst_addr")
    words = []
    for name, addr in zip(names, (src, dst)):
        try:
            words.append(_addr_words(str(addr)))
        except ValueError as e:
            raise InputError(f"{where + ', ' if where else ''}{name}: {e}; {fix}") from None
    (fs, sh, sl), (fd, dh, dl) = words
    if fs != fd:
        raise InputError(f"{where + ': ' if where else ''}source {src} is IPv{fs} and "
                         f"destination {dst} IPv{fd}; a ping has one address family")
    return Measurement(fs, sh, sl, dh, dl, None if time is None else int(time), UNKNOWN)


def first_byte_quantiles(lp_b1: np.ndarray):
    """Per query (log-probs [n, V] of the token after RTT_START): for each of QUANTILES the
    canonical first byte b1* where the cumulative first-byte probability reaches it, the
    probability before b1*, P(b1*), and the non-canonical share of the byte mass."""
    p_bytes = np.exp(lp_b1[:, B:B + 256])
    p = p_bytes[:, CANONICAL_B1]
    total = p.sum(axis=1, keepdims=True)
    off = 1.0 - total[:, 0] / p_bytes.sum(axis=1)
    p = p / total
    cum = np.cumsum(p, axis=1)
    q = np.asarray(QUANTILES)
    idx = np.minimum((cum[:, None, :] < q[None, :, None]).sum(axis=2), len(CANONICAL_B1) - 1)
    p_at = np.take_along_axis(p, idx, axis=1)
    before = np.take_along_axis(cum, idx, axis=1) - p_at
    return CANONICAL_B1[idx], before, p_at, off


def likeliest_first_bytes(lp_b1: np.ndarray):
    """Per query: the MODE_FIRST_BYTES likeliest canonical first bytes in value order, and
    their probabilities (of the canonical mass), [n, MODE_FIRST_BYTES] each."""
    p = np.exp(lp_b1[:, B:B + 256])[:, CANONICAL_B1]
    p = p / p.sum(axis=1, keepdims=True)
    idx = np.sort(np.argsort(-p, axis=1, kind="stable")[:, :MODE_FIRST_BYTES], axis=1)
    return CANONICAL_B1[idx], np.take_along_axis(p, idx, axis=1)


def band_point(b1: np.ndarray, p_b1: np.ndarray, lp_b2: np.ndarray, band: float) -> np.ndarray:
    """Per query, the band point (ms): over the codes (b1, b2) of the first bytes ``b1``
    [n, k] (value order) with mass P(b1) P(b2 | b1) (``lp_b2``: log-probs [n, k, V] of the
    token after each b1), the code value p with the most mass within ``band`` of it
    (|p - y| <= band y, i.e. p / (1 + band) <= y <= p / (1 - band)); the lowest of equals."""
    ms, cum = _code_mass(b1, p_b1, lp_b2)
    return _densest(ms, cum, band)


def _code_mass(b1: np.ndarray, p_b1: np.ndarray, lp_b2: np.ndarray):
    """The codes of the first bytes ``b1`` [n, k] (value order), as ms [n, k * 256]
    (ascending per row), and their mass P(b1) P(b2 | b1) summed along the row, [n, k * 256
    + 1] (0 first)."""
    n, k = b1.shape
    p2 = np.exp(lp_b2[:, :, B:B + 256])
    p2 = p2 / p2.sum(axis=2, keepdims=True)
    mass = (p_b1[:, :, None] * p2).reshape(n, k * 256)
    ms = code_ms((b1[:, :, None] << 8) | np.arange(256)).reshape(n, k * 256)
    return ms, np.concatenate([np.zeros((n, 1)), np.cumsum(mass, axis=1)], axis=1)


def _densest(ms: np.ndarray, cum: np.ndarray, band: float) -> np.ndarray:
    """Per row, the code value p with the most mass within ``band`` of it (``_code_mass``'s
    ms and cum); the lowest of equals."""
    n = len(ms)
    hi = _rowwise_searchsorted(ms, ms / (1.0 - band), "right")
    lo = _rowwise_searchsorted(ms, ms / (1.0 + band), "left")
    rows = np.arange(n)[:, None]
    return ms[np.arange(n), np.argmax(cum[rows, hi] - cum[rows, lo], axis=1)]


def _rowwise_searchsorted(ms: np.ndarray, x: np.ndarray, side: str) -> np.ndarray:
    """np.searchsorted(ms[i], x[i], side) for every row i at once (ms ascending per row,
    > 0): the rows' logs, each row moved past the one before, as one sorted array."""
    n, w = ms.shape
    if ms.size == 0:
        return np.zeros(x.shape, np.int64)
    lms, lx = np.log(np.maximum(ms, 1e-12)), np.log(np.maximum(x, 1e-12))
    # each row's values and queries lie within one span, so no row reaches the next's
    span = max(lms.max(), lx.max()) - min(lms.min(), lx.min()) + 1.0
    base = (np.arange(n) * span)[:, None]
    flat = (lms + base).ravel()
    q = lx + base
    at = np.searchsorted(flat, q.ravel(), side=side).reshape(x.shape)
    return at - (np.arange(n) * w)[:, None]


def band_points_covered(b1: np.ndarray, p_b1: np.ndarray, lp_b2: np.ndarray, bands: tuple,
                        median_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query and band (None: ``median_ms``): the band point over the codes of the first
    bytes ``b1`` (as ``band_point``), and the model's own P(|p - y| <= t y) at it for each t
    of COVER_T, over those codes: ([n, len(bands)], [n, len(bands), len(COVER_T)])."""
    ms, cum = _code_mass(b1, p_b1, lp_b2)
    rows = np.arange(len(ms))[:, None]
    points = np.empty((len(ms), len(bands)))
    for j, e in enumerate(bands):
        points[:, j] = median_ms if e is None else _densest(ms, cum, e)
    cover = np.empty((len(ms), len(bands), len(COVER_T)))
    for j in range(len(bands)):
        p = points[:, j:j + 1]
        hi = _rowwise_searchsorted(ms, p / np.maximum(1.0 - COVER_T, 1e-9), "right")
        lo = _rowwise_searchsorted(ms, p / (1.0 + COVER_T), "left")
        cover[:, j] = cum[rows, hi] - cum[rows, lo]
    return points, cover


def pick_bands(cover: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the band (index) whose expected median relative error is least, and
    those errors [G, bands]: the t of COVER_T where the group's mean P(|p - y| <= t y)
    first reaches one half (the last t where it never does); the first of equals."""
    mean = cover / np.maximum(count, 1)[:, None, None]
    k = np.minimum((mean < 0.5).sum(axis=2), len(COVER_T) - 1)
    expected = COVER_T[k]
    return np.argmin(expected, axis=1), expected


def second_byte_quantiles(lp_b2: np.ndarray, before: np.ndarray, p_b1: np.ndarray) -> np.ndarray:
    """The second byte of each quantile code: the first b2 where before + P(b1*) × P(b2' <= b2
    | b1*) reaches the quantile. lp_b2: log-probs [n, k, V] of the token after b1*."""
    p = np.exp(lp_b2[:, :, B:B + 256])
    p = p / p.sum(axis=2, keepdims=True)
    reach = before[:, :, None] + p_b1[:, :, None] * np.cumsum(p, axis=2)
    q = np.asarray(QUANTILES)[None, :, None]
    return np.minimum((reach < q).sum(axis=2), 255)


def _bucket(n: int) -> int:
    """Round a probe/gather width up (powers of two from 8) so few shapes get compiled."""
    return max(8, 1 << math.ceil(math.log2(max(n, 1))))


def pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    if len(a) == n:
        return a
    return np.concatenate([a, np.zeros((n - len(a),) + a.shape[1:], a.dtype)])


# --- loading a run ---------------------------------------------------------------------

def run_record(run_dir: str | Path) -> dict:
    """The run's config.json; InputError naming the fix when it is not a run folder."""
    d = Path(run_dir)
    cfg = d / "config.json"
    if not d.is_dir():
        raise InputError(f"{d}: no such run folder; train one with `train --data shards/` "
                         "(runs go under runs/)")
    if (d / "manifest.json").is_file() and not cfg.is_file():
        raise InputError(f"{d}: a shards folder (`prep shards` wrote it), not a run folder; "
                         f"train a model on it with `train --data {d}`, then give that run's "
                         f"folder (runs/...), or evaluate a run on it: train eval RUN_DIR "
                         f"--data {d}")
    if not cfg.is_file() or not (d / "checkpoints").is_dir():
        from train.fit.checkpoint import newest_first

        runs = newest_first(p for p in d.iterdir() if _is_run(p))
        listed = ", ".join(map(str, runs[:5])) + (f" and {len(runs) - 5} more" if len(runs) > 5
                                                  else "")
        raise InputError(f"{d}: not a run folder (no config.json or checkpoints/); give "
                         "RUN_DIR, the folder of one run" + (
                             f": {listed} (newest first)" if runs else
                             " `train` wrote, e.g. runs/tiny-20261123-101500"))
    try:
        record = json.loads(cfg.read_text())
    except RecursionError:
        raise InputError(f"{cfg}: unreadable (nested too deeply); not a config.json `train` "
                         "wrote") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{cfg}: unreadable ({first_line(e)}); not a config.json `train` "
                         "wrote") from None
    if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
        raise InputError(f"{cfg}: unreadable (no 'model' settings); not a config.json "
                         "`train` wrote")
    return record


def _is_run(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "checkpoints").is_dir()


def load(run_dir: str | Path, *, step: int | None = None, batch_size: int | None = None,
         attention_impl: str = "auto") -> Predictor:
    """The model of ``run_dir`` at checkpoint ``step`` (default: the newest intact one; the
    damaged newer ones are named on stderr and in ``Predictor.skipped``)."""
    from train.fit.checkpoint import Checkpointer

    record = run_record(run_dir)
    mcfg = ModelConfig(**record["model"])
    ckpt = Checkpointer(Path(run_dir) / "checkpoints")
    try:
        steps = ckpt.manager.all_steps()
        if not steps:
            raise InputError(f"{run_dir}: no checkpoint yet; train longer or resume the run")
        step = ckpt.newest_intact_step() if step is None else step
        if step not in steps:
            raise InputError(f"{run_dir}: no checkpoint at step {step}; there are "
                             f"{', '.join(map(str, sorted(steps)))}")
        ckpt.check_model(step, arch.map_params(lambda p: p.shape, arch.param_specs(mcfg)))
        state, _ = ckpt.restore(step)
    finally:
        ckpt.close()
    train_cfg = record.get("train", {})
    return Predictor(jax.device_put(state["params"]), mcfg,
                     compute_dtype=train_cfg.get("compute_dtype", "float32"),
                     attention_impl=attention_impl,
                     batch_size=batch_size or max(1, min(64, train_cfg.get("batch_size", 8))),
                     run_dir=str(run_dir), step=step, skipped=tuple(ckpt.skipped))
