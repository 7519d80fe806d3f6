"""Correctness labels: SQuAD-style QA matching and GSM8K exact numeric match.

Every labeler here is a pure function of the post-processed answer text and the gold
references (see ``actmap.data.prompts.extract_answer`` for the post-processing).

QA (TriviaQA, NQ-Open), the paper's rule: an answer is correct iff its normalized
form equals a normalized gold alias, or its token F1 against some alias is >= 0.8.
The alternative rule ``"contains"`` (a normalized alias appears as a contiguous token
run inside the normalized answer) is available by name in ``LABEL_RULES``; results
made with it must say so.

GSM8K: exact numeric match between one number read from the answer and the gold
number after ``####``. The default reads the FIRST number the model states: the
prompts ask for the final number only, so a direct answer starts with it, and any
later numbers are restatements, units of reasoning the model added anyway, or the
start of an invented next question. Reading the last number would reward answers
that state a wrong number first and drift onto the right one.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Literal

from actmap.data.base import DataError

F1_THRESHOLD = 0.8  # paper: token F1 >= 0.8 against any alias counts as correct

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lowercase, drop punctuation, drop a/an/the, collapse spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def token_f1(pred: str, gold: str) -> float:
    """SQuAD token F1 between the normalized prediction and the normalized gold.

    Two empty strings score 1.0; one empty string against a non-empty one scores 0.0.
    """
    pred_tokens = normalize_answer(pred).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    n_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if n_same == 0:
        return 0.0
    precision = n_same / len(pred_tokens)
    recall = n_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _usable_aliases(aliases: Sequence[str]) -> list[str]:
    if isinstance(aliases, str):
        raise TypeError("aliases must be a sequence of strings, not a single string")
    # an alias like "The" normalizes to "" and would match every empty answer
    return [a for a in aliases if normalize_answer(a)]


def qa_correct(answer: str, aliases: Sequence[str]) -> bool:
    """The paper's QA rule: normalized exact match to any alias, or token F1 >= 0.8.

    An answer that normalizes to the empty string is never correct.
    """
    pred = normalize_answer(answer)
    if not pred:
        return False
    usable = _usable_aliases(aliases)
    if any(pred == normalize_answer(a) for a in usable):
        return True
    return any(token_f1(answer, a) >= F1_THRESHOLD for a in usable)


def alias_contained(answer: str, aliases: Sequence[str]) -> bool:
    """Alternative QA rule: some normalized alias is a contiguous token run of the answer."""
    pred = normalize_answer(answer).split()
    for alias in _usable_aliases(aliases):
        gold = normalize_answer(alias).split()
        n = len(gold)
        if any(pred[i : i + n] == gold for i in range(len(pred) - n + 1)):
            return True
    return False


LABEL_RULES: dict[str, Callable[[str, Sequence[str]], bool]] = {
    "paper": qa_correct,  # the paper's rule, the default everywhere
    "contains": alias_contained,  # lenient alternative, reported by its name
}


def get_label_rule(name: str) -> Callable[[str, Sequence[str]], bool]:
    """The QA labeler registered under ``name`` in ``LABEL_RULES``."""
    try:
        return LABEL_RULES[name]
    except KeyError:
        raise ValueError(
            f"unknown label rule {name!r}; choose one of {sorted(LABEL_RULES)}"
        ) from None


# A number: optional sign (not glued to a preceding word or digit, so "5-7" is not -7),
# optional "$", an integer with or without thousands commas, an optional decimal part.
# A trailing "." without digits ("72.") is a sentence end, not part of the number.
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w.])-(?=\$?\d))?\$?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?P<frac>\.\d+)?"
)


def _canonical(sign: str, integer: str, frac: str) -> str:
    value = Decimal(sign + integer.replace(",", "") + frac)
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_number(text: str, which: Literal["first", "final"] = "first") -> str | None:
    """The first (or final) number stated in ``text``, canonicalized; None when there is none.

    Commas as thousands separators are removed ("1,000" -> "1000"), currency and units
    are ignored ("$5", "5 dollars", "12 cm" -> "5", "5", "12"), a percent sign is
    dropped ("50%" -> "50"), decimals are canonical ("3.50" -> "3.5", "2.0" -> "2"),
    negatives keep their sign ("-7"), and a trailing period is not a decimal point.
    Spelled-out numbers and fractions like "1/2" are not read (the latter gives "1").
    """
    if which not in ("first", "final"):
        raise ValueError(f"which must be 'first' or 'final', got {which!r}")
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    m = matches[0] if which == "first" else matches[-1]
    return _canonical(m.group("sign") or "", m.group("int"), m.group("frac") or "")


def gsm8k_gold(answer_field: str) -> str:
    """The canonical gold number after ``####`` in a GSM8K solution."""
    _, sep, tail = answer_field.rpartition("####")
    if not sep:
        raise DataError("GSM8K answer has no '####' followed by the final number")
    number = extract_number(tail, "first")
    if number is None:
        raise DataError(f"GSM8K answer has no number after '####': {tail.strip()!r}")
    return number


def _as_decimal(number: str) -> Decimal:
    try:
        return Decimal(number.replace(",", ""))
    except InvalidOperation:
        raise ValueError(f"gold {number!r} is not a number") from None


def gsm8k_correct(answer: str, gold: str, which: Literal["first", "final"] = "first") -> bool:
    """Exact numeric match between the answer's first (or final) number and the gold number."""
    stated = extract_number(answer, which)
    if stated is None:
        return False
    return Decimal(stated) == _as_decimal(gold)
