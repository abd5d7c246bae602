"""Contexts to rows: the planner (sort a bucket, cut each probe's history into contexts)
and the packer (best-fit decreasing, the fill step, repacking) into fixed-length rows.

Owns: contexts, planner_kernels, supply (what the free measurements fill and which to
spend where), packing, fill, closing (its exact closing sets), repack.
Imports: prep.tokens (the costs) and prep.schema.
"""
