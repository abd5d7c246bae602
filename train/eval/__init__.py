"""Judging a trained model against every predictor that had the same information: the
train-fit and context baselines, the metrics and strata, the report and its figure.

Owns: evaluate, registry (every predictor's name, label, kind, fallback), baselines,
context_baselines, coord_kernels, metrics, report, plot.
Imports: train.predict, train.fit, train.model, prep.base, prep.schema and prep.tokens.
"""
