"""Supply-aware fills: what the free measurements can fill, and which of them to spend where.

The packer fills the gaps that timestamped contexts leave with free (untimestamped)
measurements, whose bodies come in a few sizes (prep.tokens.costs: 14 and 12 tokens for
IPv4, 38 and 36 for IPv6) and in whatever mix the data has. Gaps below 36 tokens only the
IPv4 bodies fill: on data of mostly IPv6 probes those run out, and a gap that only they
fill stays padding (docs/measurements.md has the case that showed it). And rows of
IPv6 bodies alone close exactly only as 26 x 38 + 36 or 8 x 38 + 20 x 36. So:

- the planner (prep.pack.planner_kernels.cut_contexts) prices each body by a budget:
  ``budget`` estimates how many of each body the free rows will hold, per context that the
  row length ends; a context ends where tokens given back plus the price of the cheapest
  fill of its gap (``cheapest_fills``) is least, and spends that fill;
- the packer (prep.pack.fill) prices each size by its demand over what is left of it,
  closes gaps with the cheapest set of single measurements, and lays the donors' rest into
  rows whose remaining gap always has a fill.

All of it is integer arithmetic on the data, the config and the seed.
"""

from __future__ import annotations

import numpy as np

from prep.base.jit import kernel
from prep.tokens.costs import UNIT

INF = 1 << 40  # the cost of a sum that no bodies make
BUDGET_ROWS = 16  # a budget holds at most this many contexts' earnings
RELAID = 0.8  # the share of the free tokens that the packer lays into rows of their own


@kernel
def cheapest_fills(size, price, top, cost, via):
    """cost[t] = the least total price of bodies (size[b] tokens at price[b] each, any number
    of each) that sum to exactly t, for t <= top (INF where none do); via[t] = the body the
    cheapest sum ends with (-1 for t = 0 and where none). Ties: the earlier body."""
    cost[0], via[0] = 0, -1
    for t in range(1, top + 1):
        c, v = INF, -1
        for b in range(size.shape[0]):
            s = size[b]
            if s <= t and cost[t - s] < INF and cost[t - s] + price[b] < c:
                c, v = cost[t - s] + price[b], b
        cost[t], via[t] = c, v


@kernel(inline="always")
def slack_target(cost, g):
    """The sum that fills a gap of g: g itself, or g - 1 where that is cheaper (a gap may
    end at 1 token: with even bodies an odd gap always does)."""
    if g >= 1 and cost[g - 1] < cost[g]:
        return g - 1
    return g


def budget(sizes: list[int], counts: list[int], none_share: float, row_len: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """(rate, cap) of the planner's budget, int64 per body, in UNIT per body.

    The free rows will hold about ``counts[b] * none_share`` of body b (none-mode contexts
    are free). Rows laid of free measurements alone need some of them to close: as many
    such rows as RELAID of the free tokens make, each taking the bodies of the cheapest
    exact row (price: 1 + 2**16 // the supply) but its bulk (the body it holds most of);
    those are set aside. What is left is spread over the contexts the row length ends
    (about the rows the bodies make): rate = UNIT x left / rows, cap = BUDGET_ROWS x rate
    (at least one body; 0 for a body the data has none of).
    """
    supply = [c * none_share for c in counts]
    size = np.array(sizes, np.int64)
    price = np.array([1 + (1 << 16) // (int(x) + 1) for x in supply], np.int64)
    cost, via = np.empty(row_len + 1, np.int64), np.empty(row_len + 1, np.int64)
    cheapest_fills(size, price, row_len, cost, via)
    row = [0] * len(sizes)
    t = int(slack_target(cost, row_len))
    while cost[t] < INF and t > 0:
        row[via[t]] += 1
        t -= sizes[via[t]]
    row[int(np.argmax(row))] = 0
    relaid = sum(x * s for x, s in zip(supply, sizes)) / row_len * RELAID
    rows = sum(c * s for c, s in zip(counts, sizes)) / row_len + 1
    rate = [int(max(x - r * relaid, 0.0) / rows * UNIT) for x, r in zip(supply, row)]
    cap = [max(r * BUDGET_ROWS, UNIT) if r else 0 for r in rate]
    return np.array(rate, np.int64), np.array(cap, np.int64)
