"""Scores at natural prevalence: policy fitting on a store and the prior-correction ECE check."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from test_cli_serve import imbalanced_store

from actmap.detectors import as_inputs
from actmap.scoring.intervals import Interval
from actmap.scoring.metrics import ece, fit_temperature
from actmap.scoring.prior import logit, shift_to_prevalence, sigmoid
from actmap.serve.engine import PrevalenceTracker
from actmap.serve.fit import (
    MIN_POLICY_ROWS,
    TEMPERATURE_PRIOR_SIGMA,
    NaturalScores,
    balanced_scores,
    detector_train_prevalence,
    fit_policy_on_store,
    fit_policy_temperature,
    natural_scores,
    prevalence_shift_ece,
    prior_correction_ece,
    temperature_interval,
)
from actmap.serve.policy import (
    PriorSetting,
    correct_prior,
    load_policy,
    policy_intervals,
    save_policy,
    threshold_for_risk,
)


class ChannelDetector:
    """p(correct) from the mean of channel 0 (the synthetic store puts the label there)."""

    requires = ("maps",)
    needs_scalars = False  # reads the map only, like a LoadedDetector of a paper detector

    def predict_proba(self, maps, scalars=None):
        maps = as_inputs(maps).maps  # a store's DetectorInputs, or bare maps
        x = np.asarray(maps, dtype=np.float64)[:, 0].mean(axis=(1, 2))
        return 1 / (1 + np.exp(-40 * (x - 0.15)))


def test_natural_scores_and_fit_on_store(tmp_path):
    store = imbalanced_store(tmp_path / "s", n=120)
    scores = natural_scores(store, ChannelDetector(), "validation")
    meta = store.metadata()
    rows = meta[meta["split"] == "validation"]
    assert scores.ids == rows["id"].tolist() and len(scores.ids) == 30
    assert scores.accuracy == pytest.approx(rows["label"].mean())
    maps, _ = store.load_maps(scores.ids)
    np.testing.assert_allclose(scores.p_raw, ChannelDetector().predict_proba(maps))
    policy = fit_policy_on_store(scores, 0.2, prior="known", about={"store": "s"})
    shifted = shift_to_prevalence(scores.p_raw, scores.accuracy)
    assert policy.accept == pytest.approx(threshold_for_risk(shifted, scores.labels, 0.2)[0])
    assert policy.fitted["store"] == "s" and policy.fitted["split"] == "validation"
    em = fit_policy_on_store(scores, 0.2, prior="em")
    expected = threshold_for_risk(served_scores(scores.p_raw, em.prior), scores.labels, 0.2)
    assert em.prior.method == "em" and em.accept == pytest.approx(expected[0])
    with pytest.raises(ValueError, match="prior must be none, known or em"):
        fit_policy_on_store(scores, 0.2, prior="bayes")


def calibrated_balanced(n, prevalence, rng, mu=1.0):
    y = (rng.uniform(size=n) < prevalence).astype(int)
    x = rng.normal(np.where(y == 1, mu, -mu), 1.0)
    return 1 / (1 + np.exp(-2 * mu * x)), y


def test_prior_correction_lowers_ece_at_natural_prevalence():
    rng = np.random.default_rng(0)
    p, y = calibrated_balanced(4000, 0.25, rng)
    scores = NaturalScores([str(i) for i in range(len(y))], y, p, "test")
    result = prior_correction_ece(scores, known_accuracy=0.25)
    assert result.ece_raw == pytest.approx(ece(p, y))
    assert result.ece_known == pytest.approx(ece(shift_to_prevalence(p, 0.25), y))
    assert result.ece_known < result.ece_raw / 3 and result.ece_em < result.ece_raw / 3
    assert result.em_prevalence == pytest.approx(y.mean(), abs=0.03)


def test_prevalence_shift_simulation():
    rng = np.random.default_rng(1)
    p, y = calibrated_balanced(6000, 0.5, rng)
    rows = prevalence_shift_ece(p, y, prevalences=(0.1, 0.5, 0.9), n=2000)
    by = {r["prevalence"]: r for r in rows}
    assert by[0.5]["ece_known"] == pytest.approx(by[0.5]["ece_raw"])  # no shift at 0.5
    for pi in (0.1, 0.9):
        assert by[pi]["ece_known"] < by[pi]["ece_raw"] / 2
        assert by[pi]["em_prevalence"] == pytest.approx(pi, abs=0.04)


def test_temperature_first_then_shift():
    rng = np.random.default_rng(3)
    p, y = calibrated_balanced(4000, 0.25, rng)
    under = 1 / (1 + np.exp(-0.5 * np.log(p / (1 - p))))  # an under-confident detector: T = 0.5
    scores = NaturalScores([str(i) for i in range(len(y))], y, under, "test")
    # the policy fit's temperature, on every row at natural prevalence (posteriors at 0.5)
    temperature = fit_policy_temperature(under, y, train_prevalence=0.5)
    assert temperature == pytest.approx(0.5, rel=0.1)
    result = prior_correction_ece(scores, known_accuracy=0.25, temperature=temperature)
    assert result.ece_calibrated_known < result.ece_known
    assert result.ece_calibrated_em < result.ece_em
    assert result.em_prevalence_calibrated == pytest.approx(y.mean(), abs=0.03)


def test_balanced_scores_are_the_stored_balanced_rows(tmp_path):
    from actmap.store.rows import balanced_splits

    store = imbalanced_store(tmp_path / "s", n=120)
    scores = balanced_scores(store, ChannelDetector(), "validation")
    assert not store.has_table("splits")  # computed without writing the store
    assert scores.ids == balanced_splits(store)["validation"]
    assert scores.labels.mean() == 0.5


def served_scores(p_raw, setting: PriorSetting) -> np.ndarray:
    """p(correct) as the server gives it once it has seen every row of ``p_raw``: the engine's
    PrevalenceTracker (EM over the calibrated window, from the setting's training prior),
    then `correct_prior`."""
    window = PriorSetting(
        setting.method, setting.deployment_accuracy, setting.train_prevalence,
        em_window=len(p_raw), em_min_scores=1, temperature=setting.temperature,
    )  # fmt: skip
    prevalence = PrevalenceTracker(window).update(np.asarray(p_raw).tolist())
    return correct_prior(p_raw, setting, prevalence)


def detector_at_prior(n, accuracy, train_prevalence, seed, mu=1.0, sharpen=1.0):
    """Rows at ``accuracy`` scored by a detector whose posteriors hold at ``train_prevalence``
    (x | y ~ N(+-mu, 1)); ``sharpen`` > 1 makes it over-confident (its T is ``sharpen``)."""
    rng = np.random.default_rng(seed)
    y = (rng.uniform(size=n) < accuracy).astype(np.int64)
    x = rng.normal(np.where(y == 1, mu, -mu), 1.0)
    z = sharpen * (2 * mu * x + math.log(train_prevalence / (1 - train_prevalence)))
    return NaturalScores([str(i) for i in range(n)], y, sigmoid(z), "validation")


@pytest.mark.parametrize("prior", ["em", "known"])
def test_fit_and_serving_agree_when_training_was_not_balanced(prior):
    """A detector trained at a prior of .3 (actmap-plus without class weights): the fit's
    thresholds are those of the scores the server gives the same rows."""
    scores = detector_at_prior(600, 0.6, 0.3, seed=5)
    policy = fit_policy_on_store(
        scores, 0.15, review_risk=0.3, prior=prior, temperature=1.3, train_prevalence=0.3,
        n_resamples=0,
    )  # fmt: skip
    assert policy.prior.train_prevalence == 0.3 and policy.prior.temperature == 1.3
    served = served_scores(scores.p_raw, policy.prior)
    for band, risk in (("accept", 0.15), ("review", 0.3)):
        threshold, coverage, got = threshold_for_risk(served, scores.labels, risk)
        assert getattr(policy, band) == pytest.approx(threshold, rel=1e-9)
        assert policy.fitted[band]["coverage"] == pytest.approx(coverage)
        assert np.mean(served >= getattr(policy, band)) == pytest.approx(coverage)
    if prior == "em":  # from the .3 prior the server's EM recovers the rows' accuracy
        calibrated = replace(policy.prior, temperature=1.0)  # the detector is calibrated
        tracker = PrevalenceTracker(replace_window(calibrated, len(scores.labels)))
        estimate = tracker.update(scores.p_raw.tolist())
        assert estimate == pytest.approx(scores.accuracy, abs=0.04)  # .670 vs .645


def replace_window(setting: PriorSetting, n: int) -> PriorSetting:
    return replace(setting, em_window=n, em_min_scores=1)


def test_detector_train_prevalence():
    assert detector_train_prevalence(ChannelDetector()) == 0.5
    plus = SimpleNamespace(detector=SimpleNamespace(calibrated_prevalence_=0.3))
    assert detector_train_prevalence(plus) == 0.3


def map_temperature_by_grid(p_raw, labels, train_prevalence=0.5, sigma=TEMPERATURE_PRIOR_SIGMA):
    """The MAP temperature written out and searched on a fine grid of log T (step 1e-4):
    Platt's targets (N+ + 1) / (N+ + 2) and 1 / (N- + 2), the model
    sigmoid(logit p / T + logit(accuracy) - logit(train prior)), and log T ~ N(0, sigma^2)."""
    z, y = logit(p_raw), np.asarray(labels)
    n1, n0 = y.sum(), len(y) - y.sum()
    t = np.where(y == 1, (n1 + 1) / (n1 + 2), 1 / (n0 + 2))
    b = math.log(n1 / n0) - math.log(train_prevalence / (1 - train_prevalence))
    u = np.arange(-30_000, 30_001) * 1e-4  # log T in [-3, 3]
    q = z[None, :] / np.exp(u)[:, None] + b
    log_p, log_not_p = -np.logaddexp(0, -q), -np.logaddexp(0, q)  # log sigmoid(+-q)
    nll = -(t * log_p + (1 - t) * log_not_p).sum(axis=1)
    return float(np.exp(u[np.argmin(nll + u**2 / (2 * sigma**2))]))


def test_map_temperature_matches_a_grid_search_and_the_mle_on_many_rows():
    scores = detector_at_prior(300, 0.4, 0.3, seed=1, sharpen=2.0)
    got = fit_policy_temperature(scores.p_raw, scores.labels, 0.3)
    assert got == pytest.approx(map_temperature_by_grid(scores.p_raw, scores.labels, 0.3), rel=2e-4)
    # with thousands of rows the prior and the targets hardly matter: T of a 2x over-confident
    # balanced detector is 2, as the plain maximum-likelihood fit finds
    many = detector_at_prior(20_000, 0.5, 0.5, seed=2, sharpen=2.0)
    mle = fit_temperature(logit(many.p_raw), many.labels)
    assert mle == pytest.approx(2.0, rel=0.05)
    assert fit_policy_temperature(many.p_raw, many.labels) == pytest.approx(mle, rel=0.01)


def test_temperature_on_a_handful_of_separable_rows_keeps_scores_off_0_and_1():
    p = np.array([0.6, 0.7, 0.8, 0.9, 0.1, 0.2, 0.3, 0.4, 0.35])
    y = np.array([1, 1, 1, 1, 0, 0, 0, 0, 0])
    # the unregularised fit runs to its bound and sends a raw .964 to 1 (the demo's case)
    mle = fit_temperature(logit(p), y)
    assert mle < 0.01 and sigmoid(logit(0.964) / mle) > 1 - 1e-12
    t = fit_policy_temperature(p, y)
    assert t == pytest.approx(map_temperature_by_grid(p, y), rel=2e-4)
    assert 0.5 < t < 2.0
    setting = PriorSetting("known", y.mean(), temperature=t)
    for raw in (0.964, 0.036, 0.99, 0.01):
        for served in (
            correct_prior([raw], PriorSetting(temperature=t)),
            correct_prior([raw], setting),
        ):
            assert 0.005 < served[0] < 0.995
    with pytest.raises(ValueError, match="both kinds"):
        fit_policy_temperature(p[:4], y[:4])


def naive_interval(values, level=0.95):
    tail = 100 * (1 - level) / 2
    return np.percentile(values, [tail, 100 - tail])


def naive_resamples(y, n_resamples, seed):
    """Rows drawn with replacement one resample at a time, a one-label resample drawn again."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n_resamples:
        idx = rng.integers(0, len(y), len(y))
        if y[idx].min() != y[idx].max():
            out.append(idx)
    return out


def test_policy_intervals_match_a_naive_bootstrap_loop():
    scores = detector_at_prior(40, 0.5, 0.5, seed=3)
    s, y = scores.p_raw, scores.labels
    policy = fit_policy_on_store(scores, 0.1, review_risk=0.25, prior="none", n_resamples=0)
    got = policy_intervals(policy, s, y, n_resamples=500, seed=11)
    assert set(got) == {"accept", "review"}
    resamples = naive_resamples(y, 500, seed=11)
    for band in ("accept", "review"):
        threshold = getattr(policy, band)
        coverage, risk = [], []
        for idx in resamples:
            accepted = [i for i in idx if s[i] >= threshold]
            coverage.append(len(accepted) / len(idx))
            if accepted:
                risk.append(sum(1 - y[i] for i in accepted) / len(accepted))
        low, high = naive_interval(coverage)
        assert (got[band]["coverage_low"], got[band]["coverage_high"]) == pytest.approx((low, high))
        low, high = naive_interval(risk)
        assert (got[band]["risk_low"], got[band]["risk_high"]) == pytest.approx((low, high))
        assert got[band]["empty_resamples"] == len(resamples) - len(risk)
        assert (
            got[band]["coverage_low"]
            <= policy.fitted[band]["coverage"]
            <= got[band]["coverage_high"]
        )
    # the temperature's interval: T refitted on the same resamples
    interval = temperature_interval(s, y, n_resamples=200, seed=11)
    refits = [fit_policy_temperature(s[idx], y[idx]) for idx in naive_resamples(y, 200, seed=11)]
    assert (interval.low, interval.high) == pytest.approx(tuple(naive_interval(refits)))
    assert interval.estimate == pytest.approx(fit_policy_temperature(s, y))


def test_few_rows_warning(caplog):
    few = detector_at_prior(MIN_POLICY_ROWS - 1, 0.5, 0.5, seed=4)
    with caplog.at_level(logging.WARNING, logger="actmap.serve.fit"):
        policy = fit_policy_on_store(few, 0.2, prior="none", n_resamples=0)
    assert (
        f"fitted on {MIN_POLICY_ROWS - 1} labelled rows (fewer than 100)"
        in policy.fitted["warning"]
    )
    assert policy.fitted["warning"] in caplog.text
    caplog.clear()
    enough = detector_at_prior(MIN_POLICY_ROWS, 0.5, 0.5, seed=4)
    with caplog.at_level(logging.WARNING, logger="actmap.serve.fit"):
        policy = fit_policy_on_store(enough, 0.2, prior="none", n_resamples=0)
    assert "warning" not in policy.fitted and not caplog.text


def test_policy_file_carries_the_intervals(tmp_path):
    scores = detector_at_prior(60, 0.3, 0.5, seed=6, sharpen=2.0)
    temperature = temperature_interval(scores.p_raw, scores.labels, n_resamples=100)
    assert isinstance(temperature, Interval) and temperature.low <= temperature.estimate
    policy = fit_policy_on_store(
        scores, 0.2, review_risk=0.4, temperature=temperature, n_resamples=300, seed=2
    )
    bands = policy_intervals(policy, correct_prior(scores.p_raw, policy.prior), scores.labels,
                             n_resamples=300, seed=2)  # fmt: skip
    for band in ("accept", "review"):
        assert {k: policy.fitted[band][k] for k in bands[band]} == bands[band]
    assert policy.fitted["temperature"]["low"] == temperature.low
    assert policy.fitted["bootstrap"] == {"n_resamples": 300, "level": 0.95, "seed": 2}
    loaded = load_policy(save_policy(policy, tmp_path / "p.toml"))
    assert loaded == policy
    assert loaded.fitted["accept"]["risk_high"] == bands["accept"]["risk_high"]
    assert loaded.fitted["temperature"]["high"] == temperature.high
    assert loaded.prior.temperature == temperature.estimate


OLD_POLICY_FILE = """# actmap decision policy: p >= accept -> accept; >= review -> review;
# >= route -> route; below -> abstain. p is p(correct) after the [prior] correction.
[thresholds]
accept = 0.8123
review = 0.6
route = 0.6

[prior]
method = "known"
deployment_accuracy = 0.3
train_prevalence = 0.5
em_window = 1000
em_min_scores = 50
temperature = 0.264

[fitted]
n = 28
accuracy = 0.3
split = "validation"
run = "demo-out/run"

[fitted.accept]
target_risk = 0.1
coverage = 0.25
risk = 0.0
"""


def test_a_policy_file_without_intervals_still_loads(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text(OLD_POLICY_FILE)
    policy = load_policy(path)
    assert (policy.accept, policy.review, policy.prior.temperature) == (0.8123, 0.6, 0.264)
    assert policy.fitted["accept"] == {"target_risk": 0.1, "coverage": 0.25, "risk": 0.0}
