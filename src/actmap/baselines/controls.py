"""Controls: an answer-length-only predictor and a permuted-label fit of any supervised scorer.

The paper's sanity checks: a detector fit to permuted labels falls to chance,
and the answer length alone stays well below the full map.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from actmap.baselines.registry import baseline_class
from actmap.scoring.contract import Scorer, ScoreResult, bundle_part


def answer_length(row: Any) -> int:
    """Number of answer tokens of a Generation (or any row with ``n_tokens`` or ``token_ids``)."""
    if hasattr(row, "n_tokens"):
        return int(row.n_tokens)
    if hasattr(row, "token_ids"):
        return len(row.token_ids)
    raise TypeError(f"cannot read an answer length from {type(row).__name__}")


def length_features(lengths: np.ndarray, features: str) -> np.ndarray:
    """(N,) token counts -> (N, 1) [n] or (N, 2) [n, log(1 + n)]."""
    n = np.asarray(lengths, dtype=np.float64).reshape(-1, 1)
    if features == "n":
        return n
    if features == "n_log":
        return np.hstack([n, np.log1p(n)])
    raise ValueError(f"features must be 'n' or 'n_log', got {features!r}")


class AnswerLengthPredictor:
    """Logistic regression on the answer's token count; confidence = predicted p(correct)."""

    name: ClassVar[str] = "answer_length"
    supervised: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("generations",)
    probability: ClassVar[bool] = True

    def __init__(self, features: str = "n_log", C: float = 1.0) -> None:
        self.features = features  # "n" or "n_log" ([n, log(1 + n)] lets the fit bend)
        self.C = C  # inverse L2 strength of the logistic regression

    def _x(self, inputs: Any) -> np.ndarray:
        rows = bundle_part(inputs, "generations", self.name)
        return length_features(np.array([answer_length(r) for r in rows]), self.features)

    def fit(self, inputs: Any, y: np.ndarray, val_inputs=None, y_val=None) -> AnswerLengthPredictor:
        """Fit on a `DetectorInputs` bundle's generations (or bare rows); no validation used."""
        x, y = self._x(inputs), np.asarray(y).astype(int)
        if len(x) != len(y):
            raise ValueError(f"train has {len(x)} rows but y_train has {len(y)}")
        self.model_ = make_pipeline(StandardScaler(), LogisticRegression(C=self.C)).fit(x, y)
        return self

    def predict_proba(self, inputs: Any) -> np.ndarray:
        """(N,) p(correct) from each answer's token count."""
        if not hasattr(self, "model_"):
            raise RuntimeError("AnswerLengthPredictor used before fit")
        return self.model_.predict_proba(self._x(inputs))[:, 1].astype(np.float64)

    def score(self, inputs: Any) -> ScoreResult:
        p = self.predict_proba(inputs)
        return ScoreResult(
            confidence=p,
            raw=p,
            raw_name="p_correct_from_length",
            details={"features": self.features, "C": self.C},
        )


def permute_labels(y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A random permutation of the label vector (same class counts, no link to the rows)."""
    return np.asarray(y)[rng.permutation(len(y))]


class PermutedLabelControl:
    """The method under test refit on permuted training labels, everything else fixed.

    ``inner`` is a scorer instance (deep-copied, never mutated) or a zero-argument
    factory. When the scorer makes choices on validation rows and can hand them
    over (``fixed_choices()``, e.g. TAD's Ridge alphas and aggregation), it is first
    fit on the real labels to make those choices, and the copy with the choices
    fixed is refit on the permuted training labels without validation labels.
    Otherwise (an ActMap detector, the length control) the scorer itself is fit on
    permuted training labels, and its validation labels are permuted too, so
    early stopping or any other selection sees no real label either.
    ``PermutedLabelControl.from_fitted(scorer)`` takes the choices of a scorer
    already fit on the real labels, so several permutation seeds share that one
    real-label fit (the same choices: the fit is deterministic) instead of
    repeating it per seed.

    What the control measures: the AUROC the method reaches without any link
    between rows and labels. A method that learns its signal from labels lands
    near 0.5 (average several ``seed``s: one permutation is one draw); a score
    that ranks answers by a label-free quantity (e.g. TAD's ``sum_log``, a sum of
    per-token log-confidences over the answer's length) keeps that ranking.
    """

    name: ClassVar[str] = "permuted_label"
    supervised: ClassVar[bool] = True
    requires: tuple[str, ...] = ()  # per instance: what the inner scorer reads

    def __init__(
        self, inner: Scorer | Callable[[], Scorer], seed: int = 0, choices_fixed: bool = False
    ) -> None:
        self.inner = inner
        self.seed = seed  # permutation seed, recorded with the scores
        self.requires = tuple(getattr(inner, "requires", ()))  # what the inner scorer reads
        # inner already carries the choices made on the real labels (`from_fitted`)
        self.choices_fixed = choices_fixed

    @classmethod
    def from_fitted(cls, fitted: Scorer, seed: int = 0) -> PermutedLabelControl:
        """The control of a scorer already fit on the real labels, with its choices fixed.

        ``fitted.fixed_choices()`` (an unfitted copy with the choices made on the real
        labels) is refit on permuted training labels; the real-label fit is not repeated.
        """
        if not hasattr(fitted, "fixed_choices"):
            raise TypeError(
                f"{type(fitted).__name__} has no fixed_choices(); use PermutedLabelControl(...)"
            )
        return cls(fitted.fixed_choices(), seed=seed, choices_fixed=True)

    @property
    def probability(self) -> bool:
        return bool(getattr(getattr(self, "scorer_", self.inner), "probability", False))

    @classmethod
    def from_inputs(cls, inputs) -> PermutedLabelControl:
        """Refits the supervised scorer ``options.permuted_inner`` on shuffled labels."""

        inner = inputs.options.permuted_inner
        if inner == cls.name or not baseline_class(inner).supervised:
            raise ValueError(f"permuted_label needs a supervised inner scorer, got {inner!r}")
        first = inputs.make_scorer(inner)  # fails early (e.g. missing attention), not inside fit
        control = cls(lambda: inputs.make_scorer(inner))
        control.requires = tuple(first.requires)
        return control

    def _make(self) -> Scorer:
        is_instance = not isinstance(self.inner, type) and hasattr(self.inner, "fit")
        if is_instance:
            return copy.deepcopy(self.inner)
        if callable(self.inner):
            return self.inner()  # a class or a factory function
        raise TypeError("inner must be a scorer or a factory returning one")

    def fit(self, train: Any, y_train: np.ndarray, val=None, y_val=None) -> PermutedLabelControl:
        """Fit the inner scorer on ``train`` (its input bundle, or bare rows) and permuted labels."""
        rng = np.random.default_rng(self.seed)
        self.y_train_permuted_ = permute_labels(y_train, rng)
        scorer = self._make()
        self.fixed_ = {}
        if self.choices_fixed:
            self.fixed_ = {k: v for k, v in vars(scorer).items() if not k.endswith("_")}
            self.scorer_ = scorer.fit(train, self.y_train_permuted_)
        elif hasattr(scorer, "fixed_choices"):
            fixed = scorer.fit(train, y_train, val, y_val).fixed_choices()  # choices: real labels
            self.fixed_ = {k: v for k, v in vars(fixed).items() if not k.endswith("_")}
            self.scorer_ = fixed.fit(train, self.y_train_permuted_)
        else:
            y_val_permuted = permute_labels(y_val, rng) if y_val is not None else None
            self.scorer_ = scorer.fit(train, self.y_train_permuted_, val, y_val_permuted)
        return self

    def _fitted(self) -> Scorer:
        if not hasattr(self, "scorer_"):
            raise RuntimeError("PermutedLabelControl used before fit")
        return self.scorer_

    def predict_proba(self, inputs: Any) -> np.ndarray:
        """The inner scorer's ``predict_proba`` after its permuted-label fit."""
        return self._fitted().predict_proba(inputs)

    def score(self, inputs: Any) -> ScoreResult:
        inner = self._fitted().score(inputs)
        details = {
            "seed": self.seed,
            "inner": getattr(self.scorer_, "name", type(self.scorer_).__name__),
            "fixed_on_real_labels": self.fixed_,
        }
        details["inner_details"] = inner.details
        return ScoreResult(inner.confidence, inner.raw, f"permuted_{inner.raw_name}", details)
