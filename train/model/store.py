"""The destination store (ModelConfig.dst_store): the train split's replies by destination,
as the table the model reads (train.model.model.store_dists); and the pair store
(ModelConfig.pair_store), the same table keyed by the ordered (source, destination) pair,
which the model reads at a measurement's reverse pair.

``build`` reads packed rows (a split as train.fit.reader.read_split returns it), hashes
each measurement's destination on the device as the model does (so a row found at training
time is the row found at query time), and keeps per destination its reply count and the
STORE_K quantiles of its RTT codes (the quantile at levels (k + 0.5) / K: the code is
monotone in the RTT, so these are the RTT quantiles). A destination is in one of its two
rows (model.store_rows, from its hash), placed by cuckoo hashing; one left without a row
(a full table) has none, and the model reads nothing for it rather than another's
replies (its check differs).

Each row: K codes (16-bit RTT codes, float32), the count, the check (model.store_check).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from prep.base.words import count
from prep.schema import vocab
from prep.tokens import rowdecode
from train.model import arch, failprior
from train.model import model as M


KEYS = {"dst": ("destination store", "destinations", "dst_store"),
        "pair": ("pair store", "address pairs", "pair_store")}


@dataclass(frozen=True)
class StoreSummary:
    destinations: int  # keys (destinations, or pairs) with at least one reply in the rows
    usable: int  # with a row of their own and at least STORE_MIN replies
    replies: int
    collided: int  # with enough replies, but no row (the table was full)
    key: str = "dst"
    # the pair store: train replies whose reverse pair is usable (what it answers in
    # training, where its gate learns); -1 for the destination store
    answered: int = -1
    sources: int = 0  # by_source: the (destination, source) medians its quantiles are over
    # the pair store: train replies whose own pair is usable (what its forward read would
    # answer, ModelConfig.pair_forward, were they not in the store); -1 for the destination store
    own: int = -1
    min_count: int = arch.STORE_MIN  # the fewest replies a key's row is read with
    recent: int = 0  # the pair store: quantiles over each pair's latest this many (0: all)
    fails: int = -1  # the pair store with failures: the failed pings counted in its rows
    failing: int = -1  # and the pairs whose rows say how often they fail (min_count pings)
    untimed_rows: int = 0  # with recent: rows the decoder refused, whose replies are untimed
    fail_recent: int = 0  # with fails: the failures among each pair's latest this many pings
    shared: int = 0  # with fails: the pairs of a shared source address, their failures not read
    left_out: int = 0  # without_shared: the pairs of a shared source address, not stored

    def line(self) -> str:
        name, what, field = KEYS[self.key]
        return (f"{name}: {self.usable:,} of {self.destinations:,} {what} "
                f"(>= {self.min_count} replies each) from {self.replies:,} train replies"
                + (f", quantiles over {self.sources:,} (destination, source) medians"
                   if self.sources else "")
                + (f", quantiles over each pair's latest {self.recent} replies"
                   if self.recent else "")
                + (f", not the {self.left_out:,} pairs whose source address hosts share "
                   "(NAT: several probes' pings, none of them a node's)" if self.left_out
                   else "")
                + (f" ({count(self.untimed_rows, 'row')} that `prep shards` would not "
                   "write: their replies untimed)" if self.untimed_rows else "")
                + (f"; {self.failing:,} pairs' failure rates (>= {self.min_count} pings each, "
                   f"{self.fails:,} failed" + (f" among each pair's latest {self.fail_recent}"
                                               if self.fail_recent else "") + ")"
                   + (f", not those of {self.shared:,} pairs whose source address hosts share "
                      "(NAT: several probes' failures)" if self.shared else "")
                   if self.fails >= 0 else "")
                + (f"; {self.collided:,} found no free row (a larger ModelConfig.{field} "
                   "would hold them)" if self.collided else "")
                + ("" if self.answered < 0 else
                   f"; {self.answered:,} train replies have their reverse pair there"
                   + (" (none: its reverse read answers nothing on this data)"
                      if not self.answered else "")
                   + ("" if self.own < 0 else f", {self.own:,} their own pair")))


@functools.partial(jax.jit, static_argnames=("key", "fold", "pair_fold"))
def _replies(tokens, segment_ids, key="dst", fold=0, pair_fold=0):
    """(key, reverse key, code, is_reply, is_failure), [B, T] each: at each RTT_START whose two bytes
    follow in its segment, the measurement's destination hash (``key`` "dst"; its reverse
    key is itself) or the key of its ordered (source, destination) pair ("pair"; the
    reverse: (destination, source)), or ("ends") the destination's hash and the source's,
    and the reply's 16-bit code; the FAILED tokens of pings without a reply. ``fold`` (ModelConfig.gate_fold, with store_without_fold):
    the replies of that fold's contexts (model.source_fold) are not replies here; nor, with
    ``pair_fold`` (ModelConfig.pair_forward), those of its fold's (model.context_fold)."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    _, full, _ = M.address_hashes(tokens, seg, "dst")
    back = full
    if key in ("pair", "ends"):
        src = M.address_hashes(tokens, seg, "src")[1]
        full, back = ((M.pair_key(src, full), M.pair_key(full, src)) if key == "pair"
                      else (full, src))
    nxt = lambda x, k: jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)
    b1, b2 = nxt(tokens, 1) - vocab.BYTE_OFFSET, nxt(tokens, 2) - vocab.BYTE_OFFSET
    ok = ((tokens == vocab.RTT_START) & (seg > 0) & (nxt(seg, 2) == seg)
          & (b1 >= 0) & (b1 < 256) & (b2 >= 0) & (b2 < 256))
    failed = (tokens == vocab.FAILED) & (seg > 0)
    if fold:
        kept = ~M.source_fold(tokens, seg, fold)
        ok, failed = ok & kept, failed & kept
    if pair_fold:
        kept = ~M.context_fold(tokens, seg, pair_fold)
        ok, failed = ok & kept, failed & kept
    return full, back, b1 * 256 + b2, ok, failed


MAX_KICKS = 256


def _place(first: np.ndarray, second: np.ndarray, n: np.ndarray, keys: np.ndarray,
           rows: int) -> np.ndarray:
    """Each key's row, -1 for none, by cuckoo hashing (Pagh and Rodler, 2004): keys in order
    of most replies (then key) each take their first row, moving a key found there to its
    other row, and so on, up to MAX_KICKS moves; the key then left without a row has none.
    (Only a free first-or-second row, without moves, lost 2.3 % of Seattle's 8,526 pairs in
    32,768 rows; one row per key, 12 %.)"""
    owner = np.full(rows, -1, np.int64)
    for i in np.lexsort((keys, -n)):
        cur, r = int(i), int(first[i])
        for _ in range(MAX_KICKS):
            if owner[r] < 0:
                owner[r] = cur
                break
            owner[r], cur = cur, int(owner[r])
            r = int(second[cur]) if r == first[cur] else int(first[cur])
    row = np.full(len(keys), -1, np.int64)
    held = np.flatnonzero(owner >= 0)
    row[owner[held]] = held
    return row


# Addresses that unrelated hosts share by design (RFC 1918, shared CGNAT space, loopback,
# link-local, "this network"; IPv6 unspecified, loopback, unique-local, link-local): as a
# source, such an address names a host on some network behind a NAT, not a node, so a query
# from it is never `node_known` (prep synth puts 40 % of its probes behind 12 of them).
_LOCAL_V4 = tuple((int(a) << 24 | int(b) << 16, (0xFFFF_FFFF << (32 - bits)) & 0xFFFF_FFFF)
                  for a, b, bits in ((0, 0, 8), (10, 0, 8), (100, 64, 10), (127, 0, 8),
                                     (169, 254, 16), (172, 16, 12), (192, 168, 16)))
_LOCAL_V6_HI = ((0xFC00 << 48, 0xFE00 << 48), (0xFE80 << 48, 0xFFC0 << 48))  # fc00::/7, fe80::/10


def local_scope(family: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """bool per address (family, hi, lo as the rows decode them): in a range that unrelated
    hosts share (``_LOCAL_V4``, ``_LOCAL_V6_HI``, ``::`` and ``::1``)."""
    v4 = np.asarray(lo, np.uint64) & np.uint64(0xFFFF_FFFF)
    hi = np.asarray(hi, np.uint64)
    in4 = np.zeros(len(v4), bool)
    for net, mask in _LOCAL_V4:
        in4 |= (v4 & np.uint64(mask)) == np.uint64(net)
    in6 = (hi == 0) & (np.asarray(lo, np.uint64) <= 1)
    for net, mask in _LOCAL_V6_HI:
        in6 |= (hi & np.uint64(mask)) == np.uint64(net)
    return np.where(np.asarray(family) == 4, in4, in6)


def reply_times(tokens: np.ndarray, segment_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """(int64[R, T], refused): at each measurement's result header (a reply's RTT_START, a
    failed ping's FAILED), when it was measured as far as its context says: its own
    timestamp, else (a measurement that lost it) its context's latest, else (a context
    without timestamps) -1; -1 elsewhere. The rows' measurements are decoded on the host
    (prep.tokens.rowdecode), as the evaluation's pair baselines read them; rows the decoder
    refuses (not what `prep shards` writes: test rows of counting tokens) are untimed, and
    counted."""
    t = timed(tokens, segment_ids)
    return t.times, t.refused


@dataclass(frozen=True)
class Timed:
    """What the stores read of the rows' measurements beyond their tokens (``timed``), at
    each result header (-1 / False elsewhere): ``times`` (reply_times'), ``shared`` (its
    source is an address unrelated hosts share: ``local_scope``); ``refused``, the rows the
    decoder refused (untimed)."""
    times: np.ndarray
    shared: np.ndarray
    refused: int


def timed(tokens: np.ndarray, segment_ids: np.ndarray) -> Timed:
    """The rows decoded once (prep.tokens.rowdecode) for what build and recency_check read
    of them (``Timed``); a run that builds several tables from one split passes it to each."""
    shape = np.shape(tokens)[:2]
    times, shared = np.full(shape, -1, np.int64), np.zeros(shape, bool)
    m, refused = rowdecode.decode_whole_rows(tokens, segment_ids)
    if not len(m):
        return Timed(times, shared, refused)
    ctx = m.row * 256 + m.segment  # segment ids are uint8
    first = np.r_[True, ctx[1:] != ctx[:-1]]  # a context's measurements are consecutive
    group = np.cumsum(first) - 1
    latest = np.full(int(group[-1]) + 1, -1, np.int64)
    np.maximum.at(latest, group, np.where(m.has_time, m.time, -1))
    times[m.row, m.result_pos] = np.where(m.has_time, m.time, latest[group])
    shared[m.row, m.result_pos] = local_scope(m.family, m.src_hi, m.src_lo)
    return Timed(times, shared, refused)


def _collect(tokens, segment_ids, key: str, batch: int, fold: int = 0, pair_fold: int = 0,
             t: Timed | None = None, shared: bool = False) -> dict:
    """Every reply in the rows (``_replies``): "key", "back" (its reverse key), "code",
    int32[n] each; every failed ping's "fail_key", int32[m]; with ``t`` (``timed``), each
    one's time too, "when" int64[n] and "fail_when" int64[m]; with ``shared`` too, whether
    each one's source is shared, "shared" bool[n + m] (the replies', then the failures')."""
    got = {k: [] for k in ("key", "back", "code", "when", "fail_key", "fail_when", "shared",
                           "fail_shared")}
    for r0 in range(0, len(tokens), batch):
        rt, rs = tokens[r0:r0 + batch], segment_ids[r0:r0 + batch]
        n = len(rt)
        if n < batch:  # one compiled shape: pad the last batch with empty rows
            rt = np.concatenate([rt, np.zeros((batch - n,) + rt.shape[1:], rt.dtype)])
            rs = np.concatenate([rs, np.zeros((batch - n,) + rs.shape[1:], rs.dtype)])
        h, b, c, ok, failed = (np.asarray(x) for x in _replies(rt, rs, key, fold, pair_fold))
        got["key"].append(h[ok])
        got["back"].append(b[ok])
        got["code"].append(c[ok])
        got["fail_key"].append(h[failed])
        if t is not None:
            for name, a in (("when", t.times),) + ((("shared", t.shared),) if shared else ()):
                got[name].append(a[r0:r0 + n][ok[:n]])
                got["fail_" + name].append(a[r0:r0 + n][failed[:n]])
    dtype = lambda k: np.int64 if "when" in k else bool if "shared" in k else np.int32
    out = {k: np.concatenate(v) if v else np.zeros(0, dtype(k)) for k, v in got.items()}
    out["shared"] = np.concatenate([out["shared"], out.pop("fail_shared")])
    return out


def _latest(key: np.ndarray, when: np.ndarray, n: int) -> np.ndarray:
    """Indices of each key's latest ``n`` entries: by key, then ``when`` (stable: in the
    order given where times tie)."""
    o = np.lexsort((when, key))
    first = np.flatnonzero(np.r_[True, key[o][1:] != key[o][:-1]])
    count = np.diff(np.r_[first, len(o)])
    rank = np.arange(len(o)) - np.repeat(first, count)  # place in its key's time order
    return o[rank >= np.repeat(count - n, count)]


def _pair_medians(one: np.ndarray, other: np.ndarray, code: np.ndarray):
    """(order, first, n, middle): the replies in ``order`` are by (``one``, ``other``), then
    ``code`` ascending; each pair's first index in that order, its reply count, and the index
    of its median code (the lower middle of an even count). build's store by source and
    build_krig's residuals read a (destination, source) pair's median so."""
    order = np.lexsort((code, other, one))
    one, other = one[order], other[order]
    first = np.flatnonzero(np.r_[True, (one[1:] != one[:-1]) | (other[1:] != other[:-1])])
    n = np.diff(np.r_[first, len(one)])
    return order, first, n, first + (n - 1) // 2


def build(tokens: np.ndarray, segment_ids: np.ndarray, rows: int, *, key: str = "dst",
          batch: int = 512, by_source: bool = False,
          fold: int = 0, pair_fold: int = 0, min_count: int = arch.STORE_MIN,
          recent: int = 0, failures: bool = False, fail_recent: int = 0,
          without_shared: bool = False, shared_fails: bool = False,
          t: Timed | None = None) -> tuple[np.ndarray, StoreSummary]:
    """(float32[rows, STORE_K + 2], summary) from packed rows ``tokens``/``segment_ids``,
    by destination (``key`` "dst") or by ordered address pair ("pair"). ``by_source`` (with
    "dst"; ModelConfig.store_by_source): a destination's quantiles are over its sources'
    median codes (the lower middle of an even count), each source once, instead of over its
    replies; its count is its replies either way. ``fold``: without the replies of that
    gate fold's contexts (ModelConfig.store_without_fold). ``pair_fold`` (with "pair";
    ModelConfig.pair_forward): nor those of the contexts of that fold, on which the read at
    a measurement's own pair learns. ``min_count``: the fewest replies a key is read with
    (ModelConfig.pair_min for the pair store); only such keys take rows. ``recent`` (with
    "pair"; ModelConfig.pair_recent): a pair's quantiles are over its latest this many
    replies (``reply_times``; ties and untimed contexts in row order), its count over all.
    ``failures`` (with "pair"; ModelConfig.pair_fail): each row holds one more column, the
    pair's failed pings, and a pair takes a row with ``min_count`` pings, replies or not
    (its quantiles are read only with ``min_count`` replies). ``fail_recent`` (with
    ``failures``; ModelConfig.pair_fail_recent): that column counts the failures among a
    pair's latest this many pings (``reply_times``; replies before failures where times
    tie), and the pings a row is taken with are its replies plus those failures. A pair
    whose source address unrelated hosts share (``local_scope``: a NAT's private address)
    has -1 for its failures: they are several probes', and a probe's own are not among
    them where it was held out (model.fail_share reads no -1). ``without_shared`` (with
    "pair"; ModelConfig.pair_shared False): no such pair is stored at all, its replies'
    quantiles no more than its failures (a held-out probe behind a NAT read there the RTTs
    of other probes behind other NATs as its own). ``shared_fails`` (with ``failures``;
    ModelConfig.pair_shared_fail): such a pair's failures are counted and read as any
    other's (where the test probes are the train probes, they are the probe's own).
    ``t``: the rows' ``timed`` (decoded here if not given and read)."""
    if key not in KEYS:
        raise ValueError(f"store key must be one of {sorted(KEYS)}, not {key!r}")
    if by_source and key != "dst":
        raise ValueError(f"by_source is for the destination store, not key {key!r}")
    K = arch.STORE_K
    if pair_fold and key != "pair":
        raise ValueError(f"pair_fold is for the pair store, not key {key!r}")
    if recent < 0 or recent and key != "pair":
        raise ValueError(f"recent is a count of a pair's latest replies (>= 0, key 'pair'), "
                         f"not {recent} with key {key!r}")
    if failures and key != "pair":
        raise ValueError(f"failures are counted in the pair store, not with key {key!r}")
    if fail_recent < 0 or fail_recent and not failures:
        raise ValueError(f"fail_recent is a count of a pair's latest pings (>= 0, with "
                         f"failures), not {fail_recent} with failures={failures}")
    if without_shared and key != "pair":
        raise ValueError(f"without_shared is for the pair store, not key {key!r}")
    if shared_fails and (not failures or without_shared):
        raise ValueError("shared_fails reads the failures of the pairs of shared addresses: "
                         "with failures, and without without_shared")
    if recent or failures or without_shared:
        t = timed(tokens, segment_ids) if t is None else t
    else:
        t = None
    untimed = t.refused if recent or fail_recent else 0  # (else no time is read)
    got = _collect(tokens, segment_ids, "ends" if by_source else key, batch, fold, pair_fold,
                   t, (failures and not shared_fails) or without_shared)  # read below
    left_out = 0
    if without_shared:  # a NAT's address: several hosts' pings, none of them a node's
        mine = ~got["shared"]
        replies_mine, fails_mine = mine[:len(got["key"])], mine[len(got["key"]):]
        left_out = len(np.unique(np.concatenate([got["key"][~replies_mine],
                                                 got["fail_key"][~fails_mine]])))
        for k in ("key", "back", "code", "when"):
            got[k] = got[k][replies_mine]
        for k in ("fail_key", "fail_when"):
            got[k] = got[k][fails_mine]
        got["shared"] = got["shared"][mine]
    h, back, code = got["key"], got["back"], got["code"]
    fail_keys = got["fail_key"] if failures else np.zeros(0, np.int32)
    if fail_recent:  # the failures among each pair's latest pings, replies and failures alike
        ping_key = np.concatenate([h, fail_keys])
        kept = _latest(ping_key, np.concatenate([got["when"], got["fail_when"]]), fail_recent)
        fail_keys = ping_key[kept[kept >= len(h)]]
    table = np.zeros((rows, K + 2 + int(failures)), np.float32)
    answered = -1 if key == "dst" else 0
    if len(h) == 0 and len(fail_keys) == 0:
        return table, StoreSummary(0, 0, 0, 0, key, answered, min_count=min_count,
                                   recent=recent, fails=0 if failures else -1,
                                   untimed_rows=untimed, fail_recent=fail_recent,
                                   left_out=left_out)
    replies = np.ones(len(h), np.int64)  # the replies each entry stands for
    if by_source:  # back is the source's hash: one entry per (destination, source)
        o, start, replies, mid = _pair_medians(h, back, code)
        h, code = h[o][start], code[o][mid]
    all_h = h
    if recent:  # each pair's latest replies (row order where times tie)
        keep = _latest(h, got["when"], recent)
        counted = np.unique(h, return_counts=True)
        h, code, replies = h[keep], code[keep], replies[keep]
    order = np.lexsort((code, h))  # by destination, codes ascending within
    h, code, replies = h[order], code[order], replies[order]
    first = np.flatnonzero(np.r_[True, h[1:] != h[:-1]]) if len(h) else np.zeros(0, np.int64)
    n = np.diff(np.r_[first, len(h)])
    n_replies = np.add.reduceat(replies, first) if len(h) else np.zeros(0, np.int64)
    dest = h[first]
    if recent:  # the count is over all of a pair's replies (ModelConfig.pair_min reads it)
        n_replies = counted[1]
        assert np.array_equal(counted[0], dest)
    # the keys with failed pings only come after those with replies (no quantiles)
    f_key, f_count = np.unique(fail_keys, return_counts=True)
    only_failed = np.setdiff1d(f_key, dest)
    keys = np.concatenate([dest, only_failed]).astype(dest.dtype)
    n_pings = np.concatenate([n_replies, np.zeros(len(only_failed), n_replies.dtype)])
    n_failed = np.zeros(len(keys), np.int64)
    if len(f_key):
        at = np.minimum(np.searchsorted(f_key, keys), len(f_key) - 1)
        n_failed = np.where(f_key[at] == keys, f_count[at], 0)
        n_pings = n_pings + n_failed
    # only a key the model reads (min_count replies, or pings where failures are stored)
    # takes a row: one that never would crowded others out (8 % of a generated world's
    # usable pairs in 32,768 rows)
    readable = np.flatnonzero(n_pings >= min_count)
    row = np.full(len(keys), -1, np.int64)
    row[readable] = _place(*(np.asarray(r)[readable] for r in M.store_rows(keys, rows)),
                           n_pings[readable], keys[readable], rows)
    keep = row >= 0
    levels = (np.arange(K) + 0.5) / K
    q = first[:, None] + np.minimum((levels[None, :] * n[:, None]).astype(np.int64), n[:, None] - 1)
    coded = keep[:len(dest)]
    table[row[:len(dest)][coded], :K] = code[q[coded]]
    table[row[keep], K] = n_pings[keep] - n_failed[keep]
    table[row[keep], K + 1] = M.store_check(keys[keep])
    unread = 0
    if failures and shared_fails:
        table[row[keep], K + 2] = n_failed[keep]
    elif failures:  # a shared source's pairs: several hosts' failures (-1)
        mine = keep & ~np.isin(keys, np.concatenate([got["key"], got["fail_key"]])[got["shared"]])
        table[row[keep], K + 2] = np.where(mine[keep], n_failed[keep], -1)
        unread = int(keep.sum() - mine.sum())
        keep = mine
    usable = coded & (n_replies >= min_count)
    collided = int((~coded & (n_replies >= min_count)).sum())
    own = -1
    if key == "pair":
        answered = int(np.isin(back, dest[usable]).sum())
        own = int(np.isin(all_h, dest[usable]).sum())
    return table, StoreSummary(len(dest), int(usable.sum()), int(n_replies.sum()), collided,
                               key, answered, len(code) if by_source else 0, own, min_count,
                               recent, int(n_failed[keep].sum()) if failures else -1,
                               int(keep.sum()) if failures else -1, untimed, fail_recent,
                               unread, left_out)


def fail_offsets(tokens: np.ndarray, segment_ids: np.ndarray, dst_table: np.ndarray,
                 batch: int = 256) -> tuple[np.ndarray, str]:
    """(float32[rows, 3], a log line): ModelConfig.fail_dst's table, beside the destination
    store's ``dst_table``: at each destination's row, its offsets to P(failed)'s rule
    (train.model.failprior.dst_offsets over the rows' (source, destination) pairs, keyed by
    the model's hashes: model.result_pairs); 0 in rows of no destination."""
    dst, src, failed = M.result_pairs(tokens, segment_ids, batch)
    d, f, n = failprior.pair_counts(src, dst, failed)
    keys, inv = np.unique(d, return_inverse=True)
    off = failprior.dst_offsets(inv.ravel(), f, n, len(keys))
    rows, K = len(dst_table), arch.STORE_K
    table = np.zeros((rows, 3), np.float32)
    if len(keys):
        r1, r2 = (np.asarray(r) for r in M.store_rows(keys, rows))
        check = np.asarray(M.store_check(keys))
        mine = lambda r: (dst_table[r, K] >= arch.STORE_MIN) & (dst_table[r, K + 1] == check)
        ok1, ok2 = mine(r1), mine(r2)
        row = np.where(ok1, r1, np.where(ok2, r2, -1))
        table[row[row >= 0]] = off[:, row >= 0].T
    else:
        row = np.zeros(0, np.int64)
    line = (f"P(failed): the rule's rate, P(dead) and live rate by destination at "
            f"{int((row >= 0).sum()):,} of {len(keys):,} destinations (those with a store row), "
            f"from {len(d):,} train pairs' {len(failed):,} results, each destination's "
            f"shrunk over {failprior.DST_SHRINK:g} pairs toward all destinations'")
    return table, line


@dataclass(frozen=True)
class RecencyCheck:
    """recency_check's answer: over ``pairs`` address pairs and the ``replies`` of their
    later tenths, the median relative error of the median of each pair's earlier replies
    (``all_err``) and of its latest ``recent`` of them (``latest_err``)."""
    recent: int
    pairs: int
    replies: int
    all_err: float
    latest_err: float

    @property
    def latest_better(self) -> bool:
        """Whether the latest replies predict better; as set (True) where no pair tells."""
        return self.pairs == 0 or self.latest_err < self.all_err

    def line(self) -> str:
        if not self.pairs:
            return (f"pair store: no pair has more than {self.recent} train replies before its "
                    f"latest tenth, so none tells whether its latest {self.recent} predict "
                    "better than all of them: its latest, as set (ModelConfig.pair_recent)")
        return (f"pair store: the median of a pair's latest {self.recent} train replies "
                f"predicts the latest tenth of its replies at {self.latest_err:.3f} median "
                f"relative error, of all its earlier ones at {self.all_err:.3f} "
                f"({count(self.pairs, 'pair')}, {count(self.replies, 'reply', 'replies')}): "
                + (f"quantiles over its latest {self.recent}" if self.latest_better else
                   "quantiles over all of them for this run (pair_recent 0)"))


def recency_check(tokens: np.ndarray, segment_ids: np.ndarray, recent: int, *,
                  batch: int = 512, pair_fold: int = 0, without_shared: bool = False,
                  t: Timed | None = None) -> RecencyCheck:
    """Whether a pair's latest ``recent`` train replies say more of its next ones than all
    of them (ModelConfig.pair_recent_check), from the rows alone: each pair's replies
    (those build's ``pair_fold`` and ``without_shared`` would store), timed as build times
    them (``reply_times``; row order where times tie), the latest tenth of them
    (at least one) held back, and where more than ``recent`` come before it, that tenth
    predicted by the median of the earlier ones' values and by the median of their latest
    ``recent``. RTTs that drift (a route change) favour the latest; RTTs that scatter about
    a steady value (Seattle's matrices, frame to frame) favour all of them. ``t``: the rows'
    ``timed`` (decoded here if not given)."""
    if recent < 1:
        raise ValueError(f"recency_check compares a pair's latest replies (>= 1), not {recent}")
    t = timed(tokens, segment_ids) if t is None else t
    got = _collect(tokens, segment_ids, "pair", batch, 0, pair_fold, t, without_shared)
    h, code, when = got["key"], got["code"], got["when"]
    if without_shared:
        mine = ~got["shared"][:len(h)]
        h, code, when = h[mine], code[mine], when[mine]
    o = np.lexsort((when, h))
    h, code = h[o], np.asarray(code[o], np.int64)
    value = (code & 0x7FF).astype(np.float64) * np.exp2((code >> 11).astype(np.float64))
    first = np.flatnonzero(np.r_[True, h[1:] != h[:-1]]) if len(h) else np.zeros(0, np.int64)
    n = np.diff(np.r_[first, len(h)])
    held = np.maximum(1, n // 10)
    told = n - held > recent  # (else both medians are the same)
    if not told.any():
        return RecencyCheck(recent, 0, 0, float("nan"), float("nan"))
    pair = np.repeat(np.arange(len(first)), n)
    place = np.arange(len(h)) - np.repeat(first, n)  # in the pair's time order
    cut = np.repeat(np.where(told, n - held, -1), n)  # its earlier replies' count
    earlier, later = place < cut, (place >= cut) & (cut >= 0)
    at = pair[later]
    a, b = (np.abs(_medians(pair[w], value[w], len(first))[at] - value[later]) / value[later]
            for w in (earlier, earlier & (place >= cut - recent)))
    return RecencyCheck(recent, int(told.sum()), len(a), float(np.median(a)),
                        float(np.median(b)))


def _medians(group: np.ndarray, value: np.ndarray, groups: int) -> np.ndarray:
    """float64[groups]: each group's median of ``value`` (np.median's: the mean of the two
    middle values of an even count), NaN for a group without values."""
    o = np.lexsort((value, group))
    group, value = group[o], value[o]
    start = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    n = np.diff(np.r_[start, len(group)])
    out = np.full(groups, np.nan)
    out[group[start]] = (value[start + (n - 1) // 2] + value[start + n // 2]) / 2
    return out


KRIG_SHRINK = 5.0  # a covariance over n shared sources is scaled n / (n + this); context_krig's


def pairs_in_runs(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(one, other): every ordered pair (i, j), i == j included, of indices whose ``group``
    values are equal, ``group`` being in runs (sorted); by i, then j. The pairs of
    destinations one source reached, for build_krig and the context_krig baseline."""
    group = np.asarray(group)
    start = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]) if len(group) else group[:0]
    size = np.diff(np.r_[start, len(group)]).astype(np.int64)
    per = np.repeat(size, size)  # each index pairs with its run's every member
    one = np.repeat(np.arange(len(group)), per)
    other = (np.repeat(np.repeat(start, size), per)
             + np.arange(len(one)) - np.repeat(np.cumsum(per) - per, per))
    return one, other


@dataclass(frozen=True)
class KrigSummary:
    pairs: int  # destination pairs (a destination with itself included) some source reached
    placed: int  # of them, with a row
    sources: int
    noise: float  # a reply's variance about its pair's median, in octaves squared

    def line(self) -> str:
        return (f"kriging store: {self.placed:,} of {self.pairs:,} destination pairs from "
                f"{self.sources:,} train sources; a reply's noise {self.noise:.3f} octaves^2"
                + ("" if self.placed == self.pairs else
                   f"; {self.pairs - self.placed:,} found no free row (a larger "
                   "ModelConfig.krig_store would hold them)"))


def _log2_value(code: np.ndarray) -> np.ndarray:
    """log2 of an RTT code's value in µs (model._code_value in numpy)."""
    code = np.asarray(code, np.int64)
    return np.log2((code & 0x7FF).astype(np.float64)) + (code >> 11)


def build_krig(tokens: np.ndarray, segment_ids: np.ndarray, rows: int, dst_table: np.ndarray,
               *, batch: int = 512, fold: int = 0) -> tuple[np.ndarray, float, KrigSummary]:
    """(float32[rows, 2] of (covariance, check), a reply's noise variance, summary): the
    kriging store (ModelConfig.krig_store) from packed rows, as the context_krig baseline
    fits its (train.eval.context_baselines.krig_table), in octaves: per (source,
    destination) the median code of its replies, its residual the log2 ratio to the
    destination's row median in ``dst_table`` (destinations with a row of their own only);
    per destination pair (``model.cov_key``) the residuals' products summed over the
    sources that reached both, over their count (plus KRIG_SHRINK for two destinations);
    the noise the replies' mean square log2 ratio to their pair's median."""
    K = arch.STORE_K
    got = _collect(tokens, segment_ids, "ends", batch, fold)
    dst, src, code = got["key"], got["back"], got["code"]
    table = np.zeros((rows, 2), np.float32)
    if len(dst):  # the destination's own row (model.store_rows; its check, enough replies)
        r1, r2 = (np.asarray(r) for r in M.store_rows(dst, len(dst_table)))
        mine = lambda r: ((dst_table[r, K] >= arch.STORE_MIN)
                          & (dst_table[r, K + 1] == M.store_check(dst)))
        row = np.where(mine(r1), r1, r2)
        ok = mine(r1) | mine(r2)
        dst, src, code, median = dst[ok], src[ok], code[ok], dst_table[row[ok], K // 2]
    if not len(dst):
        return table, 0.0, KrigSummary(0, 0, 0, 0.0)
    o, first, n, mid = _pair_medians(src, dst, code)  # by source, destination, then code
    dst, src, code, median = dst[o], src[o], code[o], median[o]
    pair_code = code[mid]
    noise = float(np.mean((_log2_value(code) - np.repeat(_log2_value(pair_code), n)) ** 2))
    p_src, p_dst = src[first], dst[first]
    resid = _log2_value(pair_code) - _log2_value(median[first].astype(np.int64))
    one, other = pairs_in_runs(p_src)  # every ordered pair of destinations one source reached
    keep = p_dst[one] <= p_dst[other]  # each unordered pair once per source
    one, other = one[keep], other[keep]
    key = M.cov_key(p_dst[one], p_dst[other])
    ukey, inv = np.unique(key, return_inverse=True)
    total = np.bincount(inv, resid[one] * resid[other], len(ukey))
    shared = np.bincount(inv, minlength=len(ukey))
    same = np.zeros(len(ukey), bool)
    same[inv[p_dst[one] == p_dst[other]]] = True
    cov = total / (shared + np.where(same, 0.0, KRIG_SHRINK))
    at = _place(*(np.asarray(r) for r in M.store_rows(ukey, rows)), shared, ukey, rows)
    held = at >= 0
    table[at[held], 0] = cov[held]
    table[at[held], 1] = M.store_check(ukey[held])
    return table, noise, KrigSummary(len(ukey), int(held.sum()), len(np.unique(p_src)), noise)
