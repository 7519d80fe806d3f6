"""Correctness labels: hand-checked cases for every labeler."""

from __future__ import annotations

import pytest

from actmap.data.base import DataError
from actmap.data.labels import (
    LABEL_RULES,
    alias_contained,
    extract_number,
    get_label_rule,
    gsm8k_correct,
    gsm8k_gold,
    normalize_answer,
    qa_correct,
    token_f1,
)
from actmap.data.prompts import extract_answer


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("The Beatles", "beatles"),
        ("  A  tale of Two   Cities! ", "tale of two cities"),
        ("U.S.A.", "usa"),
        ("an apple", "apple"),
        ("Theatre", "theatre"),  # "the" only as a whole word
        ("rock-and-roll", "rockandroll"),  # SQuAD drops punctuation without a space
        ("", ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_token_f1_hand_computed():
    # pred tokens {paris, france}, gold {paris}: P = 1/2, R = 1, F1 = 2/3
    assert token_f1("Paris, France", "Paris") == pytest.approx(2 / 3)
    # pred {john, f, kennedy}, gold {john, kennedy}: P = 2/3, R = 1, F1 = 0.8
    assert token_f1("John F. Kennedy", "John Kennedy") == pytest.approx(0.8)
    # repeated tokens count once each side: pred {new, new, york}, gold {new, york}
    assert token_f1("new new york", "New York") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))
    assert token_f1("", "") == 1.0
    assert token_f1("", "x") == 0.0
    assert token_f1("berlin", "paris") == 0.0


QA_CASES = [
    # (answer, aliases, paper rule, contains rule)
    ("Paris", ["Paris"], True, True),
    ("paris.", ["Paris"], True, True),
    ("The Beatles", ["Beatles"], True, True),
    ("Beatles", ["The Beatles"], True, True),
    ("John F. Kennedy", ["John Kennedy"], True, False),  # F1 = 0.8 exactly -> correct
    ("Paris, France", ["Paris"], False, True),  # F1 = 2/3 < 0.8, but alias contained
    ("It is Paris", ["Paris"], False, True),
    ("London", ["Paris", "London"], True, True),  # any alias
    ("Berlin", ["Paris", "London"], False, False),
    ("", ["Paris"], False, False),
    ("The", ["The"], False, False),  # normalizes to empty: never correct
    ("Scorpio", ["Scorpio", "Skorpio", "Scorpio (disambiguation)"], True, True),
    ("Sir Henry Campbell Bannerman", ["Campbell-Bannerman"], False, False),
    ("Henry Campbell-Bannerman", ["Sir Henry Campbell-Bannerman"], True, False),  # F1 0.8
    ("1972", ["14 December 1972 UTC", "December 1972"], False, False),  # F1 2/3
    ("December 1972", ["14 December 1972 UTC", "December 1972"], True, True),
    ("Bobby Scott and Bob Russell", ["Bobby Scott", "Bob Russell"], False, True),
    ("Nine", ["Nine"], True, True),
    ("9", ["Nine"], False, False),  # no number-word mapping
    ("david seville", ["David Seville"], True, True),
]


@pytest.mark.parametrize(("answer", "aliases", "paper", "contains"), QA_CASES)
def test_qa_rules(answer, aliases, paper, contains):
    assert qa_correct(answer, aliases) is paper
    assert alias_contained(answer, aliases) is contains


def test_qa_correct_matches_naive_definition():
    """qa_correct equals 'EM to any alias or max F1 >= 0.8', written out in the test."""
    for answer, aliases, _, _ in QA_CASES:
        pred = normalize_answer(answer)
        usable = [a for a in aliases if normalize_answer(a)]
        em = any(pred == normalize_answer(a) for a in usable)
        f1 = max((token_f1(answer, a) for a in usable), default=0.0)
        assert qa_correct(answer, aliases) is (bool(pred) and (em or f1 >= 0.8))


def test_label_rule_registry():
    assert LABEL_RULES["paper"] is qa_correct
    assert get_label_rule("contains") is alias_contained
    with pytest.raises(ValueError, match="unknown label rule 'fuzzy'"):
        get_label_rule("fuzzy")
    with pytest.raises(TypeError):
        qa_correct("Paris", "Paris")  # a bare string would match letter by letter


@pytest.mark.parametrize(
    ("text", "first", "final"),
    [
        ("72", "72", "72"),
        ("The answer is 1,000 apples.", "1000", "1000"),
        ("$5", "5", "5"),
        ("5 dollars", "5", "5"),
        ("12 cm", "12", "12"),
        ("12cm", "12", "12"),
        ("3.50", "3.5", "3.5"),
        ("2.0", "2", "2"),
        ("-7", "-7", "-7"),
        ("It dropped to -$7.50 today", "-7.5", "-7.5"),
        ("50%", "50", "50"),
        ("72.", "72", "72"),
        ("She pays $1,234,567.00 in total.", "1234567", "1234567"),
        ("16 - 3 - 4 = 9", "16", "9"),  # a minus between numbers is not a sign
        ("5-7 people", "5", "7"),
        ("1, 2, 3", "1", "3"),  # a list is not a thousands group
        ("The answer is 0.5.", "0.5", "0.5"),
        ("no numbers here", None, None),
        ("", None, None),
    ],
)
def test_extract_number(text, first, final):
    assert extract_number(text, "first") == first
    assert extract_number(text, "final") == final


def test_extract_number_rejects_bad_which():
    with pytest.raises(ValueError, match="which"):
        extract_number("1", "last")


def test_gsm8k_gold():
    assert gsm8k_gold("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert gsm8k_gold("...\n#### 1,000") == "1000"
    assert gsm8k_gold("#### -3") == "-3"
    assert gsm8k_gold("#### 2.50") == "2.5"
    with pytest.raises(DataError, match="####"):
        gsm8k_gold("no final marker 42")
    with pytest.raises(DataError, match="no number"):
        gsm8k_gold("#### none")


GSM8K_CASES = [
    # (answer, gold, first-number rule, final-number rule)
    ("72", "72", True, True),
    (" 72", "72", True, True),
    ("$18", "18", True, True),
    ("18 dollars", "18", True, True),
    ("1,000", "1000", True, True),
    ("1000", "1,000", True, True),  # commas in the gold too
    ("3.50", "3.5", True, True),
    ("3.5", "3.50", True, True),
    ("-7", "-7", True, True),
    ("7", "-7", False, False),
    ("50%", "50", True, True),
    ("72.", "72", True, True),
    ("20 eggs, so 16 - 4 = 12", "20", True, False),
    ("20 eggs, so 16 - 4 = 12", "12", False, True),
    ("no idea", "5", False, False),
    ("5.0", "5", True, True),
    ("0.5", "5", False, False),
    ("624 pages", "624", True, True),
    ("He makes 10 per hour", "10", True, True),
]


@pytest.mark.parametrize(("answer", "gold", "first", "final"), GSM8K_CASES)
def test_gsm8k_correct(answer, gold, first, final):
    assert gsm8k_correct(answer, gold) is first  # the default reads the first number
    assert gsm8k_correct(answer, gold, which="first") is first
    assert gsm8k_correct(answer, gold, which="final") is final


def test_gsm8k_correct_rejects_non_numeric_gold():
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_correct("5", "five")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (" Paris\n\nQuestion: What is the capital of Spain?\nAnswer: Madrid", "Paris"),
        ("Paris Question: next", "Paris"),
        ("\n\nParis", "Paris"),
        ("Answer: Paris", "Paris"),
        ("answer:\nParis\nmore", "Paris"),
        ("The answer is 42.\nBecause", "The answer is 42."),
        ("", ""),
    ],
)
def test_extract_answer(raw, expected):
    assert extract_answer(raw) == expected


def test_extracted_answers_feed_labels():
    raw = " David Seville\n\nQuestion: Who wrote Hamlet?\nAnswer: Shakespeare"
    assert not qa_correct(raw, ["David Seville"])  # the raw continuation spoils the match
    assert qa_correct(extract_answer(raw), ["David Seville"])
    assert gsm8k_correct(extract_answer(" 42\nQuestion: 7 + 1?\nAnswer: 8"), "42", which="final")
