"""The separate judging pass: labels from a judge, resumable, the source store untouched."""

from __future__ import annotations

import json

import numpy as np
import pytest

from actmap.capture import CaptureConfig
from actmap.capture.run import run_capture, store_config
from actmap.data.datasets import CNNDMTask
from actmap.data.factuality import split_sentences
from actmap.judging import JUDGMENTS, judge_store, judged_labels
from actmap.maps import MapConfig
from actmap.models import ModelSource
from actmap.store import MapStore, StoreError

WORDS = "the capital of river red blue green one two three paris rome".split()
SOURCE = ModelSource("tiny", "tiny", None, "0")


def supported(claim: str) -> bool:
    return claim.split()[0] < "n"  # about half of the word list


class FirstWordJudge:
    """Supports a sentence iff its first word sorts before "n"; counts calls."""

    name = "first-word"

    def __init__(self):
        self.calls = 0

    def support_probability(self, document: str, claim: str) -> float:
        self.calls += 1
        return 0.9 if supported(claim) else 0.1


@pytest.fixture
def summary_store(tmp_path, tiny_llama, word_tokenizer):
    rng = np.random.default_rng(0)
    folder = tmp_path / "data" / "cnn_dm"
    folder.mkdir(parents=True)
    rows = [
        {"id": f"t{i}", "article": " ".join(rng.choice(WORDS, 6)), "highlights": "one ."}
        for i in range(10)
    ]
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "validation.jsonl").write_text(
        json.dumps({"id": "v0", "article": "red", "highlights": "red ."}) + "\n"
    )
    task = CNNDMTask(tmp_path / "data")
    config = CaptureConfig(max_new_tokens=6, batch_size=4)
    store = MapStore.create(
        tmp_path / "cnn", store_config(task, SOURCE, config, MapConfig(), keep={})
    )
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.load("test"), store, config)
    return store


def test_judging_labels_every_summary_and_resumes(summary_store, tmp_path):
    assert summary_store.metadata()["label"].isna().all()  # captured without a judge
    judge = FirstWordJudge()
    partial = judge_store(summary_store, tmp_path / "judged", judge, batch_size=3, limit=4)
    meta = partial.metadata().set_index("id")
    assert meta["label"].notna().sum() == 4 and len(meta) == 10  # the rest wait, as None
    first_calls = judge.calls
    judged = judge_store(summary_store, tmp_path / "judged", judge, batch_size=3)
    labels = judged.metadata().set_index("id")["label"]
    # independent reference: the all-sentences rule applied by hand to the stored texts
    gens = summary_store.read_table("generations").to_pandas().set_index("id")
    for key, label in labels.items():
        sentences = split_sentences(gens.at[key, "label_text"])
        assert label == int(bool(sentences) and all(supported(s) for s in sentences))
    assert len(judged_labels(judged)) == 10
    assert 0 < labels.sum() < 10  # both labels occur, so the comparison can fail
    # the second call judged only the six remaining summaries, stopping at unsupported ones
    assert judge.calls - first_calls <= sum(
        len(split_sentences(gens.at[k, "label_text"])) for k in labels.index[4:]
    )
    assert len(judged.read_table(JUDGMENTS)) == 10  # nothing judged twice
    assert summary_store.metadata()["label"].isna().all()  # the source is untouched
    assert judged.manifest["config"]["task"]["judge"] == "first-word"
    assert judged.has_table("generations") and judged.has_table("maps")


def test_judging_refuses_a_store_that_is_not_summaries(tmp_path):
    store = MapStore.create(tmp_path / "qa", {"task": {"task": "triviaqa"}})
    with pytest.raises(StoreError, match="cnn_dm"):
        judge_store(store, tmp_path / "out", FirstWordJudge())
