"""The contracts every stage shares: what a measurement is and which are valid, the token
vocabulary and grammar table, the bytes of a packed row, the manifest of a dataset, the split
rules, the hash everything seeds from, and the one error type a user sees.

Owns: errors, vocab, hashing, sniff, measurements, validate, rows, manifest, splits.
Imports: nothing of prep's other packages (the ground floor).
"""
