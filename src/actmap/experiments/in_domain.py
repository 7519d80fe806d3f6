"""Main results: every method on one store's identical balanced test rows, with intervals.

    method_scores(store, runs)        -> {method: MethodScores} on the balanced test rows
    in_domain_column(store, runs)     -> InDomainColumn (one column of the paper's table)

A cell is AUROC / AUPRC / ECE with 95% bootstrap intervals (`actmap.scoring.intervals`,
resampling the test rows) and its row count. ActMap detectors (one `actmap train`
run each, several seeds) score a row with the mean p(correct) of their seeds.
Each ActMap detector is compared with each baseline on the rows both scored: the
paired bootstrap interval of the AUROC difference. A column's best method is
marked only where its paired interval against every other method excludes 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actmap.errors import ActmapUserError
from actmap.scoring import metrics
from actmap.scoring.contract import is_probability
from actmap.scoring.intervals import N_RESAMPLES, Interval, bootstrap, paired_bootstrap
from actmap.store import MapStore, latest_rows
from actmap.store.rows import rows_to_score
from actmap.training.run_folder import method_name, read_run

log = logging.getLogger(__name__)

# the paper's taxonomy (Table "taxonomy"); controls are not methods
FAMILIES = {
    "semantic_entropy": "black",
    "perplexity": "grey",
    "mean_token_entropy": "grey",
    "p_true": "grey",
    "tad": "white",
    "rauq": "white",
    "eigenscore": "white",
    "actvit": "white",
    "answer_length": "control",
    "permuted_label": "control",
}
FAMILY_ORDER = ("black", "grey", "white", "actmap", "control")


def family_of(method: str) -> str:
    if method.startswith("actmap"):
        return "actmap"
    if method in FAMILIES:  # "permuted_label" is the control itself, not a permuted "label"
        return FAMILIES[method]
    return FAMILIES.get(method.removeprefix("permuted_"), "white")


@dataclass(frozen=True)
class MethodScores:
    """One method's confidence on test rows (higher = more likely correct)."""

    method: str
    family: str
    ids: list[str]
    confidence: np.ndarray
    probability: bool  # the confidence estimates p(correct): ECE applies
    seeds: int = 1


@dataclass(frozen=True)
class Cell:
    method: str
    family: str
    n: int
    seeds: int
    auroc: Interval
    auprc: Interval
    ece: Interval | None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "family": self.family,
            "n": self.n,
            "seeds": self.seeds,
            "auroc": self.auroc.to_json(),
            "auprc": self.auprc.to_json(),
            "ece": None if self.ece is None else self.ece.to_json(),
            "note": self.note,
        }


@dataclass(frozen=True)
class Paired:
    """AUROC(a) - AUROC(b) on the rows both scored, with its paired bootstrap interval."""

    a: str
    b: str
    difference: Interval

    @property
    def excludes_zero(self) -> bool:
        return self.difference.low > 0 or self.difference.high < 0

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, **self.difference.to_json()}


@dataclass(frozen=True)
class InDomainColumn:
    store: str
    generator: str
    task: str
    n_test: int
    cells: list[Cell]
    paired: list[Paired]  # each ActMap detector vs each other method
    best: str | None  # the top AUROC, kept only when its paired intervals all exclude 0
    best_check: list[Paired] = field(default_factory=list)  # the top method vs every other
    paired_ece: list[Paired] = field(default_factory=list)  # ECE(ActMap) - ECE(probability)

    def pair(self, a: str, b: str, metric: str = "auroc") -> Paired | None:
        found = self.paired if metric == "auroc" else self.paired_ece
        return next((p for p in found if p.a == a and p.b == b), None)

    def cell(self, method: str) -> Cell | None:
        return next((c for c in self.cells if c.method == method), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "generator": self.generator,
            "task": self.task,
            "n_test": self.n_test,
            "cells": [c.to_json() for c in self.cells],
            "paired": [p.to_json() for p in self.paired],
            "best": self.best,
            "best_check": [p.to_json() for p in self.best_check],
            "paired_ece": [p.to_json() for p in self.paired_ece],
        }


# --- scores ---------------------------------------------------------------------------------


def run_scores(run: Path, name: str, test_ids: Sequence[str], labels: np.ndarray) -> MethodScores:
    """An `actmap train` run: the mean p(correct) over its seeds on its stored test rows."""
    import pandas as pd

    checked = read_run(run)
    frames = [pd.read_parquet(f / "test_scores.parquet") for f in checked.seed_dirs.values()]
    wanted = set(map(str, test_ids))
    for folder, frame in zip(checked.seed_dirs.values(), frames, strict=True):
        if set(map(str, frame["id"])) != wanted:
            raise ActmapUserError(
                f"{folder} scored rows other than the store's {len(wanted)} balanced test rows; "
                "was it trained on another store?"
            )
    p = np.mean(
        [f.set_index(f["id"].astype(str)).loc[list(test_ids), "p_correct"] for f in frames], 0
    )
    return MethodScores(name, "actmap", list(test_ids), p.astype(np.float64), True, len(frames))


def stored_baseline_scores(store, method: str, test_ids: Sequence[str]) -> MethodScores | None:
    """A baseline's stored results on the test rows it scored (mean over its seeds if several)."""

    frame = latest_rows(store.read_table(f"results/{method}")).to_pandas()
    frame = frame.set_index(frame["id"].astype(str))
    present = [k for k in test_ids if k in frame.index]
    if not present:
        return None
    seed_columns = sorted(c for c in frame.columns if c.startswith("confidence_by_seed_"))
    columns = seed_columns if len(seed_columns) > 1 else ["confidence"]
    confidence = frame.loc[present, columns].to_numpy(dtype=np.float64).mean(axis=1)
    record = store.manifest.get("results", {}).get(method, {})
    probability = is_probability(record, confidence)
    return MethodScores(method, family_of(method), present, confidence, probability, len(columns))


def method_scores(
    store, runs: Mapping[str, Path], test_ids: Sequence[str], labels: np.ndarray
) -> dict[str, MethodScores]:
    """Every stored baseline result and every ActMap run, on the balanced test rows."""
    out: dict[str, MethodScores] = {}
    for table in sorted(store.tables()):
        if table.startswith("results/"):
            method = table.split("/", 1)[1]
            scored = stored_baseline_scores(store, method, test_ids)
            if scored is not None:
                out[method] = scored
    for detector, run in sorted(runs.items()):
        name = method_name(detector)
        out[name] = run_scores(Path(run), name, test_ids, labels)
    return out


# --- the column -----------------------------------------------------------------------------


def _aligned(a: MethodScores, b: MethodScores, label_of: Mapping[str, int]):
    common = [k for k in a.ids if k in set(b.ids)]
    ia = dict(zip(a.ids, a.confidence, strict=True))
    ib = dict(zip(b.ids, b.confidence, strict=True))
    y = np.array([label_of[k] for k in common])
    return np.array([ia[k] for k in common]), np.array([ib[k] for k in common]), y


def score_cell(
    scored: MethodScores, label_of: Mapping[str, int], n_resamples: int, seed: int = 0
) -> Cell:
    y = np.array([label_of[k] for k in scored.ids])
    s = scored.confidence
    note = ""
    if len(np.unique(y)) < 2:
        raise ValueError(f"{scored.method}: its scored test rows hold a single class")
    ece = None
    if scored.probability:
        ece = bootstrap(s, y, metrics.ece, n_resamples, seed=seed)
    else:
        note = "ECE n/a: the confidence is not a probability"
    return Cell(
        scored.method,
        scored.family,
        len(y),
        scored.seeds,
        bootstrap(s, y, None, n_resamples, seed=seed),
        bootstrap(s, y, metrics.auprc, n_resamples, seed=seed),
        ece,
        note,
    )


def paired_auroc(
    a: MethodScores,
    b: MethodScores,
    label_of: Mapping[str, int],
    n_resamples: int,
    seed: int = 0,
    metric=None,
) -> Paired:
    """metric(a) - metric(b) on the rows both scored (AUROC when ``metric`` is None)."""
    sa, sb, y = _aligned(a, b, label_of)
    return Paired(a.method, b.method, paired_bootstrap(sa, sb, y, metric, n_resamples, seed=seed))


def in_domain_column(
    scores: Mapping[str, MethodScores],
    label_of: Mapping[str, int],
    store: str,
    generator: str,
    task: str,
    n_resamples: int = N_RESAMPLES,
) -> InDomainColumn:
    """Cells, ActMap-vs-each paired differences, and the best method where it is clear."""
    scores = {s.method: s for s in scores.values()}
    cells = [score_cell(s, label_of, n_resamples) for s in scores.values()]
    cells.sort(key=lambda c: (FAMILY_ORDER.index(c.family), c.method))
    ours = [m for m in scores if scores[m].family == "actmap"]
    paired = [
        paired_auroc(scores[a], scores[b], label_of, n_resamples)
        for a in ours
        for b in scores
        if b != a
    ]
    paired_ece = [
        paired_auroc(scores[a], scores[b], label_of, n_resamples, metric=metrics.ece)
        for a in ours
        for b in scores
        if b != a and scores[b].probability
    ]
    ranked = [c for c in cells if c.family != "control"]
    best, check = None, []
    if len(ranked) > 1:
        top = max(ranked, key=lambda c: c.auroc.estimate)
        check = [
            paired_auroc(scores[top.method], scores[c.method], label_of, n_resamples)
            for c in ranked
            if c.method != top.method
        ]
        best = top.method if all(p.difference.low > 0 for p in check) else None
    return InDomainColumn(
        store, generator, task, len(label_of), cells, paired, best, check, paired_ece
    )


def store_column(
    store_path: str | Path,
    runs: Mapping[str, Path],
    name: str,
    generator: str,
    task: str,
    n_resamples: int = N_RESAMPLES,
) -> InDomainColumn:
    """One store's column on its balanced test rows (the store is only read)."""

    store = MapStore.open(store_path)
    rows = rows_to_score(store, "balanced")
    label_of = dict(zip(rows.ids, rows.labels.tolist(), strict=True))
    scores = method_scores(store, runs, rows.ids, rows.labels)
    return in_domain_column(scores, label_of, name, generator, task, n_resamples)


@dataclass(frozen=True)
class InDomainMatrix:
    columns: list[InDomainColumn]
    skipped: dict[str, str] = field(default_factory=dict)  # store -> why it has no column
    judge_notes: dict[str, str] = field(default_factory=dict)  # judge-labelled store -> check

    def to_json(self) -> dict[str, Any]:
        return {
            "columns": [c.to_json() for c in self.columns],
            "skipped": self.skipped,
            "judge_notes": self.judge_notes,
        }
