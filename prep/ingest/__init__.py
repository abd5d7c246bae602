"""Sources to parquet measurements in the input schema of `prep shards`: RIPE Atlas results
(`prep import-atlas`), latency matrices (`prep import-matrix`) and synthetic data
(`prep synth`).

Owns: atlas, atlas_json, atlas_read, atlas_rows, matrix, synth.
Imports: prep.jobs, prep.schema and prep.base; nothing of prep.shards (its sibling).
"""
