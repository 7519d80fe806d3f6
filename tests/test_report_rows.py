"""Frozen evaluation reads a store without writing into it, on the rows asked for, and counts
empty answers as incorrect at the natural prevalence."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from report_stores import synthetic_store
from sklearn.metrics import roc_auc_score
from typer.testing import CliRunner

from actmap.cli import app
from actmap.experiments.seeds import frozen_scores
from actmap.store import MapStore
from actmap.store.rows import balanced_splits, rows_to_score


def snapshot(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("rows")
    synthetic_store(base / "a", signal=2.0)
    run = base / "run"
    args = ["train", "--store", str(base / "a"), "--out", str(run), "--detector", "logreg"]
    result = CliRunner().invoke(app, [*args, "--seeds", "1,2", "--max-epochs", "3"])
    assert result.exit_code == 0, result.output
    return base, run


@pytest.mark.parametrize("rows", ["balanced", "test", "all"])
def test_evaluate_reads_the_rows_asked_and_never_writes_the_store(trained, tmp_path, rows):
    base, run = trained
    other = synthetic_store(tmp_path / "b", signal=2.0, prevalence=0.3, seed=5)
    before = snapshot(other)
    out = tmp_path / "e.json"
    args = ["evaluate", "--run", str(run), "--store", str(other), "--rows", rows, "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert snapshot(other) == before  # no splits table, no manifest edit
    report = json.loads(out.read_text())
    store = MapStore.open(other)
    meta = store.metadata()
    expected = {
        "balanced": balanced_splits(store, persist=False)["test"],
        "test": meta.loc[meta["split"] == "test", "id"].tolist(),
        "all": meta["id"].tolist(),
    }[rows]
    assert report["n"] == len(expected)
    y = meta.set_index("id").loc[expected, "label"].to_numpy()
    p = frozen_scores(run, store, expected)["1"]
    assert report["per_seed"]["1"]["auroc"] == pytest.approx(roc_auc_score(y, p))
    # read and scored a few rows at a time: the same scores
    np.testing.assert_allclose(frozen_scores(run, store, expected, chunk=7)["1"], p, rtol=1e-6)


def test_empty_answers_count_as_incorrect_at_natural_prevalence(trained, tmp_path):
    base, run = trained
    other = synthetic_store(tmp_path / "b", signal=2.0, seed=6)
    store = MapStore.open(other)
    skipped = pa.table(
        {
            "id": ["e1", "e2", "e3"],
            "split": ["test", "test", "train"],
            "reason": ["empty answer"] * 3,
        }
    )
    store.write_table("skipped", skipped)
    store.close()
    chosen = rows_to_score(MapStore.open(other), "test")
    assert chosen.n_empty == 2
    assert rows_to_score(MapStore.open(other), "all").n_empty == 3
    assert rows_to_score(MapStore.open(other), "balanced").n_empty == 0
    out = tmp_path / "e.json"
    args = ["evaluate", "--run", str(run), "--store", str(other), "--rows", "test", "-o", str(out)]
    assert CliRunner().invoke(app, args).exit_code == 0
    report = json.loads(out.read_text())
    p = frozen_scores(run, MapStore.open(other), chosen.ids)["2"]
    y = np.r_[chosen.labels, 0, 0]
    assert report["n"] == len(chosen.ids) + 2 and report["n_empty_counted_incorrect"] == 2
    assert report["per_seed"]["2"]["auroc"] == pytest.approx(roc_auc_score(y, np.r_[p, 0, 0]))
