"""The in-domain matrix: cells and paired differences against direct resampling loops."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from report_stores import synthetic_store
from sklearn.metrics import roc_auc_score
from typer.testing import CliRunner

from actmap.cli import app
from actmap.experiments.in_domain import (
    MethodScores,
    in_domain_column,
    paired_auroc,
    score_cell,
    store_column,
)
from actmap.store import MapStore
from actmap.store.rows import rows_to_score


def loop_interval(statistic, y, n_resamples, seed=0):
    """The percentile interval by a plain loop (redrawing single-class resamples)."""
    rng = np.random.default_rng(seed)
    values = []
    while len(values) < n_resamples:
        idx = rng.integers(0, len(y), len(y))
        if y[idx].min() == y[idx].max():
            continue
        values.append(statistic(idx))
    return np.percentile(values, [2.5, 97.5])


def scores(name, y, quality, seed, family="white"):
    rng = np.random.default_rng(seed)
    s = quality * y + rng.standard_normal(len(y))
    return MethodScores(name, family, [str(i) for i in range(len(y))], 1 / (1 + np.exp(-s)), True)


def test_cell_and_paired_intervals_match_a_direct_loop():
    y = np.array([0, 1] * 30)
    label_of = {str(i): int(v) for i, v in enumerate(y)}
    a, b = scores("actmap-mlp", y, 2.0, 1, "actmap"), scores("tad", y, 0.5, 2)
    cell = score_cell(a, label_of, 300)
    assert cell.n == 60 and cell.auroc.estimate == pytest.approx(roc_auc_score(y, a.confidence))
    low, high = loop_interval(lambda i: roc_auc_score(y[i], a.confidence[i]), y, 300)
    assert (cell.auroc.low, cell.auroc.high) == pytest.approx((low, high))
    diff = paired_auroc(a, b, label_of, 300).difference
    low, high = loop_interval(
        lambda i: roc_auc_score(y[i], a.confidence[i]) - roc_auc_score(y[i], b.confidence[i]),
        y,
        300,
    )
    assert (diff.low, diff.high) == pytest.approx((low, high))


def test_best_is_marked_only_when_every_paired_interval_excludes_zero():
    y = np.array([0, 1] * 40)
    label_of = {str(i): int(v) for i, v in enumerate(y)}
    strong, weak = scores("actmap-vit", y, 6.0, 1, "actmap"), scores("perplexity", y, 0.0, 2)
    clear = in_domain_column({"a": strong, "b": weak}, label_of, "s", "g", "t", 300)
    assert clear.best == "actmap-vit"
    twin = MethodScores("tad", "white", strong.ids, strong.confidence + 1e-9, True)
    tied = in_domain_column({"a": strong, "b": weak, "c": twin}, label_of, "s", "g", "t", 300)
    assert tied.best is None
    assert [c.family for c in tied.cells] == ["white", "white", "actmap"]  # grouped by family


def write_result(root, method, ids, confidence, probability):
    store = MapStore.open(root)
    table = pa.table({"id": ids, "split": ["test"] * len(ids), "confidence": confidence})
    store.write_table(f"results/{method}", table)
    store.set_manifest_key(["results", method], {"probability": probability})
    store.close()


def test_store_column_reads_stored_results_and_runs(tmp_path):
    root = synthetic_store(tmp_path / "s", signal=2.0)
    run = tmp_path / "run"
    args = ["train", "--store", str(root), "--out", str(run), "--detector", "logreg"]
    assert CliRunner().invoke(app, [*args, "--seeds", "1,2", "--max-epochs", "2"]).exit_code == 0
    rows = rows_to_score(MapStore.open(root), "balanced")
    rng = np.random.default_rng(0)
    write_result(root, "perplexity", rows.ids, -rng.random(len(rows.ids)) * 5, False)
    write_result(root, "tad", rows.ids[:-2], rng.random(len(rows.ids) - 2), True)
    column = store_column(root, {"logreg": run}, "s", "g", "t", n_resamples=200)
    cells = {c.method: c for c in column.cells}
    assert set(cells) == {"perplexity", "tad", "actmap-logreg"}
    assert cells["perplexity"].ece is None and cells["tad"].ece is not None
    assert cells["tad"].n == len(rows.ids) - 2 and cells["actmap-logreg"].n == len(rows.ids)
    assert cells["actmap-logreg"].seeds == 2
    assert {(p.a, p.b) for p in column.paired} == {
        ("actmap-logreg", "perplexity"),
        ("actmap-logreg", "tad"),
    }
    vs_tad = next(p for p in column.paired if p.b == "tad")
    assert vs_tad.difference.n == len(rows.ids) - 2  # the rows both scored


def test_every_method_lands_in_the_paper_family_of_its_table():
    """The taxonomy by hand: the permuted-label control is a control (not a white-box
    "label"), a permuted variant of a method keeps that method's family."""
    from actmap.experiments.in_domain import family_of

    expected = {
        "permuted_label": "control",
        "answer_length": "control",
        "semantic_entropy": "black",
        "perplexity": "grey",
        "p_true": "grey",
        "tad": "white",
        "actvit": "white",
        "permuted_tad": "white",
        "actmap-vit": "actmap",
    }
    assert {m: family_of(m) for m in expected} == expected


def test_a_detector_named_actmap_something_keeps_one_prefix(tmp_path):
    """actmap-plus runs are listed as "actmap-plus", the paper's detectors as "actmap-<name>"."""
    from actmap.training.run_folder import method_name

    assert [method_name(d) for d in ("mlp", "vit", "actmap-plus")] == [
        "actmap-mlp",
        "actmap-vit",
        "actmap-plus",
    ]
    root = synthetic_store(tmp_path / "s", signal=2.0)
    run = tmp_path / "run"
    args = ["train", "--store", str(root), "--out", str(run), "--detector", "logreg"]
    assert CliRunner().invoke(app, [*args, "--seeds", "1", "--max-epochs", "2"]).exit_code == 0
    column = store_column(root, {"actmap-plus": run}, "s", "g", "t", n_resamples=50)
    assert [c.method for c in column.cells] == ["actmap-plus"]
    assert column.cells[0].family == "actmap"
