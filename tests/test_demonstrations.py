"""Few-shot demonstrations: a warning when the fixed ones are missing, recorded in the store
config, and reused from a store with --demonstrations-from."""

from __future__ import annotations

import logging

import pytest
from test_data_loaders import write_jsonl

from actmap.capture.job import store_demonstrations
from actmap.data.datasets import TriviaQATask
from actmap.errors import ActmapUserError
from actmap.store import MapStore, StoreError, check_config


def trivia_rows(prefix: str, n: int = 60):
    return [
        {
            "question": f"{prefix} question {i}?",
            "question_id": f"{prefix}{i:02d}",
            "answer": {"value": f"A{i}", "aliases": [f"A{i}"]},
        }
        for i in range(n)
    ]


def test_missing_fixed_keys_warn_and_the_shown_demonstrations_are_recorded(tmp_path, caplog):
    write_jsonl(tmp_path / "triviaqa" / "validation.jsonl", trivia_rows("own"))
    task = TriviaQATask(tmp_path)
    with caplog.at_level(logging.WARNING, logger="actmap.data.datasets"):
        demos = task.demonstrations()
    assert "fixed demonstration keys" in caplog.text and "--demonstrations-from" in caplog.text
    recorded = task.describe()["demonstrations"]
    assert [d["key"] for d in recorded] == [d.source_key for d in demos]
    prompt = task.prompt(task.load("test")[0], None)
    for d in recorded:
        assert f"Question: {d['question']}\nAnswer: {d['answer']}\n" in prompt
    assert "demonstrations" not in TriviaQATask(tmp_path, prompt_style="zero_shot").describe()


def test_demonstrations_from_a_store_rebuild_its_prompts_on_other_data(tmp_path):
    write_jsonl(tmp_path / "a" / "triviaqa" / "validation.jsonl", trivia_rows("a"))
    write_jsonl(tmp_path / "b" / "triviaqa" / "validation.jsonl", trivia_rows("b"))
    original = TriviaQATask(tmp_path / "a")
    recorded = original.describe()["demonstrations"]
    reused = TriviaQATask(tmp_path / "b", demonstrations=recorded)
    example = reused.load("train")[0]
    assert reused.prompt(example, None) == original.prompt(example, None)
    assert reused.describe()["demonstrations"] == recorded
    # the demonstration rows of the data they come from are never evaluated
    same = TriviaQATask(tmp_path / "a", demonstrations=recorded)
    keys = {d["key"] for d in recorded}
    assert not keys & {e.source_key for s in ("train", "validation", "test") for e in same.load(s)}


def test_store_demonstrations_reads_the_config_and_names_problems(tmp_path):
    demos = [{"key": "k", "question": "q?", "answer": "a"}]
    store = MapStore.create(tmp_path / "s", {"task": {"task": "triviaqa", "demonstrations": demos}})
    store.close()
    assert store_demonstrations(tmp_path / "s", "triviaqa") == demos
    with pytest.raises(ActmapUserError, match="not 'nq_open'"):
        store_demonstrations(tmp_path / "s", "nq_open")
    MapStore.create(tmp_path / "z", {"task": {"task": "triviaqa"}}).close()
    with pytest.raises(ActmapUserError, match="records no demonstrations"):
        store_demonstrations(tmp_path / "z", "triviaqa")


def test_a_store_made_before_demonstrations_were_recorded_still_resumes(tmp_path):
    demos = [{"key": "k", "question": "q?", "answer": "a"}]
    check_config(
        tmp_path, {"task": {"task": "t"}}, {"task": {"task": "t", "demonstrations": demos}}
    )
    other = [{"key": "j", "question": "q?", "answer": "a"}]
    with pytest.raises(StoreError, match="demonstrations"):
        check_config(
            tmp_path,
            {"task": {"task": "t", "demonstrations": demos}},
            {"task": {"task": "t", "demonstrations": other}},
        )
