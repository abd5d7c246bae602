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

from prep.schema import vocab
from train.model import arch
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

    def line(self) -> str:
        name, what, field = KEYS[self.key]
        return (f"{name}: {self.usable:,} of {self.destinations:,} {what} "
                f"(>= {arch.STORE_MIN} replies each) from {self.replies:,} train replies"
                + (f"; {self.collided:,} found no free row (a larger ModelConfig.{field} "
                   "would hold them)" if self.collided else "")
                + ("" if self.answered < 0 else
                   f"; {self.answered:,} train replies have their reverse pair there"
                   + (" (none: it answers nothing on this data)" if not self.answered
                      else "")))


@functools.partial(jax.jit, static_argnames="key")
def _replies(tokens, segment_ids, key="dst"):
    """(key, reverse key, code, is_reply), [B, T] each: at each RTT_START whose two bytes
    follow in its segment, the measurement's destination hash (``key`` "dst"; its reverse
    key is itself) or the key of its ordered (source, destination) pair ("pair"; the
    reverse: (destination, source)), and the reply's 16-bit code."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    _, full, _ = M.address_hashes(tokens, seg, "dst")
    back = full
    if key == "pair":
        src = M.address_hashes(tokens, seg, "src")[1]
        full, back = M.pair_key(src, full), M.pair_key(full, src)
    nxt = lambda x, k: jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)
    b1, b2 = nxt(tokens, 1) - vocab.BYTE_OFFSET, nxt(tokens, 2) - vocab.BYTE_OFFSET
    ok = ((tokens == vocab.RTT_START) & (seg > 0) & (nxt(seg, 2) == seg)
          & (b1 >= 0) & (b1 < 256) & (b2 >= 0) & (b2 < 256))
    return full, back, b1 * 256 + b2, ok


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


def build(tokens: np.ndarray, segment_ids: np.ndarray, rows: int, *, key: str = "dst",
          batch: int = 512) -> tuple[np.ndarray, StoreSummary]:
    """(float32[rows, STORE_K + 2], summary) from packed rows ``tokens``/``segment_ids``,
    by destination (``key`` "dst") or by ordered address pair ("pair")."""
    if key not in KEYS:
        raise ValueError(f"store key must be one of {sorted(KEYS)}, not {key!r}")
    K = arch.STORE_K
    hs, backs, codes = [], [], []
    for r0 in range(0, len(tokens), batch):
        t, s = tokens[r0:r0 + batch], segment_ids[r0:r0 + batch]
        if len(t) < batch:  # one compiled shape: pad the last batch with empty rows
            t = np.concatenate([t, np.zeros((batch - len(t),) + t.shape[1:], t.dtype)])
            s = np.concatenate([s, np.zeros((batch - len(s),) + s.shape[1:], s.dtype)])
        h, b, c, ok = (np.asarray(x) for x in _replies(t, s, key))
        hs.append(h[ok])
        backs.append(b[ok])
        codes.append(c[ok])
    h = np.concatenate(hs) if hs else np.zeros(0, np.int32)
    back = np.concatenate(backs) if backs else np.zeros(0, np.int32)
    code = np.concatenate(codes) if codes else np.zeros(0, np.int32)
    table = np.zeros((rows, K + 2), np.float32)
    answered = -1 if key == "dst" else 0
    if len(h) == 0:
        return table, StoreSummary(0, 0, 0, 0, key, answered)
    order = np.lexsort((code, h))  # by destination, codes ascending within
    h, code = h[order], code[order]
    first = np.flatnonzero(np.r_[True, h[1:] != h[:-1]])
    n = np.diff(np.r_[first, len(h)])
    dest = h[first]
    row = _place(*(np.asarray(r) for r in M.store_rows(dest, rows)), n, dest, rows)
    keep = row >= 0
    levels = (np.arange(K) + 0.5) / K
    q = first[:, None] + np.minimum((levels[None, :] * n[:, None]).astype(np.int64), n[:, None] - 1)
    table[row[keep], :K] = code[q[keep]]
    table[row[keep], K] = n[keep]
    table[row[keep], K + 1] = M.store_check(dest[keep])
    usable = keep & (n >= arch.STORE_MIN)
    collided = int((~keep & (n >= arch.STORE_MIN)).sum())
    if key == "pair":
        answered = int(np.isin(back, dest[usable]).sum())
    return table, StoreSummary(len(dest), int(usable.sum()), int(len(h)), collided, key,
                               answered)
