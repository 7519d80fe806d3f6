"""Every baseline by name, imported only when created (heavy dependencies stay out of startup)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from actmap.scoring.contract import Scorer, row_input

# name -> "module:Class" (imported on first use) or the class itself; the name equals the
# class's ``name`` attribute. Adding a baseline: its module, and one entry here (or
# `register_baseline`).
BASELINES: dict[str, str | type] = {
    "perplexity": "actmap.baselines.greybox:Perplexity",
    "mean_token_entropy": "actmap.baselines.greybox:MeanTokenEntropy",
    "p_true": "actmap.baselines.ptrue:PTrue",
    "semantic_entropy": "actmap.baselines.semantic_entropy:SemanticEntropy",
    "eigenscore": "actmap.baselines.eigenscore:EigenScore",
    "rauq": "actmap.signals.rauq:RAUQ",
    "tad": "actmap.signals.tad:TAD",
    "actvit": "actmap.baselines.actvit:ACTViTScorer",
    "answer_length": "actmap.baselines.controls:AnswerLengthPredictor",
    "permuted_label": "actmap.baselines.controls:PermutedLabelControl",
}


def list_baselines() -> list[str]:
    """Registered baseline names, sorted."""
    return sorted(BASELINES)


def register_baseline(cls: type) -> type:
    """Class decorator: register a scorer under its ``name`` (it must declare the contract)."""
    missing = [a for a in ("name", "supervised", "requires", "probability") if not hasattr(cls, a)]
    if missing:
        raise TypeError(f"{cls.__name__} does not declare {', '.join(missing)}")
    row_input(cls.requires)  # names a row input, and only known inputs
    if cls.name in BASELINES:
        raise ValueError(f"baseline {cls.name!r} is already registered")
    BASELINES[cls.name] = cls
    return cls


def baseline_class(name: str) -> type:
    """The scorer class registered under ``name`` (imports its module)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(list_baselines())}")
    target = BASELINES[name]
    if isinstance(target, type):
        return target
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_baseline(name: str, **kwargs: Any) -> Scorer:
    """Instantiate the baseline ``name`` with its constructor arguments."""
    return baseline_class(name)(**kwargs)


def time_per_answer(scorer: Scorer, rows: Sequence[Any], repeats: int = 1) -> float:
    """Wall-clock seconds ``scorer.score`` spends per answer (the best of ``repeats`` runs).

    Measures only the added scoring cost on already captured rows; a fitted
    scorer is expected for supervised methods.
    """
    if len(rows) == 0:
        raise ValueError("time_per_answer needs at least one row")
    best = np.inf
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        scorer.score(rows)
        best = min(best, time.perf_counter() - start)
    return float(best / len(rows))
