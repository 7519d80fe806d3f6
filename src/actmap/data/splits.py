"""Train / validation / test splits disjoint by source key, and balanced row indices.

Splits are decided per source key, never per row: every row that shares a key (several
samples of one question, several models answering it) lands in the same split. A key's
split comes from a seeded hash of the key alone, so it does not depend on the order of
the rows or on which other keys are present; adding questions never moves old ones.

Where the dataset has its own split, it is kept:
- keys the dataset puts in "test" stay in test, "validation" in validation, "train" in train;
- test is never carved out of anything else;
- if no key is in "validation", validation is carved out of the "train" keys (share
  f_val / (f_train + f_val)); if no key is in "train", train is carved out of the
  "validation" keys the same way (share f_train / (f_train + f_val));
- keys without a dataset split (``None``) are split three ways by ``fractions``.

Balancing (paper): every supervised method trains, selects and is tested on rows with
equal numbers of correct and incorrect generations, per (dataset, model, split).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

SPLITS = ("train", "validation", "test")
DEFAULT_FRACTIONS: Mapping[str, float] = {"train": 0.8, "validation": 0.1, "test": 0.1}


def key_uniform(key: str, seed: int, salt: str = "split") -> float:
    """A uniform number in [0, 1) fixed by (salt, seed, key): the seeded hash behind every split."""
    digest = hashlib.sha256(f"{salt}:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _check_fractions(fractions: Mapping[str, float]) -> dict[str, float]:
    unknown = set(fractions) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split names in fractions: {sorted(unknown)}; use {SPLITS}")
    f = {s: float(fractions.get(s, 0.0)) for s in SPLITS}
    if any(v < 0 for v in f.values()) or abs(sum(f.values()) - 1.0) > 1e-9:
        raise ValueError(f"fractions must be non-negative and sum to 1, got {f}")
    return f


def _pick(u: float, shares: Sequence[tuple[str, float]]) -> str:
    """The split whose cumulative share interval holds u."""
    total = sum(share for _, share in shares)
    edge = 0.0
    for name, share in shares:
        edge += share / total
        if u < edge:
            return name
    return shares[-1][0]


def assign_splits(
    source_keys: Sequence[str],
    dataset_splits: Sequence[str | None] | None = None,
    *,
    seed: int = 0,
    fractions: Mapping[str, float] = DEFAULT_FRACTIONS,
) -> list[str]:
    """The split ("train", "validation" or "test") of every row, disjoint by source key.

    ``dataset_splits[i]`` is the dataset's own split of row i ("train", "validation",
    "test") or None; rows that share a key must agree on it. See the module docstring
    for the carving rules.
    """
    f = _check_fractions(fractions)
    if dataset_splits is None:
        dataset_splits = [None] * len(source_keys)
    if len(dataset_splits) != len(source_keys):
        raise ValueError(
            f"dataset_splits has {len(dataset_splits)} entries, source_keys {len(source_keys)}"
        )
    own: dict[str, str | None] = {}
    for key, split in zip(source_keys, dataset_splits, strict=True):
        if split is not None and split not in SPLITS:
            raise ValueError(f"unknown dataset split {split!r} for key {key!r}; use {SPLITS}")
        if own.setdefault(key, split) != split:
            raise ValueError(
                f"source key {key!r} has two dataset splits: {own[key]!r} and {split!r}"
            )

    present = set(own.values())
    train_shares = [("train", f["train"]), ("validation", f["validation"])]
    carve = {
        # validation carved out of train when the dataset has no validation keys, and back
        "train": train_shares if "validation" not in present else [("train", 1.0)],
        "validation": train_shares if "train" not in present else [("validation", 1.0)],
        "test": [("test", 1.0)],
        None: [(s, f[s]) for s in SPLITS if f[s] > 0],
    }
    for name, shares in carve.items():
        if name in present and sum(share for _, share in shares) <= 0:
            raise ValueError(f"fractions give no share to the splits carved from {name!r}")
    assigned = {key: _pick(key_uniform(key, seed), carve[split]) for key, split in own.items()}
    return [assigned[key] for key in source_keys]


@dataclass(frozen=True)
class SplitCounts:
    """How one split's rows were balanced."""

    correct: int  # rows labelled correct before balancing
    incorrect: int  # rows labelled incorrect before balancing
    unlabeled: int  # rows with label None, never used
    per_class: int  # rows kept of each class: min(correct, incorrect)


@dataclass(frozen=True)
class BalancedSplits:
    """Balanced row ids per split (in input order) and the counts behind them."""

    ids: dict[str, list[Hashable]]
    counts: dict[str, SplitCounts]


def _as_label(label: object, row: int) -> bool | None:
    if label is None:
        return None
    if isinstance(label, (bool, np.bool_)) or label in (0, 1):
        return bool(label)
    raise ValueError(f"label of row {row} must be True, False, 0, 1 or None, got {label!r}")


def balanced_ids(
    ids: Sequence[Hashable],
    splits: Sequence[str],
    labels: Sequence[bool | None],
    seed: int = 0,
) -> BalancedSplits:
    """Per split, all minority-class rows plus an equal seeded random draw of the majority.

    Rows labelled None are left out. Ids keep their input order within each split.
    """
    if not len(ids) == len(splits) == len(labels):
        raise ValueError(
            f"ids, splits and labels differ in length: {len(ids)}, {len(splits)}, {len(labels)}"
        )
    if len(set(ids)) != len(ids):
        raise ValueError("ids must be unique")
    unknown = set(splits) - set(SPLITS)
    if unknown:
        raise ValueError(f"unknown split names: {sorted(unknown)}; use {SPLITS}")

    out_ids: dict[str, list[Hashable]] = {}
    counts: dict[str, SplitCounts] = {}
    for split_index, name in enumerate(SPLITS):
        rows = [i for i, s in enumerate(splits) if s == name]
        as_labels = {i: _as_label(labels[i], i) for i in rows}
        pos = [i for i in rows if as_labels[i] is True]
        neg = [i for i in rows if as_labels[i] is False]
        k = min(len(pos), len(neg))
        minority, majority = (pos, neg) if len(pos) <= len(neg) else (neg, pos)
        rng = np.random.default_rng([seed, split_index])
        drawn = rng.choice(len(majority), size=k, replace=False) if k else []
        kept = sorted(minority + [majority[j] for j in drawn])
        out_ids[name] = [ids[i] for i in kept]
        counts[name] = SplitCounts(
            correct=len(pos),
            incorrect=len(neg),
            unlabeled=len(rows) - len(pos) - len(neg),
            per_class=k,
        )
    return BalancedSplits(ids=out_ids, counts=counts)
