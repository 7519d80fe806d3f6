"""Relabelling a store under another named rule, without generating again."""

from __future__ import annotations

import os

import pytest
from conftest import ListTask

from actmap.capture import CaptureConfig
from actmap.capture.run import run_capture
from actmap.data.base import Example
from actmap.data.labels import alias_contained, qa_correct
from actmap.labelling.relabel import relabel_store
from actmap.llm.models import ModelSource
from actmap.store import MapStore, StoreError

SOURCE = ModelSource("tiny", "tiny", None, "0")


class AliasTask(ListTask):
    name = "aliases"
    max_new_tokens = 4

    def __init__(self):
        words = "red blue green one two three the river".split()
        super().__init__(
            Example(
                f"k{i}",
                "aliases",
                ("train", "validation", "test")[i % 3],
                f"{words[i % 8]} {words[(i * 3) % 8]}",
                (words[(i * 5) % 8], "the " + words[i % 8]),
            )
            for i in range(18)
        )

    def label(self, answer, example):
        return qa_correct(answer, example.references)


def test_relabel_rewrites_labels_and_shares_side_tables(tmp_path, tiny_llama, word_tokenizer):
    task = AliasTask()
    store = MapStore.create(tmp_path / "a", {"t": 1})
    run_capture(
        tiny_llama,
        word_tokenizer,
        SOURCE,
        task,
        task.examples,
        store,
        CaptureConfig(max_new_tokens=4),
    )
    new = relabel_store(store, tmp_path / "b", "contains")
    old_meta, new_meta = store.metadata().set_index("id"), new.metadata().set_index("id")
    refs = {f"aliases:{e.source_key}": e.references for e in task.examples}
    for key, row in new_meta.iterrows():
        assert row["label"] == int(alias_contained(row["answer"], refs[key]))
        assert old_meta.loc[key, "label"] == int(qa_correct(row["answer"], refs[key]))
    assert new.manifest["config"]["relabel"]["rule"] == "contains"
    shard = next((tmp_path / "a" / "generations").glob("*.parquet"))
    twin = tmp_path / "b" / "generations" / shard.name
    assert os.path.samefile(shard, twin) or twin.read_bytes() == shard.read_bytes()
    with pytest.raises(ValueError, match="unknown label rule"):
        relabel_store(store, tmp_path / "c", "nope")
    with pytest.raises(StoreError, match="already holds"):
        relabel_store(store, tmp_path / "b", "contains")
