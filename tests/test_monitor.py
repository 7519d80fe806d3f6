"""The shift monitor: exact false-alarm rate without shift, power under a known shift, per-map
scores against a direct numpy computation, save/load, and the CLI over a store and a run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.stats import binom
from sklearn.covariance import ledoit_wolf
from typer.testing import CliRunner

from actmap.cli import app
from actmap.errors import ActmapUserError
from actmap.monitor import MonitorConfig, ShiftMonitor, layer_profiles
from actmap.monitor.on_run import alarm_rates, window_rows
from actmap.store import MapRecord, MapStore

SHAPE = (3, 8, 16)  # (C, H, W): small maps, the monitor reads any shape
LOADINGS = np.random.default_rng(123).normal(size=(4, SHAPE[0] * SHAPE[1]))


def synthetic_maps(n: int, rng: np.random.Generator, shift: float = 0.0) -> np.ndarray:
    """Maps whose layer profiles follow four latent factors; ``shift`` moves the first."""
    z = rng.normal(size=(n, 4))
    z[:, 0] += shift
    profile = (z @ LOADINGS).reshape(n, SHAPE[0], SHAPE[1], 1)
    return (profile + rng.normal(size=(n, *SHAPE))).astype(np.float16)


def test_layer_profiles_are_row_means_and_stds():
    maps = np.random.default_rng(0).normal(size=(3, 2, 4, 5)).astype(np.float16)
    expected = []
    for m in maps.astype(np.float64):
        means = [m[c, h].mean() for c in range(2) for h in range(4)]
        stds = [
            np.sqrt(((m[c, h] - m[c, h].mean()) ** 2).mean()) for c in range(2) for h in range(4)
        ]
        expected.append(means + stds)
    np.testing.assert_allclose(layer_profiles(maps), expected, rtol=1e-5, atol=1e-6)


def test_false_alarm_rate_without_shift_is_alpha():
    """Each trial: fresh in-domain data, a fresh monitor, one fresh window. The permutation
    p-value is exact, so the alarms are Binomial(trials, q) with q = floor(alpha (B+1)) / (B+1)
    = 0.05 exactly (no ties with continuous data). The count must fall inside that binomial's
    central 99.8% range; a test that ignored the reference's noise or a biased threshold
    (e.g. the in-sample quantile) lands far outside it."""
    trials, alpha = 300, 0.05
    config = dict(n_components=6, n_reference=100, n_permutations=99, alpha=alpha)
    alarms = 0
    for trial in range(trials):
        rng = np.random.default_rng(trial)
        monitor = ShiftMonitor(MonitorConfig(seed=trial, **config)).fit(synthetic_maps(150, rng))
        alarms += monitor.test_window(synthetic_maps(30, rng), seed=trial).alarm
    low, high = binom.ppf(0.001, trials, alpha), binom.isf(0.001, trials, alpha)
    assert low <= alarms <= high, (alarms, low, high)


def test_a_known_shift_alarms_and_larger_windows_see_it_more_often():
    rng = np.random.default_rng(0)
    monitor = ShiftMonitor(MonitorConfig(n_components=6, n_reference=300)).fit(
        synthetic_maps(600, rng)
    )

    def rate(size: int, shift: float, n: int = 40) -> float:
        return np.mean(
            [monitor.test_window(synthetic_maps(size, rng, shift), seed=i).alarm for i in range(n)]
        )

    assert rate(50, 2.0) == 1.0  # a large shift: every window alarms
    small, large = rate(10, 0.5), rate(80, 0.5)
    assert large >= 0.9 and large > small + 0.3, (small, large)


def test_per_map_score_is_the_mahalanobis_distance_to_the_transform_rows():
    rng = np.random.default_rng(1)
    maps = synthetic_maps(300, rng)
    monitor = ShiftMonitor(MonitorConfig(n_components=5)).fit(maps)
    new = synthetic_maps(20, rng, shift=1.0)

    def features(m):  # the monitor's feature space, written out with numpy
        x = m.astype(np.float64)
        profiles = np.concatenate(
            [x.mean(axis=3).reshape(len(x), -1), x.std(axis=3).reshape(len(x), -1)], axis=1
        )
        return ((profiles - monitor.feature_mean_) / monitor.feature_scale_) @ monitor.components_.T

    fit_rows = features(maps[monitor.transform_rows_])
    covariance, _ = ledoit_wolf(fit_rows)
    centred = features(new) - fit_rows.mean(axis=0)
    expected = np.array([c @ np.linalg.inv(covariance) @ c for c in centred])
    scores = monitor.score_maps(new)
    np.testing.assert_allclose(scores.distance, expected, rtol=1e-6)
    # the conformal p-value: (1 + reference scores at least as large) / (1 + n)
    reference = monitor.calibration_scores_
    p = [(1 + np.sum(reference >= d)) / (1 + len(reference)) for d in expected]
    np.testing.assert_allclose(scores.p_value, p)
    assert (scores.flagged == (scores.p_value <= monitor.config.map_alpha)).all()


def test_per_map_p_values_of_in_domain_maps_are_uniform():
    rng = np.random.default_rng(2)
    monitor = ShiftMonitor(MonitorConfig(n_components=5)).fit(synthetic_maps(1500, rng))
    p = monitor.score_maps(synthetic_maps(3000, rng)).p_value
    # 1000 calibration scores: P(p <= 0.1) is 0.1 +- 0.0095 (sd over calibration sets), plus
    # 0.0055 binomial sd over 3000 maps; 0.045 is over four combined sd
    assert abs(np.mean(p <= 0.1) - 0.1) < 0.045
    shifted = monitor.score_maps(synthetic_maps(500, rng, shift=3.0)).p_value
    assert np.mean(shifted <= 0.1) > 0.5


def test_save_and_load_score_the_same(tmp_path):
    rng = np.random.default_rng(3)
    monitor = ShiftMonitor(MonitorConfig(n_components=4, seed=7)).fit(synthetic_maps(120, rng))
    monitor.save(tmp_path / "m", metadata={"note": "x"})
    loaded = ShiftMonitor.load(tmp_path / "m")
    window = synthetic_maps(25, rng, shift=0.3)
    np.testing.assert_array_equal(
        loaded.score_maps(window).distance, monitor.score_maps(window).distance
    )
    assert loaded.test_window(window, seed=1) == monitor.test_window(window, seed=1)
    assert loaded.config == monitor.config and loaded.metadata_["note"] == "x"
    (tmp_path / "m" / "config.json").write_text("{")
    with pytest.raises(ActmapUserError, match="config.json"):
        ShiftMonitor.load(tmp_path / "m")
    with pytest.raises(ActmapUserError, match="another map shape"):
        monitor.score_maps(np.zeros((2, 3, 4, 16), dtype=np.float16))
    with pytest.raises(ActmapUserError, match="at least 30"):
        ShiftMonitor().fit(synthetic_maps(10, rng))


def small_store(path, n: int, rng, shift: float = 0.0, correct_every: int = 3) -> MapStore:
    store = MapStore.create(path, {"synthetic": True}, map_shape=SHAPE)
    maps = synthetic_maps(n, rng, shift)
    splits = ("train", "train", "validation", "test")
    records = [
        MapRecord(f"s:{i}", str(i), "s", splits[i % 4], "m", "r", "p", "a", 3,
                  int(i % correct_every == 0), maps[i])
        for i in range(n)
    ]  # fmt: skip
    store.write_maps(records)
    return store


def test_prevalence_resampling_and_alarm_rates(tmp_path):
    rng = np.random.default_rng(4)
    store = small_store(tmp_path / "s", 400, rng)
    ids = window_rows(store, "test", prevalence=0.1)
    meta = store.metadata().set_index("id").loc[ids]
    assert (meta["split"] == "test").all() and len(set(ids)) == len(ids)
    assert meta["label"].mean() == pytest.approx(0.1, abs=0.01)
    # all incorrect test rows are kept: 10% correct is reached by dropping correct ones
    assert (meta["label"] == 0).sum() == int(
        ((store.metadata()["split"] == "test") & (store.metadata()["label"] == 0)).sum()
    )
    with pytest.raises(ActmapUserError, match="no rows of split 'dev'"):
        window_rows(store, "dev")
    monitor = ShiftMonitor(MonitorConfig(n_components=5)).fit(
        store.load_maps(window_rows(store, "train"))[0]
    )
    maps, _ = store.load_maps(window_rows(store, "test"))
    result = alarm_rates(monitor, maps, windows=(20, 100), n_windows=20)
    assert [r.window for r in result.rates] == [20, 100]
    first = result.rates[0]
    assert first.independent_windows == 5 and first.windows == 20 and first.passes == 4
    assert first.interval_low <= first.alarm_rate <= 1
    with pytest.raises(ActmapUserError, match="window 500"):
        alarm_rates(monitor, maps, windows=(500,))


def test_cli_fits_next_to_the_run_and_checks_another_store(tmp_path):
    rng = np.random.default_rng(5)
    small_store(tmp_path / "home", 240, rng)
    small_store(tmp_path / "away", 240, rng, shift=3.0)
    runner = CliRunner()
    run = tmp_path / "run"
    trained = runner.invoke(
        app,
        ["train", "--store", str(tmp_path / "home"), "--out", str(run), "--detector", "logreg",
         "--seeds", "1", "--max-epochs", "1", "--device", "cpu"],
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output
    fitted = runner.invoke(
        app,
        [
            "monitor",
            "fit",
            "--run",
            str(run),
            "--store",
            str(tmp_path / "home"),
            "--components",
            "5",
        ],
    )
    assert fitted.exit_code == 0, fitted.output
    assert (run / "monitor" / "model.safetensors").is_file()
    saved = json.loads((run / "monitor" / "config.json").read_text())
    assert saved["n_fit"] == 120 and saved["metadata"]["split"] == "train"
    out = tmp_path / "check.json"
    checked = runner.invoke(
        app,
        ["monitor", "check", "--run", str(run), "--store", str(tmp_path / "away"),
         "--window", "10,50", "--windows", "10", "--out", str(out)],
    )  # fmt: skip
    assert checked.exit_code == 0, checked.output
    result = json.loads(out.read_text())
    assert [r["alarm_rate"] for r in result["rates"]] == [1.0, 1.0]
    missing = runner.invoke(
        app, ["monitor", "check", "--run", str(tmp_path), "--store", str(tmp_path / "away")]
    )
    assert missing.exit_code == 2 and "no monitor" in missing.output


def test_window_rows_read_a_rewritten_id_once_with_its_last_label(tmp_path):
    # the store's rule: an id written twice is one row, its last; resampling draws from those
    store = small_store(tmp_path / "s", 40, np.random.default_rng(5), correct_every=2)
    first = store.metadata().query("split == 'test'").iloc[0]  # s:3, label 0
    rewritten = store.load_maps([first["id"]])[0][0]
    store.write_maps(
        [MapRecord(first["id"], "3", "s", "test", "m", "r", "p", "a", 3, 1, rewritten)]
    )
    every = window_rows(store, "test")
    assert sorted(every) == sorted(set(every)) and len(every) == 10
    # 10 test rows: s:3 now correct, so 1 correct (s:3) and 9 incorrect (odd i, i % 4 == 3)
    for seed in range(5):
        ids = window_rows(store, "test", prevalence=0.1, seed=seed)
        assert sorted(ids) == sorted(every)  # 1 correct row allows 9 incorrect: all of them
