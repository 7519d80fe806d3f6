"""A store's labelled answers at their natural prevalence, scored by a detector: policy fitting
and the prior-correction check.

Detectors are trained and tested on balanced rows; a deployment sees the
generator's natural accuracy. `natural_scores` scores every labelled row of one
split (not only the balanced subset; the rows `actmap.store.rows.natural_rows`
reads), which is what a policy is fitted on and what prior correction is judged
on (`prior_correction_ece`). The logit shift assumes calibrated posteriors at
the training prevalence, so a temperature is fitted first
(`fit_policy_temperature`, on labelled validation rows): calibration before the shift is what makes EM work in practice (Alexandari,
Kundaje and Shrikumar 2020, "Maximum likelihood with bias-corrected calibration
is hard-to-beat at label shift adaptation").

A policy is often fitted on few rows (the demo's validation split holds 28), so
`fit_policy_on_store` fits with its uncertainty: the temperature is a MAP
estimate (`fit_policy_temperature`: Platt's smoothed targets and a log-normal
prior on T, fitted on every labelled row of the split at its natural prevalence),
so a handful of separable rows cannot send T to 0 and scores to 0 or 1; the
temperature and each band's coverage and risk carry bootstrap intervals
(`policy_intervals`), written to the policy file; and fewer than
``MIN_POLICY_ROWS`` labelled rows is warned about. The scores are shifted from
the prior the detector's probabilities hold at (``train_prevalence``: 0.5 for
the paper's detectors, actmap-plus's ``calibrated_prevalence``), the same way
the server shifts them (`actmap.serve.engine`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.optimize import minimize_scalar

from actmap.detectors import check_stored_inputs, read_inputs
from actmap.errors import ActmapUserError
from actmap.scoring.intervals import N_RESAMPLES, Interval, resample_indices
from actmap.scoring.metrics import ece
from actmap.scoring.prior import BALANCED, em_prevalence, logit, shift_to_prevalence, sigmoid
from actmap.serve.policy import (
    Policy,
    PriorSetting,
    calibrate,
    correct_prior,
    fit_policy,
    policy_intervals,
)
from actmap.store import MapStore
from actmap.store.rows import Rows, balanced_rows, natural_rows
from actmap.store.served import current_sampling, is_served

log = logging.getLogger(__name__)

# below this many labelled rows a fitted policy is warned about: at a target risk of .05 the
# accepted rows' error rate is then known to no better than about +-.05 (binomial, 95%)
MIN_POLICY_ROWS = 100
# log T ~ N(0, sigma^2) a priori (T within [0.37, 2.7] at 95%): a few rows cannot move T far
TEMPERATURE_PRIOR_SIGMA = 0.5
_LOG_T_BOUND = 7.0  # search log T in [-7, 7], as `actmap.scoring.metrics.fit_temperature`
# rows scored at once (a stacked actmap-plus's position states: ~0.3 MB a row at 1.5B; a
# multiple of the recipe's eval batch, so a torch detector scores the same batches)
STORE_CHUNK = 512


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
    """Every labelled row of ``split`` (`actmap.store.rows.natural_rows`) scored by
    ``detector`` (a `LoadedDetector`); the split must hold both labels."""
    rows = natural_rows(store, (split,))[split]
    if len(np.unique(rows.labels)) < 2:
        raise ActmapUserError(f"split '{split}' of {store.root} holds a single label; need both")
    return scored(store, detector, rows, split)


def balanced_scores(store: MapStore, detector, split: str = "validation") -> NaturalScores:
    """The balanced rows of ``split`` (`actmap.store.rows.balanced_rows`), scored; the
    store's ``splits`` table is not written."""
    rows = balanced_rows(store, persist=False, splits=(split,))[split]
    return scored(store, detector, rows, split)


def scored(store: MapStore, detector, rows: Rows, split: str) -> NaturalScores:
    """``rows`` with the detector's raw p(correct) (`store_p_raw`)."""
    p_raw = store_p_raw(store, detector, rows)
    return NaturalScores(rows.row_ids(), rows.labels, p_raw, split)


def store_p_raw(store: MapStore, detector, rows: Rows, chunk: int = STORE_CHUNK) -> np.ndarray:
    """(N,) raw p(correct) of ``rows`` of ``store`` by ``detector`` (a `LoadedDetector`), from
    what it ``requires``, read by `actmap.detectors.read_inputs` (as training and
    compare-stacked read them): the maps, the per-answer scalars, the position states and the
    attention-carrying generations, ``chunk`` rows at a time."""
    check_stored_inputs(store, rows.row_ids(), detector.requires, getattr(detector, "id", None))
    parts = [
        detector.predict_proba(
            read_inputs(store, _row_slice(rows, start, chunk), detector.requires)
        )
        for start in range(0, len(rows), chunk)
    ]
    return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)


def _row_slice(rows: Rows, start: int, size: int) -> Rows:
    part = slice(start, start + size)
    scalars = None if rows.scalars is None else rows.scalars[part]
    return Rows(rows.row_ids()[part], rows.labels[part], rows.maps[part], scalars)


def detector_train_prevalence(detector) -> float:
    """The prior a detector's p(correct) holds at: actmap-plus's ``calibrated_prevalence_``
    (0.5 under class weights, its training rows' accuracy without), else 0.5 (the paper's
    detectors are trained on balanced rows)."""
    inner = getattr(detector, "detector", detector)  # a LoadedDetector or the estimator
    return float(getattr(inner, "calibrated_prevalence_", BALANCED))


def _temperature_objective(z, y, train_prevalence: float, sigma: float):
    """-log posterior of log T for logits ``z`` (n,) and 0/1 labels ``y`` (n,).

    The model is the server's: ``p = sigmoid(z / T + logit(pi) - logit(train_prevalence))``
    with ``pi`` the rows' own fraction correct (their natural prevalence). The labels are
    Platt's (1999) smoothed targets, (N+ + 1) / (N+ + 2) and 1 / (N- + 2), so separable rows
    keep a finite optimum, and log T has a N(0, sigma^2) prior. The returned function takes
    log T as a number or as a (G,) array (then it returns (G,) values).
    """
    n_pos = int(y.sum())
    n_neg = len(y) - n_pos
    target = np.where(y == 1, (n_pos + 1) / (n_pos + 2), 1 / (n_neg + 2))
    offset = math.log(n_pos / n_neg) - math.log(train_prevalence / (1 - train_prevalence))

    def objective(log_t):
        u = np.asarray(log_t, dtype=np.float64)
        q = np.multiply.outer(np.exp(-u), z) + offset  # (..., n)
        nll = (np.logaddexp(0.0, q) - target * q).sum(axis=-1)
        return nll + u**2 / (2 * sigma**2)

    return objective


def fit_policy_temperature(
    p_raw,
    labels,
    train_prevalence: float = BALANCED,
    sigma: float = TEMPERATURE_PRIOR_SIGMA,
    tol: float = 1e-8,
    near: float | None = None,
) -> float:
    """MAP temperature of raw p(correct) on labelled rows at their natural prevalence.

    See `_temperature_objective`. With thousands of rows it is the maximum-likelihood
    temperature; on a handful of rows it stays near 1 (``sigma`` sets how near), where the
    unregularised fit of separable rows runs to the bound (T = e^-7) and sends every score
    to 0 or 1. Needs both labels. ``tol`` is the search's tolerance on log T; ``near`` (a
    temperature) starts a downhill search there instead of scanning log T in [-7, 7] (the
    bootstrap starts each resample at the estimate on all rows).
    """
    z = logit(np.asarray(p_raw, dtype=np.float64))
    y = np.asarray(labels).astype(np.int64)
    if len(z) != len(y):
        raise ActmapUserError(f"{len(z)} scores but {len(y)} labels")
    if y.min(initial=1) == y.max(initial=0):
        raise ActmapUserError("a temperature needs labelled rows of both kinds (right and wrong)")
    if not sigma > 0:
        raise ActmapUserError(f"the prior's sigma must be > 0, got {sigma}")
    objective = _temperature_objective(z, y, train_prevalence, sigma)
    if near is not None:
        start = math.log(near)
        result = minimize_scalar(
            lambda u: float(objective(u)), bracket=(start - 0.05, start + 0.05), tol=tol
        )
        return float(math.exp(np.clip(result.x, -_LOG_T_BOUND, _LOG_T_BOUND)))
    # a coarse grid finds the basin, a bounded Brent search the optimum within it
    grid = np.linspace(-_LOG_T_BOUND, _LOG_T_BOUND, 57)  # step 0.25
    best = int(np.argmin(objective(grid)))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    result = minimize_scalar(
        lambda u: float(objective(u)), bounds=(low, high), method="bounded",
        options={"xatol": tol},
    )  # fmt: skip
    return float(math.exp(result.x))


def temperature_interval(
    p_raw,
    labels,
    train_prevalence: float = BALANCED,
    sigma: float = TEMPERATURE_PRIOR_SIGMA,
    n_resamples: int = N_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """`fit_policy_temperature` on all rows and its bootstrap percentile interval: the rows
    are resampled with replacement (resamples holding one label drawn again, as in
    `actmap.scoring.intervals`) and T refitted on each, by a downhill search from the estimate."""
    p, y = np.asarray(p_raw, dtype=np.float64), np.asarray(labels).astype(np.int64)
    estimate = fit_policy_temperature(p, y, train_prevalence, sigma)
    rng = np.random.default_rng(seed)
    idx, redrawn = resample_indices(y, n_resamples, rng, need_both=True)
    values = [
        fit_policy_temperature(p[i], y[i], train_prevalence, sigma, near=estimate) for i in idx
    ]
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return Interval(estimate, float(low), float(high), len(y), n_resamples, level, redrawn)


def fit_policy_on_store(
    scores: NaturalScores,
    target_risk: float,
    review_risk: float | None = None,
    route_risk: float | None = None,
    prior: str = "known",
    deployment_accuracy: float | None = None,
    about: dict[str, Any] | None = None,
    temperature: float | Interval = 1.0,
    train_prevalence: float = BALANCED,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
) -> Policy:
    """Fit thresholds on the corrected p(correct) of a split at natural prevalence.

    Scores are first calibrated with ``temperature`` (an `Interval` from
    `temperature_interval` is written to the file with its interval). ``prior="known"`` then
    shifts from ``train_prevalence`` to ``deployment_accuracy`` (default: the split's own
    accuracy); ``"em"`` lets the server estimate it online, and the thresholds are fitted on
    the scores shifted to the split's EM estimate, computed as the server does; ``"none"``
    keeps the calibrated scores. Each band's coverage and risk get bootstrap intervals
    (`policy_intervals`, ``n_resamples`` resamples; 0: none), and fewer than
    ``MIN_POLICY_ROWS`` rows a warning (logged, and kept in ``fitted["warning"]``).
    """
    t = temperature.estimate if isinstance(temperature, Interval) else float(temperature)
    if prior == "known":
        setting = PriorSetting(
            "known", deployment_accuracy or scores.accuracy, train_prevalence, temperature=t
        )
        fitted_on = correct_prior(scores.p_raw, setting)
    elif prior == "em":
        setting = PriorSetting("em", train_prevalence=train_prevalence, temperature=t)
        # the server's PrevalenceTracker: EM over the calibrated scores from the training prior
        fitted_on = em_prevalence(calibrate(scores.p_raw, setting), train_prevalence).probs
    elif prior == "none":
        setting = PriorSetting(train_prevalence=train_prevalence, temperature=t)
        fitted_on = correct_prior(scores.p_raw, setting)
    else:
        raise ActmapUserError(f"prior must be none, known or em, got {prior!r}")
    info: dict[str, Any] = {"split": scores.split, **(about or {})}
    n = len(scores.labels)
    if n < MIN_POLICY_ROWS:
        info["warning"] = (
            f"fitted on {n} labelled rows (fewer than {MIN_POLICY_ROWS}): the thresholds' "
            "risk and coverage are uncertain; read their intervals"
        )
        log.warning("policy %s", info["warning"])
    if isinstance(temperature, Interval):
        info["temperature"] = {
            "estimate": temperature.estimate, "low": temperature.low, "high": temperature.high,
            "n": temperature.n, "prior_sigma": TEMPERATURE_PRIOR_SIGMA,
        }  # fmt: skip
    policy = fit_policy(
        fitted_on, scores.labels, target_risk, review_risk, route_risk, setting, info
    )
    if n_resamples:
        bands = policy_intervals(policy, fitted_on, scores.labels, n_resamples, seed=seed)
        fitted = {k: ({**v, **bands[k]} if k in bands else v) for k, v in policy.fitted.items()}
        fitted["bootstrap"] = {"n_resamples": n_resamples, "level": 0.95, "seed": seed}
        policy = Policy(policy.accept, policy.review, policy.route, setting, fitted)
    return policy


@dataclass(frozen=True)
class FittedPolicy:
    """A policy fitted on a store (`fit_policy_from_store`) and what it was fitted from."""

    policy: Policy
    scores: NaturalScores  # the labelled rows at their natural prevalence, scored
    temperature: float | Interval  # 1.0 when not calibrated
    train_prevalence: float  # the prior the detector's p(correct) holds at


def fit_policy_from_store(
    store: MapStore,
    detector,
    target_risk: float,
    review_risk: float | None = None,
    route_risk: float | None = None,
    prior: str = "known",
    deployment_accuracy: float | None = None,
    split: str = "validation",
    calibrate: bool = True,
    train_prevalence: float | None = None,
    n_resamples: int = N_RESAMPLES,
    about: dict[str, Any] | None = None,
) -> FittedPolicy:
    """``actmap policy fit``: score every labelled row of ``split`` (`natural_scores`), fit
    a temperature (with its bootstrap interval when ``n_resamples``) unless ``calibrate`` is
    off, then the thresholds (`fit_policy_on_store`). ``train_prevalence`` defaults to the
    detector's own (`detector_train_prevalence`).

    An audit store's labelled rows are the ones `actmap.store.served.served_sampling`
    counts: by default only the review queue's uniform random sample, so a review band
    reviewed in full does not bias the natural prevalence, the temperature or the risks;
    the choice is recorded in the policy's ``fitted`` table."""
    scores = natural_scores(store, detector, split)
    if train_prevalence is None:
        train_prevalence = detector_train_prevalence(detector)
    temperature: float | Interval = 1.0
    if calibrate and n_resamples:
        temperature = temperature_interval(
            scores.p_raw, scores.labels, train_prevalence, n_resamples=n_resamples
        )
    elif calibrate:
        temperature = fit_policy_temperature(scores.p_raw, scores.labels, train_prevalence)
    about = dict(about or {})
    if is_served(store):
        about["sampling"] = current_sampling(store)
    policy = fit_policy_on_store(
        scores, target_risk, review_risk, route_risk, prior, deployment_accuracy, about,
        temperature, train_prevalence, n_resamples,
    )  # fmt: skip
    return FittedPolicy(policy, scores, temperature, train_prevalence)


@dataclass(frozen=True)
class PriorCorrectionECE:
    """ECE of raw and prior-corrected p(correct) on one split at its natural prevalence."""

    n: int
    accuracy: float  # the split's natural fraction correct
    known_accuracy: float  # the "known" deployment accuracy used (from another split)
    temperature: float  # fitted first (`fit_policy_temperature`; 1.0: none)
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
    and ``temperature`` from labelled validation rows (`fit_policy_temperature`)."""
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
