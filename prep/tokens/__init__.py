"""Measurements to tokens and back: the token costs, the seeded draws, the Numba tokenizer
and its plain-Python oracle, and the readers (decode, grammar, rowdecode).

Owns: costs, draws, kernel, reference, decode, rowdecode, grammar.
Imports: prep.schema only (nothing of the packer).
"""
