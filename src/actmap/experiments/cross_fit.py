"""A cross-fitted comparison of the stacked presets: every labelled row of a store is tested once.

`compare_stacked` tests on one split's balanced rows, which on a store whose generator is
rarely right is a hundred rows or so: methods .01-.02 apart cannot be told apart there.
This pools every labelled row (train, validation and test splits), cuts the pool into
``folds`` stratified folds, and for fold k fits every method on the other folds but one,
makes every choice on fold k + 1 (the validation fold: balanced, as in `compare_stacked`)
and scores fold k's balanced rows once.

The models differ from fold to fold, and their scores need not share a scale (TAD's
regression is refit per fold: pooled over folds its AUROC on one store fell from .78-.84 per
fold to .67). So each method is read by its **fold-stratified AUROC**: the fraction of
(correct, incorrect) pairs *within a fold* that it orders right, i.e. each fold's AUROC
weighted by its number of pairs. Intervals resample rows within each fold (the same rows for
both methods of a paired difference). The pooled AUROC is kept beside it for reference.

What this answers: "which method ranks this generator's answers better", with every labelled
row tested once, not "how well does the one saved detector rank the held-out split"; the rows
of the store's test split are trained on in the other folds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from actmap.data.splits import balanced_ids
from actmap.errors import ActmapUserError
from actmap.experiments.compare_product import (
    SINGLE_PASS_BASELINES,
    GenerationReader,
    baseline_scored,
    store_rows,
)
from actmap.experiments.stacked import preset_columns, presets_scored, with_positions_only
from actmap.scoring import metrics
from actmap.scoring.intervals import Interval, stratified_auroc
from actmap.store.rows import Rows

log = logging.getLogger(__name__)

POOLED = ("train_all", "validation_all", "test_all")


def _take(rows: Rows, index: np.ndarray) -> Rows:
    return Rows(
        [rows.ids[i] for i in index],
        np.asarray(rows.labels)[index],
        np.asarray(rows.maps)[index],
        None if rows.scalars is None else np.asarray(rows.scalars)[index],
    )


def pooled_rows(sets: dict[str, Rows]) -> Rows:
    """Every labelled row of the store (train, validation, test splits) as one `Rows`."""
    parts = [sets[name] for name in POOLED]
    scalars = None if any(p.scalars is None for p in parts) else np.concatenate([p.scalars for p in parts])  # fmt: skip
    return Rows(
        [i for p in parts for i in p.ids],
        np.concatenate([np.asarray(p.labels) for p in parts]),
        np.concatenate([np.asarray(p.maps) for p in parts]),
        scalars,
    )


def fold_sets(pool: Rows, folds: int = 5, seed: int = 0) -> list[dict[str, Rows]]:
    """Per fold k, the row sets `compare_stacked` reads: test = fold k, validation = fold
    k + 1, train = the rest; "<name>_all" every row of it, "<name>" its balanced rows."""
    from sklearn.model_selection import StratifiedKFold

    labels = np.asarray(pool.labels)
    if folds < 3:
        raise ActmapUserError(
            f"a cross-fit needs at least 3 folds (train, validation, test), got {folds}"
        )
    if np.bincount(labels, minlength=2).min() < folds:
        raise ActmapUserError(
            f"fewer than {folds} rows of a class: cannot cut {folds} stratified folds"
        )
    cut = StratifiedKFold(folds, shuffle=True, random_state=seed)
    parts = [held for _, held in cut.split(np.zeros(len(labels)), labels)]
    out = []
    for k in range(folds):
        role = np.full(len(labels), "train", dtype=object)
        role[parts[k]], role[parts[(k + 1) % folds]] = "test", "validation"
        # the store's own balancing rule (`balanced_ids`), over this fold's three row sets
        chosen = balanced_ids(range(len(labels)), list(role), list(labels), seed + k).ids
        sets = {}
        for name in ("train", "validation", "test"):
            sets[f"{name}_all"] = _take(pool, np.flatnonzero(role == name))
            sets[name] = _take(pool, np.asarray(chosen[name], dtype=np.int64))
        out.append(sets)
    return out


@dataclass(frozen=True)
class CrossFitRow:
    method: str
    role: str  # "preset" | "strongest baseline" | "baseline"
    validation_auroc: float  # mean over folds
    test_auroc: Interval  # fold-stratified, on every fold's balanced test rows
    fold_aurocs: list[float]  # each fold's own balanced-test AUROC
    pooled_auroc: float  # every fold's scores pooled as one ranking (scales may differ)
    vs: dict[str, Interval]  # preset name -> preset minus this method, fold-stratified, paired


@dataclass(frozen=True)
class CrossFitComparison:
    store: str
    folds: int
    n_rows: int  # every labelled row pooled
    n_test: int  # pooled balanced test rows (every fold's)
    prevalence: float
    rows: list[CrossFitRow]

    def to_json(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        presets, head = preset_columns(self.rows)
        lines = [
            f"store {self.store}: {self.folds}-fold cross-fit over {self.n_rows} labelled rows "
            f"({self.prevalence:.1%} correct); {self.n_test} balanced test rows pooled over folds",
            "",
            f"| method | role | mean val AUROC | test AUROC, fold-stratified [95%] | per fold "
            f"| pooled | {head} |",
            "|---|---|---|---|---|---|" + "---|" * len(presets),
        ]
        for r in self.rows:
            diffs = " | ".join(str(r.vs[p]) if p in r.vs else "" for p in presets)
            per_fold = ", ".join(f"{a:.3f}" for a in r.fold_aurocs)
            lines.append(
                f"| {r.method} | {r.role} | {r.validation_auroc:.3f} | {r.test_auroc} | {per_fold} "
                f"| {r.pooled_auroc:.3f} | {diffs} |"
            )  # fmt: skip
        return "\n".join(lines) + "\n"


def cross_fitted_comparison(
    store,
    folds: int = 5,
    presets: Sequence[str] = ("deployable", "full"),
    baselines: Sequence[str] = SINGLE_PASS_BASELINES,
    n_resamples: int = 2000,
    seed: int = 0,
) -> CrossFitComparison:
    """Both presets and every single-pass baseline, fit and chosen per fold (module doc)."""
    pool = pooled_rows(with_positions_only(store, store_rows(store)))
    gens = GenerationReader(store)
    scores: dict[str, list[np.ndarray]] = {}
    val_aurocs: dict[str, list[float]] = {}
    roles: dict[str, str] = {}
    labels = []
    for k, sets in enumerate(fold_sets(pool, folds, seed)):
        log.info("cross-fit fold %d of %d: %d train, %d validation, %d test rows", k + 1, folds,
                 len(sets["train_all"]), len(sets["validation"]), len(sets["test"]))  # fmt: skip
        methods = presets_scored(store, sets, presets)
        for m in methods:
            roles[m.name] = "preset"
        for method in baselines:
            try:
                methods.append(baseline_scored(store, sets, method, gens))
            except Exception as err:  # e.g. no attention stored: the others still compare
                log.warning("%s cannot run on %s: %s", method, store.root, err)
        for m in methods:
            scores.setdefault(m.name, []).append(np.asarray(m.score_test(sets["test"]), np.float64))
            val_aurocs.setdefault(m.name, []).append(m.validation_auroc)
        labels.append(np.asarray(sets["test"].labels))
    complete = [name for name, s in scores.items() if len(s) == folds]  # ran on every fold
    y = np.concatenate(labels)
    preset_names = [n for n in complete if roles.get(n) == "preset"]
    others = [n for n in complete if n not in preset_names]
    if not others:
        raise ValueError(f"{store.root}: none of the baselines {', '.join(baselines)} could run")
    strongest = max(others, key=lambda n: float(np.mean(val_aurocs[n])))
    rows = []
    for name in [*preset_names, strongest, *(n for n in others if n != strongest)]:
        role = roles.get(name) or ("strongest baseline" if name == strongest else "baseline")
        rows.append(
            CrossFitRow(
                name,
                role,
                float(np.mean(val_aurocs[name])),
                stratified_auroc(scores[name], labels, n_resamples=n_resamples),
                [metrics.auroc(s, lab) for s, lab in zip(scores[name], labels, strict=True)],
                metrics.auroc(np.concatenate(scores[name]), y),
                {
                    p: stratified_auroc(scores[p], labels, scores[name], n_resamples=n_resamples)
                    for p in preset_names
                    if p != name
                },
            )
        )
    return CrossFitComparison(str(store.root), folds, len(pool), len(y), pool.prevalence, rows)
