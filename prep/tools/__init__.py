"""What a user asks of data and datasets: `prep analyze-padding`, `prep verify` and
`prep inspect`; and what the benchmarks (bench/) and the tests both build their inputs with:
workloads, synthetic_shards, s3_server.

Owns: analyze, verify, inspect_rows, workloads, synthetic_shards, s3_server.
Imports: prep.shards, prep.ingest, prep.pack, prep.tokens, prep.jobs, prep.schema, prep.base.
"""
