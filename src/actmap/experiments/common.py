"""What the paper-section experiments share: one method's test scores over seeds, where they
come from (a detector trained here, an `actmap train` run folder, a stored baseline result),
and the AUROC row every table prints (seed mean, 95% bootstrap interval, paired difference).

    train_seeds(train, val, test, detector, seeds, config) -> SeedScores
    scores_from_run(run_dir, ids, labels)                  -> SeedScores
    scores_from_results(store, method, ids, labels)        -> SeedScores
    auroc_summary(scores, reference)                       -> AurocSummary
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actmap.errors import ActmapUserError
from actmap.experiments.seeds import run_seeds
from actmap.scoring import metrics
from actmap.scoring.intervals import N_RESAMPLES, Interval, bootstrap, paired_bootstrap
from actmap.scoring.prior import logit
from actmap.store import latest_rows
from actmap.training.run_folder import method_name, read_run


@dataclass(frozen=True)
class SeedScores:
    """One method's scores on one set of test rows, one row of scores per seed."""

    method: str
    labels: np.ndarray  # (n,) 1 = correct
    confidence: np.ndarray  # (S, n) p(correct) or a monotone equivalent, higher = correct
    seeds: tuple[int, ...]  # one per row of confidence; (0,) for a method without seeds
    probability: bool  # confidence estimates p(correct) (reliability and ECE apply)
    logits: np.ndarray | None = None  # (S, n) where the method has one; else logit(p) or None

    def __post_init__(self) -> None:
        confidence = np.atleast_2d(np.asarray(self.confidence, dtype=np.float64))
        object.__setattr__(self, "confidence", confidence)
        object.__setattr__(self, "labels", np.asarray(self.labels).astype(np.int64))
        if confidence.shape[1] != len(self.labels) or confidence.shape[0] != len(self.seeds):
            raise ValueError(
                f"{self.method}: confidence has shape {confidence.shape}, "
                f"expected ({len(self.seeds)}, {len(self.labels)})"
            )
        if self.logits is None and self.probability:
            object.__setattr__(self, "logits", logit(confidence))

    def per_seed(self, metric=metrics.auroc) -> list[float]:
        return [float(metric(row, self.labels)) for row in self.confidence]

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "seeds": list(self.seeds),
            "probability": self.probability,
            "labels": self.labels.tolist(),
            "confidence": self.confidence.round(6).tolist(),
        }


@dataclass(frozen=True)
class AurocSummary:
    """A table row: AUROC per seed, the seed mean with its interval, and the paired difference
    to a reference method on the same rows (both 95% bootstrap, rows resampled)."""

    method: str
    per_seed: tuple[float, ...]
    std: float  # over seeds, ddof=1; NaN for one seed
    auroc: Interval  # of the seed-mean AUROC
    reference: str | None = None
    difference: Interval | None = None  # seed-mean AUROC minus the reference's

    def to_json(self) -> dict:
        return {
            "method": self.method,
            "per_seed": list(self.per_seed),
            "std": self.std,
            "auroc": self.auroc.to_json(),
            "reference": self.reference,
            "difference": None if self.difference is None else self.difference.to_json(),
        }


def auroc_summary(
    scores: SeedScores,
    reference: SeedScores | None = None,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
) -> AurocSummary:
    """The AUROC row of ``scores``; with ``reference`` (same rows) the paired difference too."""
    per_seed = scores.per_seed()
    _, std = metrics.seed_summary(per_seed)
    difference = None
    if reference is not None:
        if not np.array_equal(reference.labels, scores.labels):
            raise ValueError(f"{scores.method} and {reference.method} are not on the same rows")
        difference = paired_bootstrap(
            scores.confidence,
            reference.confidence,
            scores.labels,
            n_resamples=n_resamples,
            seed=seed,
        )
    return AurocSummary(
        scores.method,
        tuple(per_seed),
        std,
        bootstrap(scores.confidence, scores.labels, n_resamples=n_resamples, seed=seed),
        None if reference is None else reference.method,
        difference,
    )


def train_seeds(
    train,
    val,
    test,
    detector: str,
    seeds: Sequence[int],
    config=None,
    method: str | None = None,
    device: str | None = None,
) -> SeedScores:
    """Train one CorrectnessDetector per seed (the paper's recipe), score test once each.

    ``train`` / ``val`` / ``test`` are `Rows`; nothing is written to disk.
    """

    runs = run_seeds(
        train, val, test, None, detector=detector, config=config, seeds=seeds, device=device
    )
    return scores_of_runs(runs, method or detector)


def scores_of_runs(runs, method: str) -> SeedScores:
    """The test scores of `actmap.experiments.seeds.SeedRuns`, one row per seed."""
    return SeedScores(
        method,
        runs.runs[0].test_scores.labels,
        np.stack([r.test_scores.p_correct for r in runs.runs]),
        tuple(int(r.seed) for r in runs.runs),
        True,
        np.stack([r.test_scores.logits for r in runs.runs]).astype(np.float64),
    )


def select_seeds(scores: SeedScores, seeds: Sequence[int]) -> SeedScores | None:
    """``scores`` restricted to ``seeds`` in that order, or None when one of them is missing."""
    if any(s not in scores.seeds for s in seeds):
        return None
    rows = [scores.seeds.index(s) for s in seeds]
    return dataclasses.replace(
        scores,
        confidence=scores.confidence[rows],
        seeds=tuple(seeds),
        logits=None if scores.logits is None else scores.logits[rows],
    )


def scores_from_run(run_dir: str | Path, ids: Sequence[str], labels: np.ndarray) -> SeedScores:
    """The stored test scores of an `actmap train` run folder, in the order of ``ids``."""
    import pandas as pd

    checked = read_run(Path(run_dir))
    confidence, logits = [], []
    for folder in checked.seed_dirs.values():
        frame = pd.read_parquet(folder / "test_scores.parquet")
        frame = frame.set_index(frame["id"].astype(str))
        missing = [key for key in ids if key not in frame.index]
        if missing:
            raise ActmapUserError(
                f"{folder} has no test score for {len(missing)} of the {len(ids)} rows "
                f"(e.g. {missing[:2]}); was it trained on another store?"
            )
        confidence.append(frame.loc[list(ids), "p_correct"].to_numpy(dtype=np.float64))
        logits.append(frame.loc[list(ids), "logit"].to_numpy(dtype=np.float64))
    return SeedScores(
        method_name(checked.detector),
        labels,
        np.stack(confidence),
        tuple(checked.seed_dirs),
        True,
        np.stack(logits),
    )


def scores_from_results(store, method: str, ids: Sequence[str], labels: np.ndarray) -> SeedScores:
    """A baseline's stored results (``results/<method>`` of ``store``) on ``ids``; a method
    stored with one confidence column per seed (ACT-ViT) keeps its seeds."""

    name = f"results/{method}"
    if not store.has_table(name):
        raise ActmapUserError(f"{store.root} has no stored results of {method!r}")
    frame = latest_rows(store.read_table(name)).to_pandas().set_index("id")
    missing = [key for key in ids if key not in frame.index]
    if missing:
        raise ActmapUserError(
            f"{store.root}: {method} scored {len(ids) - len(missing)} of {len(ids)} rows"
        )
    by_seed = sorted(c for c in frame.columns if c.startswith("confidence_by_seed_"))
    columns = by_seed if len(by_seed) > 1 else ["confidence"]
    confidence = np.stack([frame.loc[list(ids), c].to_numpy(dtype=np.float64) for c in columns])
    record = store.manifest.get("results", {}).get(method, {})
    seeds = tuple(int(c.rsplit("_", 1)[1]) for c in columns) if len(columns) > 1 else (0,)
    # a probability when the scorer said so when it stored its results (and values fit)
    probability = bool(record.get("probability")) and bool(
        np.all((confidence >= 0) & (confidence <= 1))
    )
    return SeedScores(method, labels, confidence, seeds, probability)
