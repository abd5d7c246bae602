"""Parquet measurements to a dataset of shards: one bucket's work (plan, tokenize, pack,
write), the dataset both runners finish the same way, and the runners of `prep shards`
(local processes, Apache Beam).

Owns: bucket, dataset, local_runner, beam_runner.
Imports: prep.pack, prep.tokens, prep.jobs, prep.schema; nothing of prep.ingest.
"""
