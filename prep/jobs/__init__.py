"""The machinery a command that writes runs on: the output folder (claim, stage, publish,
replace; on a bucket too) and the one worker pool of `prep shards`, `prep verify` and
`prep import-atlas`.

Owns: outdir, parquet_out, remote_out, pool.
Imports: prep.schema and prep.base only.
"""
