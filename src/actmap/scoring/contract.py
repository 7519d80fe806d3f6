"""The one scoring contract every detector and baseline honours.

Every scorer returns a *confidence*: higher = more likely correct. Upstream
uncertainties U are negated by `negate`, once, and the raw upstream value is
kept beside it so numbers can be compared with the authors' own.

A scorer declares what it reads in ``requires`` (see `INPUTS`); the runner's
input providers read each of those from the store once and hand the scorer its
rows. ``probability`` says whether the confidence estimates p(correct), so
ECE applies to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

# What a scorer can read. Row inputs (one per scored answer), most specific first, then the
# resources a scorer is built with.
ROW_INPUTS = ("maps", "dense", "samples", "verification", "attention", "generations")
# read beside the map by the detectors (`actmap.detectors.inputs.DetectorInputs`)
MAP_PARTS = ("scalars", "positions")
RESOURCE_INPUTS = ("model", "judge")
INPUTS = ROW_INPUTS + MAP_PARTS + RESOURCE_INPUTS
INPUT_DOCS = {
    "maps": "the activation maps (C, H, W) per answer",
    "scalars": "the six per-answer scalars (length, log-likelihood, entropy, first token)",
    "positions": "the full-width states at four named positions per answer",
    "generations": "captured Generation records (tokens, log-probs, entropies)",
    "attention": "the same records with the captured attention entries (RAUQ, TAD)",
    "verification": "(question, answer) pairs to verify",
    "samples": "answers sampled again per prompt (kept in the store's samples table)",
    "dense": "the dense per-layer hidden states (8, 100, D) per answer",
    "model": "the generator itself, loaded once",
    "judge": "an entailment judge, cached by prompt",
}


@dataclass(frozen=True)
class ScoreResult:
    """Scores for N rows, aligned with the inputs."""

    confidence: np.ndarray  # (N,) float64, higher = more likely correct
    raw: np.ndarray  # (N,) float64, the upstream quantity as its authors report it
    raw_name: str  # e.g. "log_perplexity", "semantic_entropy", "rauq_uncertainty"
    details: dict[str, Any] = field(default_factory=dict)  # per-method settings to record


class Scorer(Protocol):
    """fit (a no-op for unsupervised methods) then score, like a scikit-learn estimator."""

    name: ClassVar[str]
    supervised: ClassVar[bool]
    requires: tuple[str, ...]  # what it reads, from `INPUTS`, e.g. ("generations", "attention")
    probability: bool  # the confidence estimates p(correct) (after fit, for supervised ones)

    def fit(
        self,
        train: Sequence[Any],
        y_train: np.ndarray,
        val: Sequence[Any] | None = None,
        y_val: np.ndarray | None = None,
    ) -> Scorer: ...

    def score(self, rows: Sequence[Any]) -> ScoreResult: ...


def row_input(requires: Sequence[str]) -> str:
    """The row input a scorer reads: the most specific one it requires."""
    unknown = sorted(set(requires) - set(INPUTS))
    if unknown:
        raise ValueError(f"unknown inputs {unknown}; known: {', '.join(INPUTS)}")
    for name in ROW_INPUTS:
        if name in requires:
            return name
    raise ValueError(f"requires {tuple(requires)} names no row input ({', '.join(ROW_INPUTS)})")


def negate(uncertainty: np.ndarray) -> np.ndarray:
    """The one place an uncertainty becomes a confidence."""
    return -np.asarray(uncertainty, dtype=np.float64)


# raw names of stored results that estimate p(correct) (records written before `probability`)
PROBABILITY_RAW_NAMES = ("neg_log_p_true", "p_correct_from_length", "p_correct")


def is_probability(record: dict, confidence: np.ndarray) -> bool:
    """ECE applies when the method estimates p(correct) and every value lies in [0, 1]."""
    estimates_p = record.get("probability")
    if estimates_p is None:  # stored by an earlier actmap
        raw_name = str(record.get("raw_name", "")).removeprefix("permuted_")
        estimates_p = raw_name in PROBABILITY_RAW_NAMES or (
            raw_name == "tad_uncertainty" and record.get("details", {}).get("aggregation") == "mean"
        )
    return estimates_p and bool(np.all((confidence >= 0) & (confidence <= 1)))
