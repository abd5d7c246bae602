"""The machinery a command that writes runs on: the output folder (claim, stage, publish,
release: prep.jobs.claim, with its two layouts, outdir and parquet_out, and its bucket
backend, remote_out) and the one worker pool of `prep shards`, `prep verify` and
`prep import-atlas`.

Owns: claim, owned, outdir, parquet_out, remote_out, pool.
Imports: prep.schema and prep.base only.
"""
