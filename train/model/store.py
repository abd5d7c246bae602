"""The destination store (ModelConfig.dst_store): the train split's replies by destination,
as the table the model reads (train.model.model.store_dists).

``build`` reads packed rows (a split as train.fit.reader.read_split returns it), hashes
each measurement's destination on the device as the model does (so a row found at training
time is the row found at query time), and keeps per destination its reply count and the
STORE_K quantiles of its RTT codes (the quantile at levels (k + 0.5) / K: the code is
monotone in the RTT, so these are the RTT quantiles). A destination goes to the row of its
hash; where two share a row, the one with more replies keeps it and the other has none
(its check differs, so the model reads nothing for it rather than another's replies).

Each row: K codes (16-bit RTT codes, float32), the count, the check (model.store_check).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from prep.schema import vocab
from train.model import arch
from train.model import model as M


@dataclass(frozen=True)
class StoreSummary:
    destinations: int  # with at least one reply in the rows
    usable: int  # with a row of their own and at least STORE_MIN replies
    replies: int
    collided: int  # lost their row to a destination with more replies

    def line(self) -> str:
        return (f"destination store: {self.usable:,} of {self.destinations:,} destinations "
                f"(>= {arch.STORE_MIN} replies each) from {self.replies:,} train replies"
                + (f"; {self.collided:,} lost their row to another (a larger --dst-store "
                   "would keep them)" if self.collided else ""))


@jax.jit
def _replies(tokens, segment_ids):
    """(hash, code, is_reply), [B, T] each: at each RTT_START whose two bytes follow in
    its segment, the measurement's destination hash and the reply's 16-bit code."""
    tokens, seg = tokens.astype(jnp.int32), segment_ids.astype(jnp.int32)
    _, full, _ = M.address_hashes(tokens, seg, "dst")
    nxt = lambda x, k: jnp.concatenate([x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)
    b1, b2 = nxt(tokens, 1) - vocab.BYTE_OFFSET, nxt(tokens, 2) - vocab.BYTE_OFFSET
    ok = ((tokens == vocab.RTT_START) & (seg > 0) & (nxt(seg, 2) == seg)
          & (b1 >= 0) & (b1 < 256) & (b2 >= 0) & (b2 < 256))
    return full, b1 * 256 + b2, ok


def build(tokens: np.ndarray, segment_ids: np.ndarray, rows: int, *,
          batch: int = 512) -> tuple[np.ndarray, StoreSummary]:
    """(float32[rows, STORE_K + 2], summary) from packed rows ``tokens``/``segment_ids``."""
    K = arch.STORE_K
    hs, codes = [], []
    for r0 in range(0, len(tokens), batch):
        t, s = tokens[r0:r0 + batch], segment_ids[r0:r0 + batch]
        if len(t) < batch:  # one compiled shape: pad the last batch with empty rows
            t = np.concatenate([t, np.zeros((batch - len(t),) + t.shape[1:], t.dtype)])
            s = np.concatenate([s, np.zeros((batch - len(s),) + s.shape[1:], s.dtype)])
        h, c, ok = (np.asarray(x) for x in _replies(t, s))
        hs.append(h[ok])
        codes.append(c[ok])
    h = np.concatenate(hs) if hs else np.zeros(0, np.int32)
    code = np.concatenate(codes) if codes else np.zeros(0, np.int32)
    table = np.zeros((rows, K + 2), np.float32)
    if len(h) == 0:
        return table, StoreSummary(0, 0, 0, 0)
    order = np.lexsort((code, h))  # by destination, codes ascending within
    h, code = h[order], code[order]
    first = np.flatnonzero(np.r_[True, h[1:] != h[:-1]])
    n = np.diff(np.r_[first, len(h)])
    dest = h[first]
    row = np.asarray(M.memory_row(jnp.asarray(dest), rows))
    # the row goes to the destination with the most replies
    by_size = np.lexsort((-n, row))
    keep = np.zeros(len(dest), bool)
    keep[by_size[np.r_[True, row[by_size][1:] != row[by_size][:-1]]]] = True
    levels = (np.arange(K) + 0.5) / K
    q = first[:, None] + np.minimum((levels[None, :] * n[:, None]).astype(np.int64), n[:, None] - 1)
    table[row[keep], :K] = code[q[keep]]
    table[row[keep], K] = n[keep]
    table[row[keep], K + 1] = M.store_check(dest[keep])
    usable = int((keep & (n >= arch.STORE_MIN)).sum())
    collided = int((~keep & (n >= arch.STORE_MIN)).sum())
    return table, StoreSummary(len(dest), usable, int(len(h)), collided)
