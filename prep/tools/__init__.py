"""What a user asks of data and datasets: `prep analyze-padding`, `prep verify` and
`prep inspect`.

Owns: analyze, verify, inspect_rows.
Imports: prep.shards, prep.pack, prep.tokens, prep.jobs, prep.schema, prep.base.
"""
