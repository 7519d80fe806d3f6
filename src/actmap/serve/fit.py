"""A store's labelled answers at their natural prevalence, scored by a detector: policy fitting
and the prior-correction check.

Detectors are trained and tested on balanced rows; a deployment sees the
generator's natural accuracy. `natural_scores` scores every labelled row of one
split (not only the balanced subset), which is what a policy is fitted on and
what prior correction is judged on (`prior_correction_ece`). The logit shift
assumes calibrated posteriors at the training prevalence, so a temperature is
first fitted on the balanced validation rows (`fit_balanced_temperature`):
calibration before the shift is what makes EM work in practice (Alexandari,
Kundaje and Shrikumar 2020, "Maximum likelihood with bias-corrected calibration
is hard-to-beat at label shift adaptation").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from actmap.capture.answer_scalars import scalars_from_store
from actmap.data.splits import balanced_ids
from actmap.errors import ActmapUserError
from actmap.scoring.metrics import ece, fit_temperature
from actmap.scoring.prior import em_prevalence, logit, shift_to_prevalence, sigmoid
from actmap.serve.policy import Policy, PriorSetting, correct_prior, fit_policy
from actmap.store import MapStore
from actmap.store.rows import BALANCE_SEED


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
    return NaturalScores(ids, labels, score_rows(store, detector, ids), split)


def score_rows(store: MapStore, detector, ids: list[str]) -> np.ndarray:
    """Raw p(correct) of the store rows ``ids``: their maps, and their per-answer scalars
    (from the store's ``generations`` table) when the detector reads them."""
    maps, _ = store.load_maps(ids)
    scalars = scalars_from_store(store, ids) if detector.needs_scalars else None
    return detector.predict_proba(maps, scalars)


def balanced_scores(store: MapStore, detector, split: str = "validation") -> NaturalScores:
    """The balanced rows of ``split`` (the rows `actmap.store.rows.balanced_splits` gives), scored.

    Computed from the labels without writing the store's ``splits`` table.
    """
    meta = store.metadata().drop_duplicates("id", keep="last")
    labels = [None if np.isnan(x) else bool(x) for x in meta["label"].astype(float)]
    chosen = balanced_ids(meta["id"].tolist(), meta["split"].tolist(), labels, seed=BALANCE_SEED)
    ids = list(chosen.ids[split])
    if not ids:
        raise ActmapUserError(
            f"the balanced '{split}' split of {store.root} is empty (need both labels)"
        )
    labels = meta.set_index("id").loc[ids, "label"].to_numpy().astype(np.int64)
    return NaturalScores(ids, labels, score_rows(store, detector, ids), split)


def fit_balanced_temperature(scores: NaturalScores) -> float:
    """Temperature minimising the NLL of the detector's logits on balanced rows."""
    return fit_temperature(logit(scores.p_raw), scores.labels)


def fit_policy_on_store(
    scores: NaturalScores,
    target_risk: float,
    review_risk: float | None = None,
    route_risk: float | None = None,
    prior: str = "known",
    deployment_accuracy: float | None = None,
    about: dict[str, Any] | None = None,
    temperature: float = 1.0,
) -> Policy:
    """Fit thresholds on the corrected p(correct) of a split at natural prevalence.

    Scores are first calibrated with ``temperature``. ``prior="known"`` then shifts to
    ``deployment_accuracy`` (default: the split's own accuracy); ``"em"`` lets the server
    estimate it online, and the thresholds are fitted on the scores shifted to the split's
    EM estimate; ``"none"`` keeps the calibrated scores.
    """
    if prior == "known":
        setting = PriorSetting(
            "known", deployment_accuracy or scores.accuracy, temperature=temperature
        )
        fitted_on = correct_prior(scores.p_raw, setting)
    elif prior == "em":
        setting = PriorSetting("em", temperature=temperature)
        fitted_on = em_prevalence(correct_prior(scores.p_raw, setting)).probs
    elif prior == "none":
        setting = PriorSetting(temperature=temperature)
        fitted_on = correct_prior(scores.p_raw, setting)
    else:
        raise ActmapUserError(f"prior must be none, known or em, got {prior!r}")
    info = {"split": scores.split, **(about or {})}
    return fit_policy(fitted_on, scores.labels, target_risk, review_risk, route_risk, setting, info)


@dataclass(frozen=True)
class PriorCorrectionECE:
    """ECE of raw and prior-corrected p(correct) on one split at its natural prevalence."""

    n: int
    accuracy: float  # the split's natural fraction correct
    known_accuracy: float  # the "known" deployment accuracy used (from another split)
    temperature: float  # fitted on balanced validation rows (1.0: none)
    em_prevalence: float  # estimated from the split's unlabelled raw scores
    em_prevalence_calibrated: float  # ... from its calibrated scores
    ece_raw: float
    ece_known: float  # logit shift of the raw scores
    ece_em: float
    ece_calibrated: float  # temperature only
    ece_calibrated_known: float  # temperature, then the shift
    ece_calibrated_em: float

    def to_json(self) -> dict[str, float]:
        return asdict(self)


def prior_correction_ece(
    scores: NaturalScores, known_accuracy: float, temperature: float = 1.0, n_bins: int = 10
) -> PriorCorrectionECE:
    """Raw vs corrected ECE; ``known_accuracy`` should come from labelled rows of another split
    and ``temperature`` from the balanced validation rows."""
    y = scores.labels
    calibrated = sigmoid(logit(scores.p_raw) / temperature)
    raw_em, calibrated_em = em_prevalence(scores.p_raw), em_prevalence(calibrated)
    return PriorCorrectionECE(
        n=len(y),
        accuracy=scores.accuracy,
        known_accuracy=known_accuracy,
        temperature=temperature,
        em_prevalence=raw_em.prevalence,
        em_prevalence_calibrated=calibrated_em.prevalence,
        ece_raw=ece(scores.p_raw, y, n_bins),
        ece_known=ece(shift_to_prevalence(scores.p_raw, known_accuracy), y, n_bins),
        ece_em=ece(raw_em.probs, y, n_bins),
        ece_calibrated=ece(calibrated, y, n_bins),
        ece_calibrated_known=ece(shift_to_prevalence(calibrated, known_accuracy), y, n_bins),
        ece_calibrated_em=ece(calibrated_em.probs, y, n_bins),
    )


def prevalence_shift_ece(
    p_raw,
    labels,
    prevalences=(0.1, 0.2, 0.3, 0.5, 0.7, 0.9),
    n: int = 1000,
    seed: int = 0,
    temperature: float = 1.0,
) -> list[dict[str, float]]:
    """Resample rows to each prevalence (with replacement) and compare ECE raw / known / EM
    (the corrections start from the scores calibrated with ``temperature``)."""
    raw, labels = np.asarray(p_raw, dtype=np.float64), np.asarray(labels)
    calibrated = sigmoid(logit(raw) / temperature)
    rng = np.random.default_rng(seed)
    right, wrong = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
    out = []
    for pi in prevalences:
        k = int(round(pi * n))
        rows = np.r_[rng.choice(right, k), rng.choice(wrong, n - k)]
        p, y = calibrated[rows], labels[rows]
        estimate = em_prevalence(p)
        out.append(
            {
                "prevalence": float(pi),
                "ece_raw": ece(raw[rows], y),
                "ece_known": ece(shift_to_prevalence(p, pi), y),
                "em_prevalence": estimate.prevalence,
                "ece_em": ece(estimate.probs, y),
            }
        )
    return out
