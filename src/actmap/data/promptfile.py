"""A user's own JSONL files: prompts to answer, or answers already generated.

Prompts file, one object a line::

    {"prompt": "...", "id": "q1"?, "answers": ["gold", ...]?, "split": "test"?}

Answers file (answers made elsewhere, e.g. exported from a server log), the same plus::

    {"prompt": "...", "answer": "the model's answer", "label": 0 | 1?}

Every line is one example, captured once. Its id is the line's ``id``, else a hash of
the prompt (and answer); its split is the line's ``split``, else a seeded hash of the
id (80/10/10), so a file gets train, validation and test rows without bookkeeping.
``prompt`` is the user's message: it is wrapped in the tokenizer's chat template when
it has one (``chat_template=False`` sends it verbatim), or it is a list of
``{"role", "content"}`` messages.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from actmap.data.base import DataError, Example
from actmap.data.datasets import read_jsonl
from actmap.data.labels import qa_correct
from actmap.data.prompts import extract_answer, render_chat, uses_chat_template
from actmap.data.splits import SPLITS, assign_splits
from actmap.defaults import SHORT_MAX_NEW_TOKENS

SPLIT_SEED = 0


def read_rows(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) of every non-blank line; errors name the file and line."""
    rows = list(read_jsonl(path))
    if not rows:
        raise DataError(f"{path} is empty: expected one JSON object per line")
    return rows


def _prompt_field(value, where: str) -> str | list[dict]:
    if isinstance(value, str) and value.strip():
        return value
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in value
        )
    ):
        return value
    raise DataError(f"{where}: field 'prompt' is missing or empty (a string or chat messages)")


def _text_field(row: dict, name: str, where: str, required: bool) -> str | None:
    value = row.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise DataError(f"{where}: field '{name}' must be a non-empty string")
    return value


@dataclass
class PromptFileTask:
    """Prompts from a JSONL file; rows with ``answers`` get the paper's QA label."""

    path: Path
    chat_template: bool = True
    max_new_tokens: int = SHORT_MAX_NEW_TOKENS
    stop_strings: tuple[str, ...] = ()
    name: str = "prompts"

    def load(self, split: str = "test", limit: int | None = None) -> list[Example]:
        if split not in SPLITS:
            raise DataError(f"unknown split '{split}'; use one of {SPLITS}")
        examples = [e for e in self.load_all() if e.split == split]
        return examples[:limit] if limit is not None else examples

    def load_all(self) -> list[Example]:
        """Every line of the file once, each in its split."""
        path = Path(self.path)
        parsed, seen = [], {}
        for number, row in read_rows(path):
            where = f"{path}: line {number}"
            prompt = _prompt_field(row.get("prompt"), where)
            extra = self._extra_fields(row, where)
            question = prompt
            if not isinstance(prompt, str):  # chat messages: kept whole, shown by the last turn
                extra["messages"] = json.dumps(prompt, ensure_ascii=False)
                question = prompt[-1]["content"]
            key = row.get("id")
            if key is None:  # a prompt's hash (and its answer's, in an answers file)
                text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
                key = _digest(text + ("\0" + extra["answer"] if "answer" in extra else ""))
            elif not isinstance(key, str | int) or not str(key).strip():
                raise DataError(f"{where}: field 'id' must be a non-empty string or integer")
            key = str(key)
            if key in seen:
                raise DataError(f"{where}: id '{key}' repeats line {seen[key]}")
            seen[key] = number
            split = row.get("split")
            if split is not None and split not in SPLITS:
                raise DataError(f"{where}: field 'split' must be one of {SPLITS}, got {split!r}")
            answers = row.get("answers") or []
            if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
                raise DataError(f"{where}: field 'answers' must be a list of strings")
            parsed.append((key, split, question, tuple(answers), extra))
        splits = assign_splits([p[0] for p in parsed], [p[1] for p in parsed], seed=SPLIT_SEED)
        return [
            Example(key, self.name, split, question, answers, extra)
            for (key, _, question, answers, extra), split in zip(parsed, splits, strict=True)
        ]

    def _extra_fields(self, row: dict, where: str) -> dict[str, str]:
        return {}

    def prompt(self, example: Example, tokenizer) -> str:
        """The user's message in the chat template (when there is one and it is wanted)."""
        if "messages" in example.meta:
            if not uses_chat_template(tokenizer, True):
                raise DataError(
                    f"example '{example.source_key}' gives chat messages, but the tokenizer "
                    "has no chat template"
                )
            return render_chat(tokenizer, json.loads(example.meta["messages"]))
        if uses_chat_template(tokenizer, self.chat_template):
            return render_chat(tokenizer, [{"role": "user", "content": example.question}])
        return example.question

    def postprocess(self, raw: str) -> str:
        """The label reads the answer up to its first newline or next 'Question:'."""
        return extract_answer(raw)

    def label(self, answer: str, example: Example) -> bool | None:
        return qa_correct(answer, example.references) if example.references else None

    def describe(self) -> dict:
        return {
            "task": self.name,
            "path": str(self.path),
            "chat_template": self.chat_template,
            "max_new_tokens": self.max_new_tokens,
        }


@dataclass
class AnswersFileTask(PromptFileTask):
    """Answers generated elsewhere: capture reads them by teacher forcing, generating nothing.

    A row's label is its ``label`` field when given, else the QA rule over ``answers``.
    """

    name: str = "answers"
    teacher_forced: bool = True  # capture reads the file's answers instead of generating

    def _extra_fields(self, row: dict, where: str) -> dict[str, str]:
        extra = {"answer": _text_field(row, "answer", where, required=True)}
        label = row.get("label")
        if label is not None:
            if label not in (0, 1, True, False):
                raise DataError(f"{where}: field 'label' must be 0, 1, true or false")
            extra["label"] = str(int(label))
        return extra

    def label(self, answer: str, example: Example) -> bool | None:
        if "label" in example.meta:
            return example.meta["label"] == "1"
        return super().label(answer, example)

    def describe(self) -> dict:
        return {**super().describe(), "source": "teacher-forced answers from the file"}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
