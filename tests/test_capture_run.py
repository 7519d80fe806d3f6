"""Capture runs into a store: labels, side tables, empty answers, and resume after a kill."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ListTask

from actmap.capture import CaptureConfig, generate_with_capture
from actmap.capture.from_store import read_generations
from actmap.capture.run import run_capture, store_config
from actmap.data.base import Example
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig, build_map
from actmap.store import MapStore

ROOT = Path(__file__).resolve().parents[1]
WORDS = "what is the capital of the river red blue green one two three four five".split()


class WordTask(ListTask):
    """Tiny task: the answer is 'correct' when its first word is in the question."""

    name = "words"
    max_new_tokens = 5

    def __init__(self, n: int = 24):
        rng = np.random.default_rng(0)
        super().__init__(
            Example(
                source_key=f"q{i}",
                dataset="words",
                split=("train", "validation", "test")[i % 3],
                question=" ".join(rng.choice(WORDS, size=int(rng.integers(2, 8)))),
                references=(),
            )
            for i in range(n)
        )

    def label(self, answer, example):
        words = answer.split()
        return bool(words) and words[0] in example.question.split()


SOURCE = ModelSource("tiny", "tiny", None, "0")


def test_run_writes_maps_labels_and_side_tables(tmp_path, tiny_llama, word_tokenizer):
    task = WordTask()
    config = CaptureConfig(max_new_tokens=5, batch_size=8, attention_keys=2, keep_dense=True)
    store = MapStore.create(tmp_path, store_config(task, SOURCE, config, MapConfig(), {}))
    summary = run_capture(
        tiny_llama,
        word_tokenizer,
        SOURCE,
        task,
        task.examples,
        store,
        config,
        keep_trajectories=True,
    )
    assert summary.written == 24 and summary.skipped_existing == 0
    maps, meta = store.load_maps()
    # independent reference: capture the same prompts directly and build each map
    direct = generate_with_capture(
        tiny_llama, word_tokenizer, [e.question for e in task.examples], config
    )
    by_id = {f"words:{e.source_key}": (e, r) for e, r in zip(task.examples, direct, strict=True)}
    for row, key in enumerate(meta["id"]):
        example, generation = by_id[key]
        assert meta.loc[row, "answer"] == generation.answer
        assert meta.loc[row, "label"] == int(task.label(generation.answer, example))
        assert meta.loc[row, "split"] == example.split
        expected = build_map(generation.trajectory).half().numpy()
        np.testing.assert_allclose(
            maps[row].astype(np.float32), expected.astype(np.float32), atol=2e-3
        )
    rebuilt = read_generations(store, list(meta["id"][:3]), with_trajectories=True)
    for key, record in zip(meta["id"][:3], rebuilt, strict=True):
        generation = by_id[key][1]
        assert record.token_ids == generation.token_ids
        torch.testing.assert_close(record.logprobs, generation.logprobs)
        torch.testing.assert_close(record.attention, generation.attention, atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(record.trajectory, generation.trajectory, atol=1e-2, rtol=1e-2)
    assert store.has_table("dense") and store.has_table("trajectories")
    # a second run skips everything
    again = run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config)
    assert again.written == 0 and again.skipped_existing == 24
    # an id whose maps row is written again: read back as its last row, as the store reads it
    from actmap.store import MapRecord
    from actmap.store.derived import RECORD_FIELDS

    key = meta["id"][0]
    first = meta.set_index("id").loc[key]
    store.write_maps([MapRecord(
        id=key, **{**{f: first[f] for f in RECORD_FIELDS}, "answer": "a rewritten answer"},
        n_tokens=int(first["n_tokens"]), label=int(first["label"]), map=maps[0],
    )])  # fmt: skip
    (record,) = read_generations(store, [key])
    assert record.answer == "a rewritten answer" and record.token_ids == by_id[key][1].token_ids


def test_empty_answers_are_recorded_not_mapped(tmp_path, tiny_llama, word_tokenizer):
    task = WordTask(6)
    config = CaptureConfig(max_new_tokens=4, batch_size=6)
    first = generate_with_capture(tiny_llama, word_tokenizer, [task.examples[0].question], config)[
        0
    ]
    original = tiny_llama.generation_config.eos_token_id
    tiny_llama.generation_config.eos_token_id = first.token_ids[0]  # example 0 now stops at once
    try:
        store = MapStore.create(tmp_path, {})
        summary = run_capture(
            tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config
        )
    finally:
        tiny_llama.generation_config.eos_token_id = original
    assert summary.skipped_empty >= 1
    assert "words:q0" in store.ids("skipped") and "words:q0" not in store.ids("maps")
    assert summary.written + summary.skipped_empty == 6


KILL_SCRIPT = """
import sys, time
sys.path.insert(0, {src!r}); sys.path.insert(0, {tests!r})
from conftest import make_word_tokenizer, make_tiny_llama
from test_capture_run import WordTask, SOURCE
from actmap.capture import CaptureConfig
from actmap.capture.run import run_capture, store_config
from actmap.maps import MapConfig
from actmap.store import MapStore
import actmap.capture.run as run

original = run.commit_batch
def slow_commit(*args, **kwargs):
    out = original(*args, **kwargs)
    time.sleep(0.5)  # leave time to be killed between batches
    return out
run.commit_batch = slow_commit
tok = make_word_tokenizer(); model = make_tiny_llama(len(tok))
task = WordTask(40); config = CaptureConfig(max_new_tokens=4, batch_size=4)
store = MapStore.create({store!r}, store_config(task, SOURCE, config, MapConfig(), {{}}))
run_capture(model, tok, SOURCE, task, task.examples, store, config)
"""


def test_killed_run_resumes_without_loss_or_duplicates(tmp_path, word_tokenizer):
    from conftest import make_tiny_llama

    path = tmp_path / "store"
    script = KILL_SCRIPT.format(src=str(ROOT / "src"), tests=str(ROOT / "tests"), store=str(path))
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 120
    while time.time() < deadline and len(list((path / "maps").glob("part-*.parquet"))) < 2:
        time.sleep(0.05)
    process.kill()
    process.wait()
    store = MapStore.open(path)
    partial = store.ids()
    assert 0 < len(partial) < 40, "the run should have been killed mid-way"
    # the killed run recorded itself after each batch it committed, never as finished
    (killed,) = store.manifest["runs"]
    assert killed["finished_at"] is None and killed["wall_time_s"] > 0
    assert killed["written"] <= len(partial)
    assert len(partial) - killed["written"] <= 4  # at most the batch committed after its record
    task = WordTask(40)
    config = CaptureConfig(max_new_tokens=4, batch_size=4)
    model = make_tiny_llama(len(word_tokenizer))
    store = MapStore.create(path, store_config(task, SOURCE, config, MapConfig(), {}))
    restored, advanced = [], []
    summary = run_capture(
        model, word_tokenizer, SOURCE, task, task.examples, store, config,
        progress=advanced.append, resumed=restored.append,
    )  # fmt: skip
    assert summary.skipped_existing == len(partial)
    # the stored rows are reported once as restored work, this run's batches as progress
    assert restored == [len(partial)] and sum(advanced) == 40 - len(partial)
    ids = store.read_table("maps", ["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 40
    runs = MapStore.open(path).manifest["runs"]
    assert len(runs) == 2 and runs[0] == killed  # the resumed run adds its own record
    assert runs[1]["finished_at"] is not None and runs[1]["written"] == 40 - len(partial)
    generations = read_generations(store, ids)
    assert len(generations) == 40


def test_store_config_records_the_prefix_cache_only_when_on():
    task = WordTask(3)
    off = store_config(task, SOURCE, CaptureConfig(), MapConfig(), keep={})
    on = store_config(task, SOURCE, CaptureConfig(share_prefix=32), MapConfig(), keep={})
    assert "share_prefix" not in off["capture"] and on["capture"]["share_prefix"] == 32
    assert off["capture"]["stop_strings"] == ()
    # grey-box statistics are recorded only when off (map-only), so older stores resume
    assert "greybox" not in off["capture"]
    map_only = store_config(task, SOURCE, CaptureConfig(greybox=False), MapConfig(), keep={})
    assert map_only["capture"]["greybox"] is False


def test_map_only_store_keeps_no_step_statistics(tmp_path, tiny_llama, word_tokenizer):
    from actmap.baselines.greybox import Perplexity

    task = WordTask(6)
    config = CaptureConfig(max_new_tokens=4, batch_size=3, greybox=False)
    store = MapStore.create(tmp_path, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config)
    full = generate_with_capture(
        tiny_llama,
        word_tokenizer,
        [e.question for e in task.examples],
        CaptureConfig(max_new_tokens=4),
    )
    maps, meta = store.load_maps()
    by_id = {f"words:{e.source_key}": g for e, g in zip(task.examples, full, strict=True)}
    for row, key in enumerate(meta["id"]):  # the same maps as a capture with statistics on
        expected = build_map(by_id[key].trajectory).half().numpy().astype(np.float32)
        np.testing.assert_allclose(maps[row].astype(np.float32), expected, atol=2e-3)
    rows = read_generations(store, list(meta["id"]))
    assert all(r.logprobs is None and r.entropies is None for r in rows)
    assert [r.token_ids for r in rows] == [by_id[k].token_ids for k in meta["id"]]
    with pytest.raises(ValueError, match=r"Generation.logprobs was not captured \(map-only"):
        Perplexity().score(rows)


def test_capture_imports_no_baseline():
    # capture knows no baseline: importing the capture run and the CLI's capture path
    # must not load any actmap.baselines module
    code = (
        "import sys; import actmap.capture.run, actmap.capture.generate; "
        "bad = sorted(m for m in sys.modules if m.startswith('actmap.baselines')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_dense_states_are_stored_layer_max_pooled(tmp_path, tiny_llama, word_tokenizer):
    # independent reference: the max over each contiguous group of layers, zero-padded to 8
    from actmap.store import decode_array, latest_rows

    task = WordTask(4)
    config = CaptureConfig(max_new_tokens=3, batch_size=4, keep_dense=True)
    store = MapStore.create(tmp_path, store_config(task, SOURCE, config, MapConfig(), {}))
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config)
    direct = generate_with_capture(
        tiny_llama, word_tokenizer, [e.question for e in task.examples], config
    )
    table = latest_rows(store.read_table("dense"))
    keys = table.column("id").to_pylist()
    for example, generation in zip(task.examples, direct, strict=True):
        row = keys.index(f"words:{example.source_key}")
        shape = table.column("shape")[row].as_py()
        stored = decode_array(table.column("dense")[row].as_py(), shape)
        dense = generation.dense.float().numpy()  # (L, N, D)
        n_layers = dense.shape[0]
        padded = np.concatenate([dense, np.zeros((-n_layers % 8, *dense.shape[1:]))])
        expected = padded.reshape(8, -1, *dense.shape[1:]).max(axis=1)
        np.testing.assert_allclose(stored.astype(np.float32), expected, atol=2e-3, rtol=1e-3)


def test_batches_take_prompts_in_order_of_length(tmp_path, tiny_llama, word_tokenizer, monkeypatch):
    import actmap.capture.run as run

    task = WordTask(12)
    seen = []
    original = run.generate_batch

    def recording(model, tokenizer, prompts, config, layers_path=None):
        seen.append([len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts])
        return original(model, tokenizer, prompts, config, layers_path)

    monkeypatch.setattr(run, "generate_batch", recording)
    config = CaptureConfig(max_new_tokens=3, batch_size=4)
    store = MapStore.create(
        tmp_path / "sorted", store_config(task, SOURCE, config, MapConfig(), {})
    )
    run_capture(tiny_llama, word_tokenizer, SOURCE, task, task.examples, store, config)
    flat = [n for batch in seen for n in batch]
    by_hand = sorted(len(e.question.split()) for e in task.examples)  # one token per word
    assert flat == by_hand and [len(b) for b in seen] == [4, 4, 4]
    # the same rows as a capture in task order, each id with its own answer
    seen.clear()
    unsorted = MapStore.create(
        tmp_path / "plain", store_config(task, SOURCE, config, MapConfig(), {})
    )
    run_capture(
        tiny_llama,
        word_tokenizer,
        SOURCE,
        task,
        task.examples,
        unsorted,
        config,
        sort_by_length=False,
    )
    assert [n for batch in seen for n in batch] == [len(e.question.split()) for e in task.examples]
    a = store.metadata().set_index("id").sort_index()
    b = unsorted.metadata().set_index("id").sort_index()
    assert list(a.index) == list(b.index) and list(a["answer"]) == list(b["answer"])
