"""A built-in arithmetic task that needs no external data.

Questions are generated from a seed, with exact integer answers, and span
difficulties a 135M model gets right (one-digit sums) and wrong (two-digit
products, three-term expressions), so one run yields both labels. The source
key of a question is its text, so splits are disjoint by question.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from actmap.data.base import DataError, Example
from actmap.data.labels import gsm8k_correct
from actmap.data.splits import SPLITS

# Each level: (question template, operand ranges, how the answer is computed). Chosen so the
# embedded 135M model gets some levels mostly right (one-digit products) and others mostly wrong
# (two-digit sums, unit conversions), giving both labels in one run.
LEVELS: tuple[tuple[str, tuple[tuple[int, int], ...], str], ...] = (
    ("What is {a} + {b}?", ((1, 9), (1, 9)), "a + b"),
    ("What is {a} times {b}?", ((2, 9), (2, 9)), "a * b"),
    ("What is {a} + {b}?", ((10, 99), (10, 99)), "a + b"),
    ("How many minutes are in {a} hours?", ((2, 48),), "60 * a"),
    ("What is {a} minus {b}?", ((10, 99), (1, 9)), "a - b"),
    ("How many days are in {a} weeks?", ((2, 52),), "7 * a"),
)
INSTRUCTION = "Reply with just the number."


def _split_of(key: str, seed: int) -> str:
    """80/10/10 by a seeded hash of the source key."""
    bucket = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest(), 16) % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def make_questions(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` distinct (question, answer) pairs, cycling through the difficulty levels."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, int]] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise DataError(f"cannot make {n} distinct built-in questions")
        template, ranges, formula = LEVELS[
            attempts % len(LEVELS)
        ]  # exhausted levels yield to others
        values = {name: rng.randint(lo, hi) for name, (lo, hi) in zip("ab", ranges, strict=False)}
        question = template.format(**values)
        if question in seen:
            continue
        seen.add(question)
        out.append((question, evaluate(formula, values)))
    return out


def evaluate(formula: str, values: dict[str, int]) -> int:
    """Exact value of 'x op y' where x, y are operand names or integers (no eval())."""
    left, op, right = formula.split()
    x = values[left] if left in values else int(left)
    y = values[right] if right in values else int(right)
    if op == "+":
        return x + y
    if op == "-":
        return x - y
    if op == "*":
        return x * y
    raise DataError(f"unknown operator '{op}' in '{formula}'")


@dataclass
class BuiltinArithmeticTask:
    """Seeded arithmetic and unit questions with exact integer answers."""

    n_questions: int = 400
    seed: int = 0
    name: str = "builtin"
    max_new_tokens: int = 24
    stop_strings: tuple[str, ...] = ()  # answers end at end-of-sequence or max_new_tokens

    def load(self, split: str, limit: int | None = None) -> list[Example]:
        if split not in SPLITS:
            raise DataError(f"unknown split '{split}' for the built-in task; use one of {SPLITS}")
        examples = [
            Example(
                source_key=question,
                dataset=self.name,
                split=split,
                question=question,
                references=(str(answer),),
            )
            for question, answer in make_questions(self.n_questions, self.seed)
            if _split_of(question, self.seed) == split
        ]
        return examples[:limit] if limit is not None else examples

    def load_all(self, limit: int | None = None) -> list[Example]:
        examples = [e for split in SPLITS for e in self.load(split)]
        return examples[:limit] if limit is not None else examples

    def prompt(self, example: Example, tokenizer) -> str:
        """Zero-shot: the chat template when the tokenizer has one, else 'Question: ... Answer:'."""
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": f"{example.question} {INSTRUCTION}"}]
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        return f"Question: {example.question}\nAnswer:"

    def postprocess(self, raw: str) -> str:
        """The answer's first line: small models keep talking after the result."""
        return raw.strip().split("\n", 1)[0]

    def label(self, answer: str, example: Example) -> bool | None:
        """The final number of the (post-processed) answer must equal the exact result.

        Small models restate the question ("7 + 7 = 14"), so the final number is
        the one they commit to.
        """
        return gsm8k_correct(answer, example.references[0], which="final")

    def describe(self) -> dict:
        return {
            "task": self.name,
            "n_questions": self.n_questions,
            "seed": self.seed,
            "prompt": f"zero-shot, '<question> {INSTRUCTION}'",
            "label_rule": "final number of the first line, exact match",
            "max_new_tokens": self.max_new_tokens,
        }
