"""The transformer: its configuration and presets, packed (segment-masked) attention on
each backend, the forward pass and loss by token, and what a step keeps for its backward
pass.

Owns: arch, attention, model, memory.
Imports: prep.schema (the vocabulary) only.
"""
