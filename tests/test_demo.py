"""`actmap demo` end to end at small size on the embedded model, checked against the files it
wrote (read back with pandas and scikit-learn, not through actmap)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from typer.testing import CliRunner

from actmap.cli import app

# 100 built-in questions leave both labels in the 10% validation and test splits.
ARGS = ["--questions", "100", "--seeds", "42", "--max-epochs", "3", "--overhead-repeats", "1"]


@pytest.mark.real_model
def test_demo_runs_end_to_end_on_the_embedded_model(embedded_gguf, tmp_path):
    from actmap.llm.models import resolve_model

    try:
        resolve_model()  # the demo loads the embedded model from its wheel, by name
    except FileNotFoundError as error:
        pytest.skip(str(error))
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--out", str(out), *ARGS, "--batch-size", "50"])
    assert result.exit_code == 0, result.output
    assert "actmap demo" in result.output and "answer length only AUROC" in result.output
    summary = json.loads((out / "demo-summary.json").read_text())

    meta = pd.read_parquet(out / "store" / "maps", columns=["id", "split", "label", "n_tokens"])
    meta = meta.drop_duplicates("id", keep="last").set_index("id")
    assert summary["rows"] + summary["empty_answers"] == 100 and summary["rows"] == len(meta)
    assert summary["natural_accuracy"]["all"] == pytest.approx(meta["label"].mean())
    assert summary["capture_overhead"]["batch"] == 50
    assert summary["capture_overhead"]["identical_tokens"] is True

    # the detector's test AUROC, from the scores it wrote
    scores = pd.read_parquet(out / "run-mlp" / "seed-42" / "test_scores.parquet")
    assert len(scores) == summary["balanced_rows"]["test"]
    assert set(scores["id"]) <= set(meta[meta["split"] == "test"].index)
    np.testing.assert_array_equal(scores["label"], meta.loc[scores["id"], "label"].astype(int))
    assert summary["detector"]["per_seed"]["42"]["auroc"] == pytest.approx(
        roc_auc_score(scores["label"], scores["p_correct"])
    )

    # the balanced rows: the stored split table, both classes equally often in every split
    splits = pd.read_parquet(out / "store" / "splits", columns=["id", "split"])
    ids = {s: splits.loc[splits["split"] == s, "id"].tolist() for s in ("train", "test")}
    for name, chosen in ids.items():
        counts = meta.loc[chosen, "label"].value_counts()
        assert len(counts) == 2 and counts.iloc[0] == counts.iloc[1]
        assert (meta.loc[chosen, "split"] == name).all()
        assert len(chosen) == summary["balanced_rows"][name]
    assert set(scores["id"]) == set(ids["test"])

    # the answer-length control, refit with scikit-learn on the stored token counts
    train, test = meta.loc[ids["train"]], meta.loc[ids["test"]]
    model = make_pipeline(StandardScaler(), LogisticRegression(C=1.0))
    model.fit(features(train["n_tokens"]), train["label"].astype(int))
    p = model.predict_proba(features(test["n_tokens"]))[:, 1]
    assert summary["answer_length_only"]["auroc"] == pytest.approx(
        roc_auc_score(test["label"].astype(int), p)
    )
    assert 0 <= summary["permuted_labels"]["auroc"] <= 1


def features(n):
    n = np.asarray(n, dtype=np.float64).reshape(-1, 1)
    return np.hstack([n, np.log1p(n)])
