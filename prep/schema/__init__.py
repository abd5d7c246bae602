"""The contracts every stage shares: what a measurement is and which are valid, the token
vocabulary and grammar table, the bytes of a packed row, the manifest of a dataset, the split
rules, the hash everything seeds from, the one error type a user sees, and where a dataset
may live (a local folder, or a bucket read through a local cache).

Owns: errors, vocab, hashing, sniff, measurements, validate, rows, manifest, splits, words,
storage, cache.
Imports: nothing of prep's other packages (the ground floor).
"""
