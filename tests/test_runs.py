"""A run folder holds one detector and one recipe; more seeds extend it; readers never mix."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score
from test_cli import synthetic_store
from typer.testing import CliRunner

from actmap.cli import app
from actmap.errors import ActmapUserError
from actmap.training.run_folder import read_run

runner = CliRunner()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "store"
    synthetic_store(path)
    return path


def train(store, out, detector, seeds, epochs=2, *extra):
    args = ["train", "--store", str(store), "--out", str(out), "--detector", detector]
    return runner.invoke(app, [*args, "--seeds", seeds, "--max-epochs", str(epochs), *extra])


def test_another_detector_into_the_same_folder_refuses_and_overwrite_replaces(store, tmp_path):
    run = tmp_path / "run"
    assert train(store, run, "mlp", "1,2").exit_code == 0
    refused = train(store, run, "logreg", "3")
    assert refused.exit_code == 2
    assert "holds a run of detector mlp, not logreg" in refused.output
    assert "--overwrite" in refused.output
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["detector"] == "mlp" and manifest["seeds"] == [1, 2]
    assert sorted(p.name for p in run.glob("seed-*")) == ["seed-1", "seed-2"]
    replaced = train(store, run, "logreg", "3", 2, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert sorted(p.name for p in run.glob("seed-*")) == ["seed-3"]
    assert json.loads((run / "summary.json").read_text())["detector"] == "logreg"


def test_another_recipe_refuses_and_more_seeds_extend(store, tmp_path):
    run = tmp_path / "run"
    assert train(store, run, "logreg", "1,2", 2).exit_code == 0
    refused = train(store, run, "logreg", "3", 3)
    assert refused.exit_code == 2 and "another recipe (max_epochs 2 vs 3)" in refused.output
    extended = train(store, run, "logreg", "3", 2)
    assert extended.exit_code == 0, extended.output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["seeds"] == [1, 2, 3]
    assert json.loads((run / "manifest.json").read_text())["seeds"] == [1, 2, 3]
    aurocs = []
    for seed in (1, 2, 3):
        scores = pd.read_parquet(run / f"seed-{seed}" / "test_scores.parquet")
        aurocs.append(roc_auc_score(scores["label"], scores["p_correct"]))
    assert summary["mean"]["auroc"] == pytest.approx(np.mean(aurocs))
    assert summary["std"]["auroc"] == pytest.approx(np.std(aurocs, ddof=1))
    evaluated = runner.invoke(app, ["evaluate", "--run", str(run)])
    assert evaluated.exit_code == 0, evaluated.output
    report = json.loads((run / "evaluation.json").read_text())
    assert sorted(report["per_seed"]) == ["1", "2", "3"] and report["detector"] == "logreg"


def test_evaluate_and_compare_refuse_a_folder_that_mixes_detectors(store, tmp_path):
    """A folder left mixed by an older actmap is never averaged as one result."""
    mlp, logreg = tmp_path / "mlp", tmp_path / "logreg"
    assert train(store, mlp, "mlp", "1").exit_code == 0
    assert train(store, logreg, "logreg", "3").exit_code == 0
    shutil.copytree(logreg / "seed-3", mlp / "seed-3")
    with pytest.raises(ActmapUserError, match="mixes detectors"):
        read_run(mlp)
    evaluated = runner.invoke(app, ["evaluate", "--run", str(mlp)])
    assert (
        evaluated.exit_code == 2
        and "mixes detectors (mlp in seed 1, logreg in seed 3)" in evaluated.output
    )
    compared = runner.invoke(app, ["compare", "--store", str(store), "--run", str(mlp)])
    assert compared.exit_code == 2 and "mixes detectors" in compared.output
    refused = train(store, mlp, "mlp", "2")  # and nothing is added to it
    assert refused.exit_code == 2 and "mixes detectors" in refused.output


def test_evaluate_refuses_a_folder_that_mixes_recipes(store, tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    assert train(store, short, "logreg", "1", 2).exit_code == 0
    assert train(store, long, "logreg", "2", 3).exit_code == 0
    shutil.copytree(long / "seed-2", short / "seed-2")
    evaluated = runner.invoke(app, ["evaluate", "--run", str(short)])
    assert evaluated.exit_code == 2
    assert "mixes training recipes (seed 1 vs seed 2: max_epochs 2 vs 3)" in evaluated.output


def test_a_folder_that_is_not_a_run_refuses(store, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused = train(store, out, "logreg", "1")
    assert refused.exit_code == 2 and "holds no run" in refused.output
    assert (out / "notes.txt").read_text() == "mine"
