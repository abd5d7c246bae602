"""Parquet measurements to a dataset of shards: one bucket's work (plan, tokenize, pack,
write), the one run of `prep shards` both runners share (dataset.build: inputs, output
folder, start line, manifest), and each runner's own passes (local processes, Apache Beam).

Owns: config (ShardsConfig, with the flags of `prep shards`), bucket, dataset, stages (the
seconds per stage in the report), kernels (compiled once into Numba's cache, loaded after),
local_runner, beam_runner, beam_worker (what Beam's workers run).
Imports: prep.pack, prep.tokens, prep.jobs, prep.schema, prep.base; nothing of prep.ingest.
"""
