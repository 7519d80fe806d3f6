"""A store's labelled answers at their natural prevalence, scored by a detector: policy fitting
and the prior-correction check.

Detectors are trained and tested on balanced rows; a deployment sees the
generator's natural accuracy. `natural_scores` scores every labelled row of one
split (not only the balanced subset), which is what a policy is fitted on and
what prior correction is judged on (`prior_correction_ece`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from actmap.errors import ActmapUserError
from actmap.metrics import ece
from actmap.prior import em_prevalence, shift_to_prevalence
from actmap.serve.policy import Policy, PriorSetting, correct_prior, fit_policy
from actmap.store import MapStore


@dataclass(frozen=True)
class NaturalScores:
    ids: list[str]
    labels: np.ndarray  # (N,) 1 = correct
    p_raw: np.ndarray  # (N,) the detector's p(correct)
    split: str

    @property
    def accuracy(self) -> float:
        return float(self.labels.mean())


def natural_scores(store: MapStore, detector, split: str = "validation") -> NaturalScores:
    """Every labelled row of ``split`` scored by ``detector`` (a `LoadedDetector`)."""
    meta = store.metadata()
    rows = meta[(meta["split"] == split) & meta["label"].notna()]
    if rows.empty:
        raise ActmapUserError(f"{store.root} has no labelled rows in split '{split}'")
    labels = rows["label"].to_numpy().astype(np.int64)
    if len(np.unique(labels)) < 2:
        raise ActmapUserError(f"split '{split}' of {store.root} holds a single label; need both")
    ids = rows["id"].tolist()
    maps, _ = store.load_maps(ids)
    return NaturalScores(ids, labels, detector.predict_proba(maps), split)


def fit_policy_on_store(
    scores: NaturalScores,
    target_risk: float,
    review_risk: float | None = None,
    route_risk: float | None = None,
    prior: str = "known",
    deployment_accuracy: float | None = None,
    about: dict[str, Any] | None = None,
) -> Policy:
    """Fit thresholds on the corrected p(correct) of a split at natural prevalence.

    ``prior="known"`` shifts to ``deployment_accuracy`` (default: the split's own
    accuracy); ``"em"`` lets the server estimate it online, and the thresholds are fitted
    on the scores shifted to the split's EM estimate; ``"none"`` keeps raw scores.
    """
    if prior == "known":
        setting = PriorSetting("known", deployment_accuracy or scores.accuracy)
        fitted_on = correct_prior(scores.p_raw, setting)
    elif prior == "em":
        setting = PriorSetting("em")
        fitted_on = em_prevalence(scores.p_raw).probs
    elif prior == "none":
        setting = PriorSetting()
        fitted_on = scores.p_raw
    else:
        raise ActmapUserError(f"prior must be none, known or em, got {prior!r}")
    info = {"split": scores.split, **(about or {})}
    return fit_policy(fitted_on, scores.labels, target_risk, review_risk, route_risk, setting, info)


@dataclass(frozen=True)
class PriorCorrectionECE:
    """ECE of raw and prior-corrected p(correct) on one split at its natural prevalence."""

    n: int
    accuracy: float  # the split's natural fraction correct
    train_accuracy: float  # the "known" deployment accuracy used (from another split)
    em_prevalence: float  # estimated from the split's unlabelled scores
    ece_raw: float
    ece_known: float
    ece_em: float

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def prior_correction_ece(
    scores: NaturalScores, known_accuracy: float, n_bins: int = 10
) -> PriorCorrectionECE:
    """Raw vs corrected ECE; ``known_accuracy`` should come from labelled rows of another split."""
    estimate = em_prevalence(scores.p_raw)
    return PriorCorrectionECE(
        n=len(scores.labels),
        accuracy=scores.accuracy,
        train_accuracy=known_accuracy,
        em_prevalence=estimate.prevalence,
        ece_raw=ece(scores.p_raw, scores.labels, n_bins),
        ece_known=ece(shift_to_prevalence(scores.p_raw, known_accuracy), scores.labels, n_bins),
        ece_em=ece(estimate.probs, scores.labels, n_bins),
    )


def prevalence_shift_ece(
    p_raw, labels, prevalences=(0.1, 0.2, 0.3, 0.5, 0.7, 0.9), n: int = 1000, seed: int = 0
) -> list[dict[str, float]]:
    """Resample rows to each prevalence (with replacement) and compare ECE raw / known / EM."""
    p_raw, labels = np.asarray(p_raw, dtype=np.float64), np.asarray(labels)
    rng = np.random.default_rng(seed)
    right, wrong = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
    out = []
    for pi in prevalences:
        k = int(round(pi * n))
        rows = np.r_[rng.choice(right, k), rng.choice(wrong, n - k)]
        p, y = p_raw[rows], labels[rows]
        out.append(
            {
                "prevalence": float(pi),
                "ece_raw": ece(p, y),
                "ece_known": ece(shift_to_prevalence(p, pi), y),
                "em_prevalence": em_prevalence(p).prevalence,
                "ece_em": ece(em_prevalence(p).probs, y),
            }
        )
    return out
