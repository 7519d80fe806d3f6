"""The decision policy: bands, fitting on a hand-computed risk-coverage curve, TOML files."""

from __future__ import annotations

import math

import numpy as np
import pytest

from actmap.scoring.prior import shift_to_prevalence
from actmap.serve.policy import (
    Policy,
    PriorSetting,
    correct_prior,
    decide,
    fit_policy,
    load_policy,
    save_policy,
    threshold_for_risk,
)

# accepted from the top: coverage 0.2 0.4 0.6 0.8 1.0 with risk 0 0 1/3 1/4 2/5
SCORES = [0.9, 0.8, 0.7, 0.6, 0.5]
LABELS = [1, 1, 0, 1, 0]


@pytest.mark.parametrize(
    "target, threshold, coverage, risk",
    [
        (0.25, 0.6, 0.8, 0.25),
        (0.1, 0.8, 0.4, 0.0),
        (0.0, 0.8, 0.4, 0.0),
        (0.3, 0.6, 0.8, 0.25),  # 1/3 at 0.6 coverage is above 0.3, 1/4 at 0.8 is not
        (0.4, 0.5, 1.0, 0.4),
    ],
)
def test_threshold_on_hand_computed_curve(target, threshold, coverage, risk):
    got = threshold_for_risk(SCORES, LABELS, target)
    assert got == pytest.approx((threshold, coverage, risk))
    # accepting p >= threshold gives exactly that coverage and risk
    accepted = np.asarray(SCORES) >= got[0]
    assert accepted.mean() == pytest.approx(coverage)
    assert 1 - np.asarray(LABELS)[accepted].mean() == pytest.approx(risk)


def test_threshold_unreachable_and_ties():
    assert threshold_for_risk([0.9, 0.5], [0, 1], 0.1) == (math.inf, 0.0, 0.0)
    # the tied pair at 0.9 goes together: risk 1/2 at coverage 2/3, 1/3 at coverage 1
    assert threshold_for_risk([0.9, 0.9, 0.5], [1, 0, 1], 0.4) == pytest.approx((0.5, 1.0, 1 / 3))
    assert threshold_for_risk([0.9, 0.9, 0.5], [1, 0, 1], 0.2)[0] == math.inf


def test_fit_policy_bands_and_decisions():
    policy = fit_policy(SCORES, LABELS, target_risk=0.1, review_risk=0.25, route_risk=0.4)
    assert (policy.accept, policy.review, policy.route) == (0.8, 0.6, 0.5)
    assert policy.fitted["accept"] == {"target_risk": 0.1, "coverage": 0.4, "risk": 0.0}
    assert policy.fitted["review"] == {"target_risk": 0.25, "coverage": 0.8, "risk": 0.25}
    assert policy.fitted["n"] == 5 and policy.fitted["accuracy"] == pytest.approx(0.6)
    assert [decide(p, policy) for p in (0.95, 0.8, 0.7, 0.6, 0.55, 0.5, 0.1)] == [
        "accept",
        "accept",
        "review",
        "review",
        "route",
        "route",
        "abstain",
    ]
    only_accept = fit_policy(SCORES, LABELS, target_risk=0.25)
    assert only_accept.accept == only_accept.review == only_accept.route == 0.6
    assert decide(0.59, only_accept) == "abstain" and decide(0.6, only_accept) == "accept"
    with pytest.raises(ValueError, match="review risk 0.05 is below the accept risk 0.1"):
        fit_policy(SCORES, LABELS, target_risk=0.1, review_risk=0.05)


def test_policy_validation():
    with pytest.raises(ValueError, match="route <= review <= accept"):
        Policy(accept=0.5, review=0.7, route=0.1)
    with pytest.raises(ValueError, match="needs prior.deployment_accuracy"):
        PriorSetting(method="known")
    with pytest.raises(ValueError, match="none, known or em"):
        PriorSetting(method="magic")


def test_correct_prior_per_method():
    p = np.array([0.2, 0.5, 0.9])
    np.testing.assert_array_equal(correct_prior(p, PriorSetting()), p)
    known = PriorSetting(method="known", deployment_accuracy=0.3)
    np.testing.assert_allclose(correct_prior(p, known), shift_to_prevalence(p, 0.3))
    em = PriorSetting(method="em")
    np.testing.assert_array_equal(correct_prior(p, em, None), p)  # too few scores seen yet
    np.testing.assert_allclose(correct_prior(p, em, 0.7), shift_to_prevalence(p, 0.7))
    # a temperature divides the logit first: sigmoid(logit(p) / T), then the shift
    hot = PriorSetting(method="known", deployment_accuracy=0.3, temperature=2.0)
    cooled = 1 / (1 + np.exp(-np.log(p / (1 - p)) / 2))
    np.testing.assert_allclose(correct_prior(p, hot), shift_to_prevalence(cooled, 0.3))
    np.testing.assert_allclose(correct_prior(p, PriorSetting(temperature=2.0)), cooled)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        PriorSetting(temperature=0)


def test_toml_round_trip(tmp_path):
    policy = fit_policy(
        SCORES,
        LABELS,
        target_risk=0.0,
        review_risk=0.3,
        prior=PriorSetting(method="known", deployment_accuracy=0.35),
        about={"store": "/data/x", "run": "runs/mlp"},
    )
    path = save_policy(policy, tmp_path / "policy.toml")
    assert load_policy(path) == policy
    text = path.read_text()
    assert "[fitted.accept]" in text and "coverage = 0.4" in text
    unreachable = fit_policy([0.9, 0.5], [0, 1], target_risk=0.1)
    assert load_policy(save_policy(unreachable, tmp_path / "inf.toml")).accept == math.inf


def test_load_policy_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[thresholds]\naccept = 0.8\nreveiw = 0.5\n")
    with pytest.raises(
        ValueError, match=r"bad.toml: unknown key\(s\) in \[thresholds\]: \['reveiw'\]"
    ):
        load_policy(bad)
    bad.write_text("[thresholds\n")
    with pytest.raises(ValueError, match="bad.toml is not valid TOML"):
        load_policy(bad)
    bad.write_text("[thresholds]\naccept = 0.4\nreview = 0.6\n")
    with pytest.raises(ValueError, match="bad.toml: thresholds must satisfy"):
        load_policy(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy(tmp_path / "missing.toml")
    hand = tmp_path / "hand.toml"
    hand.write_text("[thresholds]\naccept = 0.9\nreview = 0.7\n\n[prior]\nmethod = 'em'\n")
    policy = load_policy(hand)
    assert (policy.accept, policy.review, policy.route) == (0.9, 0.7, 0.7)
    assert policy.prior.method == "em"
