"""Labels needed (the learning curve): test AUROC against the number of labelled training rows.

    run_learning_curve(store, LearningCurveConfig()) -> LearningCurve (to_json, to_markdown)

For each fraction (10 / 25 / 50 / 100% by default) and seed, a class-balanced subsample of
the store's balanced training rows (drawn with that seed) trains each method; validation
and test rows are always the full balanced splits, so every point is scored on the same
rows. ActMap detectors (MLP, logistic regression) train with the paper's recipe; the
supervised baselines (TAD, ACT-ViT) are fitted through their own scorers on the same
subsample. A baseline whose inputs the store lacks is reported unavailable with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from actmap.baselines.base import BaselineUnavailable
from actmap.baselines.inputs import StoreInputs
from actmap.baselines.options import BaselineOptions
from actmap.experiments.common import AurocSummary, SeedScores, auroc_summary, train_seeds
from actmap.experiments.seeds import recipe_config
from actmap.scoring.intervals import N_RESAMPLES
from actmap.store import StoreError
from actmap.store.rows import Rows, balanced_splits, read_rows

log = logging.getLogger(__name__)

ACTMAP_DETECTORS = ("mlp", "logreg", "vit", "mlp4x")
SUPERVISED_BASELINES = ("tad", "actvit", "answer_length")


@dataclass(frozen=True)
class LearningCurveConfig:
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0)  # of the balanced training rows
    seeds: tuple[int, ...] = (42, 123, 456)  # each seed draws its own subsample and init
    methods: tuple[str, ...] = ("mlp", "logreg", "tad")  # ActMap detectors and baselines
    max_epochs: int | None = None  # ActMap recipe epoch cap; None = the paper's 80
    n_resamples: int = N_RESAMPLES

    def __post_init__(self) -> None:
        if not self.fractions or any(not 0.0 < f <= 1.0 for f in self.fractions):
            raise ValueError(f"fractions must lie in (0, 1], got {self.fractions}")
        unknown = [m for m in self.methods if m not in ACTMAP_DETECTORS + SUPERVISED_BASELINES]
        if unknown:
            raise ValueError(
                f"unknown learning-curve methods {unknown}; known: "
                f"{ACTMAP_DETECTORS + SUPERVISED_BASELINES}"
            )


def balanced_subsample(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted row indices: ``round(fraction * n_c)`` rows of each class c (at least 1), drawn
    without replacement with ``seed``; class counts keep their ratio (balanced stays balanced)."""
    y = np.asarray(labels)
    rng = np.random.default_rng(seed)
    chosen = []
    for cls in (0, 1):
        rows = np.flatnonzero(y == cls)
        if len(rows) == 0:
            raise ValueError(f"the training rows hold no row of class {cls}")
        k = max(1, int(round(fraction * len(rows))))
        chosen.append(rng.choice(rows, size=k, replace=False))
    return np.sort(np.concatenate(chosen))


@dataclass(frozen=True)
class CurvePoint:
    method: str
    fraction: float
    n_train: int  # labelled training rows used (same for every seed)
    summary: AurocSummary

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "fraction": self.fraction,
            "n_train": self.n_train,
            **self.summary.to_json(),
        }


@dataclass(frozen=True)
class LearningCurve:
    store: str
    config: LearningCurveConfig
    rows: dict[str, int]
    points: list[CurvePoint] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why
    # (method, fraction, n_train, why): a fit that cannot run on so few rows (e.g. TAD's
    # stacking needs 5 training sequences); the other points of the curve are kept
    skipped: list[tuple[str, float, int, str]] = field(default_factory=list)

    def curve(self, method: str) -> list[CurvePoint]:
        return sorted((p for p in self.points if p.method == method), key=lambda p: p.fraction)

    def to_json(self) -> dict:
        return {
            "store": self.store,
            "config": dataclasses.asdict(self.config),
            "rows": self.rows,
            "points": [p.to_json() for p in self.points],
            "unavailable": self.unavailable,
            "skipped": [
                {"method": m, "fraction": f, "n_train": n, "reason": why}
                for m, f, n, why in self.skipped
            ],
        }

    def to_markdown(self) -> str:
        fractions = self.config.fractions
        head = " | ".join(f"{100 * f:g}%" for f in fractions)
        lines = [f"| method | {head} |", "|---" * (len(fractions) + 1) + "|"]
        fitted = {(p.method, p.fraction): f"{p.summary.auroc} (n={p.n_train})" for p in self.points}
        fitted |= {(m, f): f"skipped (n={n}): {why}" for m, f, n, why in self.skipped}
        for method in dict.fromkeys(m for m, _ in fitted):
            cells = [fitted.get((method, f), "") for f in fractions]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        for method, reason in self.unavailable.items():
            lines.append(f"| {method} | unavailable: {reason} |" + " |" * (len(fractions) - 1))
        return "\n".join(lines) + "\n"


class _Baseline:
    """A supervised baseline's rows from the store (read once) and one fit per subsample."""

    def __init__(self, store, splits: dict[str, list[str]], method: str) -> None:

        self.inputs = StoreInputs(store, BaselineOptions(), splits)
        self.method = method
        scorer = self.inputs.make_scorer(method)  # BaselineUnavailable when inputs are missing
        self.rows = {s: self.inputs.scorer_inputs(scorer, ids, method) for s, ids in splits.items()}

    def scores(self, train_rows: np.ndarray, labels: dict[str, np.ndarray], seed: int):
        scorer = self.inputs.make_scorer(self.method)
        train = self.rows["train"]
        subset = train.take(np.asarray(train_rows))  # the one input bundle (`DetectorInputs`)
        scorer.fit(
            subset, labels["train"][train_rows], self.rows["validation"], labels["validation"]
        )
        return scorer.score(self.rows["test"]), getattr(scorer, "probability", False)


def run_learning_curve(
    store,
    config: LearningCurveConfig = LearningCurveConfig(),
    progress: Callable[[str, float], None] | None = None,
    splits: dict[str, list[str]] | None = None,
    known: Mapping[str, SeedScores] | None = None,
) -> LearningCurve:
    """Every (method, fraction) point of ``config`` on ``store``'s balanced rows (``splits``,
    default `actmap.store.rows.balanced_splits(store)`, which records them in the store).

    ``known``: {ActMap detector: test scores} of that detector already trained on all the
    balanced training rows with the same recipe and seeds (an `actmap train` run): the 100%
    point is exactly that fit (the subsample is every row, in order), so it is read, not
    trained again."""

    splits = splits or balanced_splits(store)
    rows = {s: read_rows(store, ids, f"balanced '{s}' split") for s, ids in splits.items()}
    maps = {s: r.maps for s, r in rows.items()}
    labels = {s: r.labels for s, r in rows.items()}
    val, test = rows["validation"], rows["test"]
    points, unavailable, skipped = [], {}, []
    for method in config.methods:
        baseline = None
        if method in SUPERVISED_BASELINES:
            try:
                baseline = _Baseline(store, splits, method)
            except (BaselineUnavailable, StoreError) as reason:
                unavailable[method] = str(reason)
                continue
        for fraction in config.fractions:
            if progress is not None:
                progress(method, fraction)
            subsamples = [balanced_subsample(labels["train"], fraction, s) for s in config.seeds]
            try:
                if baseline is None and fraction == 1.0 and method in (known or {}):
                    scores = dataclasses.replace(known[method], method=method)
                elif baseline is None:
                    scores = _actmap_point(
                        method, subsamples, maps, labels, splits, val, test, config
                    )
                else:
                    scores = _baseline_point(baseline, method, subsamples, labels, config.seeds)
            except ValueError as reason:  # too few rows for this fit at this fraction
                log.warning("learning curve %s at %g skipped: %s", method, fraction, reason)
                skipped.append((method, fraction, len(subsamples[0]), str(reason)))
                continue
            summary = auroc_summary(scores, n_resamples=config.n_resamples)
            points.append(CurvePoint(method, fraction, len(subsamples[0]), summary))
            log.info("learning curve %s at %g: %s", method, fraction, summary.auroc)
    rows = {s: len(v) for s, v in splits.items()}
    return LearningCurve(str(store.root), config, rows, points, unavailable, skipped)


def _actmap_point(method, subsamples, maps, labels, splits, val, test, config) -> SeedScores:
    """One seed per subsample: seed s trains on subsample s."""
    per_seed = []
    for seed, rows in zip(config.seeds, subsamples, strict=True):
        train = Rows([splits["train"][i] for i in rows], labels["train"][rows], maps["train"][rows])
        per_seed.append(
            train_seeds(train, val, test, method, (seed,), recipe_config(config.max_epochs))
        )
    return SeedScores(
        method,
        test.labels,
        np.concatenate([s.confidence for s in per_seed]),
        config.seeds,
        True,
        np.concatenate([s.logits for s in per_seed]),
    )


def _baseline_point(baseline: _Baseline, method, subsamples, labels, seeds) -> SeedScores:
    """One fit per distinct subsample: a baseline's fit does not depend on the learning-curve
    seed (TAD's folds and ACT-ViT's seeds are its own), so seeds that drew the same rows
    (every seed at 100%) share it."""
    confidence, probability, fits = [], False, {}
    for seed, rows in zip(seeds, subsamples, strict=True):
        key = np.asarray(rows).tobytes()
        if key not in fits:
            fits[key] = baseline.scores(rows, labels, seed)
        result, probability = fits[key]
        confidence.append(result.confidence)
    return SeedScores(method, labels["test"], np.stack(confidence), tuple(seeds), probability)
