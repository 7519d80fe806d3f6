"""A user's own prompts and answers files: each line once, a stable id, its split, the chat template."""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from actmap.cli import app
from actmap.data.promptfile import AnswersFileTask, PromptFileTask
from actmap.data.splits import key_uniform

runner = CliRunner()
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}answer{% endif %}"
)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected_split(key: str) -> str:
    """Independent reference: 80/10/10 on the seeded uniform of the id (seed 0)."""
    u = key_uniform(key, 0)
    return "train" if u < 0.8 else "validation" if u < 0.9 else "test"


@pytest.fixture()
def chat_model_dir(tmp_path, tiny_llama, word_tokenizer):
    import copy

    tokenizer = copy.deepcopy(word_tokenizer)
    tokenizer.chat_template = TEMPLATE
    folder = tmp_path / "chat-model"
    tiny_llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_each_prompt_once_with_a_stable_id_and_split(tmp_path):
    prompts = ["what is the capital", "red blue green", "how many days"]
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": prompts[0], "id": "q1"},
            {"prompt": prompts[1]},
            {"prompt": prompts[2], "split": "test"},
        ],
    )
    task = PromptFileTask(path)
    loaded = [e for split in ("train", "validation", "test") for e in task.load(split)]
    assert len(loaded) == 3
    by_key = {e.source_key: e for e in loaded}
    hashed = hashlib.sha256(prompts[1].encode()).hexdigest()[:16]
    assert set(by_key) == {"q1", hashed, hashlib.sha256(prompts[2].encode()).hexdigest()[:16]}
    assert by_key["q1"].split == expected_split("q1")
    assert by_key[hashed].split == expected_split(hashed)
    assert [e.question for e in task.load("test") if e.question == prompts[2]] == [prompts[2]]
    # the same file gives the same ids and splits again (resume)
    assert [(e.source_key, e.split) for e in task.load_all()] == [
        (e.source_key, e.split) for e in PromptFileTask(path).load_all()
    ]


def test_prompt_uses_the_chat_template_unless_told_not_to(tmp_path, word_tokenizer):
    import copy

    tokenizer = copy.deepcopy(word_tokenizer)
    tokenizer.chat_template = TEMPLATE
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "what is the capital", "split": "test"},
            {"prompt": [{"role": "user", "content": "red"}, {"role": "user", "content": "blue"}]},
        ],
    )
    first, second = PromptFileTask(path).load_all()
    assert PromptFileTask(path).prompt(first, tokenizer) == "user what is the capital answer"
    assert (
        PromptFileTask(path, chat_template=False).prompt(first, tokenizer) == "what is the capital"
    )
    assert (
        PromptFileTask(path).prompt(first, word_tokenizer) == "what is the capital"
    )  # no template
    assert PromptFileTask(path).prompt(second, tokenizer) == "user red user blue answer"


def test_capture_from_a_prompts_file_writes_each_prompt_once(tmp_path, chat_model_dir):
    """Three prompts, the default three splits: three rows, templated, unique ids."""
    lines = [
        {"prompt": "what is the capital", "id": "a", "answers": ["paris"]},
        {"prompt": "red blue green"},
        {"prompt": "how many days", "split": "validation"},
    ]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    store = tmp_path / "store"
    args = ["capture", "--prompts", str(path), "--model", str(chat_model_dir), "--out", str(store)]
    result = runner.invoke(app, [*args, "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(store / "maps")
    skipped = pd.read_parquet(store / "skipped") if (store / "skipped").is_dir() else pd.DataFrame()
    assert len(frame) + len(skipped) == 3 and frame["id"].is_unique
    assert all(p.startswith("user ") and p.endswith(" answer") for p in frame["prompt"])
    assert len(frame) >= 1
    for key, split in zip(frame["source_key"], frame["split"], strict=True):
        assert split == expected_split(key)
    verbatim = runner.invoke(
        app, [*args[:-1], str(tmp_path / "plain"), "--max-new-tokens", "3", "--no-chat-template"]
    )
    assert verbatim.exit_code == 0, verbatim.output
    plain = pd.read_parquet(tmp_path / "plain" / "maps")
    assert set(plain["prompt"]) <= {line["prompt"] for line in lines}


def test_answers_file_keeps_labels_and_records_its_source(tmp_path, chat_model_dir):
    rows = [
        {
            "prompt": "what is the capital",
            "answer": "paris",
            "answers": ["paris"],
            "split": "train",
        },
        {"prompt": "what is the capital", "answer": "rome", "answers": ["paris"], "split": "test"},
        {"prompt": "red", "answer": "blue green", "label": 1, "split": "validation"},
    ]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    task = AnswersFileTask(path)
    examples = task.load_all()
    assert len({e.source_key for e in examples}) == 3  # same prompt, other answer: other id
    assert [task.label(e.meta["answer"], e) for e in examples] == [True, False, True]
    store = tmp_path / "store"
    args = ["capture", "--answers", str(path), "--model", str(chat_model_dir), "--out", str(store)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(store / "maps").set_index("split")
    assert frame.loc[["train", "test", "validation"], "answer"].tolist() == [
        "paris",
        "rome",
        "blue green",
    ]
    assert frame.loc[["train", "test", "validation"], "label"].tolist() == [1, 0, 1]
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["config"]["task"]["source"].startswith("teacher-forced")
    assert manifest["config"]["task"]["path"] == str(path)
