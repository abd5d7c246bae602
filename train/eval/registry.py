"""The one list of predictors `train eval` scores: for each, its name (the key in the report's
JSON), its label in the table and the figure, its kind and what it answers with where it
has nothing of its own. Everything else derives from it: train.eval.baselines.BASELINES,
train.eval.context_baselines.CONTEXT_BASELINES, train.eval.evaluate.PREDICTORS (the
report's order), train.eval.report's labels and fallbacks, train.eval.plot's line styles.

Adding a baseline is one entry here plus its fit / predict code (train.eval.baselines for
a train-fit one, train.eval.context_baselines for a context one). Imports nothing of the
project.
"""

from __future__ import annotations

from dataclasses import dataclass

MODEL, CONTEXT, TRAIN_FIT = "model", "context", "train-fit"
CONTEXT_FALLBACK = "pair mode > dst median > global median"


@dataclass(frozen=True)
class Predictor:
    name: str  # the key in the report's JSON, and --baseline style names
    label: str  # in the table and the figure's legend
    kind: str  # MODEL, CONTEXT (reads the query's own context) or TRAIN_FIT (the train split)
    fallback: str | None  # where it has no answer of its own; None: it answers every query


# In the report's order: the model, the context baselines, the train-fit baselines.
REGISTRY = (
    Predictor("model", "model", MODEL, None),
    Predictor("model_median", "model, its median", MODEL, None),
    Predictor("model_no_context", "model, no context", MODEL, None),
    Predictor("context_last", "context last-seen", CONTEXT, CONTEXT_FALLBACK),
    Predictor("context_ema", "context EMA (0.3)", CONTEXT, CONTEXT_FALLBACK),
    Predictor("context_median", "context median", CONTEXT, CONTEXT_FALLBACK),
    Predictor("context_vivaldi", "context Vivaldi", CONTEXT, CONTEXT_FALLBACK),
    Predictor("context_knn", "context kNN (5)", CONTEXT, CONTEXT_FALLBACK),
    Predictor("context_krig", "context kriging", CONTEXT, CONTEXT_FALLBACK),
    Predictor("global_median", "global median", TRAIN_FIT, "global median"),
    Predictor("dst_median", "dst median", TRAIN_FIT, "global median"),
    Predictor("pair_last", "pair last-seen", TRAIN_FIT, "global median"),
    Predictor("pair_ema", "pair EMA (0.3)", TRAIN_FIT, "global median"),
    Predictor("pair_median", "pair median", TRAIN_FIT, "global median"),
    Predictor("pair_mode", "pair mode", TRAIN_FIT, "global median"),
    Predictor("vivaldi", "Vivaldi", TRAIN_FIT, "global median"),
    Predictor("matrix_factorization", "matrix factorization", TRAIN_FIT, "global median"),
)
BY_NAME = {p.name: p for p in REGISTRY}
PREDICTORS = tuple(p.name for p in REGISTRY)
LABELS = {p.name: p.label for p in REGISTRY}


def names(kind: str) -> tuple[str, ...]:
    """The predictors of one kind, in the registry's order."""
    return tuple(p.name for p in REGISTRY if p.kind == kind)


def label(name: str) -> str:
    """The table's label; an unknown name is its own label."""
    p = BY_NAME.get(name)
    return p.label if p else name


def kind_of(name: str) -> str | None:
    p = BY_NAME.get(name)
    return p.kind if p else None


def fallback_of(name: str) -> str:
    """What the predictor answers with where it has nothing (the table's "fell back for
    all" line); a model answers every query, and an unknown name says "global median"."""
    p = BY_NAME.get(name)
    return p.fallback if p and p.fallback else "global median"
