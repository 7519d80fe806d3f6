"""Prior correction: the logit shift against Bayes' rule, and SLD EM on known mixtures."""

from __future__ import annotations

import numpy as np
import pytest

from actmap.scoring.metrics import ece
from actmap.scoring.prior import em_prevalence, shift_to_prevalence


def bayes_shift(p, pi, pi_t):
    """Saerens et al. eq. (2.4) written out: re-weight each class's posterior by the prior ratio."""
    num = (pi / pi_t) * p
    return num / (num + ((1 - pi) / (1 - pi_t)) * (1 - p))


@pytest.mark.parametrize("pi, pi_t", [(0.3, 0.5), (0.9, 0.5), (0.2, 0.7), (0.5, 0.5)])
def test_shift_matches_bayes_rule(pi, pi_t):
    p = np.array([0.0, 1e-9, 0.01, 0.2, 0.5, 0.73, 0.99, 1.0 - 1e-9, 1.0])
    got = shift_to_prevalence(p, pi, pi_t)
    inner = slice(1, -1)  # the endpoints are clipped by 1e-12 to keep logits finite
    np.testing.assert_allclose(got[inner], bayes_shift(p, pi, pi_t)[inner], rtol=1e-9, atol=1e-12)
    assert got[0] < 1e-9 and got[-1] > 1 - 1e-9
    # p = 0.5 from a balanced detector becomes exactly the deployment prevalence
    assert shift_to_prevalence([0.5], pi, 0.5)[0] == pytest.approx(pi, abs=1e-12)


def test_shift_keeps_ranking_and_rejects_bad_prevalence():
    p = np.random.default_rng(0).uniform(size=200)
    q = shift_to_prevalence(p, 0.2)
    assert (np.argsort(p) == np.argsort(q)).all()
    for bad in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="prevalence must lie strictly between 0 and 1"):
            shift_to_prevalence(p, bad)
    with pytest.raises(ValueError, match="probs must be finite"):
        shift_to_prevalence([0.2, 1.3], 0.3)


def balanced_posteriors(labels, rng, separation=1.5):
    """Scores of a detector calibrated on balanced rows: x | y ~ N(+-mu, 1), p = sigmoid(2 mu x)."""
    x = rng.normal(np.where(labels == 1, separation, -separation), 1.0)
    return 1.0 / (1.0 + np.exp(-2 * separation * x))


@pytest.mark.parametrize("prevalence", [0.15, 0.5, 0.8])
def test_em_recovers_known_prevalence(prevalence):
    rng = np.random.default_rng(1)
    labels = (rng.uniform(size=20_000) < prevalence).astype(int)
    p = balanced_posteriors(labels, rng)
    result = em_prevalence(p)
    assert result.converged
    assert result.prevalence == pytest.approx(labels.mean(), abs=0.015)
    # its shifted scores are the closed-form shift to the estimate, and better calibrated
    np.testing.assert_allclose(result.probs, shift_to_prevalence(p, result.prevalence))
    if prevalence != 0.5:
        assert ece(result.probs, labels) < ece(p, labels) / 2


def test_em_fixed_point_is_self_consistent():
    rng = np.random.default_rng(2)
    p = balanced_posteriors((rng.uniform(size=3000) < 0.3).astype(int), rng)
    result = em_prevalence(p, tol=1e-10)
    # at the fixed point the estimate equals the mean of the scores shifted to it
    assert result.probs.mean() == pytest.approx(result.prevalence, abs=1e-8)


def test_em_input_errors():
    with pytest.raises(ValueError, match="at least one score"):
        em_prevalence([])
    with pytest.raises(ValueError, match="1-D"):
        em_prevalence(np.zeros((2, 2)))


def test_em_with_training_prior_03_recovers_a_hand_worked_prevalence():
    """Two kinds of answers, likelihood ratios f1/f0 of 4 (A: f1 .8, f0 .2) and 1/4 (B).

    At a true prevalence of .6, A is .6*.8 + .4*.2 = 56% of the rows and B 44%. A detector
    whose posteriors hold at a training prior of .3 scores A at .3*4 / (.3*4 + .7) = 12/19 and
    B at .3*.25 / (.3*.25 + .7) = 3/31. Shifted to .6, A is 2.4 / 2.8 = 6/7 and B .15 / .55 =
    3/11, whose mean .56*6/7 + .44*3/11 = .48 + .12 = .6: .6 is EM's fixed point (and the
    maximum of the concave likelihood of the mixture). Read as a balanced detector's scores
    (the division by the training prior dropped), the same rows give another estimate.
    """
    p = np.r_[np.full(56, 12 / 19), np.full(44, 3 / 31)]
    result = em_prevalence(p, train_prevalence=0.3, tol=1e-12)
    assert result.converged
    assert result.prevalence == pytest.approx(0.6, abs=1e-9)
    np.testing.assert_allclose(result.probs[[0, -1]], [6 / 7, 3 / 11], rtol=1e-9)
    assert abs(em_prevalence(p, tol=1e-12).prevalence - 0.6) > 0.05


def test_em_with_training_prior_03_on_a_simulated_mixture():
    """x | y ~ N(+-1.5, 1); a detector calibrated at a training prior of .3 scores
    sigmoid(3x + logit .3); deployed where 70% of answers are right."""
    rng = np.random.default_rng(4)
    labels = (rng.uniform(size=20_000) < 0.7).astype(int)
    x = rng.normal(np.where(labels == 1, 1.5, -1.5), 1.0)
    p = 1.0 / (1.0 + np.exp(-(3.0 * x + np.log(0.3 / 0.7))))
    result = em_prevalence(p, train_prevalence=0.3)
    assert result.prevalence == pytest.approx(labels.mean(), abs=0.015)
    np.testing.assert_allclose(result.probs, shift_to_prevalence(p, result.prevalence, 0.3))
    assert ece(result.probs, labels) < 0.02 < ece(p, labels)
