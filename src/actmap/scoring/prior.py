"""Prior (prevalence) correction of p(correct) for a deployment whose accuracy differs from training.

Detectors are trained on balanced rows: their p(correct) is a posterior under a
training prevalence of ``pi_t = 0.5``. Where the generator is right a fraction
``pi`` of the time, Bayes' rule with the class-conditional densities unchanged
("label shift") gives the deployment posterior as a shift of the logit::

    logit p' = logit p + logit(pi) - logit(pi_t)

(`shift_to_prevalence`). When ``pi`` is unknown it can be estimated from
unlabelled deployment scores alone with the EM procedure of Saerens, Latinne and
Decaestecker (2002), "Adjusting the outputs of a classifier to new a priori
probabilities: a simple procedure", Neural Computation 14(1):21-41
(`em_prevalence`): alternate the prior shift above with re-estimating ``pi`` as
the mean of the shifted posteriors, until ``pi`` stops moving.

Everything here is a pure function of numpy arrays; scores are p(correct),
higher = more likely correct.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BALANCED = 0.5  # the training prevalence of detectors fitted on balanced rows
_EPS = 1e-12  # keeps logits finite for p in {0, 1}


def _check_prevalence(value: float, name: str) -> float:
    value = float(value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")
    return value


def _check_probs(probs) -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"probs must be 1-D, got shape {p.shape}")
    if not np.all(np.isfinite(p)) or (p.size and (p.min() < 0.0 or p.max() > 1.0)):
        raise ValueError("probs must be finite and lie in [0, 1]")
    return p


def logit(p) -> np.ndarray:
    p = np.clip(np.asarray(p, dtype=np.float64), _EPS, 1.0 - _EPS)
    return np.log(p) - np.log1p(-p)


def sigmoid(z) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(z, dtype=np.float64)))  # overflow-free


def shift_to_prevalence(probs, prevalence: float, train_prevalence: float = BALANCED) -> np.ndarray:
    """p(correct) under deployment prevalence ``prevalence`` from p under ``train_prevalence``.

    ``logit p' = logit p + logit(prevalence) - logit(train_prevalence)``; monotone in p,
    so rankings (AUROC) are unchanged and only calibration moves.
    """
    p = _check_probs(probs)
    pi = _check_prevalence(prevalence, "prevalence")
    pi_t = _check_prevalence(train_prevalence, "train_prevalence")
    shift = np.log(pi / (1.0 - pi)) - np.log(pi_t / (1.0 - pi_t))
    return sigmoid(logit(p) + shift)


@dataclass(frozen=True)
class PrevalenceEstimate:
    """The result of `em_prevalence`."""

    prevalence: float  # estimated deployment fraction correct
    probs: np.ndarray  # (N,) the scores shifted to that prevalence
    n_iter: int
    converged: bool


def em_prevalence(
    probs,
    train_prevalence: float = BALANCED,
    tol: float = 1e-6,
    max_iter: int = 1000,
) -> PrevalenceEstimate:
    """Saerens-Latinne-Decaestecker EM estimate of the deployment prevalence.

    ``probs`` are p(correct) of unlabelled deployment answers under the training
    prevalence. Starting from ``pi = train_prevalence``: shift every score to ``pi``
    (E step), set ``pi`` to their mean (M step), repeat until ``|delta pi| < tol``.
    The fixed point maximises the likelihood of the unlabelled scores over ``pi``.
    """
    p = _check_probs(probs)
    if p.size == 0:
        raise ValueError("em_prevalence needs at least one score")
    pi_t = _check_prevalence(train_prevalence, "train_prevalence")
    if tol <= 0 or max_iter < 1:
        raise ValueError(f"need tol > 0 and max_iter >= 1, got tol={tol}, max_iter={max_iter}")
    # the posteriors' likelihood ratios under the training prior, computed once
    ratio_correct = p / pi_t
    ratio_wrong = (1.0 - p) / (1.0 - pi_t)
    pi = pi_t
    for n_iter in range(1, max_iter + 1):
        numerator = pi * ratio_correct
        shifted = numerator / np.maximum(numerator + (1.0 - pi) * ratio_wrong, _EPS)
        new_pi = float(np.clip(shifted.mean(), _EPS, 1.0 - _EPS))
        moved, pi = abs(new_pi - pi), new_pi
        if moved < tol:
            return PrevalenceEstimate(pi, shift_to_prevalence(p, pi, pi_t), n_iter, True)
    return PrevalenceEstimate(pi, shift_to_prevalence(p, pi, pi_t), max_iter, False)
