"""The paper-section experiments (ablations, learning curve, localization, calibration) on a
tiny synthetic store, each against an independent reference; and their figures."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from experiment_helpers import synthetic_store
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from actmap.experiments.ablations import AblationConfig, _Inputs, _map_variant, run_ablations
from actmap.experiments.calibration import (
    CalibrationConfig,
    class_conditional_resample,
    distinct_at_prevalence,
    prevalence_shift,
    reliability,
    run_calibration,
    selective_prediction,
    split_prevalence,
)
from actmap.experiments.common import SeedScores, auroc_summary, train_seeds
from actmap.experiments.learning_curve import (
    LearningCurveConfig,
    balanced_subsample,
    run_learning_curve,
)
from actmap.experiments.localization import (
    LocalizationConfig,
    _block_attention,
    integrated_gradients,
    localize,
)
from actmap.experiments.seeds import recipe_config
from actmap.maps import MapConfig, build_map
from actmap.maps.ablations import LAST_TOKEN_CHANNELS
from actmap.scoring import metrics
from actmap.scoring.intervals import auroc_rows, bootstrap, paired_bootstrap, resample_indices
from actmap.scoring.prior import sigmoid
from actmap.store.rows import Rows


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("exp") / "store")


@pytest.fixture(scope="module")
def inputs(store):
    return _Inputs.read(store)


@pytest.fixture(scope="module")
def logreg(inputs):
    """A logistic-regression detector trained on the store's maps, and its test rows."""
    from actmap.detectors import CorrectnessDetector

    train = Rows(None, inputs.labels["train"], inputs.maps["train"])
    detector = CorrectnessDetector("logreg", config=recipe_config(8), seed=0).fit(
        train.maps, train.labels, inputs.maps["validation"], inputs.labels["validation"]
    )
    return detector, Rows(inputs.ids["test"], inputs.labels["test"], inputs.maps["test"])


# --- intervals over seeds ------------------------------------------------------------------


def test_seed_averaged_bootstrap_matches_a_direct_loop():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 40)
    a = rng.standard_normal((3, 40)) + y
    b = rng.standard_normal(40) + 0.5 * y
    got = paired_bootstrap(a, b, y, n_resamples=100, seed=7)
    draws, _ = resample_indices(y, 100, np.random.default_rng(7), True)
    diffs = [
        np.mean([roc_auc_score(y[i], s[i]) for s in a]) - roc_auc_score(y[i], b[i]) for i in draws
    ]
    assert got.low == pytest.approx(np.percentile(diffs, 2.5))
    assert got.high == pytest.approx(np.percentile(diffs, 97.5))
    expected = np.mean([roc_auc_score(y, s) for s in a]) - roc_auc_score(y, b)
    assert got.estimate == pytest.approx(expected)
    # one seed given as (1, n) is the plain one-method interval
    assert bootstrap(a[:1], y, n_resamples=300).low == bootstrap(a[0], y, n_resamples=300).low


# --- ablations -----------------------------------------------------------------------------


def test_rebuilt_variant_maps_equal_direct_builds(store, inputs):
    maps = _map_variant(inputs, "last_token_channels")
    key = inputs.ids["test"][3]
    trajectory = torch.from_numpy(store.read_arrays("trajectories", [key])[key].astype(np.float32))
    direct = build_map(trajectory, MapConfig(channels=LAST_TOKEN_CHANNELS)).half().numpy()
    assert maps["test"].shape[1:] == (2, 32, 128)
    np.testing.assert_array_equal(maps["test"][3], direct)


def test_ablations_run_rows_refs_and_unavailable(store):
    config = AblationConfig(
        detector="logreg",
        seeds=(1, 2),
        max_epochs=6,
        n_resamples=200,
        variants=(
            "full",
            "segments_1",
            "resolution_64x256",
            "contiguous_pooling",
            "coordinate_permutation",
            "classifier_logreg",
            "permuted_labels",
            "answer_length",
        ),
    )
    result = run_ablations(store, config)
    assert [v.name for v in result.variants] == list(config.variants)
    full = result.variant("full")
    assert full.summary.auroc.estimate > 0.8 and full.summary.auroc.n == result.rows["test"]
    wide = result.variant("resolution_64x256")
    assert wide.status == "unavailable" and "pooled_dim=256" in wide.reason
    seg = result.variant("segments_1")
    assert seg.map_shape == (9, 32, 128) and seg.summary.reference == "full"
    expected = np.mean(seg.summary.per_seed) - np.mean(full.summary.per_seed)
    assert seg.summary.difference.estimate == pytest.approx(expected)
    assert result.variant("coordinate_permutation").summary.reference == "contiguous_pooling"
    # the classifier equal to the configured detector reuses the reference's fits
    same = result.variant("classifier_logreg").scores.confidence
    np.testing.assert_array_equal(same, full.scores.confidence)
    length = result.variant("answer_length")
    meta = store.metadata().set_index("id")
    inputs = _Inputs.read(store)
    x = {
        s: np.log1p(meta.loc[inputs.ids[s], "n_tokens"].to_numpy(float)) for s in ("train", "test")
    }
    direct = LogisticRegression().fit(
        np.c_[np.expm1(x["train"]), x["train"]], inputs.labels["train"]
    )
    expected = roc_auc_score(
        inputs.labels["test"], direct.decision_function(np.c_[np.expm1(x["test"]), x["test"]])
    )
    assert length.scores.seeds == (0,)
    assert length.summary.auroc.estimate == pytest.approx(expected)
    assert "unavailable" in result.to_markdown() and result.to_json()["rows"] == result.rows


def test_permuted_labels_fit_never_sees_real_labels(store, monkeypatch):
    """The control hands the detector a permutation of the train and validation labels."""
    from actmap.detectors import CorrectnessDetector

    seen = []
    original = CorrectnessDetector.fit

    def spy(self, maps, labels, val_maps, val_labels, progress=None):
        seen.append((np.asarray(labels).copy(), np.asarray(val_labels).copy()))
        return original(self, maps, labels, val_maps, val_labels, progress)

    monkeypatch.setattr(CorrectnessDetector, "fit", spy)
    config = AblationConfig(
        detector="logreg", seeds=(3,), max_epochs=2, n_resamples=50, variants=("permuted_labels",)
    )
    result = run_ablations(store, config)
    inputs = _Inputs.read(store)
    ((train, val),) = seen
    assert sorted(train) == sorted(inputs.labels["train"])
    assert not np.array_equal(train, inputs.labels["train"])
    assert not np.array_equal(val, inputs.labels["validation"])
    assert result.variant("permuted_labels").scores.seeds == (3,)


def test_ablations_refuse_unknown_variant():
    with pytest.raises(ValueError, match="unknown ablation"):
        AblationConfig(variants=("nope",))


# --- learning curve ------------------------------------------------------------------------


def test_balanced_subsample_counts_and_reproducibility():
    y = np.array([0] * 30 + [1] * 30)
    rows = balanced_subsample(y, 0.25, seed=4)
    assert (y[rows] == 0).sum() == 8 and (y[rows] == 1).sum() == 8  # round(7.5) = 8
    assert len(set(rows)) == len(rows)
    np.testing.assert_array_equal(rows, balanced_subsample(y, 0.25, seed=4))
    assert not np.array_equal(rows, balanced_subsample(y, 0.25, seed=5))
    assert len(balanced_subsample(y, 1.0, seed=0)) == 60


def test_learning_curve_points(store):
    config = LearningCurveConfig(
        fractions=(0.25, 1.0),
        seeds=(1, 2),
        methods=("logreg", "tad"),
        max_epochs=4,
        n_resamples=100,
    )
    curve = run_learning_curve(store, config)
    n_train = curve.rows["train"]
    logreg = curve.curve("logreg")
    assert [p.n_train for p in logreg] == [2 * round(0.25 * n_train / 2), n_train]
    assert all(p.summary.auroc.n == curve.rows["test"] for p in curve.points)
    assert "attention" in curve.unavailable["tad"]  # the synthetic store has no attention
    assert "unavailable" in curve.to_markdown()


def test_learning_curve_skips_a_point_too_small_to_fit_and_keeps_the_rest(store, monkeypatch):
    """A fit that cannot run on a small fraction's rows (TAD's stacking needs 5 training
    sequences; a 300-row TriviaQA slice has 4 at 10%) is a skipped point, not a lost section."""
    import actmap.experiments.learning_curve as lc

    real = lc._actmap_point

    def needs_many_rows(method, subsamples, *args):
        if len(subsamples[0]) < 20:
            raise ValueError(f"needs at least 20 training rows, got {len(subsamples[0])}")
        return real(method, subsamples, *args)

    monkeypatch.setattr(lc, "_actmap_point", needs_many_rows)
    config = LearningCurveConfig(
        fractions=(0.1, 1.0), seeds=(1,), methods=("logreg",), max_epochs=4, n_resamples=50
    )
    curve = run_learning_curve(store, config)
    small = 2 * round(0.1 * curve.rows["train"] / 2)
    assert small < 20 <= curve.rows["train"]
    assert [p.fraction for p in curve.curve("logreg")] == [1.0]
    assert curve.skipped == [
        ("logreg", 0.1, small, f"needs at least 20 training rows, got {small}")
    ]
    assert curve.to_json()["skipped"][0]["n_train"] == small
    row = next(line for line in curve.to_markdown().splitlines() if line.startswith("| logreg"))
    assert f"skipped (n={small})" in row and f"(n={curve.rows['train']})" in row


def test_learning_curve_fits_a_baseline_once_per_distinct_subsample():
    """At 100% every seed draws all the training rows: a baseline (its fit does not read the
    seed) is fit once and its scores serve every seed; smaller fractions fit per seed."""
    from types import SimpleNamespace

    from actmap.experiments.learning_curve import _baseline_point

    fits = []

    class MeanOfRows:  # a deterministic stand-in baseline: its scores depend on its rows only
        def scores(self, rows, labels, seed):
            fits.append(tuple(rows))
            return SimpleNamespace(confidence=np.full(4, float(np.mean(rows)))), False

    labels = {"train": np.arange(20) % 2, "test": np.array([0, 1, 0, 1])}
    full = [balanced_subsample(labels["train"], 1.0, s) for s in (1, 2, 3)]
    point = _baseline_point(MeanOfRows(), "m", full, labels, (1, 2, 3))
    assert fits == [tuple(range(20))] and point.confidence.shape == (3, 4)
    np.testing.assert_array_equal(point.confidence, np.full((3, 4), 9.5))
    fits.clear()
    half = [balanced_subsample(labels["train"], 0.5, s) for s in (1, 2, 3)]
    point = _baseline_point(MeanOfRows(), "m", half, labels, (1, 2, 3))
    assert fits == [tuple(r) for r in half]  # three different draws, three fits
    np.testing.assert_array_equal(point.confidence[:, 0], [np.mean(r) for r in half])


# --- localization --------------------------------------------------------------------------


def test_whole_map_occlusion_is_chance_and_signal_region_matters(logreg):
    detector, test = logreg
    result = localize(detector, test, LocalizationConfig(ig_steps=4))
    assert result.whole_map_auroc == 0.5
    assert result.auroc > 0.8
    # the label lives in layers 2-3 of 6 (map rows ~10-21) and hidden units 0-63 (coords 0-31)
    row, col = np.unravel_index(
        np.argmax(result.integrated_gradients), result.integrated_gradients.shape
    )
    assert 2 <= row <= 5 and col <= 1
    assert result.integrated_gradients.sum() == pytest.approx(1.0)
    assert result.rollout is None  # not a ViT


def test_occlusion_of_the_only_region_read_gives_chance(logreg):
    """A linear detector that reads one region only: occluding it ties every score (drop =
    AUROC - 0.5), occluding any other region changes nothing."""
    import copy

    detector, test = logreg
    local = copy.deepcopy(detector)
    weight = local.model_.linear.weight.data.view(12, 32, 128)
    keep = torch.zeros_like(weight)
    keep[:, 12:16, 0:16] = 1  # depth band 3, coordinate band 0 of the 8 x 8 grid
    weight.mul_(keep)
    result = localize(local, test, LocalizationConfig(ig_steps=2))
    expected = np.zeros((8, 8))
    expected[3, 0] = result.auroc - 0.5
    np.testing.assert_allclose(result.occlusion_drop, expected, atol=1e-12)
    np.testing.assert_allclose(result.band_drop, expected.sum(axis=1), atol=1e-12)
    assert result.integrated_gradients[3, 0] == pytest.approx(1.0)


def test_integrated_gradients_of_a_linear_model_are_input_times_weight(logreg):
    detector, test = logreg
    x = torch.as_tensor(np.asarray(test.maps[:5], dtype=np.float32))
    attributions = integrated_gradients(detector.model_, x, steps=3)
    weight = detector.model_.linear.weight.detach().reshape(x.shape[1:])
    torch.testing.assert_close(attributions, x * weight, rtol=1e-4, atol=1e-5)


def test_rollout_attention_reproduces_the_block_output():
    """With one head, the recomputed softmax weights times v, projected, is the block's
    attention output (what the rollout multiplies is the attention the model used)."""
    from actmap.detectors.vit import MapViT

    torch.manual_seed(0)
    model = MapViT(
        in_channels=2, map_height=8, map_width=32, patch=(4, 16), dim=8, depth=2, heads=1
    ).eval()
    h = model.blocks[0].norm1(torch.randn(3, 5, 8))
    attn = model.blocks[0].attn
    weights = _block_attention(model.blocks[0], h)  # (3, 5, 5)
    v = attn.qkv(h)[..., 16:]
    torch.testing.assert_close(attn.proj(weights @ v), attn(h), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 5))


# --- calibration ---------------------------------------------------------------------------


def _calibrated_scores(n=200, mu=1.0, seed=0) -> SeedScores:
    """Logits z = 2 mu x with x ~ N(+-mu, 1): sigmoid(z) is the exact balanced posterior."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    z = 2 * mu * (rng.standard_normal((2, n)) + np.where(y == 1, mu, -mu))
    return SeedScores("calibrated", y, sigmoid(z), (0, 1), True, z)


def test_resampling_against_direct_counts():
    rng = np.random.default_rng(0)
    y = np.array([1] * 20 + [0] * 30)
    rows = class_conditional_resample(y, 0.3, 50, rng)
    assert len(rows) == 50 and y[rows].sum() == 15  # round(0.3 * 50) correct rows
    assert set(rows[:15]) <= set(range(20)) and set(rows[15:]) <= set(range(20, 50))
    distinct = distinct_at_prevalence(y, 0.3, 256, rng)
    assert len(set(distinct)) == len(distinct) == 42  # floor(30 / 0.7) = 42 rows at most
    assert y[distinct].sum() == round(0.3 * 42)
    assert len(distinct_at_prevalence(y, 0.3, 10, rng)) == 10


def test_temperature_scaling_against_a_grid_search():
    scores = _calibrated_scores()
    z, y = scores.logits[0] * 3.0, scores.labels  # overconfident by a factor 3
    got = metrics.temperature_scaled_ece(z, y, seed=0)
    order = np.random.default_rng(0).permutation(len(z))
    fit = order[: len(z) // 2]
    grid = np.exp(np.linspace(-3, 3, 6001))
    nll = [np.mean(np.logaddexp(0, z[fit] / t) - y[fit] * z[fit] / t) for t in grid]
    assert got["temperature"] == pytest.approx(grid[int(np.argmin(nll))], rel=2e-3)
    assert got["ece_after"] < got["ece_before"]


def test_risk_coverage_against_a_naive_loop():
    scores = _calibrated_scores(60)
    s, y = scores.confidence[0], scores.labels
    result = selective_prediction(scores, CalibrationConfig(n_resamples=50))
    best_coverage, risk_at_80 = 0.0, None
    for threshold in sorted(set(s), reverse=True):  # accept every score >= threshold
        accepted = s >= threshold
        risk = 1 - y[accepted].mean()
        if risk <= 0.05:
            best_coverage = max(best_coverage, accepted.mean())
        if risk_at_80 is None and accepted.mean() >= 0.8:
            risk_at_80 = risk
    assert result.coverage_at_risk.estimate == pytest.approx(
        np.mean([metrics.coverage_at_risk(c, y) for c in scores.confidence])
    )
    assert metrics.coverage_at_risk(s, y) == pytest.approx(best_coverage)
    assert metrics.risk_at_coverage(s, y) == pytest.approx(risk_at_80)
    assert result.coverage[-1] == 1.0 and len(result.coverage) == len(result.risk)


def test_reliability_bins_add_up_to_the_ece():
    scores = _calibrated_scores()
    r = reliability(scores.confidence[0], scores.labels)
    direct = sum(
        c / len(scores.labels) * abs(f - p)
        for c, f, p in zip(r.count, r.fraction_correct, r.mean_p, strict=True)
        if c
    )
    assert r.ece == pytest.approx(direct) and sum(r.count) == len(scores.labels)


def test_prior_shift_repairs_calibration_under_prevalence_shift():
    scores = _calibrated_scores(400)
    shift = prevalence_shift(scores, 0.2, CalibrationConfig(n_replicates=20))
    assert shift.ece_prior_shift["mean"] < shift.ece_raw["mean"]
    assert shift.n_fit == 125 and shift.n_eval == 200  # floor(100 / 0.8); half of 400 rows
    calibration = run_calibration([scores], 0.2, CalibrationConfig(n_replicates=5, n_resamples=50))
    text = calibration.to_markdown()
    assert "Prevalence shift" in text and calibration.to_json()["methods"][0]["shift"]


def test_prevalence_shift_fits_temperature_on_held_out_target_rows():
    """T is fit on the target rows (not the test rows): every replicate's T equals a grid
    search on them when they are all drawn (at the target prevalence exactly), and the whole
    balanced test set is resampled and scored."""
    from actmap.experiments.calibration import FALLBACK_SOURCE, TargetRows

    scores = _calibrated_scores(100)
    rng = np.random.default_rng(3)
    y_target = np.array([1] * 12 + [0] * 28)  # 40 rows at prevalence 0.3
    z_target = 3.0 * (rng.standard_normal((2, 40)) + np.where(y_target == 1, 1.0, -1.0))
    target = TargetRows(z_target, y_target, "40 held-out rows")
    shift = prevalence_shift(scores, 0.3, CalibrationConfig(n_replicates=4), target)
    grid = np.exp(np.linspace(-3, 3, 6001))
    per_seed = []
    for z in z_target:
        nll = [np.mean(np.logaddexp(0, z / t) - y_target * z / t) for t in grid]
        per_seed.append(grid[int(np.argmin(nll))])
    assert shift.temperature["mean"] == pytest.approx(np.mean(per_seed), rel=2e-3)
    assert shift.temperature["low"] == pytest.approx(shift.temperature["high"])  # same rows
    assert (shift.n_fit, shift.n_eval, shift.fit_source) == (40, 100, "40 held-out rows")
    # the test rows' own logits never enter the fit: scaling them leaves T unchanged
    louder = dataclasses.replace(scores, logits=scores.logits * 5.0)
    assert prevalence_shift(louder, 0.3, CalibrationConfig(n_replicates=2), target).temperature[
        "mean"
    ] == pytest.approx(shift.temperature["mean"])
    fallback = prevalence_shift(scores, 0.3, CalibrationConfig(n_replicates=2))
    assert fallback.fit_source == FALLBACK_SOURCE and fallback.n_eval == 50
    table = run_calibration(
        [scores], 0.3, CalibrationConfig(n_replicates=2, n_resamples=20), "", {"calibrated": target}
    ).to_markdown()
    assert "40 held-out rows (40)" in table
    with pytest.raises(ValueError, match="seeds"):
        prevalence_shift(
            scores,
            0.3,
            CalibrationConfig(n_replicates=1),
            TargetRows(z_target[:1], y_target, "one seed"),
        )


def test_split_prevalence_reads_every_labelled_train_row(store):
    value, source = split_prevalence(store)
    meta = store.metadata()
    assert value == pytest.approx(meta.loc[meta["split"] == "train", "label"].mean())
    assert "labelled train rows" in source


# --- figures -------------------------------------------------------------------------------


def test_figures_render(store, logreg, tmp_path):
    from actmap.report.plots import save_figure
    from actmap.report.plots.ablations import plot_ablations
    from actmap.report.plots.calibration import plot_reliability, plot_risk_coverage
    from actmap.report.plots.learning import plot_learning_curve
    from actmap.report.plots.localization import plot_atlas, plot_depth_profile

    detector, test = logreg
    ablation = run_ablations(
        store,
        AblationConfig(
            detector="logreg",
            seeds=(1,),
            max_epochs=2,
            n_resamples=50,
            variants=("full", "answer_length"),
        ),
    )
    curve = run_learning_curve(
        store,
        LearningCurveConfig(
            fractions=(0.5, 1.0), seeds=(1,), methods=("logreg",), max_epochs=2, n_resamples=50
        ),
    )
    scores = train_seeds(
        Rows(None, np.asarray(test.labels), np.asarray(test.maps)),
        test,
        test,
        "logreg",
        (1,),
        recipe_config(2),
    )
    calibration = run_calibration(
        [scores, _flip(scores)], 0.3, CalibrationConfig(n_replicates=3, n_resamples=50)
    )
    location = localize(detector, test, LocalizationConfig(ig_steps=2))
    figures = {
        "ablations": plot_ablations(ablation),
        "learning": plot_learning_curve(curve),
        "atlas": plot_atlas(location),
        "depth": plot_depth_profile(location),
        "reliability": plot_reliability(calibration),
        "risk": plot_risk_coverage(calibration),
    }
    assert len(figures["ablations"].axes[0].patches) == 2  # one bar per variant that ran
    assert len(figures["learning"].axes[0].lines) == 2  # logreg and the chance line
    assert len(figures["risk"].axes[0].lines) >= 2
    for name, figure in figures.items():
        path = save_figure(figure, tmp_path / f"{name}.png")
        assert path.stat().st_size > 5000


def _flip(scores: SeedScores) -> SeedScores:
    """A second method on the same rows: the opposite ranking, as a probability."""
    return SeedScores("flipped", scores.labels, 1 - scores.confidence, scores.seeds, True)


def test_auroc_summary_refuses_different_rows():
    a = SeedScores("a", np.array([0, 1, 0, 1]), np.array([0.1, 0.9, 0.2, 0.8]), (0,), True)
    b = SeedScores("b", np.array([1, 0, 0, 1]), np.array([0.1, 0.9, 0.2, 0.8]), (0,), True)
    with pytest.raises(ValueError, match="same rows"):
        auroc_summary(a, b, n_resamples=10)
    assert math.isnan(auroc_summary(a, n_resamples=10).std)
    assert auroc_rows(np.array([[0.1, 0.9, 0.2, 0.8]]), np.array([[0, 1, 0, 1]]))[0] == 1.0


def test_claim_helpers_pick_the_worst_variant_and_the_peak_band(store, logreg):
    result = run_ablations(
        store,
        AblationConfig(
            detector="logreg",
            seeds=(1,),
            max_epochs=3,
            n_resamples=50,
            variants=("full", "segments_1", "last_token_channels", "classifier_logreg"),
        ),
    )
    worst = result.most_damaging()
    diffs = {
        v: result.variant(v).summary.difference.estimate
        for v in ("segments_1", "last_token_channels")
    }
    assert worst.name == min(diffs, key=diffs.get)
    assert result.classifier_spread()["spread"] == 0.0  # one classifier
    detector, test = logreg
    location = localize(detector, test, LocalizationConfig(ig_steps=2))
    first, last = location.peak_depth_band()
    band = int(np.argmax(location.band_drop))
    assert (first, last) == (4 * band, 4 * band + 3)


def test_recaptured_hidden_states_pool_back_to_the_stored_trajectories(
    tmp_path, tiny_llama, word_tokenizer
):
    from test_capture_run import SOURCE, WordTask

    from actmap.capture import CaptureConfig
    from actmap.capture.run import run_capture, store_config
    from actmap.experiments.ablations import recapture_hidden
    from actmap.maps import pool_hidden
    from actmap.store import MapStore

    task = WordTask(9)
    config = CaptureConfig(max_new_tokens=5, batch_size=4)
    store = MapStore.create(tmp_path, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(
        tiny_llama,
        word_tokenizer,
        SOURCE,
        task,
        task.examples,
        store,
        config,
        keep_trajectories=True,
    )
    ids = sorted(store.ids())[:5]
    hidden = recapture_hidden(store, ids, tiny_llama, word_tokenizer, batch_size=2)
    stored = store.read_arrays("trajectories", ids)
    width = tiny_llama.config.hidden_size
    for key in ids:
        assert hidden[key].shape[-1] == width and hidden[key].shape[:2] == stored[key].shape[:2]
        pooled = pool_hidden(torch.from_numpy(hidden[key].astype(np.float32)), 128)
        np.testing.assert_allclose(pooled.numpy(), stored[key].astype(np.float32), atol=2e-2)


def test_results_arrive_as_they_finish_and_outside_scores_join(store):
    seen = []
    config = AblationConfig(
        detector="logreg",
        seeds=(1,),
        max_epochs=2,
        n_resamples=50,
        variants=("full", "resolution_64x256", "answer_length"),
    )
    result = run_ablations(store, config, on_result=lambda v: seen.append(v.name))
    assert seen == ["full", "resolution_64x256", "answer_length"]
    from actmap.experiments.ablations import with_scores

    full = result.variant("full").scores
    joined = with_scores(result, "classifier_vit", dataclasses.replace(full, method="vit"), "run")
    vit = joined.variant("classifier_vit")
    assert vit.summary.reference == "full" and vit.summary.difference.estimate == 0.0
    assert vit.reason == "run" and len(joined.variants) == 4
