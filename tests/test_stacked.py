"""The stacked actmap-plus (`actmap.detectors.stacked`): out-of-fold stacking, layer choice, presets,
and the save/load round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actmap.capture.records import Generation
from actmap.detectors import DetectorInputs, load_detector
from actmap.detectors.stacked import (
    ATTENTION_BLOCKS,
    FALLBACK,
    StackConfig,
    StackedPlus,
    out_of_fold_logits,
)
from actmap.scoring.prior import logit

LAYERS, HEADS, KEYS, WIDTH = 3, 2, 3, 16
INFORMATIVE_LAYER = 1


def test_out_of_fold_logits_equal_a_hand_written_loop():
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 90)
    x = rng.normal(size=(90, 5)) + y[:, None] * np.array([1.0, 0, 0.5, 0, 0])
    folds = StratifiedKFold(5, shuffle=True, random_state=3)
    got = out_of_fold_logits(x, y, 0.1, "balanced", folds)
    want = np.zeros(len(y))
    for fit, held in folds.split(x, y):  # by hand: scale on the fit rows, score the held rows
        mean, std = x[fit].mean(0), x[fit].std(0)
        model = LogisticRegression(C=0.1, class_weight="balanced", max_iter=5000)
        model.fit((x[fit] - mean) / std, y[fit])
        want[held] = ((x[held] - mean) / std) @ model.coef_[0] + model.intercept_[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


def synthetic_rows(n: int, seed: int) -> tuple[DetectorInputs, np.ndarray]:
    """Rows whose label shows in layer 1's last-answer state, weakly in the map and scalars,
    and in the attention to the previous token."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    maps = rng.normal(size=(n, 2, 4, 8)).astype(np.float16)
    maps[:, 0, 0, 0] += 0.3 * y
    scalars = rng.normal(size=(n, 6))
    scalars[:, 0] = rng.integers(1, 6, n)
    positions = rng.normal(size=(n, 4, LAYERS, WIDTH)).astype(np.float16)
    positions[:, 2, INFORMATIVE_LAYER, :4] += 1.5 * y[:, None]
    gens = []
    for i in range(n):
        t = int(rng.integers(2, 6))
        attention = rng.uniform(0, 0.3, size=(t, LAYERS, HEADS, KEYS))
        attention[1:, :, 0, 0] += 0.4 * y[i]
        attention[0] = 0
        gens.append(
            Generation(
                prompt="q",
                answer="a",
                token_ids=list(range(t)),
                logprobs=torch.tensor(-rng.uniform(0, 2, t) * (1.5 - y[i]), dtype=torch.float32),
                entropies=torch.tensor(rng.uniform(0, 3, t), dtype=torch.float32),
                trajectory=torch.empty(0),
                stopped=True,
                prompt_tokens=3,
                attention=torch.tensor(attention, dtype=torch.float32),
            )
        )
    return DetectorInputs(maps, scalars, positions, gens), y


@pytest.fixture(scope="module")
def data():
    return {
        name: synthetic_rows(n, s)
        for name, n, s in (("train", 160, 0), ("val", 80, 1), ("test", 60, 2))
    }


@pytest.mark.parametrize("preset", ["deployable", "full"])
def test_presets_fit_choose_on_validation_and_round_trip(preset, data, tmp_path):
    (train, y), (val, y_val), (test, _) = data["train"], data["val"], data["test"]
    config = StackConfig(preset=preset, map_components=8, tad_previous=KEYS)
    est = StackedPlus(config).fit(train, y, val, y_val)
    probe = est.blocks_["probe:last_answer"]  # in both presets, and the rows hold positions
    assert probe.choices["layer"] == INFORMATIVE_LAYER  # chosen on validation
    assert est.selected_  # at least one block stacked
    if preset == "deployable":
        assert not set(est.selected_) & set(ATTENTION_BLOCKS)
        assert "attention" not in est.requires
    assert est.validation_["stack"] > 0.8
    assert est.validation_["stack"] > est.validation_[FALLBACK]  # the probe carries the label
    assert not est.validation_["fallback"] and FALLBACK not in est.selected_
    est.save(tmp_path)
    again = load_detector(tmp_path)
    assert isinstance(again, StackedPlus) and again.selected_ == est.selected_
    np.testing.assert_array_equal(again.decision_function(test), est.decision_function(test))
    np.testing.assert_array_equal(
        load_detector(tmp_path).predict_proba(test, prevalence=0.3),
        est.predict_proba(test, prevalence=0.3),
    )


def take(rows: DetectorInputs, idx) -> DetectorInputs:
    gens = None if rows.generations is None else [rows.generations[i] for i in idx]
    return DetectorInputs(rows.maps[idx], rows.scalars[idx], rows.positions[idx], gens)


def test_without_class_weights_its_probabilities_hold_at_the_training_prior(data, tmp_path):
    """Trained on rows 30% correct without class weights, its p(correct) holds at .3: the
    prior shift to a deployment accuracy starts from .3, and the saved model keeps it."""
    (train, y), (val, y_val), (test, _) = data["train"], data["val"], data["test"]
    wrong = np.flatnonzero(y == 0)
    right = np.flatnonzero(y == 1)[: round(len(wrong) * 3 / 7)]
    idx = np.sort(np.r_[wrong, right])
    config = StackConfig(preset="deployable", map_components=8, class_weight=None)
    est = StackedPlus(config).fit(take(train, idx), y[idx], val, y_val)
    assert est.calibrated_prevalence_ == est.train_prevalence_ == pytest.approx(0.3, abs=0.01)
    p, q = est.predict_proba(test), est.predict_proba(test, prevalence=0.6)
    # the shift from its prior: logit(.6) - logit(.3), about 1.25 (from .5 it would be .41)
    np.testing.assert_allclose(logit(q) - logit(p), logit(0.6) - logit(y[idx].mean()), atol=1e-8)
    est.save(tmp_path)
    again = load_detector(tmp_path)
    assert again.calibrated_prevalence_ == est.calibrated_prevalence_
    np.testing.assert_allclose(again.predict_proba(test, prevalence=0.6), q, rtol=1e-6)


def test_full_preset_needs_attention_where_it_uses_it(data):
    (train, y), (val, y_val) = data["train"], data["val"]
    est = StackedPlus(StackConfig(preset="full", map_components=8, tad_previous=KEYS))
    est.fit(train, y, val, y_val)
    assert set(est.selected_) & set(ATTENTION_BLOCKS)  # selection "all": every block stacks
    with pytest.raises(ValueError, match="attention"):
        est.decision_function(DetectorInputs(val.maps, val.scalars, val.positions, None))


def test_version_1_still_loads_and_names_version_2(tmp_path, data):
    from actmap.detectors.plus import ActMapPlus, PlusConfig

    (train, y) = data["train"]
    v1 = ActMapPlus(PlusConfig(n_components=4)).fit(DetectorInputs(train.maps, train.scalars), y)
    v1.save(tmp_path / "v1")
    assert isinstance(load_detector(tmp_path / "v1"), ActMapPlus)
    v2 = StackedPlus(StackConfig(preset="deployable", map_components=4))
    v2.fit(train, y, *data["val"]).save(tmp_path / "v2")
    with pytest.raises(ValueError, match="stacked"):
        ActMapPlus.load(tmp_path / "v2")
    with pytest.raises(ValueError, match="preset"):
        StackConfig(preset="best")


def test_a_restricted_full_fit_equals_fitting_the_deployable_preset(data):
    (train, y), (val, y_val), (test, _) = data["train"], data["val"], data["test"]
    full = StackedPlus(StackConfig(preset="full", map_components=8, tad_previous=KEYS))
    full.fit(train, y, val, y_val)
    alone = StackedPlus(StackConfig(preset="deployable", map_components=8, tad_previous=KEYS))
    alone.fit(train, y, val, y_val)
    cut = full.restricted("deployable")
    assert cut.selected_ == alone.selected_ and cut.config == alone.config
    np.testing.assert_allclose(cut.decision_function(test), alone.decision_function(test))
    assert set(full.selected_) > set(cut.selected_)  # "all": every block of the preset


def test_greedy_selection_stops_when_no_block_adds(data):
    (train, y), (val, y_val) = data["train"], data["val"]
    config = StackConfig(preset="deployable", map_components=8, selection="greedy", min_gain=1.0)
    est = StackedPlus(config).fit(train, y, val, y_val)
    assert len(est.selected_) == 1  # the best single block; nothing adds a whole AUROC point
    best = max((b for b in est.oof_ if b != FALLBACK), key=lambda b: est.validation_[b])
    assert est.selected_ == [best] and not est.validation_["fallback"]


def test_map_and_scalars_replace_the_stack_when_they_rank_validation_better(tmp_path):
    """Few rows, probes that carry nothing: one regression on the map's components and the
    scalars beats the stack on validation and takes its place (sklearn as the reference)."""
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression

    (train, y), (val, y_val) = synthetic_rows(60, 2), synthetic_rows(40, 12)
    rng = np.random.default_rng(2)
    for rows, labels in ((train, y), (val, y_val)):
        rows.positions = rng.normal(size=rows.positions.shape).astype(np.float16)
        rows.maps[:, 0, 0, 0] += labels
    est = StackedPlus(StackConfig(preset="deployable", map_components=8)).fit(train, y, val, y_val)
    assert est.validation_[FALLBACK] > est.validation_["stack"]
    assert est.validation_["fallback"] and est.selected_ == [FALLBACK]
    assert est.requires == ("maps", "scalars")  # no position states needed to serve it
    flat = lambda r: r.maps.astype(np.float32).reshape(len(r.maps), -1)  # noqa: E731
    pca = PCA(8, svd_solver="randomized", random_state=0).fit(flat(train))
    x = np.hstack([pca.transform(flat(train)), train.scalars])
    xv = np.hstack([pca.transform(flat(val)), val.scalars])
    mean, std = x.mean(0), x.std(0)
    block = est.blocks_[FALLBACK]
    model = LogisticRegression(C=block.C, class_weight="balanced", max_iter=5000)
    model.fit((x - mean) / std, y)
    want = model.decision_function((xv - mean) / std)
    np.testing.assert_allclose(block.logits(est._features(FALLBACK, val)), want, atol=1e-3)
    # the stack's place: one weight and a bias on that logit
    np.testing.assert_allclose(
        est.decision_function(val), est.meta_.logits(want[:, None]), atol=1e-3
    )
    est.save(tmp_path)
    again = load_detector(tmp_path)
    assert again.selected_ == [FALLBACK]
    np.testing.assert_array_equal(again.decision_function(val), est.decision_function(val))
    off = StackedPlus(StackConfig(preset="deployable", map_components=8, fallback=False))
    assert FALLBACK not in off.fit(train, y, val, y_val).selected_
