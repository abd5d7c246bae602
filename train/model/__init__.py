"""The transformer: its configuration and presets, packed (segment-masked) attention on
each backend, and the forward pass and loss by token.

Owns: arch, attention, model.
Imports: prep.schema (the vocabulary) only.
"""
