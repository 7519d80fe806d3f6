"""The cross-fitted comparison (`actmap.experiments.cross_fit`): folds that test every labelled
row once, and pooled scores that equal each method scored on its own."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi")
from test_stacked_run import store_path  # noqa: E402, F401  (the tiny store fixture)

from actmap.experiments.compare_product import store_rows  # noqa: E402
from actmap.experiments.cross_fit import (  # noqa: E402
    cross_fitted_comparison,
    fold_sets,
    pooled_rows,
)
from actmap.store import MapStore  # noqa: E402
from actmap.store.rows import Rows  # noqa: E402


def test_folds_test_every_labelled_row_once():
    rng = np.random.default_rng(0)
    n = 60
    labels = (rng.uniform(size=n) < 0.3).astype(np.int64)
    pool = Rows(
        [f"r{i}" for i in range(n)], labels, rng.normal(size=(n, 1, 2, 2)), rng.normal(size=(n, 6))
    )
    sets = fold_sets(pool, folds=4, seed=1)
    tested = [i for s in sets for i in s["test_all"].ids]
    assert sorted(tested) == sorted(pool.ids)  # each row tested exactly once
    for k, s in enumerate(sets):
        parts = {name: set(s[f"{name}_all"].ids) for name in ("train", "validation", "test")}
        assert not parts["train"] & parts["validation"] and not parts["train"] & parts["test"]
        assert not parts["validation"] & parts["test"]
        assert len(parts["train"] | parts["validation"] | parts["test"]) == n
        assert parts["validation"] == set(sets[(k + 1) % 4]["test_all"].ids)
        for name in ("train", "validation", "test"):
            balanced = s[name]
            assert set(balanced.ids) <= parts[name]
            assert balanced.labels.sum() * 2 == len(balanced)  # equal correct and incorrect
            # every row of the rarer class is kept
            assert balanced.labels.sum() == min(
                s[f"{name}_all"].labels.sum(), (1 - s[f"{name}_all"].labels).sum()
            )
            by_id = dict(zip(pool.ids, range(n), strict=True))
            rows = [by_id[i] for i in balanced.ids]
            np.testing.assert_array_equal(balanced.maps, pool.maps[rows])
            np.testing.assert_array_equal(balanced.scalars, pool.scalars[rows])
    with pytest.raises(ValueError, match="at least 3 folds"):
        fold_sets(pool, folds=2)


def test_pooled_scores_equal_each_method_on_its_own(store_path):  # noqa: F811
    """RAUQ needs no training, so its pooled out-of-fold confidences are RAUQ run on the pooled
    test rows directly; the pooled AUROC and the paired difference are sklearn's on them."""
    from sklearn.metrics import roc_auc_score

    from actmap.capture.from_store import read_generations
    from actmap.signals.rauq import RAUQ

    store = MapStore.open(store_path)
    result = cross_fitted_comparison(
        store,
        folds=3,
        presets=("deployable",),
        baselines=("rauq", "answer_length"),
        n_resamples=200,
    )
    sets = fold_sets(pooled_rows(store_rows(store)), folds=3)
    ids = [i for s in sets for i in s["test"].ids]
    y = np.concatenate([s["test"].labels for s in sets])
    assert result.n_test == len(ids) and result.n_rows == sum(len(s["test_all"]) for s in sets)
    rows = {r.method: r for r in result.rows}
    assert rows["actmap-plus deployable"].role == "preset"
    assert {rows["rauq"].role, rows["answer_length"].role} == {"strongest baseline", "baseline"}
    rauq = np.asarray(RAUQ().score(read_generations(store, ids)).confidence, dtype=np.float64)
    assert rows["rauq"].pooled_auroc == pytest.approx(roc_auc_score(y, rauq))
    per_fold = np.split(rauq, np.cumsum([len(s["test"]) for s in sets])[:-1])
    for got, scores, s in zip(rows["rauq"].fold_aurocs, per_fold, sets, strict=True):
        assert got == pytest.approx(roc_auc_score(s["test"].labels, scores))
    # fold-stratified: the share of within-fold (correct, incorrect) pairs ordered right, by hand
    right = pairs = 0.0
    for scores, s in zip(per_fold, sets, strict=True):
        pos, neg = scores[s["test"].labels == 1], scores[s["test"].labels == 0]
        right += (pos[:, None] > neg[None]).sum() + 0.5 * (pos[:, None] == neg[None]).sum()
        pairs += len(pos) * len(neg)
    assert rows["rauq"].test_auroc.estimate == pytest.approx(right / pairs)
    interval = rows["rauq"].test_auroc
    assert interval.low <= interval.estimate <= interval.high and interval.n == len(y)
    preset = rows["actmap-plus deployable"].test_auroc.estimate
    diff = rows["rauq"].vs["actmap-plus deployable"].estimate
    assert diff == pytest.approx(preset - right / pairs)
    assert "cross-fit over" in result.to_markdown()


def test_a_stratified_interval_matches_a_hand_written_bootstrap():
    """Resampling within each fold, same draws for both methods: a naive loop over resamples
    with the same generator gives the same percentiles."""
    from sklearn.metrics import roc_auc_score

    from actmap.scoring.intervals import resample_indices, stratified_auroc

    rng = np.random.default_rng(3)
    labels = [np.array([0, 1] * 6), np.array([0, 0, 1, 1, 1, 0, 1, 0])]
    a = [rng.normal(size=len(y)) + y for y in labels]
    b = [rng.normal(size=len(y)) for y in labels]
    got = stratified_auroc(a, labels, b, n_resamples=200, seed=5)
    draw = np.random.default_rng(5)
    idx = [resample_indices(y, 200, draw, need_both=True)[0] for y in labels]
    values = []
    for r in range(200):
        num = den = 0.0
        for k, y in enumerate(labels):
            i = idx[k][r]
            w = y[i].sum() * (len(y) - y[i].sum())
            num += w * (roc_auc_score(y[i], a[k][i]) - roc_auc_score(y[i], b[k][i]))
            den += w
        values.append(num / den)
    low, high = np.percentile(values, [2.5, 97.5])
    assert (got.low, got.high) == pytest.approx((low, high))


def test_the_cli_writes_the_cross_fit(store_path, tmp_path):  # noqa: F811
    import json

    from typer.testing import CliRunner

    from actmap.cli import app

    out = tmp_path / "cf"
    args = ["compare-stacked", "--store", str(store_path), "--out", str(out), "--cross-fit", "3"]
    result = CliRunner().invoke(app, [*args, "--presets", "deployable", "--resamples", "100"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "cross_fit.json").read_text())
    assert saved["folds"] == 3 and saved["rows"][0]["method"] == "actmap-plus deployable"
    assert len(saved["rows"][0]["fold_aurocs"]) == 3
    assert (out / "cross_fit.md").read_text().startswith(f"store {store_path}: 3-fold cross-fit")
    bad = CliRunner().invoke(app, [*args[:-1], "2"])
    assert bad.exit_code == 2 and "at least 3 folds" in bad.output
    # without --cross-fit: the fixed-split comparison, its table headed the same way
    # v1 needs 5 rows of each class for its folds, more than this store's balanced training
    # rows hold: it is left out with a warning and the rest still compare
    fixed = CliRunner().invoke(app, [*args[:-2], "--presets", "deployable", "--resamples", "100"])
    assert fixed.exit_code == 0, fixed.output
    assert "actmap-plus v1" not in (out / "stacked.md").read_text()
    table = (out / "stacked.md").read_text()
    assert "| deployable - method [95%, paired] |" in table
    assert "| deployable - method [95%, paired] |" in (out / "cross_fit.md").read_text()
