"""The one scorer contract every baseline honours.

Every scorer returns a *confidence*: higher = more likely correct. Upstream
uncertainties U are negated here, once, and the raw upstream value is kept
beside it so numbers can be compared with the authors' own.

Inputs differ by family (a captured `Generation`, sampled answers, a dense
activation tensor); each family defines its own typed input and the scorer
declares which store tables it needs in `requires`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np


class BaselineUnavailable(RuntimeError):
    """A method cannot run here (missing weights, missing captured features); the message says why."""


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
    requires: ClassVar[tuple[str, ...]]  # store tables read, e.g. ("generations", "attention")

    def fit(
        self,
        train: Sequence[Any],
        y_train: np.ndarray,
        val: Sequence[Any] | None = None,
        y_val: np.ndarray | None = None,
    ) -> Scorer: ...

    def score(self, rows: Sequence[Any]) -> ScoreResult: ...


def negate(uncertainty: np.ndarray) -> np.ndarray:
    """The one place an uncertainty becomes a confidence."""
    return -np.asarray(uncertainty, dtype=np.float64)
