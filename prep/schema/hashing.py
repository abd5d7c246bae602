"""SplitMix64, the one hash of the pipeline: its constants and its finalizer ``mix64``.

Every seeded choice is a function of (seed, probe, counter) through it, so outputs never
depend on workers or order: the tokenizer's draws (prep.tokens.draws, in Numba, from these
constants; prep.tokens.reference, the pure-Python oracle, from ``mix64``), the epoch seeds
(prep.pack.contexts), and the bucket and split of a probe (prep.shards.bucket, ``splitmix64`` over
arrays). Arithmetic wraps at 64 bits.
"""

from __future__ import annotations

import numpy as np

MASK = 0xFFFF_FFFF_FFFF_FFFF
GOLDEN = 0x9E3779B97F4A7C15  # the increment of the sequence (2**64 / golden ratio)
C1 = 0xBF58476D1CE4E5B9  # the finalizer's multipliers
C2 = 0x94D049BB133111EB


def mix64(z: int) -> int:
    """The finalizer on one Python int in [0, 2**64)."""
    z = ((z ^ (z >> 30)) * C1) & MASK
    z = ((z ^ (z >> 27)) * C2) & MASK
    return z ^ (z >> 31)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """One SplitMix64 step (add GOLDEN, then the finalizer) over uint64 arrays."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, np.uint64) + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(C1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(C2)
        return z ^ (z >> np.uint64(31))
