"""The floor of plumbing every command stands on, below the contracts (prep.schema) and
train: the one error type a user sees and the one table of disk failures (errors), the
folder lock (lock), whole-or-nothing writes (atomic), the signal guard (signals), click
options derived from a config dataclass (options), the helper-process lifetime (lifetime),
counts in words (words), what a path holds (sniff), a parquet file written a table at a
time (tables), object storage (storage), the local copy of a bucket's objects (mirror) and
how Numba code is compiled (jit).

Owns: errors, lock, atomic, signals, options, lifetime, words, sniff, tables, storage, mirror,
jit.
Imports: nothing of prep's other packages, nothing of train (both import it).
"""
