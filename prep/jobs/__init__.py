"""The machinery a command that writes runs on: the output it owns (claim, stage, publish,
release: prep.jobs.claim; one Claim, two backends, a local folder and a bucket prefix, two
layouts, a shards dataset and parquet files) and the one worker pool of `prep shards`,
`prep verify` and `prep import-atlas`.

Owns: claim, owned, outdir, parquet_out, remote_out, pool.
Imports: prep.schema and prep.base only.
"""
