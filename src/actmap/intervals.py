"""Bootstrap intervals for every table: one metric's, and the paired difference of two.

Rows are resampled with replacement ``n_resamples`` times (2,000 by default).
Unpaired: the interval of ``metric(scores, labels)``. Paired: both methods are
scored on the *same* resampled rows each time, so the interval of their
difference keeps the correlation between them (two methods that rank the same
rows well differ by much less than their separate intervals suggest).
Intervals are percentile intervals; resamples with a single class (AUROC
undefined) are drawn again, and their count is reported.

A method trained with several seeds on the same rows passes its scores as an
(S, n) array: the metric is the mean over seeds, on each resample as on all rows
(so the interval covers the seed-averaged figure a table reports).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import rankdata

from actmap import metrics

N_RESAMPLES = 2000
Metric = Callable[[np.ndarray, np.ndarray], float]


def auroc_rows(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """AUROC of every row of (R, n) scores against (R, n) 0/1 labels, at once (Mann-Whitney U).

    Ties share their average rank, which is what sklearn's ``roc_auc_score`` counts as 1/2.
    """
    ranks = rankdata(scores, axis=1)  # (R, n)
    n_pos = labels.sum(axis=1)
    n_neg = labels.shape[1] - n_pos
    u = (ranks * labels).sum(axis=1) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


@dataclass(frozen=True)
class Interval:
    """A point estimate on all rows and its bootstrap percentile interval."""

    estimate: float
    low: float
    high: float
    n: int  # rows
    n_resamples: int
    level: float = 0.95
    redrawn: int = 0  # resamples drawn again because they held a single class

    def to_json(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.estimate:.3f} [{self.low:.3f}, {self.high:.3f}]"


def resample_indices(
    labels: np.ndarray, n_resamples: int, rng: np.random.Generator, need_both: bool
) -> tuple[list[np.ndarray], int]:
    """``n_resamples`` index vectors drawn with replacement (each with both classes if asked)."""
    n = len(labels)
    out, redrawn = [], 0
    while len(out) < n_resamples:
        idx = rng.integers(0, n, n)
        if need_both and labels[idx].min() == labels[idx].max():
            redrawn += 1
            if redrawn > 100 * n_resamples:
                raise ValueError("almost every resample holds a single class; too few rows")
            continue
        out.append(idx)
    return out, redrawn


def _interval(estimate, values, n, n_resamples, level, redrawn) -> Interval:
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(np.asarray(values), [tail, 100 - tail])
    return Interval(float(estimate), float(low), float(high), n, n_resamples, level, redrawn)


def _metric_values(metric: Metric | None, s: np.ndarray, y: np.ndarray, draws) -> np.ndarray:
    """metric on every resample; AUROC (``metric=None``) is computed for all at once."""
    if metric is None:
        idx = np.stack(draws)  # (R, n)
        return auroc_rows(s[idx], y[idx])
    return np.array([metric(s[i], y[i]) for i in draws])


def bootstrap(
    scores,
    labels,
    metric: Metric | None = None,
    n_resamples: int = N_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """The bootstrap interval of ``metric(scores, labels)``; ``metric=None`` is AUROC."""
    return _bootstrap([scores], labels, metric, n_resamples, level, seed)


def paired_bootstrap(
    scores_a,
    scores_b,
    labels,
    metric: Metric | None = None,
    n_resamples: int = N_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """The interval of ``metric(a) - metric(b)`` on the same resampled rows (AUROC if None)."""
    return _bootstrap([scores_a, scores_b], labels, metric, n_resamples, level, seed)


def _seed_rows(scores) -> np.ndarray:
    """(n,) one method's scores or (S, n) one per seed -> (S, n) float64."""
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim not in (1, 2):
        raise ValueError(f"scores must be (n,) or (seeds, n), got shape {array.shape}")
    return np.atleast_2d(array)


def _bootstrap(scores, labels, metric, n_resamples, level, seed) -> Interval:
    """One method's metric, or (two methods) the difference of theirs, on shared resamples;
    a method given as (S, n) scores contributes its metric averaged over the S seeds."""
    columns = [_seed_rows(s) for s in scores]
    y = np.asarray(labels).astype(np.int64)
    if any(c.shape[1] != len(y) for c in columns):
        sizes = ", ".join(str(c.shape[1]) for c in columns)
        raise ValueError(f"scores have {sizes} rows but labels have {len(y)}")
    draws, redrawn = resample_indices(y, n_resamples, np.random.default_rng(seed), True)
    signs = (1.0, -1.0)[: len(columns)]
    full = metric or metrics.auroc
    values = sum(
        sign * np.mean([_metric_values(metric, row, y, draws) for row in c], axis=0)
        for sign, c in zip(signs, columns, strict=True)
    )
    estimate = sum(
        sign * np.mean([full(row, y) for row in c]) for sign, c in zip(signs, columns, strict=True)
    )
    return _interval(estimate, values, len(y), n_resamples, level, redrawn)
