"""The contracts every stage shares: what a measurement is and which are valid, the token
vocabulary and grammar table, the bytes of a packed row, the manifest of a dataset (and its
local copy when it lives in a bucket), the split rules and the hash everything seeds from.

Owns: vocab, hashing, measurements, validate, rows, manifest, splits, cache (and errors,
``InputError`` under its older name).
Imports: prep.base only.
"""
