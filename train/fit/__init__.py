"""Training a model on a dataset: the Grain reader over packed shards, the train step and
loop, its metering, the run folder and its checkpoints, the CPU/GPU defaults and the device.

Owns: config, device, reader, checkpoint, step, loop, meter, runfolder, board (TensorBoard),
multihost (`train --distributed`).
Imports: train.model, prep.base (the plumbing), and prep.schema and prep.tokens (rows, their
decoding).
"""
