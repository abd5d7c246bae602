"""The tokenizer's encoder in Numba: a plan's measurement columns in, token arrays out.

- ``encode_kernel``: writes the tokens of every piece into one preallocated array
  (``SLACK`` tokens longer than the pieces), without a branch on the data per measurement:
  per piece, the random draws and RTT codes first, in loops LLVM vectorizes; then per
  measurement its whole layout (block offsets, length, timestamp header) from one
  ``LAYOUT`` look-up, bytes to tokens by vector stores (``_put8``/``_put4``/``_put2``,
  LLVM intrinsics), IPv4-unused address tails and a failed ping's RTT bytes sent to the
  slack. The blocks and their orders come from ``prep.schema.vocab``: with value fields
  (``VALUE_FIELDS``) there are ``N_BLOCKS!`` orders, and each value block's offset comes
  from ``VALUE_OFFSET`` beside ``LAYOUT``; without them those loops compile away.
- ``encode_pieces`` / ``encode_plan``: the entry points (``prep.shards.bucket``, the tests).
- ``rtt_code``: an RTT's (exponent, mantissa), without branches.

``prep.tokens.reference.encode_context`` is the pure-Python twin the tests hold the encoder to,
token for token. The draws (streams FIELD and SHUFFLE) are ``prep.tokens.draws``'; the kernels
that plan what gets encoded (sort, contexts, piece lengths) are ``prep.pack.planner_kernels``'.
"""

from __future__ import annotations

import itertools
import sys
from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from prep.base.jit import helper, kernel
from prep.schema import vocab as V
from prep.tokens.costs import (
    ADDR4,
    ADDR6,
    DELTA4_LIMIT,
    RESULT_FAILED,
    RESULT_OK,
    TS_LEN,
    piece_lengths_kernel,
)
from prep.tokens.draws import (
    GOLDEN,
    MODE_FULL,
    MODE_PARTIAL,
    S32,
    STREAM_FIELD,
    STREAM_SHUFFLE,
    draw,
    mix64,
    stream_key,
)

_S52 = np.uint64(52)

# Blocks (prep.schema.vocab): 0 source, 1 destination, 2 result, 3 timestamp, 4 + k value field k.
# All N_BLOCKS! orders, lexicographic (24 without value fields); a measurement without a
# timestamp skips BLOCK_TIME, which leaves each order of the other blocks equally likely.
PERMS = np.array(list(itertools.permutations(range(V.N_BLOCKS))), np.int64)
N_ORDERS = len(PERMS)  # the order of a measurement: PERMS[draw * N_ORDERS >> 32]
RANKS = np.argsort(PERMS, axis=1)  # RANKS[p, block] = where block stands in order p
N_VALUES = len(V.VALUE_FIELDS)  # 0 here: every loop over the value fields compiles away
VALUE_HEADER = np.array(V.VALUE_HEADERS, np.int64)
VALUE_WIDTH = np.array([f.width for f in V.VALUE_FIELDS], np.int64)

# The timestamp kind ``tk``: 0 none, 1 DELTA1, 2 DELTA4, 3 absolute. By tk: the block's
# length, header token and where the payload's bytes start in a uint64 (DELTA1: its top byte).
TK_LEN = TS_LEN
TK_TOKEN = (V.TIMESTAMP_DELTA1, V.TIMESTAMP_DELTA1, V.TIMESTAMP_DELTA4, V.TIMESTAMP_ABS)
TK_SHIFT = (0, 56, 32, 0)


def _layout_tables() -> tuple[np.ndarray, np.ndarray]:
    """(LAYOUT, VALUE_OFFSET), by row ``16 * order + 8 * ipv6 + 4 * failed + tk``.

    LAYOUT[row], a measurement's layout in one uint64: bytes 0-3 the offsets of its source,
    destination, result and timestamp blocks from just after MEASUREMENT_START; byte 4 its
    length in tokens; byte 5 the timestamp's header token; byte 6 the timestamp payload's
    shift; bit 63: the timestamp is absolute. VALUE_OFFSET[row, k]: the offset of value
    field k's block (no columns without value fields, and LAYOUT the same as without them).
    """
    table = np.zeros((N_ORDERS, 2, 2, 4), np.uint64)
    value_offset = np.zeros((N_ORDERS, 2, 2, 4, N_VALUES), np.uint8)
    values = [1 + f.width for f in V.VALUE_FIELDS]
    for f6, failed, tk in itertools.product(range(2), range(2), range(4)):
        addr = ADDR6 if f6 else ADDR4
        lens = np.array([addr, addr, RESULT_FAILED if failed else RESULT_OK, TK_LEN[tk]] + values)
        n = 1 + int(lens.sum())
        if n > 0xFF:  # the length and offsets are bytes
            raise ValueError("a measurement of over 255 tokens does not fit LAYOUT")
        placed = lens[PERMS]  # [order, place]: the length of the block in that place
        at = np.take_along_axis(np.cumsum(placed, axis=1) - placed, RANKS, axis=1)  # [order, block]
        w = sum(at[:, b].astype(np.uint64) << np.uint64(8 * b) for b in range(V.BLOCK_VALUE))
        table[:, f6, failed, tk] = w | np.uint64(n << 32 | TK_TOKEN[tk] << 40 | TK_SHIFT[tk] << 48
                                                 | (tk == 3) << 63)
        value_offset[:, f6, failed, tk] = at[:, V.BLOCK_VALUE:]
    return table.reshape(-1), value_offset.reshape(16 * N_ORDERS, N_VALUES)


LAYOUT, VALUE_OFFSET = _layout_tables()


@intrinsic
def _f64_bits(typingctx, x):
    if x != types.float64:
        return None
    return types.uint64(x), lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(64))


@intrinsic
def _bits_f64(typingctx, x):
    if x != types.uint64:
        return None
    return types.float64(x), lambda context, builder, sig, args: builder.bitcast(args[0], ir.DoubleType())



@kernel(inline="always")
def rtt_code(ms):
    """(exponent, mantissa): smallest exponent with a round-to-nearest mantissa < 2048.

    Without branches or calls: the exponent comes from the float's bits (``frexp``'s
    job) and scaling by ``2**-e`` is exact, so this equals ``floor(ldexp(us, -e) + 0.5)``.
    """
    us = max(1.0, ms * 1000.0)
    t = np.int64((_f64_bits(us) >> _S52) & np.uint64(0x7FF)) - 1033  # floor(log2(us)) - 10
    e = t & ~(t >> 63)  # max(0, t): us / 2**e lands in [1024, 2048) when us >= 2048
    m = np.int64(us * _bits_f64(np.uint64(1023 - e) << _S52) + 0.5)  # positive: trunc = floor
    up = m >> 11  # 1 when it rounded up out of the mantissa (m <= 2048):
    m -= up << 10  # 2048 * 2**e == 1024 * 2**(e+1)
    e += up
    big = ((31 - e) >> 63) & 1  # beyond 2047 * 2**31 µs (~50 days): saturate
    return e + (31 - e) * big, m + (2047 - m) * big


def _store_args(typingctx, out, pos, x):
    """The typing both store intrinsics share: a uint16 array, an integer index and value."""
    return (isinstance(out, types.Array) and out.dtype == types.uint16
            and isinstance(pos, types.Integer) and isinstance(x, types.Integer))


def _store_ptr(context, builder, sig, args):
    """(pointer to ``out[pos]``, the value as uint64) inside a store intrinsic's codegen."""
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    idx = context.cast(builder, args[1], sig.args[1], types.intp)
    val = context.cast(builder, args[2], sig.args[2], types.uint64)
    return builder.gep(ary.data, [idx]), val


def _put_bytes(n):
    """An intrinsic ``put(out, pos, x)``: ``out[pos:pos+n] = BYTE_0 + (the low n bytes of
    x, most significant first)`` in one unaligned vector store (byte swap, widen, add)."""

    @intrinsic
    def put(typingctx, out, pos, x):
        if not _store_args(typingctx, out, pos, x):
            return None

        def codegen(context, builder, sig, args):
            ptr, val = _store_ptr(context, builder, sig, args)
            if n < 8:
                val = builder.trunc(val, ir.IntType(8 * n))
            vec = builder.bitcast(val, ir.VectorType(ir.IntType(8), n))
            lanes = range(n - 1, -1, -1) if sys.byteorder == "little" else range(n)
            vec = builder.shuffle_vector(vec, ir.Constant(vec.type, None),
                                         ir.Constant(ir.VectorType(ir.IntType(32), n), list(lanes)))
            wide = builder.zext(vec, ir.VectorType(ir.IntType(16), n))
            wide = builder.add(wide, ir.Constant(wide.type, [V.BYTE_OFFSET] * n))
            builder.store(wide, builder.bitcast(ptr, wide.type.as_pointer()), align=2)
            return context.get_dummy_value()

        return types.void(out, pos, x), codegen

    return put


_put8, _put4, _put2 = _put_bytes(8), _put_bytes(4), _put_bytes(2)
SLACK = 16  # tokens past the end of ``out`` that encode_kernel may scribble on


@intrinsic
def _put1(typingctx, out, pos, tok):
    """``out[pos] = tok`` for a non-negative ``pos``, without the wraparound check."""
    if not _store_args(typingctx, out, pos, tok):
        return None

    def codegen(context, builder, sig, args):
        ptr, val = _store_ptr(context, builder, sig, args)
        builder.store(builder.trunc(val, ir.IntType(16)), ptr, align=2)
        return context.get_dummy_value()

    return types.void(out, pos, tok), codegen


@helper(inline=True)
def _addr(out, o, scratch, tok4, f6, hi, lo):
    """An address block at ``o`` (``f6``: 1 for IPv6), without a branch on the family:
    the 12 tokens only an IPv6 block has go to ``scratch`` for IPv4."""
    _put1(out, o, tok4 + f6)  # SRC_IPV6 / DST_IPV6 follow their IPv4 ids
    keep = np.uint64(0) - np.uint64(f6)  # all ones for IPv6
    _put4(out, o + 1, ((hi >> S32) & keep) | (lo & ~keep))
    ext = scratch + (o + 5 - scratch) * f6
    _put4(out, ext, hi)
    _put8(out, ext + 4, lo)


# The pieces a kernel call encodes: piece j is sorted measurements [start[j], end[j]) in
# timestamp mode mode[j], its tokens going to out[offsets[j]:offsets[j + 1]].
PiecesToEncode = namedtuple("PiecesToEncode", "start end mode offsets")


@helper(inline=True)
def _shuffle(order, timed, swap, has_ts, s, m, partial, k_shuf):
    """Shuffle ``order[:m]`` (piece [s, s + m) in time order) by Fisher-Yates, the draws of
    ``k_shuf``; ``partial``: then put its timestamped measurements back into time order."""
    e = s + m
    for x in range(m):
        swap[x] = ((draw(k_shuf, x) >> S32) * np.uint64(x + 1)) >> S32
    for x in range(m - 1, 0, -1):
        q = swap[x]
        order[x], order[q] = order[q], order[x]
    if partial:
        # The timestamped measurements go back into time order, in the slots the
        # shuffle gave them, so their deltas stay non-negative.
        c = np.uint64(0)
        for i in range(s, e):
            timed[c] = i
            c += np.uint64(has_ts[i])
        # Written as a select, that step became a branch on has_ts (mispredicted
        # often): instead list the timestamped slots, then scatter into them.
        c = np.uint64(0)
        for x in range(m):
            timed[np.uint64(m) + c] = x
            c += np.uint64(has_ts[np.uint64(order[x])])
        for k in range(c):
            order[timed[np.uint64(m) + k]] = timed[k]


@helper(inline=True)
def _describe(desc, rtt, family, us, m, k_field):
    """desc[x] for measurement us + x of a piece (see ``encode_kernel``): no branches, no
    stores to ``out``, so LLVM vectorizes it. Draw h0 + x of the FIELD stream is
    mix64(k_field + x * GOLDEN)."""
    for x in range(m):
        i = us + np.uint64(x)
        r = rtt[i]
        ex, mant = rtt_code(r)
        p_ = ((mix64(k_field + np.uint64(x) * GOLDEN) >> S32) * np.uint64(N_ORDERS)) >> S32
        row = ((p_ << np.uint64(4)) | (np.uint64(family[i] != 4) << np.uint64(3))
               | (np.uint64(r < 0.0) << np.uint64(2)))
        desc[x] = np.uint64((ex << 11) | mant) | (row << np.uint64(16))


@helper(inline=True)
def _put_value(out, pos, x, n):
    """``out[pos:pos+n] = BYTE_0 + (the low n bytes of x, most significant first)``, one
    token at a time: n, a value field's width, is no data, so neither is the loop's branch."""
    for b in range(n):
        _put1(out, pos + b, V.BYTE_OFFSET + ((x >> np.uint64(8 * (n - 1 - b))) & np.uint64(0xFF)))


@helper(inline=True)
def _write_piece(out, cols, values, has_ts, order, desc, piece, pos, scratch):
    """Write the tokens of piece ``(us, m)``, measurements [us, us + m), from ``pos`` on,
    in the order ``order[:m]``, each from its ``desc`` and one ``LAYOUT`` look-up (and its
    ``VALUE_OFFSET`` row, where there are value fields)."""
    us, m = piece
    time, src_hi, src_lo = cols.time, cols.src_hi, cols.src_lo
    dst_hi, dst_lo = cols.dst_hi, cols.dst_lo
    first = np.uint64(3)  # or'ed into tk: the first timestamp is absolute; 0 after it
    prev = np.int64(0)
    for x in range(m):
        i = np.uint64(order[x])
        # Random data (family, failed, timestamp kind, block order) only ever feeds
        # arithmetic and table look-ups, never a branch: ~30 % of them would mispredict.
        dsc = desc[i - us]
        f6 = np.int64((dsc >> np.uint64(19)) & np.uint64(1))
        failed = np.int64((dsc >> np.uint64(18)) & np.uint64(1))
        t_i = time[i]
        d = t_i - prev
        ts = np.uint64(0) - np.uint64(has_ts[i])  # all ones if it has a timestamp
        tk = ((np.uint64(1) + np.uint64(d >= 256) + np.uint64(d >= DELTA4_LIMIT)) | first) & ts
        row = (dsc >> np.uint64(16)) + tk
        w = LAYOUT[row]
        base = pos + 1
        o_src = base + np.int64(w & np.uint64(0xFF))
        o_dst = base + np.int64((w >> np.uint64(8)) & np.uint64(0xFF))
        o_res = base + np.int64((w >> np.uint64(16)) & np.uint64(0xFF))
        o_ts = base + np.int64((w >> np.uint64(24)) & np.uint64(0xFF))
        # 1. The timestamp, always 1 + 8 tokens: what lies past its real end is
        #    garbage that the writes below, the next measurement or the slack cover.
        is_abs = np.uint64(0) - (w >> np.uint64(63))
        shift = (w >> np.uint64(48)) & np.uint64(0xFF)
        u = (np.uint64(t_i) & is_abs) | ((np.uint64(d) << shift) & ~is_abs)
        _put1(out, o_ts, (w >> np.uint64(40)) & np.uint64(0xFF))
        _put8(out, o_ts + 1, u)
        # 2. Everything else, exact: an IPv4 address's unused tail and a failed ping's
        #    RTT bytes go to the slack; value blocks are their header and width bytes.
        _put1(out, pos, V.MEASUREMENT_START)
        _addr(out, o_src, scratch, V.SRC_IPV4, f6, src_hi[i], src_lo[i])
        _addr(out, o_dst, scratch, V.DST_IPV4, f6, dst_hi[i], dst_lo[i])
        _put1(out, o_res, V.RTT_START + (V.FAILED - V.RTT_START) * failed)
        _put2(out, o_res + 1 + (scratch - o_res - 1) * failed, dsc)  # its low 16 bits
        for k in range(N_VALUES):
            o_val = base + np.int64(VALUE_OFFSET[row, k])
            _put1(out, o_val, VALUE_HEADER[k])
            _put_value(out, o_val + 1, values[k, i], VALUE_WIDTH[k])
        first &= ~ts
        prev = np.int64(np.uint64(prev) ^ ((np.uint64(prev) ^ np.uint64(t_i)) & ts))
        pos += np.int64((w >> np.uint64(32)) & np.uint64(0xFF))


@kernel(nogil=True)
def encode_kernel(cols, values, hist, has_ts, pieces, seed, out):
    """Write piece j's tokens to ``out[offsets[j]:offsets[j+1]]``, for every piece.

    ``cols``: the sorted measurements' ``prep.schema.measurements.Columns``; ``values``: their
    value fields' columns (``Measurements.values()``, uint64[K, n]); ``hist``, ``has_ts``:
    the plan's; ``pieces``: a ``PiecesToEncode``. ``out`` holds ``offsets[-1] + SLACK``
    tokens: to stay free of branches on random data (family, failed, the block order,
    timestamp kinds) the kernel writes some tokens more than once, in an order where the
    right one lands last; a block may spill up to 9 garbage tokens past its end
    (overwritten by the blocks written after it, or in the slack), and the IPv4-unused tail
    of an address goes to the slack.

    Per piece, what does not depend on the order the measurements are written in (the
    field order draw, the RTT code, family and failed flag, and the shuffle's draws) is
    computed first in loops without branches or stores to ``out``, which LLVM
    vectorizes (SplitMix64 on 8 lanes); the writing loop then reads one descriptor a
    measurement.
    """
    piece_start, piece_end, offsets = pieces.start, pieces.end, pieces.offsets
    n_p = len(piece_start)
    if n_p == 0:
        return out
    scratch = offsets[n_p]
    if len(out) < scratch + SLACK:
        raise ValueError("out must hold offsets[-1] + SLACK tokens")
    order = np.empty(64, np.int64)
    timed = np.empty(128, np.int64)  # timed[:m]: the timestamped measurements, timed[m:]: their slots
    # desc[x], measurement s + x: bits 0-15 its RTT payload (exponent << 11 | mantissa), bits
    # 16 on its row of LAYOUT without the timestamp kind (16 * order + 8 * ipv6 + 4 * failed).
    desc = np.empty(64, np.uint64)
    swap = np.empty(64, np.uint64)  # the Fisher-Yates shuffle's draws
    for j in range(n_p):
        s, e = piece_start[j], piece_end[j]
        m = e - s
        if m > len(order):
            order = np.empty(2 * m, np.int64)
            timed = np.empty(4 * m, np.int64)
            desc = np.empty(2 * m, np.uint64)
            swap = np.empty(2 * m, np.uint64)
        for x in range(m):
            order[x] = s + x
        p = cols.probe[s]
        h0 = hist[s]  # one probe's sorted history: measurement s + x has index h0 + x
        us = np.uint64(s)  # unsigned indices: no negative-index wraparound code
        mode = pieces.mode[j]
        if mode != MODE_FULL:
            k_shuf = draw(stream_key(seed, p, STREAM_SHUFFLE), h0)
            _shuffle(order, timed, swap, has_ts, s, m, mode == MODE_PARTIAL, k_shuf)
        k_field = stream_key(seed, p, STREAM_FIELD) + np.uint64(h0) * GOLDEN
        _describe(desc, cols.rtt, cols.family, us, m, k_field)
        # (us, m) as one argument keeps it at 9; order[:m] would cost reference counting
        _write_piece(out, cols, values, has_ts, order, desc, (us, m), offsets[j], scratch)
    return out

def encode_pieces(sorted_m, plan, piece_start, piece_end, seed: int, *, out=None, at=None):
    """(tokens uint16[total], offsets int64[k+1]) of pieces of ``plan``'s contexts.

    Each piece [s, e) lies inside one context and is encoded as a context of its own
    (its parent's mode and timestamp flags, its first timestamp absolute).

    ``at`` (int64[k+1], with ``out``): piece j's tokens go to ``out[at[j]:]`` instead, the
    pieces in that order with gaps allowed, and ``at[k]`` past them all, where ``out`` has
    SLACK tokens to spare (what the kernel scribbles); returns (out, at). Up to 9 tokens
    past a piece's end are garbage unless the next piece starts there (the caller clears
    them: prep.shards.bucket places pieces straight into the rows' records so).
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
    if at is None:
        return _encode(sorted_m, plan, ps, pe, plan.ctx_mode[ctx], lengths, seed, out)
    at = np.ascontiguousarray(at, dtype=np.int64)
    if out is None or len(at) != len(ps) + 1 or np.any(np.diff(at) < lengths) or (
            len(at) and at[0] < 0) or out.dtype != np.uint16 or len(out) < at[-1] + SLACK:
        raise ValueError("at must place the pieces in order, each after the one before, "
                         "in a uint16 out with SLACK tokens past at[-1]")
    if len(ps):
        encode_kernel(sorted_m.arrays(), sorted_m.values(), plan.hist, plan.has_ts,
                      PiecesToEncode(ps, pe, plan.ctx_mode[ctx], at),
                      np.uint64(seed & 0xFFFF_FFFF_FFFF_FFFF), out)
    return out, at


def _encode(m, plan, ps, pe, modes, lengths, seed, out=None):
    offsets = np.zeros(len(ps) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    need = int(offsets[-1]) + SLACK  # the kernel's slack: see its docstring
    if out is None:
        buf = np.empty(need, np.uint16)
    elif out.dtype != np.uint16 or len(out) < need:
        raise ValueError(f"out must be uint16 with at least {need} tokens")
    else:
        buf = out
    if len(ps):
        encode_kernel(m.arrays(), m.values(), plan.hist, plan.has_ts,
                      PiecesToEncode(ps, pe, modes, offsets),
                      np.uint64(seed & 0xFFFF_FFFF_FFFF_FFFF), buf)
    return buf[:int(offsets[-1])], offsets


def encode_plan(plan, seed: int, *, out: np.ndarray | None = None):
    """Tokens of every whole context of ``plan`` (one piece per context): ``encode_pieces``
    without its checks, and with the lengths the plan already has (a whole context's
    first timestamp is absolute already, so its length is ``ctx_len``).

    ``out``: a uint16 buffer of at least ``plan.n_tokens + SLACK`` tokens to write into
    (the tokens returned are a view of it); a fresh array costs the OS's page zeroing on
    first touch, about a third of the kernel's time on 1M measurements."""
    return _encode(plan.sorted, plan, plan.ctx_start, plan.ctx_end, plan.ctx_mode, plan.ctx_len,
                   seed, out)
