"""The tokenizer's counter-based draws, in Numba: what the planner and the encoder share.

Every draw is ``mix64(key + counter * GOLDEN)`` with
``key = mix64(mix64(seed + stream * GOLDEN) ^ probe)`` and the counter being the
measurement's index in its probe's sorted history (SplitMix64's finalizer, constants from
``prep.schema.hashing``). No state is carried from one measurement to the next, so a draw does
not depend on which worker, bucket or piece a measurement lands in. The streams:

- MODE, FRAC (counter = index of a context's first measurement): the context's timestamp
  mode, and in ``partial`` mode the fraction of measurements that lose their timestamp
  (``prep.pack.planner_kernels.cut_contexts``);
- DROP (counter = the measurement's index): does it lose its timestamp (``partial``);
- FIELD (counter = the measurement's index): the order of its blocks (``prep.tokens.kernel``);
- SHUFFLE (counter = index of a piece's first measurement, then draw ``i`` of that key):
  the Fisher-Yates shuffle of a piece in ``partial``/``none`` mode (``prep.tokens.kernel``).

``prep.tokens.reference`` draws the same numbers in plain Python.
"""

from __future__ import annotations

import numpy as np

from prep.base.jit import helper
from prep.schema import hashing

GOLDEN = np.uint64(hashing.GOLDEN)
_C1 = np.uint64(hashing.C1)
_C2 = np.uint64(hashing.C2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
S32 = np.uint64(32)  # a draw's top 32 bits: ``draw(...) >> S32``

STREAM_MODE, STREAM_FRAC, STREAM_DROP, STREAM_FIELD, STREAM_SHUFFLE = 1, 2, 3, 4, 5
MODE_FULL, MODE_PARTIAL, MODE_NONE = 0, 1, 2  # a context's timestamp mode


@helper(inline=True)
def mix64(z):
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return z ^ (z >> _S31)


@helper(inline=True)
def stream_key(seed, probe, stream):
    return mix64(mix64(seed + np.uint64(stream) * GOLDEN) ^ probe)


@helper(inline=True)
def draw(key, counter):
    return mix64(key + np.uint64(counter) * GOLDEN)
