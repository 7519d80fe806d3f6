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

AUROC, AUPRC and ECE (`actmap.scoring.metrics`) are computed on all resamples at once
(`ROW_METRICS`: the same values as the scalar metric on each resample, tested against
a direct loop), and so are coverage at a risk and risk at a coverage (`RowMetric`, whose
``rows`` does it); any other metric is called once per resample.

`stratified_auroc` reads rows in groups scored by different models (a cross-fit's folds):
AUROC over within-group pairs, resampled within each group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import rankdata

from actmap.scoring import metrics

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


def auprc_rows(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Average precision of every row of (R, n) scores against (R, n) 0/1 labels, at once.

    sklearn's ``average_precision_score``: sum over distinct thresholds (descending) of
    (recall gained) x (precision there). Every correct row gains recall 1 / n_pos at the
    threshold of its tie group, so AP = mean over correct rows of the precision at the end
    of their tie group.
    """
    order = np.argsort(-scores, axis=1, kind="stable")
    s = np.take_along_axis(scores, order, axis=1)  # (R, n) descending
    y = np.take_along_axis(labels, order, axis=1).astype(np.float64)
    precision = np.cumsum(y, axis=1) / np.arange(1, s.shape[1] + 1)  # (R, n)
    n = s.shape[1]
    last = np.concatenate([s[:, 1:] != s[:, :-1], np.ones((len(s), 1), bool)], axis=1)
    # the index of the end of each position's tie group: the next `last` at or after it
    end = np.where(last, np.arange(n), n)
    end = np.minimum.accumulate(end[:, ::-1], axis=1)[:, ::-1]
    at_end = np.take_along_axis(precision, end, axis=1)
    return (y * at_end).sum(axis=1) / y.sum(axis=1)


def ece_rows(probs: np.ndarray, labels: np.ndarray, n_bins: int = 10) -> np.ndarray:
    """`actmap.scoring.metrics.ece` of every row of (R, n) probabilities against (R, n) labels.

    Per bin, (n_bin / n) |fraction correct - mean p| = |sum of labels - sum of p| / n.
    """
    r, n = probs.shape
    bins = np.minimum(np.floor(probs * n_bins).astype(np.int64), n_bins - 1)
    flat = (bins + n_bins * np.arange(r)[:, None]).ravel()  # (R * n,) bin of each row's entry
    gap = np.bincount(flat, labels.ravel() - probs.ravel(), minlength=r * n_bins)
    return np.abs(gap.reshape(r, n_bins)).sum(axis=1) / n


def _risk_by_coverage(scores: np.ndarray, labels: np.ndarray):
    """Per row of (R, n) scores: (coverage, risk, end of a tie group) at every position of
    the rows sorted from the most confident down (`actmap.scoring.metrics.risk_coverage_curve`)."""
    order = np.argsort(-scores, axis=1, kind="stable")
    s = np.take_along_axis(scores, order, axis=1)
    errors = 1 - np.take_along_axis(labels, order, axis=1)
    accepted = np.arange(1, s.shape[1] + 1)
    risk = np.cumsum(errors, axis=1) / accepted
    last = np.concatenate([s[:, 1:] != s[:, :-1], np.ones((len(s), 1), bool)], axis=1)
    return accepted / s.shape[1], risk, last


def coverage_at_risk_rows(scores: np.ndarray, labels: np.ndarray, target: float) -> np.ndarray:
    """`actmap.scoring.metrics.coverage_at_risk` of every row of (R, n) scores, at once."""
    coverage, risk, last = _risk_by_coverage(scores, labels)
    ok = last & (risk <= target + 1e-12)
    return np.where(ok, coverage, 0.0).max(axis=1)


def risk_at_coverage_rows(scores: np.ndarray, labels: np.ndarray, coverage: float) -> np.ndarray:
    """`actmap.scoring.metrics.risk_at_coverage` of every row of (R, n) scores, at once."""
    covered, risk, last = _risk_by_coverage(scores, labels)
    first = np.argmax(last & (covered >= coverage - 1e-12), axis=1)  # the last row always is
    return risk[np.arange(len(risk)), first]


@dataclass(frozen=True)
class RowMetric:
    """A metric with a parameter, callable as ``metric(scores, labels)`` like any other, that
    `bootstrap` also computes on all resamples at once through ``rows``."""

    scalar: Callable[..., float]  # scalar(scores, labels, value)
    vectorised: Callable[..., np.ndarray]  # vectorised((R, n) scores, (R, n) labels, value)
    value: float

    def __call__(self, scores, labels) -> float:
        return self.scalar(scores, labels, self.value)

    def rows(self, scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
        return self.vectorised(scores, labels, self.value)


def coverage_at_risk_metric(target: float) -> RowMetric:
    return RowMetric(metrics.coverage_at_risk, coverage_at_risk_rows, target)


def risk_at_coverage_metric(coverage: float) -> RowMetric:
    return RowMetric(metrics.risk_at_coverage, risk_at_coverage_rows, coverage)


# metrics computed on all resamples at once: (R, n) scores, (R, n) labels -> (R,)
ROW_METRICS: dict[Callable, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    metrics.auroc: auroc_rows,
    metrics.auprc: auprc_rows,
    metrics.ece: ece_rows,
}
ROW_CHUNK = 4_000_000  # resampled entries held at once (k x n), about 32 MB per array


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


def _draw_blocks(
    y: np.ndarray, n_resamples: int, rng: np.random.Generator, need_both: bool, block: int
) -> Iterator[tuple[np.ndarray, int]]:
    """Blocks of at most ``block`` index rows, drawn with replacement (each with both classes
    if asked), with the count of refused draws so far.

    The rows are those of drawing ``rng.integers(0, n, n)`` once per resample and drawing
    again after a refused one (numpy's generator gives the same numbers for one (k, n) draw
    as for k draws of n), so the resamples do not depend on the block size."""
    n = len(y)
    have = redrawn = 0
    while have < n_resamples:
        idx = rng.integers(0, n, (min(n_resamples - have, block), n))  # never more than needed
        if need_both:
            picked = y[idx]
            ok = picked.min(axis=1) != picked.max(axis=1)
            redrawn += int((~ok).sum())
            if redrawn > 100 * n_resamples:
                raise ValueError("almost every resample holds a single class; too few rows")
            idx = idx[ok]
        have += len(idx)
        yield idx, redrawn


def resample_indices(
    labels: np.ndarray, n_resamples: int, rng: np.random.Generator, need_both: bool
) -> tuple[np.ndarray, int]:
    """(n_resamples, n) index rows drawn with replacement (each with both classes if asked),
    and how many draws were refused for holding one class."""
    y = np.asarray(labels)
    blocks = list(_draw_blocks(y, n_resamples, rng, need_both, n_resamples))
    return np.concatenate([idx for idx, _ in blocks]), blocks[-1][1]


def _interval(estimate, values, n, n_resamples, level, redrawn) -> Interval:
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(np.asarray(values), [tail, 100 - tail])
    return Interval(float(estimate), float(low), float(high), n, n_resamples, level, redrawn)


def _metric_values(metric: Metric | None, s: np.ndarray, y: np.ndarray, idx) -> np.ndarray:
    """metric on every resample of a (k, n) block: AUROC (``metric=None``), AUPRC and ECE all
    at once (`ROW_METRICS`), any other metric one resample at a time."""
    rows = getattr(metric, "rows", None) or ROW_METRICS.get(metric or metrics.auroc)
    if rows is None:
        return np.array([metric(s[i], y[i]) for i in idx])
    return rows(s[idx], y[idx])


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
    signs = (1.0, -1.0)[: len(columns)]
    full = metric or metrics.auroc
    estimate = sum(  # on all rows; also checks the scores (e.g. ECE's probabilities in [0, 1])
        sign * np.mean([full(row, y) for row in c]) for sign, c in zip(signs, columns, strict=True)
    )
    rng, block = np.random.default_rng(seed), max(1, ROW_CHUNK // len(y))
    parts, redrawn = [], 0
    for idx, refused in _draw_blocks(y, n_resamples, rng, True, block):  # (k, n) resamples
        parts.append(
            sum(
                sign * np.mean([_metric_values(metric, row, y, idx) for row in c], axis=0)
                for sign, c in zip(signs, columns, strict=True)
            )
        )
        redrawn = refused
    values = np.concatenate(parts)
    return _interval(estimate, values, len(y), n_resamples, level, redrawn)


def stratified_auroc(
    scores: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    other: Sequence[np.ndarray] | None = None,
    n_resamples: int = N_RESAMPLES,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """AUROC over groups of rows (the folds of a cross-fit): the share of (correct, incorrect)
    pairs *within a group* ordered right, i.e. each group's AUROC weighted by its pairs, so
    groups scored by different models need not share a scale. With ``other`` (the same rows
    scored by another method), the difference. The interval resamples rows within each group,
    the same rows for both methods."""

    def value(k: int, idx: np.ndarray) -> np.ndarray:  # (R, n) index rows -> (R,)
        y = np.asarray(labels[k])[idx]
        out = auroc_rows(np.asarray(scores[k], np.float64)[idx], y)
        if other is not None:
            out = out - auroc_rows(np.asarray(other[k], np.float64)[idx], y)
        return out

    pairs = [float(np.sum(y) * (len(y) - np.sum(y))) for y in labels]
    estimate = sum(w * value(k, np.arange(len(labels[k]))[None])[0] for k, w in enumerate(pairs))
    rng = np.random.default_rng(seed)
    total, weight, redrawn = np.zeros(n_resamples), np.zeros(n_resamples), 0
    for k, y in enumerate(labels):
        y = np.asarray(y)
        idx, refused = resample_indices(y, n_resamples, rng, need_both=True)
        w = y[idx].sum(axis=1) * (len(y) - y[idx].sum(axis=1))
        total += w * value(k, idx)
        weight += w
        redrawn += refused
    n = sum(len(y) for y in labels)
    return _interval(estimate / sum(pairs), total / weight, n, n_resamples, level, redrawn)
