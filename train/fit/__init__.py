"""Training a model on a dataset: the Grain reader over packed shards, the train step and
loop, checkpoints of a run folder, the CPU/GPU defaults and the device.

Owns: config, device, reader, checkpoint, step, loop, board (TensorBoard), multihost
(`train --distributed`).
Imports: train.model, prep.base (the plumbing), and prep.schema and prep.tokens (rows, their decoding).
"""
