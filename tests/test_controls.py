"""Controls: answer length alone, and any supervised scorer fit on permuted labels."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from actmap.baselines.controls import AnswerLengthPredictor, PermutedLabelControl, length_features
from actmap.scoring.contract import ScoreResult


@dataclass
class Row:
    token_ids: list[int]
    features: np.ndarray


def make_rows(rng, n, dim=100):
    """Correct answers are short and have a positive first feature; labels alternate."""
    y = np.arange(n) % 2
    lengths = np.where(y == 1, rng.integers(1, 12, n), rng.integers(8, 30, n))
    feats = rng.normal(size=(n, dim))
    feats[:, 0] += np.where(y == 1, 1.5, -1.5)
    return [Row(list(range(k)), f) for k, f in zip(lengths, feats, strict=False)], y


class FeatureProbe:
    """A supervised scorer over a 100-dim feature vector (stands in for any trained detector)."""

    name: ClassVar[str] = "feature_probe"
    supervised: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ()

    def fit(self, train, y_train, val=None, y_val=None):
        self.seen_labels_ = np.asarray(y_train).copy()
        self.model_ = LogisticRegression(C=1.0, max_iter=1000).fit(
            np.stack([r.features for r in train]), y_train
        )
        return self

    def score(self, rows):
        p = self.model_.predict_proba(np.stack([r.features for r in rows]))[:, 1]
        return ScoreResult(p, p, "p", {"C": 1.0})


def test_answer_length_matches_sklearn_and_finds_length_signal():
    rng = np.random.default_rng(0)
    train, y_train = make_rows(rng, 400)
    test, y_test = make_rows(rng, 400)
    scorer = AnswerLengthPredictor(features="n_log").fit(train, y_train)
    result = scorer.score(test)
    n_train = np.array([len(r.token_ids) for r in train], dtype=float)
    n_test = np.array([len(r.token_ids) for r in test], dtype=float)

    def standardise(n, ref):
        x = np.stack([n, np.log1p(n)], 1)
        r = np.stack([ref, np.log1p(ref)], 1)
        return (x - r.mean(0)) / r.std(0)

    reference = LogisticRegression().fit(standardise(n_train, n_train), y_train)
    np.testing.assert_allclose(
        result.confidence, reference.predict_proba(standardise(n_test, n_train))[:, 1], rtol=1e-6
    )
    assert roc_auc_score(y_test, result.confidence) > 0.85
    assert result.details["features"] == "n_log"


def test_length_features_and_errors():
    np.testing.assert_allclose(length_features(np.array([0, 3]), "n_log"), [[0, 0], [3, np.log(4)]])
    assert length_features(np.array([2]), "n").shape == (1, 1)
    with pytest.raises(ValueError, match="features"):
        length_features(np.array([2]), "sqrt")
    with pytest.raises(RuntimeError, match="before fit"):
        AnswerLengthPredictor().score([Row([1], np.zeros(1))])
    with pytest.raises(TypeError):
        AnswerLengthPredictor().fit([object(), object()], np.array([0, 1]))


def test_permuted_labels_fall_to_chance():
    rng = np.random.default_rng(1)
    train, y_train = make_rows(rng, 1000)
    test, y_test = make_rows(rng, 2000)
    honest = FeatureProbe().fit(train, y_train).score(test).confidence
    assert roc_auc_score(y_test, honest) > 0.9

    aucs = []
    for seed in range(8):
        control = PermutedLabelControl(FeatureProbe(), seed=seed).fit(train, y_train)
        assert sorted(control.y_train_permuted_) == sorted(y_train)  # same class counts
        assert np.mean(control.y_train_permuted_ == y_train) < 0.6  # but no longer the rows' labels
        np.testing.assert_array_equal(control.scorer_.seen_labels_, control.y_train_permuted_)
        aucs.append(roc_auc_score(y_test, control.score(test).confidence))
    # null AUROC sd with 2000 balanced test rows is ~.013; a 100-dim random direction adds ~.04
    assert all(abs(a - 0.5) < 0.15 for a in aucs)
    assert abs(np.mean(aucs) - 0.5) < 0.05


def test_permuted_control_is_deterministic_and_leaves_the_template_unfitted():
    rng = np.random.default_rng(2)
    train, y_train = make_rows(rng, 50)
    template = FeatureProbe()
    a = PermutedLabelControl(template, seed=3).fit(train, y_train)
    b = PermutedLabelControl(FeatureProbe, seed=3).fit(train, y_train, train, y_train)
    np.testing.assert_array_equal(a.y_train_permuted_, b.y_train_permuted_)
    assert not hasattr(template, "model_")
    result = a.score(train)
    assert result.details["seed"] == 3 and result.details["inner"] == "feature_probe"
    assert result.raw_name == "permuted_p"


# --- the control on rows where the answer length alone predicts the label -------------------


def length_rows(rng, n, shape=(2, 4, 8)):
    """Correct answers are short (2-5 tokens), wrong ones long (6-10); nothing else carries it."""
    from test_tad import random_gen  # the TAD tests' random generations

    from actmap.store.rows import Rows

    y = rng.integers(0, 2, n)
    lengths = np.where(y == 1, rng.integers(2, 6, n), rng.integers(6, 11, n))
    gens = [random_gen(rng, int(t)) for t in lengths]
    scalars = np.column_stack(
        [
            lengths,
            -0.7 * lengths,
            rng.normal(-0.7, 0.1, n),
            rng.random(n),
            rng.random(n),
            rng.random(n),
        ]
    )
    maps = rng.normal(size=(n, *shape)).astype(np.float32)
    return gens, Rows([str(i) for i in range(n)], y, maps, scalars), y


@pytest.fixture(scope="module")
def length_store():
    rng = np.random.default_rng(0)
    return length_rows(rng, 120), length_rows(rng, 60), length_rows(rng, 200)


def test_permuted_tad_keeps_the_choices_made_on_real_labels(length_store):
    from actmap.signals.tad import TAD

    (tr, _, ytr), (va, _, yva), (te, _, yte) = length_store
    real = TAD(n_previous=3).fit(tr, ytr, va, yva)
    control = PermutedLabelControl(TAD(n_previous=3), seed=0).fit(tr, ytr, va, yva)
    chosen = (real.stage1_alpha_, real.alpha_, real.aggregation_)
    assert control.fixed_["stage1_alpha"], control.fixed_["alpha"] == chosen[:2]
    fitted = control.scorer_
    assert (fitted.stage1_alpha_, fitted.alpha_, fitted.aggregation_) == chosen
    assert not hasattr(fitted, "val_auroc_")  # nothing re-selected on shuffled labels
    # "mean" fixed: the refit learns nothing from shuffled labels -> near chance
    mean_aucs = [
        roc_auc_score(
            yte,
            PermutedLabelControl(TAD(3, aggregation="mean"), seed=s)
            .fit(tr, ytr, va, yva)
            .score(te)
            .confidence,
        )
        for s in range(3)
    ]
    assert abs(np.mean(mean_aucs) - 0.5) < 0.15
    # "sum_log" fixed: a sum over the answer's tokens ranks by length with any labels
    lengths = np.array([g.n_tokens for g in te])
    summed = PermutedLabelControl(TAD(3, aggregation="sum_log"), seed=0).fit(tr, ytr, va, yva)
    assert roc_auc_score(yte, summed.score(te).confidence) > 0.9
    assert roc_auc_score(yte, -lengths) == 1.0


def test_permuted_actmap_plus_falls_to_chance_where_length_predicts_the_label(length_store):
    from actmap.detectors.plus import PlusConfig
    from actmap.experiments.compare_product import PlusScorer

    (_, tr, ytr), (_, va, yva), (_, te, yte) = length_store
    grid = [PlusConfig(n_components=4, n_strengths=4), PlusConfig(n_components=0, n_strengths=4)]
    honest = PlusScorer(grid).fit(tr, ytr, va, yva)
    assert roc_auc_score(yte, honest.score(te).confidence) > 0.95  # it reads the length
    aucs = []  # one permutation is one random linear scorer; on these rows their AUROCs spread
    for seed in range(16):  # widely (sd ~.17, length dominates any direction), so average
        control = PermutedLabelControl(PlusScorer(grid), seed=seed).fit(tr, ytr, va, yva)
        chosen = honest.model_.config_
        assert control.scorer_.model_.config_.n_components == chosen.n_components
        assert control.scorer_.model_.C_ == pytest.approx(honest.model_.C_)
        aucs.append(roc_auc_score(yte, control.score(te).confidence))
    assert abs(np.mean(aucs) - 0.5) < 0.1


def test_from_fitted_shares_one_real_label_fit_and_scores_as_the_full_control(length_store):
    """Choices taken from a scorer already fit on the real labels: the same control, cheaper."""
    from actmap.detectors.plus import PlusConfig
    from actmap.experiments.compare_product import PlusScorer
    from actmap.signals.tad import TAD

    (tr, str_, ytr), (va, sva, yva), (te, ste, yte) = length_store
    grid = [PlusConfig(n_components=4, n_strengths=4), PlusConfig(n_components=0, n_strengths=4)]
    cases = [
        (TAD(n_previous=3), tr, va, te),
        (PlusScorer(grid), str_, sva, ste),
    ]
    for template, train, val, test in cases:
        fitted = copy.deepcopy(template).fit(train, ytr, val, yva)
        for seed in (0, 1):
            full = PermutedLabelControl(template, seed=seed).fit(train, ytr, val, yva)
            cheap = PermutedLabelControl.from_fitted(fitted, seed=seed).fit(train, ytr, val, yva)
            assert cheap.fixed_ == full.fixed_
            np.testing.assert_allclose(
                cheap.score(test).confidence, full.score(test).confidence, rtol=1e-9
            )
    with pytest.raises(TypeError, match="no fixed_choices"):
        PermutedLabelControl.from_fitted(AnswerLengthPredictor())
