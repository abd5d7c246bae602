"""Contexts to rows: the planner (sort a bucket, cut each probe's history into contexts)
and the packer (best-fit decreasing, the fill step, repacking) into fixed-length rows.

Owns: contexts, planner_kernels, packing, fill, repack.
Imports: prep.tokens (the costs) and prep.schema.
"""
