"""Prompts from a user's JSONL file: {"prompt": ..., "id": optional, "answers": optional list}."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from actmap.data.base import DataError, Example
from actmap.data.labels import qa_correct
from actmap.data.prompts import extract_answer


@dataclass
class PromptFileTask:
    """Each line's prompt is fed verbatim; rows with ``answers`` get the paper's QA label."""

    path: Path
    max_new_tokens: int = 32
    stop_strings: tuple[str, ...] = ()
    name: str = "prompts"

    def load(self, split: str = "test", limit: int | None = None) -> list[Example]:
        path = Path(self.path)
        if not path.is_file():
            raise DataError(f"prompts file not found: {path}")
        examples = []
        with path.open() as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{number}: not valid JSON ({error})") from None
                prompt = row.get("prompt") if isinstance(row, dict) else None
                if not isinstance(prompt, str) or not prompt.strip():
                    raise DataError(f"{path}:{number}: field 'prompt' is missing or empty")
                key = str(row.get("id") or hashlib.sha256(prompt.encode()).hexdigest()[:16])
                answers = row.get("answers") or []
                if not isinstance(answers, list):
                    raise DataError(f"{path}:{number}: field 'answers' must be a list of strings")
                examples.append(
                    Example(key, self.name, split, prompt, tuple(str(a) for a in answers))
                )
        return examples[:limit] if limit is not None else examples

    def prompt(self, example: Example, tokenizer) -> str:
        return example.question

    def postprocess(self, raw: str) -> str:
        """The label reads the answer up to its first newline or next 'Question:'."""
        return extract_answer(raw)

    def label(self, answer: str, example: Example) -> bool | None:
        return qa_correct(answer, example.references) if example.references else None

    def describe(self) -> dict:
        return {"task": self.name, "path": str(self.path), "max_new_tokens": self.max_new_tokens}
