"""actmap-plus: against scikit-learn's own pipeline, its saved artifact, and its prior shift."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from sklearn.decomposition import PCA
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import LogisticRegressionCV
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold

from actmap.capture.answer_scalars import SCALAR_NAMES, answer_scalars
from actmap.detectors import DetectorInputs
from actmap.detectors.plus import ActMapPlus, PlusConfig
from actmap.scoring.prior import logit

SHAPE = (3, 4, 8)  # small maps: 96 values


def synthetic(n=240, prevalence=0.3, seed=0):
    """Maps whose first value carries the label, and scalars whose length also does."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < prevalence).astype(int)
    maps = rng.normal(size=(n, *SHAPE)).astype(np.float16)
    maps[:, 0, 0, 0] += 1.5 * y
    lengths = rng.poisson(np.where(y == 1, 3, 8)) + 1
    scalars = np.column_stack(
        [lengths, -0.5 * lengths, -rng.random(n), rng.random(n), rng.random(n) + 1, rng.random(n)]
    )
    return maps, y, scalars


def test_answer_scalars_by_hand():
    lp, h = [-0.1, -2.0, -0.5], [0.3, 1.2, 0.6]
    np.testing.assert_allclose(
        answer_scalars(lp, h), [3, -2.6, -2.6 / 3, 0.7, 1.2, np.exp(-0.1)], rtol=1e-12
    )
    assert len(SCALAR_NAMES) == 6
    with pytest.raises(ValueError, match="empty answer"):
        answer_scalars([], [])


def test_logits_match_the_sklearn_pipeline():
    maps, y, scalars = synthetic()
    cfg = PlusConfig(5, use_scalars=True, class_weight="balanced", n_strengths=4, calibrate=False)
    est = ActMapPlus(cfg).fit(DetectorInputs(maps, scalars), y)
    # the same pipeline written with scikit-learn directly
    x = maps.reshape(len(maps), -1).astype(np.float32)
    pca = PCA(5, svd_solver="randomized", random_state=0).fit(x)
    f = np.hstack([pca.transform(x), scalars])
    f = (f - f.mean(0)) / f.std(0)
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    ref = LogisticRegressionCV(
        Cs=4, cv=folds, scoring="roc_auc", class_weight="balanced", max_iter=5000
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ref.fit(f, y)
    np.testing.assert_allclose(
        est.decision_function(maps, scalars), ref.decision_function(f), rtol=1e-4, atol=1e-4
    )
    assert est.C_ == pytest.approx(np.ravel(ref.C_)[0])
    assert est.calibrated_prevalence_ == 0.5
    assert est.train_prevalence_ == pytest.approx(y.mean())
    assert roc_auc_score(y, est.predict_proba(maps, scalars)) > 0.8


def test_platt_rescaling_is_fit_on_out_of_fold_logits():
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_predict

    maps, y, scalars = synthetic()
    plain = ActMapPlus(PlusConfig(4, n_strengths=3, calibrate=False)).fit(
        DetectorInputs(maps, scalars), y
    )
    est = ActMapPlus(PlusConfig(4, n_strengths=3)).fit(DetectorInputs(maps, scalars), y)
    # the same two steps written out with scikit-learn
    f = plain._features(maps, scalars)
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    inner = LogisticRegression(C=plain.C_, class_weight="balanced", max_iter=5000)
    z = cross_val_predict(inner, f, y, cv=folds, method="decision_function")
    outer = LogisticRegression(C=1e6, class_weight="balanced", max_iter=5000).fit(z[:, None], y)
    a, b = outer.coef_[0, 0], outer.intercept_[0]
    assert est.platt_ == pytest.approx((a, b), rel=1e-6)
    np.testing.assert_allclose(
        est.decision_function(maps, scalars),
        a * plain.decision_function(maps, scalars) + b,
        rtol=1e-6,
        atol=1e-9,
    )
    assert a > 0  # rescaling keeps the ranking when the out-of-fold logits carry the signal


def test_save_and_from_pretrained_predict_identically(tmp_path):
    maps, y, scalars = synthetic()
    est = ActMapPlus(PlusConfig(n_components=8, n_strengths=3)).fit(
        DetectorInputs(maps, scalars), y
    )
    est.save(tmp_path / "plus", metadata={"store": "s"})
    assert sorted(p.name for p in (tmp_path / "plus").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    config = json.loads((tmp_path / "plus" / "config.json").read_text())
    assert config["detector"] == "actmap-plus"
    assert config["train_prevalence"] == pytest.approx(y.mean())
    assert config["metadata"] == {"store": "s"}
    loaded = ActMapPlus.load(tmp_path / "plus")
    np.testing.assert_allclose(  # same arrays; float32 BLAS may sum in another order
        loaded.predict_proba(maps, scalars, prevalence=0.1),
        est.predict_proba(maps, scalars, prevalence=0.1),
        rtol=1e-5,
    )


def test_prevalence_shifts_the_logit_by_the_prior_offset(tmp_path):
    maps, y, scalars = synthetic()
    est = ActMapPlus(PlusConfig(n_components=4, n_strengths=2)).fit(
        DetectorInputs(maps, scalars), y
    )
    p = est.predict_proba(maps, scalars)
    q = est.predict_proba(maps, scalars, prevalence=0.07)
    np.testing.assert_allclose(logit(q) - logit(p), logit(0.07) - logit(0.5), atol=1e-8)
    unweighted = ActMapPlus(PlusConfig(n_components=4, n_strengths=2, class_weight=None))
    unweighted.fit(DetectorInputs(maps, scalars), y)
    assert unweighted.calibrated_prevalence_ == pytest.approx(y.mean())
    assert abs(y.mean() - 0.3) < 0.05  # its probabilities hold at about .3, not .5
    # the prior shift starts from there: logit(.6) - logit(.3), about 1.25 (from .5: .41)
    p = unweighted.predict_proba(maps, scalars)
    q = unweighted.predict_proba(maps, scalars, prevalence=0.6)
    np.testing.assert_allclose(logit(q) - logit(p), logit(0.6) - logit(y.mean()), atol=1e-8)
    loaded = ActMapPlus.load(unweighted.save(tmp_path / "unweighted"))
    assert loaded.calibrated_prevalence_ == unweighted.calibrated_prevalence_
    np.testing.assert_allclose(loaded.predict_proba(maps, scalars, prevalence=0.6), q, rtol=1e-5)
    # calibrated where it was trained: on new rows, mean p(correct) tracks the fraction correct
    new_maps, new_y, new_scalars = synthetic(n=3000, seed=1)
    mean_p = unweighted.predict_proba(new_maps, new_scalars).mean()
    assert mean_p == pytest.approx(new_y.mean(), abs=0.03)


def test_scalars_only_and_map_only():
    maps, y, scalars = synthetic()
    only_scalars = ActMapPlus(PlusConfig(n_components=0, n_strengths=2)).fit(
        DetectorInputs(maps, scalars), y
    )
    assert only_scalars.coef_.shape == (6,)
    only_map = ActMapPlus(PlusConfig(n_components=3, use_scalars=False, n_strengths=2))
    only_map.fit(maps, y)
    assert only_map.decision_function(maps).shape == (len(y),)


def test_clear_errors():
    maps, y, scalars = synthetic()
    with pytest.raises(NotFittedError):
        ActMapPlus().predict_proba(maps, scalars)
    est = ActMapPlus(PlusConfig(n_components=3, n_strengths=2)).fit(
        DetectorInputs(maps, scalars), y
    )
    with pytest.raises(ValueError, match="pass them in its inputs"):
        est.predict_proba(maps)
    with pytest.raises(ValueError, match=r"scalars must have shape \(240, 6\)"):
        est.predict_proba(maps, scalars[:, :3])
    with pytest.raises(ValueError, match="maps have 48 values per row"):
        est.predict_proba(maps[:, :, :2], scalars)
    with pytest.raises(ValueError, match="prevalence must lie strictly between 0 and 1"):
        est.predict_proba(maps, scalars, prevalence=1.0)
    with pytest.raises(ValueError, match="both classes"):
        ActMapPlus().fit(DetectorInputs(maps, scalars), np.zeros(len(y)))
    with pytest.raises(ValueError, match="needs the map"):
        PlusConfig(n_components=0, use_scalars=False)


def test_load_detector_opens_either_kind(tmp_path):
    from dataclasses import replace

    from actmap.detectors import CorrectnessDetector, load_detector
    from actmap.training.recipe import TrainConfig

    maps, y, scalars = synthetic(n=64)
    ActMapPlus(PlusConfig(n_components=3, n_strengths=2)).fit(
        DetectorInputs(maps, scalars), y
    ).save(tmp_path / "p")
    assert isinstance(load_detector(tmp_path / "p"), ActMapPlus)
    config = replace(TrainConfig(), max_epochs=1, device="cpu")
    paper = CorrectnessDetector("logreg", config=config).fit(maps, y, maps, y)
    paper.save(tmp_path / "l")
    loaded = load_detector(tmp_path / "l")
    assert isinstance(loaded, CorrectnessDetector) and loaded.detector == "logreg"
    np.testing.assert_allclose(loaded.predict_proba(maps), paper.predict_proba(maps), rtol=1e-6)
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        load_detector(tmp_path / "missing")


def test_too_few_rows_of_a_class_for_the_folds_is_one_clear_error():
    from actmap.errors import ActmapUserError

    rng = np.random.default_rng(0)
    maps = rng.normal(size=(24, 2, 4, 8)).astype(np.float16)
    labels = np.array([1] * 4 + [0] * 20)  # 4 correct: fewer than the 5 folds
    with pytest.raises(ActmapUserError, match="at least 5 rows of each class; got 4 correct"):
        ActMapPlus(PlusConfig(n_components=4, use_scalars=False)).fit(maps, labels)
    labels[4] = 1  # 5 correct: it fits
    ActMapPlus(PlusConfig(n_components=4, use_scalars=False)).fit(maps, labels)
