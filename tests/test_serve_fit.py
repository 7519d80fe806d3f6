"""Scores at natural prevalence: policy fitting on a store and the prior-correction ECE check."""

from __future__ import annotations

import numpy as np
import pytest
from test_cli_serve import imbalanced_store

from actmap.scoring.metrics import ece
from actmap.scoring.prior import em_prevalence, shift_to_prevalence
from actmap.serve.fit import (
    NaturalScores,
    balanced_scores,
    fit_balanced_temperature,
    fit_policy_on_store,
    natural_scores,
    prevalence_shift_ece,
    prior_correction_ece,
)
from actmap.serve.policy import threshold_for_risk


class ChannelDetector:
    """p(correct) from the mean of channel 0 (the synthetic store puts the label there)."""

    needs_scalars = False  # reads the map only, like a LoadedDetector of a paper detector

    def predict_proba(self, maps, scalars=None):
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
    expected = threshold_for_risk(em_prevalence(scores.p_raw).probs, scores.labels, 0.2)
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
    balanced = np.r_[np.flatnonzero(y == 1), np.flatnonzero(y == 0)[: int(y.sum())]]
    scores = NaturalScores([str(i) for i in range(len(y))], y, under, "test")
    temperature = fit_balanced_temperature(
        NaturalScores([], y[balanced], under[balanced], "validation")
    )
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
