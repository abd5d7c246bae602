"""The contracts every stage shares: what a measurement is and which are valid, the token
vocabulary and grammar table, the bytes of a packed row, the manifest of a dataset, the split
rules, the hash everything seeds from, the one error type a user sees, and where a dataset
may live (a local folder, or a bucket read through a local cache); also the signal guard and
the helper-process lifetime, which prep.jobs and train share.

Owns: errors, vocab, hashing, sniff, measurements, validate, rows, manifest, splits, words,
storage, cache, signals, lifetime.
Imports: nothing of prep's other packages (the ground floor).
"""
