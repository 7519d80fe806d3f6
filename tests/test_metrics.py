"""actmap.scoring.metrics against sklearn, naive loops and hand-computed values."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

from actmap.scoring import metrics


def naive_auroc(scores, labels) -> float:
    """P(score of a correct answer > score of an incorrect one), ties count one half."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auroc_and_auprc_by_hand():
    scores, labels = [0.9, 0.8, 0.3, 0.1], [1, 0, 1, 0]
    # pairs (correct, incorrect): (.9,.8) (.9,.1) (.3,.1) ordered right, (.3,.8) wrong
    assert metrics.auroc(scores, labels) == pytest.approx(0.75)
    # precision at each correct answer: 1/1 and 2/3, each worth recall 1/2
    assert metrics.auprc(scores, labels) == pytest.approx(0.5 * 1 + 0.5 * 2 / 3)


def test_auroc_auprc_match_sklearn_and_naive_with_ties():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300)
    scores = np.round(rng.random(300) * 0.5 + 0.3 * labels, 1)  # coarse, so many ties
    assert metrics.auroc(scores, labels) == pytest.approx(roc_auc_score(labels, scores))
    assert metrics.auroc(scores, labels) == pytest.approx(naive_auroc(scores, labels))
    assert metrics.auprc(scores, labels) == pytest.approx(average_precision_score(labels, scores))


def test_correct_is_the_positive_class():
    scores, labels = np.array([0.9, 0.7, 0.2, 0.4]), np.array([1, 1, 0, 1])
    assert metrics.auroc(scores, labels) == pytest.approx(1.0)
    assert metrics.auroc(-scores, labels) == pytest.approx(0.0)


def test_ece_by_hand():
    probs, labels = [0.05, 0.15, 0.18, 0.95, 1.0], [0, 1, 0, 1, 1]
    # bin 0: {.05} acc 0 conf .05; bin 1: {.15, .18} acc .5 conf .165; bin 9: {.95, 1.0} acc 1
    expected = 1 / 5 * 0.05 + 2 / 5 * abs(0.5 - 0.165) + 2 / 5 * abs(1 - 0.975)
    assert metrics.ece(probs, labels) == pytest.approx(expected)


def test_ece_bin_edges_are_left_closed():
    # 0.1 belongs to [0.1, 0.2) with 0.19: one bin, |0.5 - 0.145|
    assert metrics.ece([0.1, 0.19], [0, 1]) == pytest.approx(0.355)
    # with one bin ECE is |accuracy - mean confidence|
    assert metrics.ece([0.2, 0.9, 0.6], [1, 1, 0], n_bins=1) == pytest.approx(abs(2 / 3 - 1.7 / 3))


def test_ece_matches_naive_loop():
    rng = np.random.default_rng(1)
    p, y = rng.random(500), rng.integers(0, 2, 500)
    expected = 0.0
    for b in range(10):
        lo, hi = b / 10, (b + 1) / 10
        rows = [i for i in range(500) if lo <= p[i] < hi or (b == 9 and p[i] == 1.0)]
        if rows:
            expected += len(rows) / 500 * abs(y[rows].mean() - p[rows].mean())
    assert metrics.ece(p, y) == pytest.approx(expected)


def test_seed_summary_uses_sample_std():
    mean, std = metrics.seed_summary([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0)
    assert std == pytest.approx(1.0)  # ddof=1; population std would be 0.816
    assert math.isnan(metrics.seed_summary([0.7])[1])


def test_risk_coverage_on_hand_sorted_list():
    scores, labels = [0.9, 0.8, 0.7, 0.6, 0.5], [1, 1, 0, 1, 0]
    coverage, risk = metrics.risk_coverage_curve(scores, labels)
    np.testing.assert_allclose(coverage, [0.2, 0.4, 0.6, 0.8, 1.0])
    np.testing.assert_allclose(risk, [0, 0, 1 / 3, 1 / 4, 2 / 5])
    assert metrics.coverage_at_risk(scores, labels, 0.05) == pytest.approx(0.4)
    assert metrics.coverage_at_risk(scores, labels, 0.25) == pytest.approx(0.8)
    assert metrics.coverage_at_risk(scores, labels, 0.4) == pytest.approx(1.0)
    assert metrics.risk_at_coverage(scores, labels, 0.8) == pytest.approx(0.25)
    assert metrics.risk_at_coverage(scores, labels, 0.5) == pytest.approx(1 / 3)
    # order of the input rows does not matter
    perm = [3, 0, 4, 2, 1]
    shuffled = [scores[i] for i in perm], [labels[i] for i in perm]
    assert metrics.coverage_at_risk(*shuffled, 0.25) == pytest.approx(0.8)


def test_risk_coverage_accepts_ties_together():
    coverage, risk = metrics.risk_coverage_curve([0.9, 0.9, 0.5], [1, 0, 1])
    np.testing.assert_allclose(coverage, [2 / 3, 1.0])
    np.testing.assert_allclose(risk, [0.5, 1 / 3])
    assert metrics.coverage_at_risk([0.9, 0.9, 0.5], [1, 0, 1], 0.05) == 0.0


def test_fit_temperature_recovers_known_temperature():
    rng = np.random.default_rng(2)
    z = rng.normal(0.0, 2.0, 40_000)
    labels = (rng.random(40_000) < 1 / (1 + np.exp(-z))).astype(int)
    t_true = 2.5
    logits = z * t_true  # sigmoid(logit / t_true) is calibrated
    assert metrics.fit_temperature(logits, labels) == pytest.approx(t_true, rel=0.04)


def test_fit_temperature_minimises_nll_on_a_grid():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, 200)
    labels = (rng.random(200) < 1 / (1 + np.exp(-logits / 1.7))).astype(int)

    def nll(t):
        p = 1 / (1 + np.exp(-logits / t))
        return -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))

    grid = np.exp(np.linspace(-1, 3, 20_001))
    best = grid[np.argmin([nll(t) for t in grid])]
    assert metrics.fit_temperature(logits, labels) == pytest.approx(best, rel=1e-3)


def test_temperature_scaled_ece_halves_and_improves_overconfidence():
    rng = np.random.default_rng(4)
    z = rng.normal(0.0, 1.5, 6_001)
    labels = (rng.random(6_001) < 1 / (1 + np.exp(-z))).astype(int)
    out = metrics.temperature_scaled_ece(z * 4.0, labels, seed=0)
    assert out["n_fit"] + out["n_eval"] == 6_001 and out["n_fit"] == 3_000
    assert out["temperature"] == pytest.approx(4.0, rel=0.1)
    assert out["ece_after"] < 0.03 < out["ece_before"]
    assert metrics.temperature_scaled_ece(z * 4.0, labels, seed=0) == out
    assert metrics.temperature_scaled_ece(z * 4.0, labels, seed=1) != out


def test_compute_metrics_bundles_the_three():
    rng = np.random.default_rng(5)
    p, y = rng.random(100), rng.integers(0, 2, 100)
    m = metrics.compute_metrics(p, y)
    assert m == metrics.BinaryMetrics(metrics.auroc(p, y), metrics.auprc(p, y), metrics.ece(p, y))


@pytest.mark.parametrize(
    ("scores", "labels", "match"),
    [
        ([0.1, 0.2], [1, 0, 1], "rows"),
        ([0.1, float("nan")], [1, 0], "NaN"),
        ([0.1, 0.2], [1, 2], "0 or 1"),
        ([[0.1, 0.2]], [[1, 0]], "1-D"),
        ([0.1, 0.2], [1, 1], "single class"),
    ],
)
def test_bad_input_is_rejected(scores, labels, match):
    with pytest.raises(ValueError, match=match):
        metrics.auroc(scores, labels)


def test_ece_rejects_probabilities_outside_unit_interval():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        metrics.ece([0.5, 1.2], [1, 0])


def test_natural_ece_raw_and_prior_corrected_by_hand():
    from actmap.scoring.metrics import natural_ece

    labels = np.array([1, 0, 0, 0, 0] * 4)  # 20% correct
    probs = np.full(20, 0.5)  # a balanced detector that knows nothing
    raw, corrected = natural_ece(probs, labels, deployment_prevalence=0.2)
    assert raw == pytest.approx(0.3)  # |0.2 - 0.5|
    assert corrected == pytest.approx(0.0, abs=1e-12)  # shifted to exactly 0.2
