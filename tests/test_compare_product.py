"""compare_product and `actmap train --detector actmap-plus` on a tiny captured store."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score
from test_baselines_runner import SOURCE, AlternatingTask
from typer.testing import CliRunner

from actmap.capture import CaptureConfig
from actmap.capture.from_store import read_generations
from actmap.capture.run import run_capture, store_config
from actmap.cli import app
from actmap.detectors.plus import ActMapPlus, PlusConfig
from actmap.experiments.compare_product import compare_product, store_rows
from actmap.maps import MapConfig
from actmap.scoring.metrics import ece
from actmap.scoring.prior import shift_to_prevalence
from actmap.store import MapStore

GRID = (
    PlusConfig(n_components=3, n_strengths=2, cv_folds=2),
    PlusConfig(0, n_strengths=2, cv_folds=2),
)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_llama, word_tokenizer):
    task = AlternatingTask()
    config = CaptureConfig(max_new_tokens=5, batch_size=8, attention_keys=3)
    root = tmp_path_factory.mktemp("plus") / "store"
    store = MapStore.create(root, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config)
    return root


def test_compare_product_rows_intervals_and_natural_metrics(tiny_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(tiny_store, root)
    store = MapStore.open(root)
    result = compare_product(
        store,
        baselines=("perplexity", "answer_length"),
        vit_epochs=1,
        vit_seeds=(42,),
        device="cpu",
        n_resamples=200,
        plus_grid=GRID,
        n_permutations=2,
    )
    rows = {r.method: r for r in result.rows}
    assert [r.role for r in result.rows][:3] == ["product", "strongest baseline", "paper ViT"]
    strongest = result.rows[1].method
    others = [r for r in result.rows if r.role in ("strongest baseline", "baseline")]
    assert rows[strongest].validation_auroc == max(r.validation_auroc for r in others)
    # perplexity's test AUROC, recomputed from the stored log-probs
    sets = store_rows(store)
    gens = read_generations(store, sets["test"].ids)
    confidence = [float(np.mean(g.logprobs.numpy())) for g in gens]
    assert rows["perplexity"].test_auroc.estimate == pytest.approx(
        roc_auc_score(sets["test"].labels, confidence)
    )
    plus = rows["actmap-plus"]
    for r in result.rows[1:]:  # paired difference: plus minus the method, on the same rows
        assert r.difference.estimate == pytest.approx(
            plus.test_auroc.estimate - r.test_auroc.estimate
        )
        assert r.difference.n == result.n_test == len(sets["test"].ids)
    assert plus.difference is None
    assert rows["perplexity"].natural_ece is None  # not a probability
    assert rows["vit"].natural_ece is not None and rows["answer_length"].natural_ece is not None
    assert result.n_test_all == len(sets["test_all"].ids)
    assert result.deployment_prevalence == pytest.approx(sets["train_all"].prevalence)
    supervised = {"answer_length"} & {strongest}  # perplexity has no labels to permute
    assert set(result.controls) == {"actmap-plus"} | supervised
    assert all(len(v) == 2 and all(0 <= a <= 1 for a in v) for v in result.controls.values())
    assert "| actmap-plus | product |" in result.to_markdown()
    json.dumps(result.to_json())  # plain JSON


def test_natural_ece_corrected_is_the_shifted_probabilities(tiny_store, tmp_path):
    """The corrected ECE is the ECE of the logit-shifted probabilities (checked by hand)."""
    from actmap.experiments.compare_product import Scored, natural_metrics

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 50)
    p = rng.random(50)
    scored = Scored("x", p, test_all=p, calibrated_prevalence=0.5)
    auc, raw, corrected = natural_metrics(scored, y, 0.2)
    assert auc == pytest.approx(roc_auc_score(y, p))
    assert raw == pytest.approx(ece(p, y))
    assert corrected == pytest.approx(ece(shift_to_prevalence(p, 0.2, 0.5), y))


def test_train_actmap_plus_cli_saves_a_loadable_run(tiny_store, tmp_path, monkeypatch):
    import actmap.experiments.compare_product as comparison

    monkeypatch.setattr(comparison, "PLUS_GRID", GRID)
    root = tmp_path / "store"
    shutil.copytree(tiny_store, root)
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--store", str(root), "--out", str(out), "--detector", "actmap-plus"]
    )
    assert result.exit_code == 0, result.output
    est = ActMapPlus.load(out / "seed-0")
    sets = store_rows(MapStore.open(root))
    test = sets["test"]
    import pandas as pd

    scores = pd.read_parquet(out / "seed-0" / "test_scores.parquet")
    np.testing.assert_allclose(
        scores["p_correct"], est.predict_proba(test.maps, test.scalars), rtol=1e-6
    )
    evaluated = CliRunner().invoke(
        app,
        ["evaluate", "--run", str(out), "--store", str(root), "--out", str(tmp_path / "e.json")],
    )
    assert evaluated.exit_code == 0, evaluated.output
    frozen = json.loads((tmp_path / "e.json").read_text())["per_seed"]["0"]["auroc"]
    assert frozen == pytest.approx(roc_auc_score(test.labels, scores["p_correct"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["per_seed"]["0"]["auroc"] == pytest.approx(
        roc_auc_score(test.labels, scores["p_correct"])
    )


def test_plus_tries_balanced_weighted_and_unweighted_rows_and_keeps_the_validation_best(
    tiny_store,
):
    from actmap.experiments.compare_product import plus_label, plus_scored

    sets = store_rows(MapStore.open(tiny_store))
    plus = plus_scored(sets, GRID)
    grid = plus.details["grid"]
    assert len(grid) == 3 * len(GRID)
    assert {k.split(": ")[0] for k in grid} == {"train", "train_all", "train_all unweighted"}
    assert all(k.endswith("unweighted") == k.startswith("train_all unweighted") for k in grid)
    best = max(grid.values())
    first_best = next(k for k, v in grid.items() if v == best)  # ties: the earlier
    assert first_best.split(": ")[1] == plus_label(plus.estimator.config_)
    unweighted = plus.estimator.config_.class_weight is None
    assert plus.calibrated_prevalence == pytest.approx(
        sets["train_all"].prevalence if unweighted else 0.5
    )
    assert plus.details["n_train"] == len(sets[plus.details["train_rows"]].ids)
