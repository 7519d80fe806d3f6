"""Evaluation metrics over confidences (SPEC section 6).

Convention: `scores` / `probs` are p(correct) or a monotone equivalent, higher =
more likely correct; `labels` are 1 for a correct answer and 0 otherwise. The
correct class is the positive class for AUROC and AUPRC.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize_scalar
from sklearn.metrics import average_precision_score, roc_auc_score

from actmap.scoring.prior import shift_to_prevalence, sigmoid


def _check_scores_labels(scores, labels, *, both_classes: bool = False) -> tuple[np.ndarray, ...]:
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels)
    if s.ndim != 1 or y.ndim != 1:
        raise ValueError(f"scores and labels must be 1-D, got shapes {s.shape} and {y.shape}")
    if len(s) != len(y):
        raise ValueError(f"scores has {len(s)} rows but labels has {len(y)}")
    if len(s) == 0:
        raise ValueError("scores and labels are empty")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores contain NaN or infinite values")
    if not np.all((y == 0) | (y == 1)):
        raise ValueError(f"labels must be 0 or 1, got values {np.unique(y)[:10].tolist()}")
    y = y.astype(np.int64)
    if both_classes and len(np.unique(y)) < 2:
        raise ValueError("labels contain a single class; the metric needs correct and incorrect")
    return s, y


def auroc(scores, labels) -> float:
    """Area under the ROC curve with correct (1) as the positive class."""
    s, y = _check_scores_labels(scores, labels, both_classes=True)
    return float(roc_auc_score(y, s))


def auprc(scores, labels) -> float:
    """Average precision with correct (1) as the positive class."""
    s, y = _check_scores_labels(scores, labels, both_classes=True)
    return float(average_precision_score(y, s))


def ece(probs, labels, n_bins: int = 10) -> float:
    """Expected calibration error over equal-width bins of p(correct).

    Bins are [0, 1/n), [1/n, 2/n), ..., [(n-1)/n, 1], with p = 1 in the last.
    ECE = sum over bins of (n_bin / N) * |fraction correct - mean p(correct)|.
    """
    p, y = _check_scores_labels(probs, labels)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    if p.min() < 0.0 or p.max() > 1.0:
        raise ValueError("probs must lie in [0, 1]")
    bins = np.minimum(np.floor(p * n_bins).astype(np.int64), n_bins - 1)
    total = 0.0
    for b in np.unique(bins):
        in_bin = bins == b
        total += in_bin.sum() / len(p) * abs(y[in_bin].mean() - p[in_bin].mean())
    return float(total)


def natural_ece(
    probs,
    labels,
    deployment_prevalence: float,
    calibrated_prevalence: float = 0.5,
    n_bins: int = 10,
) -> tuple[float, float]:
    """(raw, prior-corrected) ECE of p(correct) on rows at their natural prevalence.

    ``calibrated_prevalence`` is the prior the probabilities hold at (0.5 for a detector
    trained on balanced rows or with class weights); the corrected ECE shifts them to
    ``deployment_prevalence`` first (`actmap.scoring.prior.shift_to_prevalence`), which should be
    known without these rows' labels (e.g. the training split's accuracy).
    """
    shifted = shift_to_prevalence(probs, deployment_prevalence, calibrated_prevalence)
    return ece(probs, labels, n_bins), ece(shifted, labels, n_bins)


def _rejection_area(quality_sorted: np.ndarray, n_rejected: int) -> float:
    """Area under the prediction-rejection curve: the mean quality of the answers kept when
    the ``j`` least confident are rejected, summed over j = 0 .. n_rejected - 1, over n."""
    n = len(quality_sorted)
    kept_mean = np.cumsum(quality_sorted) / np.arange(1, n + 1)  # [k - 1]: the k most confident
    return float(kept_mean[::-1][:n_rejected].sum() / n)


def prr(scores, labels, max_rejection: float = 0.5) -> float:
    """Prediction rejection ratio (LM-Polygraph's PRR, the RAUQ and TAD papers' metric).

    Reject answers from the least confident up, to ``max_rejection`` of them; the area under
    the curve of the kept answers' accuracy (`_rejection_area`) is read between a random
    order (0: the accuracy stays the prevalence) and the oracle (1: every incorrect answer
    rejected first): PRR = (area - random) / (oracle - random). Tied scores count their
    group's mean accuracy (what a random order within the tie gives on average)."""
    s, y = _check_scores_labels(scores, labels, both_classes=True)
    if not 0.0 < max_rejection <= 1.0:
        raise ValueError(f"max_rejection must be in (0, 1], got {max_rejection}")
    n = len(s)
    n_rejected = int(max_rejection * n)
    if n_rejected < 2:
        raise ValueError(f"PRR needs at least 2 rejected rows; {n} rows reject {n_rejected}")
    order = np.argsort(-s, kind="stable")
    ranked = s[order]
    group = np.cumsum(np.r_[True, ranked[1:] != ranked[:-1]]) - 1
    quality = y[order].astype(np.float64)
    quality = (np.bincount(group, quality) / np.bincount(group))[group]
    area = _rejection_area(quality, n_rejected)
    oracle = _rejection_area(np.sort(y)[::-1].astype(np.float64), n_rejected)
    random = float(y.mean()) * n_rejected / n
    return (area - random) / (oracle - random)


# the per-seed test metrics a run summarises (mean and std over seeds)
SUMMARY_METRICS = ("auroc", "auprc", "ece", "coverage_at_5pct_risk", "risk_at_80pct_coverage")


def seed_summary(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation with ddof=1) over seeds; std is NaN for one value."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError(f"seed_summary needs a non-empty 1-D sequence, got shape {v.shape}")
    std = float(np.std(v, ddof=1)) if len(v) > 1 else math.nan
    return float(np.mean(v)), std


def risk_coverage_curve(scores, labels) -> tuple[np.ndarray, np.ndarray]:
    """Selective prediction: accept answers from the most confident down.

    Returns (coverage, risk) at every distinct confidence threshold: coverage is
    the accepted fraction, risk the error rate among accepted answers. Tied
    scores are accepted or rejected together, so a point exists only after the
    last member of each tie group.
    """
    s, y = _check_scores_labels(scores, labels)
    order = np.argsort(-s, kind="stable")
    s_sorted, errors = s[order], 1 - y[order]
    accepted = np.arange(1, len(s) + 1)
    risk = np.cumsum(errors) / accepted
    last_of_group = np.r_[s_sorted[1:] != s_sorted[:-1], True]
    return accepted[last_of_group] / len(s), risk[last_of_group]


def coverage_at_risk(scores, labels, target: float = 0.05) -> float:
    """Largest coverage whose risk is at most `target`; 0.0 when no threshold reaches it."""
    coverage, risk = risk_coverage_curve(scores, labels)
    ok = risk <= target + 1e-12
    return float(coverage[ok].max()) if ok.any() else 0.0


def risk_at_coverage(scores, labels, coverage: float = 0.8) -> float:
    """Risk at the first threshold whose coverage reaches `coverage`."""
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    cov, risk = risk_coverage_curve(scores, labels)
    return float(risk[np.argmax(cov >= coverage - 1e-12)])


def _nll(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    z = logits / temperature
    return float(np.mean(np.logaddexp(0.0, z) - labels * z))  # BCE with logits


def fit_temperature(logits, labels) -> float:
    """Temperature T minimising the NLL of sigmoid(logit / T); searched on log T in [-7, 7]."""
    z, y = _check_scores_labels(logits, labels)
    result = minimize_scalar(
        lambda log_t: _nll(z, y, math.exp(log_t)),
        bounds=(-7.0, 7.0),
        method="bounded",
        options={"xatol": 1e-8},
    )
    return float(math.exp(result.x))


def temperature_scaled_ece(logits, labels, seed: int = 0, n_bins: int = 10) -> dict[str, float]:
    """Fit T on a random half of the rows, report ECE on the other half before and after."""
    z, y = _check_scores_labels(logits, labels)
    if len(z) < 4:
        raise ValueError(f"temperature scaling needs at least 4 rows, got {len(z)}")
    order = np.random.default_rng(seed).permutation(len(z))
    fit_rows, eval_rows = order[: len(z) // 2], order[len(z) // 2 :]
    t = fit_temperature(z[fit_rows], y[fit_rows])
    return {
        "temperature": t,
        "ece_before": ece(sigmoid(z[eval_rows]), y[eval_rows], n_bins),
        "ece_after": ece(sigmoid(z[eval_rows] / t), y[eval_rows], n_bins),
        "n_fit": len(fit_rows),
        "n_eval": len(eval_rows),
    }


@dataclass(frozen=True)
class BinaryMetrics:
    """The paper's per-seed headline metrics."""

    auroc: float
    auprc: float
    ece: float  # 10 equal-width bins


def compute_metrics(p_correct, labels) -> BinaryMetrics:
    return BinaryMetrics(
        auroc=auroc(p_correct, labels), auprc=auprc(p_correct, labels), ece=ece(p_correct, labels)
    )
