"""``actmap baselines`` and ``actmap compare`` through typer's CliRunner on a tiny store."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import ListTask
from sklearn.metrics import roc_auc_score
from typer.testing import CliRunner

from actmap.capture import CaptureConfig
from actmap.capture.run import run_capture, store_config
from actmap.cli import app
from actmap.data.base import Example
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig
from actmap.store import MapStore
from actmap.store.rows import balanced_splits

SOURCE = ModelSource("tiny", "tiny", None, "0")
WORDS = "what is the capital of the river red blue green one two three".split()


class HalfTask(ListTask):
    """12 examples per split; every other one is labelled correct."""

    name = "half"
    max_new_tokens = 4

    def __init__(self):
        rng = np.random.default_rng(1)
        super().__init__(
            Example(
                source_key=f"{split}{i}",
                dataset="half",
                split=split,
                question=" ".join(rng.choice(WORDS, size=3)),
                references=(),
                meta={"correct": str(i % 2)},
            )
            for split in ("train", "validation", "test")
            for i in range(12)
        )


@pytest.fixture(scope="module")
def store_path(tmp_path_factory, tiny_llama, word_tokenizer):
    task = HalfTask()
    config = CaptureConfig(max_new_tokens=4, batch_size=12, attention_keys=2)
    root = tmp_path_factory.mktemp("cli") / "store"
    store = MapStore.create(root, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config)
    return root


def test_baselines_help_lists_the_options():
    result = CliRunner().invoke(app, ["baselines", "--help"])
    assert result.exit_code == 0
    for option in (
        "--methods",
        "--judge",
        "--judge-prompt",
        "--force",
        "--n-samples",
        "--actvit-grid",
        "--actvit-epochs",
        "--actvit-micro-batch",
    ):
        assert option in result.output


def test_baselines_then_compare(store_path, tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        app, ["baselines", "--store", str(store_path), "--methods", "ppl,mte,rauq,actvit"]
    )
    assert result.exit_code == 0, result.output
    assert "done" in result.output and "unavailable" in result.output  # no dense: ACT-ViT
    assert "--keep-dense" in result.output
    assert MapStore.open(store_path).ids("results/perplexity") == set(
        balanced_splits(MapStore.open(store_path))["test"]
    )
    again = runner.invoke(app, ["baselines", "--store", str(store_path), "--methods", "ppl"])
    assert again.exit_code == 0 and "skipped" in again.output

    out = tmp_path / "report" / "compare.md"
    result = runner.invoke(app, ["compare", "--store", str(store_path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.with_suffix(".json").read_text())
    assert {r["method"] for r in rows} == {
        "perplexity",
        "mean_token_entropy",
        "rauq",
        "answer_length",
    }
    store = MapStore.open(store_path)
    test = balanced_splits(store)["test"]
    labels = store.metadata().set_index("id").loc[test, "label"].to_numpy()
    scores = pd.read_parquet(store_path / "results" / "rauq").set_index("id").loc[test]
    rauq = next(r for r in rows if r["method"] == "rauq")
    assert rauq["auroc"] == pytest.approx(roc_auc_score(labels, scores["confidence"]))
    assert out.read_text().startswith("| method |")


def test_bad_method_name_is_a_clear_error(store_path):
    result = CliRunner().invoke(app, ["baselines", "--store", str(store_path), "--methods", "nope"])
    assert result.exit_code == 2 and "unknown method 'nope'" in result.output
    args = ["baselines", "--store", str(store_path), "--methods", "se", "--judge-prompt", "nli"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "judge_prompt must be one of" in result.output
    args = ["baselines", "--store", str(store_path), "--methods", "actvit"]
    result = CliRunner().invoke(app, [*args, "--actvit-micro-batch", "0"])
    assert result.exit_code == 2 and "actvit_micro_batch must be >= 1, got 0" in result.output
