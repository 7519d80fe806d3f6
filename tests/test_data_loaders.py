"""Dataset loaders, tasks, prompts and the task registry, on hand-written files."""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
import types
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from actmap.data import TASK_REGISTRY, available_tasks, get_task
from actmap.data.base import DataError
from actmap.data.datasets import (
    CNNDMTask,
    GSM8KTask,
    NQOpenTask,
    TriviaQATask,
    default_data_dir,
    load_cnn_dm,
    load_gsm8k,
    load_nq_open,
    load_rows,
    load_triviaqa,
)
from actmap.data.labels import gsm8k_correct, qa_correct
from actmap.data.prompts import GSM8K_INSTRUCTION, QA_INSTRUCTION, SUMMARY_INSTRUCTION
from actmap.data.splits import SPLITS, key_uniform

REPO = Path(__file__).resolve().parents[1]
REAL_DATA = REPO / ".." / "shared" / "data"


def write_jsonl(path: Path, rows: list, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def word_tokenizer(words: list[str], chat_template: str | None = None) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", *dict.fromkeys(words)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = chat_template
    return tok


CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/{{ m['role'] }}]{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def gsm8k_row(i: int, split: str, answer: int) -> dict:
    return {
        "id": f"gsm8k-{split}-{i:05d}",
        "question": f"{split} question {i}?",
        "answer": f"work\n#### {answer:,}",
        "final": str(answer),
    }


@pytest.fixture
def gsm8k_dir(tmp_path: Path) -> Path:
    write_jsonl(
        tmp_path / "gsm8k" / "train.jsonl", [gsm8k_row(i, "train", 1000 + i) for i in range(60)]
    )
    write_jsonl(
        tmp_path / "gsm8k" / "test.jsonl.gz", [gsm8k_row(i, "test", i) for i in range(15)], gz=True
    )
    return tmp_path


# ---------------------------------------------------------------- loaders


def test_gsm8k_loader_reads_both_files(gsm8k_dir):
    rows = load_gsm8k(gsm8k_dir)
    assert len(rows) == 75
    assert rows[0].source_key == "gsm8k-train-00000" and rows[0].source_split == "train"
    assert rows[0].references == ("1000",)
    assert rows[-1].source_key == "gsm8k-test-00014" and rows[-1].source_split == "test"


def test_gsm8k_loader_hub_layout_without_id_or_final(tmp_path):
    write_jsonl(
        tmp_path / "gsm8k" / "train.jsonl",
        [{"question": "q0", "answer": "a\n#### 1,234"}, {"question": "q1", "answer": "#### -5"}],
    )
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "q2", "answer": "#### 7"}])
    rows = load_gsm8k(tmp_path)
    assert [r.source_key for r in rows] == [
        "gsm8k-train-00000",
        "gsm8k-train-00001",
        "gsm8k-test-00000",
    ]
    assert [r.references for r in rows] == [("1234",), ("-5",), ("7",)]


def test_gsm8k_missing_file_and_fields_are_named(tmp_path):
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", [gsm8k_row(0, "train", 1)])
    with pytest.raises(DataError, match=r"test\.jsonl\.gz: file not found"):
        load_gsm8k(tmp_path)
    write_jsonl(
        tmp_path / "gsm8k" / "test.jsonl",
        [gsm8k_row(0, "test", 1), {"id": "x", "answer": "#### 3"}],
    )
    with pytest.raises(DataError, match=r"test\.jsonl: line 2: missing field 'question'"):
        load_gsm8k(tmp_path)
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"id": "x", "question": "q", "answer": "42"}])
    with pytest.raises(DataError, match=r"test\.jsonl: line 1: field 'answer'.*####"):
        load_gsm8k(tmp_path)
    write_jsonl(tmp_path / "gsm8k" / "test.jsonl", ['{"id": "x", "question": '])
    with pytest.raises(DataError, match=r"test\.jsonl: line 1: invalid JSON"):
        load_gsm8k(tmp_path)


def test_nq_open_loader_local_and_hub_layouts(tmp_path):
    write_jsonl(
        tmp_path / "nq_open" / "dev.jsonl.gz",
        [{"id": "nq-dev-00000", "question": "q a", "answers": ["A1", "A2"]}],
        gz=True,
    )
    write_jsonl(
        tmp_path / "nq_open" / "efficientqa_test.jsonl",
        [{"question": "who is it", "answer": ["B"]}, "", {"question": "q c", "answer": "C"}],
    )
    rows = load_nq_open(tmp_path)
    assert [r.references for r in rows] == [("A1", "A2"), ("B",), ("C",)]
    expected_key = "nq-" + hashlib.sha1(b"who is it").hexdigest()[:16]
    assert [r.source_key for r in rows][:2] == ["nq-dev-00000", expected_key]
    assert all(r.source_split is None for r in rows)  # pooled
    write_jsonl(tmp_path / "nq_open" / "dev.jsonl.gz", [{"question": "q", "answers": []}], gz=True)
    with pytest.raises(DataError, match=r"dev\.jsonl\.gz: line 1: field 'answers'"):
        load_nq_open(tmp_path)


def test_triviaqa_loader_hub_layout_and_local_layout(tmp_path):
    write_jsonl(
        tmp_path / "triviaqa" / "validation.jsonl",
        [
            {
                "question": "Q1?",
                "question_id": "tc_1",
                "answer": {
                    "value": "Paris",
                    "aliases": ["Paris", "Paris, France"],
                    "normalized_aliases": ["paris", "paris france"],
                },
            },
            {
                "question": "Q2?",
                "question_id": "tqa-unfiltered-dev-00001",
                "answer": {
                    "value": None,
                    "aliases": ["Scorpio", "Skorpio"],
                    "normalized_aliases": None,
                },
            },
        ],
    )
    rows = load_triviaqa(tmp_path)
    assert rows[0].source_key == "tc_1"
    assert rows[0].references == ("Paris", "Paris, France", "paris", "paris france")
    assert rows[0].meta["value"] == "Paris"
    assert rows[1].references == ("Scorpio", "Skorpio") and "value" not in rows[1].meta
    assert all(r.source_split is None for r in rows)  # only one split present: pooled
    write_jsonl(
        tmp_path / "triviaqa" / "validation.jsonl",
        [
            {"question": "Q1?", "question_id": "a", "answer": {"value": "x", "aliases": ["x"]}},
            {"question": "Q2?", "question_id": "b", "answer": {"value": "y"}},
        ],
    )
    with pytest.raises(
        DataError, match=r"validation\.jsonl: line 2: missing field 'answer\.aliases'"
    ):
        load_triviaqa(tmp_path)
    write_jsonl(
        tmp_path / "triviaqa" / "validation.jsonl",
        [{"question": "Q1?", "answer": {"aliases": ["x"]}}],
    )
    with pytest.raises(DataError, match="line 1: missing field 'question_id'"):
        load_triviaqa(tmp_path)


def test_triviaqa_with_local_train_keeps_dataset_splits(tmp_path):
    row = {"question": "Q?", "answer": {"aliases": ["x"]}}
    write_jsonl(tmp_path / "triviaqa" / "train.jsonl", [{**row, "question_id": "t1"}])
    write_jsonl(tmp_path / "triviaqa" / "validation.jsonl", [{**row, "question_id": "v1"}])
    assert [r.source_split for r in load_triviaqa(tmp_path)] == ["train", "test"]


def test_cnn_dm_loader_hub_layout(tmp_path):
    write_jsonl(
        tmp_path / "cnn_dm" / "test.jsonl",
        [{"id": "f001", "article": "(CNN)Text.", "highlights": "One .\nTwo ."}],
    )
    rows = load_cnn_dm(tmp_path)
    assert rows[0].source_key == "f001" and rows[0].question == "(CNN)Text."
    assert rows[0].references == ("One .\nTwo .",) and rows[0].source_split == "test"
    write_jsonl(tmp_path / "cnn_dm" / "test.jsonl", [{"id": "f001", "article": "A."}])
    with pytest.raises(DataError, match=r"test\.jsonl: line 1: missing field 'highlights'"):
        load_cnn_dm(tmp_path)


def test_repeated_source_keys_keep_the_first_row(tmp_path):
    write_jsonl(
        tmp_path / "cnn_dm" / "validation.jsonl",
        [{"id": "k", "article": "first", "highlights": "h"}],
    )
    write_jsonl(
        tmp_path / "cnn_dm" / "test.jsonl", [{"id": "k", "article": "second", "highlights": "h"}]
    )
    rows = load_cnn_dm(tmp_path)
    assert [(r.question, r.source_split) for r in rows] == [("first", "validation")]


def test_hub_fallback_uses_datasets_when_no_local_file(tmp_path, monkeypatch):
    calls = []

    def load_dataset(*args):
        calls.append(args)
        row = {"question": "Q?", "question_id": "", "answer": {"value": "v", "aliases": ["v"]}}
        return {
            "train": [{**row, "question_id": "tr0"}, {**row, "question_id": "tr1"}],
            "validation": [{**row, "question_id": "va0"}],
            "test": [
                {
                    "question": "Q?",
                    "question_id": "te0",
                    "answer": {"value": "<unk>", "aliases": []},
                }
            ],  # no answers on the hub
        }

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    rows, origin = load_rows("triviaqa", tmp_path)
    assert calls == [("trivia_qa", "rc.nocontext")] and origin == "hub:trivia_qa/rc.nocontext"
    assert [(r.source_key, r.source_split) for r in rows] == [
        ("tr0", "train"),
        ("tr1", "train"),
        ("va0", "test"),
    ]


def test_hub_rows_are_checked_like_file_rows(tmp_path, monkeypatch):
    hub = {"train": [{"question": "q", "answer": "no marker"}], "test": []}
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a: hub))
    with pytest.raises(DataError, match=r"hub:gsm8k/main\[train\]: row 0: field 'answer'"):
        load_gsm8k(tmp_path)


def test_no_local_file_and_no_datasets_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DataError, match=r"no local nq_open files in .*nq_open.*'datasets'"):
        load_nq_open(tmp_path)


def test_default_data_dir(tmp_path, monkeypatch):
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    assert default_data_dir() is None
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert default_data_dir() == Path("../shared/data")


# ---------------------------------------------------------------- tasks


def test_gsm8k_task_splits_demos_and_limit(gsm8k_dir):
    task = GSM8KTask(gsm8k_dir, seed=1)
    loaded = {s: task.load(s) for s in SPLITS}
    keys = {s: {e.source_key for e in loaded[s]} for s in SPLITS}
    assert keys["test"] == {f"gsm8k-test-{i:05d}" for i in range(15)}  # dataset test kept
    assert not keys["train"] & keys["validation"]
    assert all(e.split == s for s in SPLITS for e in loaded[s])
    demos = task.demonstrations()
    demo_keys = {d.source_key for d in demos}
    assert len(demos) == 5 and not demo_keys & set().union(*keys.values())
    assert len(keys["train"]) + len(keys["validation"]) + 5 == 60
    # demonstrations: GSM8K's fixed keys, the first five rows of the train file
    assert [d.source_key for d in demos] == [f"gsm8k-train-{i:05d}" for i in range(5)]
    assert task.load("train", 3) == loaded["train"][:3]
    assert [e.source_key for e in GSM8KTask(gsm8k_dir, seed=1).load("train")] == [
        e.source_key for e in loaded["train"]
    ]  # deterministic
    assert task.load("train", 0) == []
    pooled = GSM8KTask(gsm8k_dir, seed=1, pooled=True)  # dataset splits ignored
    pooled_test = {e.source_key for e in pooled.load("test")}
    all_keys = [f"gsm8k-train-{i:05d}" for i in range(60)] + [
        f"gsm8k-test-{i:05d}" for i in range(15)
    ]
    demo_keys = {d.source_key for d in pooled.demonstrations()}
    assert pooled_test == {k for k in all_keys if key_uniform(k, 1) >= 0.9 and k not in demo_keys}
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        task.load("dev")


def test_gsm8k_task_prompts_and_label(gsm8k_dir):
    task = GSM8KTask(gsm8k_dir)
    example = task.load("test", 1)[0]
    demos = task.demonstrations()
    shots = "".join(f"Question: {d.question}\nAnswer: {d.references[0]}\n\n" for d in demos)
    expected = f"{GSM8K_INSTRUCTION}\n\n{shots}Question: {example.question}\nAnswer:"
    assert task.prompt(example, None) == expected
    assert task.prompt(example, word_tokenizer([])) == expected  # no chat template: plain text
    zero = GSM8KTask(gsm8k_dir, prompt_style="zero_shot")
    assert (
        zero.prompt(example, None)
        == f"{GSM8K_INSTRUCTION}\n\nQuestion: {example.question}\nAnswer:"
    )
    assert zero.load("test") == task.load("test")  # same rows under both styles
    gold = example.references[0]
    assert task.label(f"{gold} dollars", example)
    assert not task.label(f"{int(gold) + 1}", example)
    assert task.label(task.postprocess(f" {gold}\nQuestion: next?\nAnswer: 3"), example)
    final = GSM8KTask(gsm8k_dir, number="final")
    assert final.label(f"99999 then {gold}", example) and not task.label(
        f"99999 then {gold}", example
    )
    assert task.describe()["prompt_style"] == "few_shot"
    assert final.describe()["label_rule"] == "numeric_exact:final"
    with pytest.raises(ValueError, match="prompt style"):
        GSM8KTask(gsm8k_dir, prompt_style="chain_of_thought")


def test_chat_template_prompt_has_demonstrations_as_turns(gsm8k_dir):
    task = GSM8KTask(gsm8k_dir)
    example = task.load("test", 1)[0]
    tok = word_tokenizer([], CHAT_TEMPLATE)
    d = task.demonstrations()
    turns = f"[user]{GSM8K_INSTRUCTION}\n\nQuestion: {d[0].question}[/user]"
    turns += f"[assistant]{d[0].references[0]}[/assistant]"
    for demo in d[1:]:
        turns += (
            f"[user]Question: {demo.question}[/user][assistant]{demo.references[0]}[/assistant]"
        )
    turns += f"[user]Question: {example.question}[/user][assistant]"
    assert task.prompt(example, tok) == turns
    zero = GSM8KTask(gsm8k_dir, prompt_style="zero_shot")
    assert zero.prompt(example, tok) == (
        f"[user]{GSM8K_INSTRUCTION}\n\nQuestion: {example.question}[/user][assistant]"
    )
    plain = GSM8KTask(gsm8k_dir, chat_template=False)  # plain text for a chat model too
    assert plain.prompt(example, tok) == task.prompt(example, None)
    assert plain.describe()["chat_template"] is False
    # template prompts carry their special tokens; plain ones need the tokenizer's
    assert task.add_special_tokens(tok) is False
    assert plain.add_special_tokens(tok) is True and task.add_special_tokens(None) is True


@pytest.fixture
def qa_dir(tmp_path: Path) -> Path:
    rows = [
        {
            "question": f"Question {i}?",
            "question_id": f"tq{i:03d}",
            "answer": {"value": "Paris" if i % 2 else None, "aliases": ["Paris", "City of Light"]},
        }
        for i in range(40)
    ]
    write_jsonl(tmp_path / "triviaqa" / "validation.jsonl", rows)
    write_jsonl(
        tmp_path / "nq_open" / "dev.jsonl",
        [{"id": f"nq{i}", "question": f"q{i}", "answers": ["Paris"]} for i in range(40)],
    )
    return tmp_path


def test_qa_tasks_label_rules_and_demonstrations(qa_dir):
    task = TriviaQATask(qa_dir)
    demos = task.demonstrations()
    assert all("value" in d.meta for d in demos)  # TriviaQA prefers rows with a value
    assert len({e.source_key for s in SPLITS for e in task.load(s)}) == 40 - 5
    example = task.load("test")[0]
    prompt = task.prompt(example, None)
    assert prompt.startswith(QA_INSTRUCTION + "\n\nQuestion: ")
    assert prompt.count("\nAnswer: Paris\n\n") == 5 and prompt.endswith(
        f"{example.question}\nAnswer:"
    )
    assert task.label("paris", example) and not task.label("It is Paris", example)
    lenient = TriviaQATask(qa_dir, label_rule="contains")
    assert lenient.label("It is Paris", example)
    assert lenient.describe()["label_rule"] == "contains"
    with pytest.raises(ValueError, match="unknown label rule"):
        TriviaQATask(qa_dir, label_rule="fuzzy")
    nq = NQOpenTask(qa_dir, n_shots=2)
    assert [d.source_key for d in nq.demonstrations()] == [
        k
        for k in (f"nq{i}" for i in range(40))
        if k not in {e.source_key for s in ("validation", "test") for e in nq.load(s)}
    ][:2]
    assert nq.describe()["source"].endswith("nq_open")


def test_gsm8k_without_fixed_keys_takes_first_train_rows(tmp_path):
    rows = [{"id": f"g{i:02d}", "question": f"q{i}?", "answer": f"#### {i}"} for i in range(40)]
    write_jsonl(tmp_path / "gsm8k" / "train.jsonl", rows)
    write_jsonl(
        tmp_path / "gsm8k" / "test.jsonl", [{"id": "t0", "question": "t?", "answer": "#### 1"}]
    )
    task = GSM8KTask(tmp_path)
    validation = {e.source_key for e in task.load("validation")}
    expected = [r["id"] for r in rows if r["id"] not in validation][:5]
    assert [d.source_key for d in task.demonstrations()] == expected
    assert all(d.split == "train" for d in task.demonstrations())
    shots = [f"Question: {d.question}\nAnswer: {d.references[0]}" for d in task.demonstrations()]
    assert "\n\n".join(shots) in task.prompt(task.load("test")[0], None)


def test_fixed_triviaqa_demonstrations_are_checked_against_gold(tmp_path):
    keys = [k for k, _ in TriviaQATask.DEMONSTRATION_KEYS]
    answers = [a for _, a in TriviaQATask.DEMONSTRATION_KEYS]
    rows = [
        {"question": f"Q{i}?", "question_id": k, "answer": {"aliases": [f"The {a}", "noise"]}}
        for i, (k, a) in enumerate(zip(keys, answers, strict=True))
    ] + [
        {"question": f"R{i}?", "question_id": f"r{i}", "answer": {"aliases": ["x"]}}
        for i in range(30)
    ]
    write_jsonl(tmp_path / "triviaqa" / "validation.jsonl", rows)
    task = TriviaQATask(tmp_path)
    assert [d.source_key for d in task.demonstrations()] == keys
    assert not {e.source_key for s in SPLITS for e in task.load(s)} & set(keys)
    prompt = task.prompt(task.load("test")[0], None)
    assert "\n\n".join(f"Question: Q{i}?\nAnswer: {a}" for i, a in enumerate(answers)) in prompt
    rows[2]["answer"]["aliases"] = ["Nevada"]  # a demonstration answer that is not gold
    write_jsonl(tmp_path / "triviaqa" / "validation.jsonl", rows)
    with pytest.raises(DataError, match="demonstration answer 'Utah' is not gold"):
        TriviaQATask(tmp_path).demonstrations()


@pytest.fixture
def cnn_dir(tmp_path: Path) -> Path:
    words = " ".join(f"w{i}" for i in range(100))
    write_jsonl(
        tmp_path / "cnn_dm" / "validation.jsonl",
        [{"id": f"v{i}", "article": words, "highlights": "h ."} for i in range(30)],
    )
    write_jsonl(
        tmp_path / "cnn_dm" / "test.jsonl",
        [{"id": f"t{i}", "article": words, "highlights": "h ."} for i in range(5)],
    )
    return tmp_path


def test_cnn_dm_task_splits_prompt_truncation_and_judge(cnn_dir):
    task = CNNDMTask(cnn_dir)
    assert task.max_new_tokens == 384
    assert {e.source_key for e in task.load("test")} == {f"t{i}" for i in range(5)}
    # the validation file is carved into train and validation by the seeded key hash
    expected_val = {f"v{i}" for i in range(30) if key_uniform(f"v{i}", 0) >= 0.8 / 0.9}
    assert {e.source_key for e in task.load("validation")} == expected_val
    assert {e.source_key for e in task.load("train")} == {f"v{i}" for i in range(30)} - expected_val
    example = task.load("test", 1)[0]
    assert task.prompt(example, None) == (
        f"{SUMMARY_INSTRUCTION}\n\nArticle:\n{example.question}\n\nSummary:"
    )

    words = [f"w{i}" for i in range(100)] + SUMMARY_INSTRUCTION.split() + ["Article:", "Summary:"]
    tok = word_tokenizer(words)
    n_overhead = len(tok(task.prompt(example, None).replace(example.question, ""))["input_ids"])
    for side, kept in [
        ("left", [f"w{i}" for i in range(70, 100)]),
        ("right", [f"w{i}" for i in range(30)]),
    ]:
        short = CNNDMTask(cnn_dir, context_length=30 + n_overhead + 384, truncation_side=side)
        text = short.prompt(example, tok)
        assert text == f"{SUMMARY_INSTRUCTION}\n\nArticle:\n{' '.join(kept)}\n\nSummary:"
        assert len(tok(text)["input_ids"]) <= short.context_length - 384
    assert CNNDMTask(cnn_dir).prompt(example, tok) == task.prompt(example, None)  # fits: untouched

    assert task.label("w1 w2.", example) is None  # no judge yet

    class Judge:
        name = "fake-judge"

        def support_probability(self, document, claim):
            return 0.9 if claim.startswith("w1") else 0.1

    judged = CNNDMTask(cnn_dir, judge=Judge())
    assert judged.label(judged.postprocess("  w1 w2. w1 w3.\n"), example) is True
    assert judged.label("w1 w2. w5 w6.", example) is False
    assert judged.describe()["judge"] == "fake-judge" and judged.judge_name == "fake-judge"
    with pytest.raises(ValueError, match="zero_shot"):
        CNNDMTask(cnn_dir, prompt_style="few_shot")


def test_summary_prompt_with_chat_template(cnn_dir):
    task = CNNDMTask(cnn_dir)
    example = task.load("test", 1)[0]
    tok = word_tokenizer([], CHAT_TEMPLATE)
    assert task.prompt(example, tok) == (
        f"[user]{SUMMARY_INSTRUCTION}\n\nArticle:\n{example.question}[/user][assistant]"
    )
    plain = CNNDMTask(cnn_dir, chat_template=False)
    assert plain.prompt(example, tok) == task.prompt(example, None)


# ---------------------------------------------------------------- registry


def test_registry(gsm8k_dir):
    task = get_task("gsm8k", data_dir=gsm8k_dir, prompt_style="zero_shot")
    assert isinstance(task, GSM8KTask) and task.prompt_style == "zero_shot"
    assert set(TASK_REGISTRY) >= {"gsm8k", "nq_open", "triviaqa", "cnn_dm", "builtin"}
    assert {"gsm8k", "nq_open", "triviaqa", "cnn_dm"} <= set(available_tasks())
    with pytest.raises(ValueError, match="unknown task 'squad'"):
        get_task("squad")


def test_registry_builtin_is_lazy():
    import actmap.data.builtin  # noqa: F401

    assert get_task("builtin").name == "builtin"


def test_registry_missing_module_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(TASK_REGISTRY, "ghost", "actmap.data.ghost_module:Ghost")
    with pytest.raises(DataError, match="actmap.data.ghost_module"):
        get_task("ghost")


# ---------------------------------------------------------------- real local files


@pytest.mark.skipif(not REAL_DATA.is_dir(), reason="../shared/data not present")
def test_real_gsm8k_and_nq_open_files():
    gsm8k = GSM8KTask(REAL_DATA)
    sizes = {s: len(gsm8k.load(s)) for s in SPLITS}
    assert sizes["test"] == 1319 and sizes["train"] + sizes["validation"] == 7473 - 5
    assert 0.08 < sizes["validation"] / 7473 < 0.14
    for e in gsm8k.load("test", 200):
        assert e.source_key.startswith("gsm8k-test-") and gsm8k_correct(
            e.references[0], e.references[0]
        )
    nq = NQOpenTask(REAL_DATA)
    keys = {s: {e.source_key for e in nq.load(s)} for s in SPLITS}
    assert sum(len(k) for k in keys.values()) == 7179 - 5
    assert not (keys["train"] & keys["test"]) and not (keys["validation"] & keys["test"])
    assert 0.08 < len(keys["test"]) / 7179 < 0.12
    for e in nq.load("validation", 200):
        assert qa_correct(e.references[0], e.references)


@pytest.mark.skipif(
    not (REAL_DATA / "triviaqa").is_dir() or not (REAL_DATA / "cnn_dm").is_dir(),
    reason="../shared/data/triviaqa or cnn_dm not present",
)
def test_real_triviaqa_and_cnn_dm_files():
    # TriviaQA: one validation file in the local layout (normalized_aliases null), pooled
    trivia = TriviaQATask(REAL_DATA)
    keys = {s: {e.source_key for e in trivia.load(s)} for s in SPLITS}
    assert sum(len(k) for k in keys.values()) == 9313 - 5  # the README's count, minus demos
    assert not (keys["train"] & keys["test"]) and not (keys["validation"] & keys["test"])
    assert 0.08 < len(keys["test"]) / 9313 < 0.12
    rows = {e.source_key: e for s in SPLITS for e in trivia.load(s)}
    # the README's third line: a Lloyd Webber musical with five aliases
    sunset = rows["tqa-unfiltered-dev-00002"]
    assert "Sunset Boulevard" in sunset.references and len(sunset.references) == 5
    assert qa_correct("sunset blvd", sunset.references)
    demos = [d.source_key for d in trivia.demonstrations()]
    assert "tqa-unfiltered-dev-00001" in demos and not set(demos) & set(rows)
    # CNN/DM: test file -> test; train and validation carved out of the validation file
    cnn = CNNDMTask(REAL_DATA)
    sizes = {s: len(cnn.load(s)) for s in SPLITS}
    assert sizes["test"] == 500 and sizes["train"] + sizes["validation"] == 1000
    test_keys = {e.source_key for e in cnn.load("test")}
    assert "f001ec5c4704938247d27a44948eebb37ae98d01" in test_keys  # README's first test id
    assert not test_keys & {e.source_key for e in cnn.load("train")}
