"""The tokenizer's Numba kernels: column arrays in, token arrays out.

The kernels (the last three have pure-Python twins in ``prep.reference`` that the tests
hold them to, token for token):

- ``argsort_probe_time``, ``history_index``: a stable radix sort by (probe, time) that
  only runs the 11-bit passes whose digit varies (usually 4: 3-4x faster than numpy's
  two stable argsorts), and each measurement's index in its probe's history;
- ``cut_contexts``: walks one sorted bucket once and decides, per context, the timestamp
  mode and where the context ends, and per measurement whether it carries a timestamp
  and how many tokens it costs (the numbers the packer plans with).
- ``piece_lengths_kernel``: the piece length rule of docs/CONTRACTS.md.
- ``encode_kernel``: writes the tokens of every piece into one preallocated array.

Randomness is counter-based: every draw is ``mix64(key + counter * GOLDEN)`` with
``key = mix64(mix64(seed + stream * GOLDEN) ^ probe)`` and the counter being the
measurement's index in its probe's sorted history (SplitMix64's finalizer). No state is
carried from one measurement to the next, so a draw does not depend on which worker,
bucket or piece a measurement lands in. The streams:

- MODE, FRAC (counter = index of a context's first measurement): the context's timestamp
  mode, and in ``partial`` mode the fraction of measurements that lose their timestamp;
- DROP (counter = the measurement's index): does it lose its timestamp (``partial``);
- FIELD (counter = the measurement's index): the order of its blocks;
- SHUFFLE (counter = index of a piece's first measurement, then draw ``i`` of that key):
  the Fisher-Yates shuffle of a piece in ``partial``/``none`` mode.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from prep import vocab as V

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)

STREAM_MODE, STREAM_FRAC, STREAM_DROP, STREAM_FIELD, STREAM_SHUFFLE = 1, 2, 3, 4, 5
MODE_FULL, MODE_PARTIAL, MODE_NONE = 0, 1, 2

# A partial-mode context drops a fraction in [0.1, 0.9) of its timestamps: 32-bit fixed point.
DROP_LO = 429_496_730  # 0.1 * 2**32
DROP_SPAN = 3_435_973_837  # 0.8 * 2**32

# Blocks: 0 source, 1 destination, 2 result, 3 timestamp. All 24 orders of the four; a measurement without a timestamp skips BLOCK_TS,
# which leaves each of the 6 orders of the other three equally likely.
PERMS = np.array([
    [0, 1, 2, 3], [0, 1, 3, 2], [0, 2, 1, 3], [0, 2, 3, 1], [0, 3, 1, 2], [0, 3, 2, 1],
    [1, 0, 2, 3], [1, 0, 3, 2], [1, 2, 0, 3], [1, 2, 3, 0], [1, 3, 0, 2], [1, 3, 2, 0],
    [2, 0, 1, 3], [2, 0, 3, 1], [2, 1, 0, 3], [2, 1, 3, 0], [2, 3, 0, 1], [2, 3, 1, 0],
    [3, 0, 1, 2], [3, 0, 2, 1], [3, 1, 0, 2], [3, 1, 2, 0], [3, 2, 0, 1], [3, 2, 1, 0],
], dtype=np.int64)
RANKS = np.argsort(PERMS, axis=1)  # RANKS[p, block] = where block stands in order p

_BYTE = np.uint64(V.BYTE_OFFSET)  # uint64 + int64 is float64 in Numba: keep byte math unsigned
TS_ABS, TS_DELTA1, TS_DELTA4 = 9, 2, 5  # tokens of each timestamp block
DELTA4_LIMIT = 1 << 32  # a gap this large no longer fits DELTA4: written absolute


@njit(cache=True, inline="always")
def mix64(z):
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@njit(cache=True, inline="always")
def stream_key(seed, probe, stream):
    return mix64(mix64(seed + np.uint64(stream) * GOLDEN) ^ probe)


@njit(cache=True, inline="always")
def draw(key, counter):
    return mix64(key + np.uint64(counter) * GOLDEN)


@njit(cache=True, inline="always")
def _ts_tokens(have_prev, prev, t):
    if not have_prev:
        return TS_ABS
    d = t - prev
    if d < 256:
        return TS_DELTA1
    if d < DELTA4_LIMIT:
        return TS_DELTA4
    return TS_ABS


@njit(cache=True, nogil=True)
def _radix_pass_all(key, idx, tmp_key, tmp_idx):
    """Stable LSD radix sort of (key, idx) pairs by key, 11 bits a pass, in place."""
    n = len(key)
    varying = np.uint64(0)
    for i in range(n):
        varying |= key[i] ^ key[0]
    mask = np.uint64(0x7FF)
    for shift in range(0, 64, 11):
        sh = np.uint64(shift)
        if (varying >> sh) & mask == 0:
            continue  # every key shares this digit: the pass would not move anything
        count = np.zeros(2049, np.int64)
        for i in range(n):
            count[((key[i] >> sh) & mask) + np.uint64(1)] += 1
        for d in range(2048):
            count[d + 1] += count[d]
        for i in range(n):
            d = (key[i] >> sh) & mask
            dst = count[d]
            count[d] = dst + 1
            tmp_key[dst] = key[i]
            tmp_idx[dst] = idx[i]
        key[:] = tmp_key
        idx[:] = tmp_idx


@njit(cache=True, nogil=True)
def argsort_probe_time(probe, time):
    """Stable order by (probe, time): radix passes over the digits that vary, only."""
    n = len(probe)
    idx = np.arange(n)
    tmp_idx = np.empty(n, np.int64)
    tmp_key = np.empty(n, np.uint64)
    if n == 0:
        return idx
    t0 = time.min()
    key = np.empty(n, np.uint64)
    for i in range(n):
        key[i] = np.uint64(time[i] - t0)  # offset from the minimum: unsigned, same order
    _radix_pass_all(key, idx, tmp_key, tmp_idx)
    for i in range(n):
        key[i] = probe[idx[i]]
    _radix_pass_all(key, idx, tmp_key, tmp_idx)
    return idx


@njit(cache=True, nogil=True)
def history_index(probe):
    """Index of each measurement within its probe's run of a sorted probe column."""
    n = len(probe)
    hist = np.empty(n, np.int64)
    for i in range(n):
        hist[i] = 0 if i == 0 or probe[i] != probe[i - 1] else hist[i - 1] + 1
    return hist


@njit(cache=True, nogil=True)
def cut_contexts(probe, time, family, rtt, hist, seed, row_len, max_meas, max_gap, max_span,
                 t_full, t_partial):
    """Contexts of one sorted bucket: (ctx_start, ctx_mode, ctx_len, cost, has_ts, abs_extra).

    A measurement costs START + two address blocks (5 or 17 tokens each) + its result
    (FAILED 1, RTT 3) + its timestamp block. A context ends before the measurement that would change the probe, overflow
    ``row_len`` tokens, exceed ``max_meas`` measurements, follow a gap > ``max_gap`` s or
    reach > ``max_span`` s past the context's first measurement (0 turns a limit off).
    """
    n = len(probe)
    ctx_start = np.empty(n, np.int64)
    ctx_mode = np.empty(n, np.uint8)
    ctx_len = np.empty(n, np.int32)
    cost = np.empty(n, np.int32)
    has_ts = np.zeros(n, np.bool_)
    abs_extra = np.zeros(n, np.int32)
    k_mode = k_frac = k_drop = np.uint64(0)
    k = 0
    i = 0
    while i < n:
        p = probe[i]
        if i == 0 or p != probe[i - 1]:
            k_mode = stream_key(seed, p, STREAM_MODE)
            k_frac = stream_key(seed, p, STREAM_FRAC)
            k_drop = stream_key(seed, p, STREAM_DROP)
        r = draw(k_mode, hist[i]) >> _S32
        mode = MODE_FULL if r < t_full else (MODE_PARTIAL if r < t_partial else MODE_NONE)
        thr = np.uint64(DROP_LO) + (((draw(k_frac, hist[i]) >> _S32) * np.uint64(DROP_SPAN)) >> _S32)
        length = 0
        have_prev = False
        prev = np.int64(0)
        j = i
        while j < n and probe[j] == p:
            if mode == MODE_FULL:
                ts = True
            elif mode == MODE_PARTIAL:
                ts = (draw(k_drop, hist[j]) >> _S32) >= thr
            else:
                ts = False
            tt = _ts_tokens(have_prev, prev, time[j]) if ts else 0
            c = (11 if family[j] == 4 else 35) + (1 if rtt[j] < 0.0 else 3) + tt
            if j > i and (length + c > row_len
                          or (max_meas > 0 and j - i >= max_meas)
                          or (max_gap > 0 and time[j] - time[j - 1] > max_gap)
                          or (max_span > 0 and time[j] - time[i] > max_span)):
                break
            cost[j] = c
            has_ts[j] = ts
            abs_extra[j] = TS_ABS - tt if ts else 0
            length += c
            if ts:
                have_prev = True
                prev = time[j]
            j += 1
        ctx_start[k] = i
        ctx_mode[k] = mode
        ctx_len[k] = length
        k += 1
        i = j
    return ctx_start[:k], ctx_mode[:k], ctx_len[:k], cost, has_ts, abs_extra


@njit(cache=True, nogil=True)
def piece_lengths_kernel(cost, has_ts, abs_extra, piece_start, piece_end):
    """cost[s:e].sum() + abs_extra[first timestamped measurement in the piece], per piece."""
    k = len(piece_start)
    out = np.empty(k, np.int64)
    for j in range(k):
        total = 0
        first = True
        for i in range(piece_start[j], piece_end[j]):
            total += cost[i]
            if first and has_ts[i]:
                total += abs_extra[i]
                first = False
        out[j] = total
    return out


@njit(cache=True, inline="always")
def rtt_code(ms):
    """(exponent, mantissa): smallest exponent with a round-to-nearest mantissa < 2048."""
    us = max(1.0, ms * 1000.0)
    if us < 2048.0:
        e = 0
    else:
        e = math.frexp(us)[1] - 11  # us / 2**e lands in [1024, 2048)
    m = int(math.floor(math.ldexp(us, -e) + 0.5))
    if m >= 2048:  # rounded up out of the mantissa: 2048 * 2**e == 1024 * 2**(e+1)
        m = 1024
        e += 1
    if e > 31:  # beyond 2047 * 2**31 µs (~50 days): saturate
        e, m = 31, 2047
    return e, m


@njit(cache=True, inline="always")
def _put_addr(out, pos, tok4, fam, hi, lo):
    if fam == 4:
        out[pos] = tok4
        for b in range(4):
            out[pos + 1 + b] = _BYTE + ((lo >> np.uint64(24 - 8 * b)) & np.uint64(0xFF))
        return pos + 5
    out[pos] = tok4 + 1  # SRC_IPV6 / DST_IPV6 follow their IPv4 ids
    for b in range(8):
        out[pos + 1 + b] = _BYTE + ((hi >> np.uint64(56 - 8 * b)) & np.uint64(0xFF))
        out[pos + 9 + b] = _BYTE + ((lo >> np.uint64(56 - 8 * b)) & np.uint64(0xFF))
    return pos + 17


@njit(cache=True, nogil=True)
def encode_kernel(probe, time, family, src_hi, src_lo, dst_hi, dst_lo, rtt, hist, has_ts,
                  piece_start, piece_end, piece_mode, offsets, seed, out):
    """Write piece j's tokens to ``out[offsets[j]:offsets[j+1]]``, for every piece."""
    order = np.empty(64, np.int64)
    for j in range(len(piece_start)):
        s, e = piece_start[j], piece_end[j]
        m = e - s
        if m > len(order):
            order = np.empty(2 * m, np.int64)
        for x in range(m):
            order[x] = s + x
        p = probe[s]
        mode = piece_mode[j]
        if mode != MODE_FULL:
            k_shuf = draw(stream_key(seed, p, STREAM_SHUFFLE), hist[s])
            for x in range(m - 1, 0, -1):
                q = ((draw(k_shuf, x) >> _S32) * np.uint64(x + 1)) >> _S32
                order[x], order[q] = order[q], order[x]
            if mode == MODE_PARTIAL:
                # The timestamped measurements go back into time order, in the slots the
                # shuffle gave them, so their deltas stay non-negative.
                t = s
                for x in range(m):
                    if has_ts[order[x]]:
                        while not has_ts[t]:
                            t += 1
                        order[x] = t
                        t += 1
        k_field = stream_key(seed, p, STREAM_FIELD)
        pos = offsets[j]
        have_prev = False
        prev = np.int64(0)
        for x in range(m):
            i = order[x]
            fam = family[i]
            la = 5 if fam == 4 else 17
            failed = rtt[i] < 0.0
            lr = 1 if failed else 3
            lt = 0
            if has_ts[i]:
                lt = _ts_tokens(have_prev, prev, time[i])
            # Each block's offset follows from the drawn order and the block lengths, so
            # the blocks are written in a fixed sequence: no branch on the random order.
            p_ = ((draw(k_field, hist[i]) >> _S32) * np.uint64(24)) >> _S32
            r0, r1, r2, r3 = RANKS[p_, 0], RANKS[p_, 1], RANKS[p_, 2], RANKS[p_, 3]
            base = pos + 1
            o_src = base + la * (r1 < r0) + lr * (r2 < r0) + lt * (r3 < r0)
            o_dst = base + la * (r0 < r1) + lr * (r2 < r1) + lt * (r3 < r1)
            o_res = base + la * (r0 < r2) + la * (r1 < r2) + lt * (r3 < r2)
            o_ts = base + la * (r0 < r3) + la * (r1 < r3) + lr * (r2 < r3)
            out[pos] = V.MEASUREMENT_START
            _put_addr(out, o_src, V.SRC_IPV4, fam, src_hi[i], src_lo[i])
            _put_addr(out, o_dst, V.DST_IPV4, fam, dst_hi[i], dst_lo[i])
            if failed:
                out[o_res] = V.FAILED
            else:
                ex, mant = rtt_code(rtt[i])
                out[o_res] = V.RTT_START
                out[o_res + 1] = V.BYTE_OFFSET + ((ex << 3) | (mant >> 8))
                out[o_res + 2] = V.BYTE_OFFSET + (mant & 0xFF)
            if lt:
                t_i = time[i]
                if lt == TS_DELTA1:
                    out[o_ts] = V.TIMESTAMP_DELTA1
                    out[o_ts + 1] = V.BYTE_OFFSET + (t_i - prev)
                elif lt == TS_DELTA4:
                    d = np.uint64(t_i - prev)
                    out[o_ts] = V.TIMESTAMP_DELTA4
                    for q in range(4):
                        out[o_ts + 1 + q] = _BYTE + ((d >> np.uint64(24 - 8 * q)) & np.uint64(0xFF))
                else:
                    u = np.uint64(t_i)  # two's complement: decoders read it back signed
                    out[o_ts] = V.TIMESTAMP_ABS
                    for q in range(8):
                        out[o_ts + 1 + q] = _BYTE + ((u >> np.uint64(56 - 8 * q)) & np.uint64(0xFF))
                have_prev = True
                prev = t_i
            pos = base + 2 * la + lr + lt
    return out


def encode_pieces(sorted_m, plan, piece_start, piece_end, seed: int):
    """(tokens uint16[total], offsets int64[k+1]) of pieces of ``plan``'s contexts.

    Each piece [s, e) lies inside one context and is encoded as a context of its own
    (its parent's mode and timestamp flags, its first timestamp absolute).
    """
    ps = np.ascontiguousarray(piece_start, dtype=np.int64)
    pe = np.ascontiguousarray(piece_end, dtype=np.int64)
    n = len(sorted_m)
    if len(ps) != len(pe):
        raise ValueError("piece_start and piece_end differ in length")
    ctx = np.searchsorted(plan.ctx_start, ps, side="right") - 1
    if len(ps) and (ps.min() < 0 or pe.max() > n or np.any(pe <= ps)
                    or np.any(pe > plan.ctx_end[ctx])):
        raise ValueError("every piece must be a non-empty range inside one context")
    lengths = piece_lengths_kernel(plan.cost, plan.has_ts, plan.abs_extra, ps, pe)
    offsets = np.zeros(len(ps) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), np.uint16)
    if len(ps):
        m = sorted_m
        encode_kernel(m.probe, m.time, m.family, m.src_hi, m.src_lo, m.dst_hi, m.dst_lo, m.rtt,
                      plan.hist, plan.has_ts, ps, pe, plan.ctx_mode[ctx], offsets,
                      np.uint64(seed & 0xFFFF_FFFF_FFFF_FFFF), out)
    return out, offsets


def encode_plan(plan, seed: int):
    """Tokens of every whole context of ``plan`` (one piece per context)."""
    return encode_pieces(plan.sorted, plan, plan.ctx_start, plan.ctx_end, seed)
