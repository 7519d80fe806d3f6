"""What every task provides: examples with stable source keys, a prompt, a labeler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from actmap.errors import ActmapUserError


class DataError(ActmapUserError):
    """A dataset file, row or field is missing or malformed; the message names it."""


@dataclass(frozen=True)
class Example:
    """One question (or article) of a task, before generation."""

    source_key: str  # stable id of the source item; splits are disjoint by it
    dataset: str  # "gsm8k", "nq_open", "triviaqa", "cnn_dm", "builtin"
    split: str  # "train", "validation" or "test"
    question: str  # the question, or the article for summarization
    references: tuple[str, ...]  # gold aliases, the gold number, or the reference highlights
    meta: dict[str, str] = field(default_factory=dict)


class Task(Protocol):
    """A dataset plus its prompt, generation length and correctness rule."""

    name: str
    max_new_tokens: int  # paper: 32 short-form and GSM8K, 384 summaries
    stop_strings: tuple[str, ...]  # texts that end an answer during capture; () = none

    def load(self, split: str, limit: int | None = None) -> list[Example]: ...

    def prompt(self, example: Example, tokenizer) -> str:
        """The exact text fed to the model (chat template applied when the tokenizer has one)."""
        ...

    def postprocess(self, raw: str) -> str:
        """The text the label is computed on (the raw answer is stored as generated)."""
        ...

    def label(self, answer: str, example: Example) -> bool | None:
        """True iff the (post-processed) answer is correct; None when a judge has not run yet."""
        ...
