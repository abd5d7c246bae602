"""Asking a trained model: the predictor (a checkpoint, a history, queries) and the queries
read from files.

Owns: predictor, queries.
Imports: train.fit (checkpoints), train.model, prep.base, prep.schema and prep.tokens.
"""
