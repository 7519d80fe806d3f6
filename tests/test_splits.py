"""Source-key-disjoint splits and balanced row ids."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from actmap.data.splits import SPLITS, assign_splits, balanced_ids, key_uniform


def _naive_uniform(key: str, seed: int) -> float:
    digest = hashlib.sha256(f"split:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def test_key_uniform_is_the_documented_hash():
    for key in ["a", "q-00001", "ü"]:
        assert key_uniform(key, 7) == _naive_uniform(key, 7)
        assert 0.0 <= key_uniform(key, 7) < 1.0


def test_pooled_split_follows_hash_thresholds():
    keys = [f"k{i}" for i in range(300)]
    got = assign_splits(keys, seed=3, fractions={"train": 0.6, "validation": 0.3, "test": 0.1})
    for key, split in zip(keys, got, strict=True):
        u = _naive_uniform(key, 3)
        expected = "train" if u < 0.6 else "validation" if u < 0.9 else "test"
        assert split == expected


def test_duplicated_keys_share_a_split_and_splits_are_disjoint():
    keys = [f"q{i % 50}" for i in range(500)]  # ten rows per question, interleaved
    got = assign_splits(keys, seed=0)
    by_key: dict[str, set[str]] = {}
    for key, split in zip(keys, got, strict=True):
        by_key.setdefault(key, set()).add(split)
    assert all(len(s) == 1 for s in by_key.values())
    keysets = {s: {k for k, g in zip(keys, got, strict=True) if g == s} for s in SPLITS}
    assert not keysets["train"] & keysets["validation"]
    assert not keysets["train"] & keysets["test"]
    assert not keysets["validation"] & keysets["test"]


def test_assignment_is_deterministic_order_free_and_seeded():
    keys = [f"q{i}" for i in range(400)]
    a = dict(zip(keys, assign_splits(keys, seed=1), strict=True))
    shuffled = keys[::-1] + ["extra-1", "extra-2"]
    b = dict(zip(shuffled, assign_splits(shuffled, seed=1), strict=True))
    assert all(a[k] == b[k] for k in keys)  # order and new keys move nothing
    c = dict(zip(keys, assign_splits(keys, seed=2), strict=True))
    assert any(a[k] != c[k] for k in keys)  # another seed is another split


def test_pooled_fractions_are_close_to_requested():
    keys = [f"q{i}" for i in range(20000)]
    counts = Counter(assign_splits(keys, seed=0))
    assert abs(counts["train"] / 20000 - 0.8) < 0.01
    assert abs(counts["validation"] / 20000 - 0.1) < 0.01
    assert abs(counts["test"] / 20000 - 0.1) < 0.01


def test_dataset_train_test_keeps_test_and_carves_validation_from_train():
    keys = [f"tr{i}" for i in range(900)] + [f"te{i}" for i in range(100)]
    own = ["train"] * 900 + ["test"] * 100
    got = assign_splits(keys, own, seed=0)
    assert all(g == "test" for g in got[900:])
    for key, g in zip(keys[:900], got[:900], strict=True):
        # validation share of the train keys: 0.1 / (0.8 + 0.1)
        assert g == ("train" if _naive_uniform(key, 0) < 0.8 / 0.9 else "validation")
    assert 60 < Counter(got[:900])["validation"] < 140


def test_dataset_validation_test_carves_train_from_validation():
    keys = [f"va{i}" for i in range(90)] + [f"te{i}" for i in range(10)]
    own = ["validation"] * 90 + ["test"] * 10
    got = assign_splits(keys, own, seed=0)
    assert got[90:] == ["test"] * 10
    assert set(got[:90]) == {"train", "validation"}


def test_dataset_with_all_three_splits_is_kept_verbatim():
    own = ["train", "validation", "test", "train"]
    assert assign_splits(["a", "b", "c", "d"], own, seed=5) == own


def test_mixed_pooled_and_fixed_keys():
    keys = ["fixed-test", "p1", "p2", "p3"]
    got = assign_splits(keys, ["test", None, None, None], seed=0)
    assert got[0] == "test"
    for key, g in zip(keys[1:], got[1:], strict=True):
        u = _naive_uniform(key, 0)
        assert g == ("train" if u < 0.8 else "validation" if u < 0.9 else "test")


def test_assign_splits_errors():
    with pytest.raises(ValueError, match="unknown dataset split 'dev'"):
        assign_splits(["a"], ["dev"])
    with pytest.raises(ValueError, match="two dataset splits"):
        assign_splits(["a", "a"], ["train", "test"])
    with pytest.raises(ValueError, match="unknown split names in fractions"):
        assign_splits(["a"], fractions={"train": 0.9, "dev": 0.1})
    with pytest.raises(ValueError, match="sum to 1"):
        assign_splits(["a"], fractions={"train": 0.5, "validation": 0.1, "test": 0.1})
    with pytest.raises(ValueError, match="entries"):
        assign_splits(["a", "b"], ["train"])


def test_balanced_ids_hand_checked():
    ids = ["a", "b", "c", "d", "e", "f", "g", "h"]
    splits = ["train", "train", "train", "train", "test", "test", "test", "validation"]
    labels = [True, True, True, False, True, False, None, True]
    out = balanced_ids(ids, splits, labels, seed=0)
    # train: 3 correct, 1 incorrect -> d plus one of a, b, c
    assert len(out.ids["train"]) == 2 and "d" in out.ids["train"]
    assert set(out.ids["train"]) - {"d"} <= {"a", "b", "c"}
    assert out.ids["test"] == ["e", "f"]  # already balanced; g unlabeled
    assert out.ids["validation"] == []  # one class only
    assert out.counts["train"].correct == 3 and out.counts["train"].incorrect == 1
    assert out.counts["train"].per_class == 1
    assert out.counts["test"].unlabeled == 1
    assert out.counts["validation"].per_class == 0


def test_balanced_ids_exact_balance_order_and_determinism():
    n = 1000
    ids = [f"row{i}" for i in range(n)]
    splits = [SPLITS[i % 3] for i in range(n)]
    labels = [None if i % 11 == 0 else (i * 7919) % 10 < 7 for i in range(n)]
    out = balanced_ids(ids, splits, labels, seed=42)
    label_of = dict(zip(ids, labels, strict=True))
    split_of = dict(zip(ids, splits, strict=True))
    for split in SPLITS:
        kept = out.ids[split]
        n_pos = sum(label_of[i] is True for i in kept)
        n_neg = sum(label_of[i] is False for i in kept)
        rows = [i for i in ids if split_of[i] == split]
        expected_k = min(
            sum(label_of[i] is True for i in rows), sum(label_of[i] is False for i in rows)
        )
        assert n_pos == n_neg == expected_k == out.counts[split].per_class
        assert all(split_of[i] == split and label_of[i] is not None for i in kept)
        # minority class kept whole
        minority = min((True, False), key=lambda v: sum(label_of[i] is v for i in rows))
        assert {i for i in rows if label_of[i] is minority} <= set(kept)
        assert kept == sorted(kept, key=ids.index)  # input order
    again = balanced_ids(ids, splits, labels, seed=42)
    assert again.ids == out.ids
    other = balanced_ids(ids, splits, labels, seed=43)
    assert other.ids != out.ids


def test_balanced_ids_accepts_int_labels_and_rejects_bad_input():
    out = balanced_ids([1, 2], ["test", "test"], [1, 0])
    assert out.ids["test"] == [1, 2]
    with pytest.raises(ValueError, match="unknown split names"):
        balanced_ids(["a"], ["dev"], [True])
    with pytest.raises(ValueError, match="differ in length"):
        balanced_ids(["a", "b"], ["test"], [True])
    with pytest.raises(ValueError, match="unique"):
        balanced_ids(["a", "a"], ["test", "test"], [True, False])
    with pytest.raises(ValueError, match="label of row 0"):
        balanced_ids(["a"], ["test"], ["yes"])
