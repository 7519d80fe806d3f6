"""Calibration and selective prediction (paper section "Calibration and Selective Prediction").

    run_calibration(methods, prevalence, CalibrationConfig()) -> Calibration (to_json, to_markdown)

``methods`` are `SeedScores` on the same balanced test rows (ActMap and the strongest
baselines). For each method whose confidence is a probability:

- reliability: 10 equal-width bins of p(correct), count, mean p and fraction correct;
- temperature scaling: T fit (NLL) on a random half of the test rows, ECE on the other
  half before and after (`actmap.scoring.metrics.temperature_scaled_ece`), per seed;
- prevalence shift: the balanced test rows resampled class-conditionally to the
  generator's natural accuracy ``prevalence``, ``n_replicates`` times, and scored: ECE
  raw, after the label-free prior shift to the known prevalence
  (`actmap.scoring.prior.shift_to_prevalence`), and after a temperature fit on held-out target
  rows, never the rows scored. Where the method has scores on held-out rows at the natural
  prevalence (``TargetRows``: every labelled validation row of the store, not only the
  balanced ones), each replicate fits T on up to ``target_fit_rows`` distinct of them drawn
  at the target prevalence, and resamples the whole balanced test set. Otherwise
  (fallback, stated in the result) each replicate splits the test rows in two stratified
  halves: T is fit on as many distinct rows of one half as it holds at the target
  prevalence (at most ``target_fit_rows``), and the other half is resampled and scored.

For every method: the risk-coverage curve (answers accepted from the most confident
down), the coverage at 5% risk and the risk at 80% coverage with 95% bootstrap intervals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from actmap.experiments.common import SeedScores
from actmap.scoring import metrics
from actmap.scoring.intervals import (
    N_RESAMPLES,
    Interval,
    bootstrap,
    coverage_at_risk_metric,
    risk_at_coverage_metric,
)
from actmap.scoring.prior import logit, shift_to_prevalence, sigmoid
from actmap.store.rows import natural_accuracy, natural_ids


@dataclass(frozen=True)
class CalibrationConfig:
    n_bins: int = 10
    n_replicates: int = 100  # prevalence-shift resamples
    target_fit_rows: int = 256  # held-out target rows the temperature is fit on (at most)
    risk: float = 0.05  # coverage at this risk
    coverage: float = 0.8  # risk at this coverage
    n_resamples: int = N_RESAMPLES
    seed: int = 0


@dataclass(frozen=True)
class Reliability:
    edges: list[float]
    count: list[int]
    mean_p: list[float | None]  # None for an empty bin
    fraction_correct: list[float | None]
    ece: float


def reliability(probs, labels, n_bins: int = 10) -> Reliability:
    """The bins of `actmap.scoring.metrics.ece` ([k/n, (k+1)/n), p = 1 in the last) and their ECE."""
    p, y = np.asarray(probs, dtype=np.float64), np.asarray(labels).astype(np.int64)
    bins = np.minimum(np.floor(p * n_bins).astype(np.int64), n_bins - 1)
    count, mean_p, correct = [], [], []
    for b in range(n_bins):
        rows = bins == b
        count.append(int(rows.sum()))
        mean_p.append(float(p[rows].mean()) if rows.any() else None)
        correct.append(float(y[rows].mean()) if rows.any() else None)
    edges = np.linspace(0.0, 1.0, n_bins + 1).tolist()
    return Reliability(edges, count, mean_p, correct, metrics.ece(p, y, n_bins))


def class_conditional_resample(
    labels, prevalence: float, n: int, rng: np.random.Generator
) -> np.ndarray:
    """``n`` row indices drawn with replacement: ``round(prevalence * n)`` from the correct
    rows, the rest from the incorrect ones (each class's rows keep their scores)."""
    y = np.asarray(labels)
    positives, negatives = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    if not len(positives) or not len(negatives):
        raise ValueError("class-conditional resampling needs correct and incorrect rows")
    n_pos = int(round(prevalence * n))
    return np.concatenate(
        [rng.choice(positives, n_pos, replace=True), rng.choice(negatives, n - n_pos, replace=True)]
    )


def distinct_at_prevalence(
    labels, prevalence: float, max_rows: int, rng: np.random.Generator
) -> np.ndarray:
    """The most distinct rows (at most ``max_rows``) whose fraction correct is ``prevalence``
    (rounded), drawn without replacement."""
    y = np.asarray(labels)
    positives, negatives = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    n = min(
        max_rows,
        int(np.floor(len(positives) / prevalence + 1e-9)),
        int(np.floor(len(negatives) / (1 - prevalence) + 1e-9)),
    )
    n_pos = min(len(positives), int(round(prevalence * n)))
    n_neg = min(len(negatives), n - n_pos)
    return np.concatenate(
        [rng.choice(positives, n_pos, replace=False), rng.choice(negatives, n_neg, replace=False)]
    )


def stratified_halves(labels, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels)
    first, second = [], []
    for cls in (0, 1):
        rows = rng.permutation(np.flatnonzero(y == cls))
        first.append(rows[: len(rows) // 2])
        second.append(rows[len(rows) // 2 :])
    return np.concatenate(first), np.concatenate(second)


def _spread(values: Sequence[float]) -> dict:
    v = np.asarray(values, dtype=np.float64)
    low, high = np.percentile(v, [2.5, 97.5])
    return {"mean": float(v.mean()), "low": float(low), "high": float(high)}


@dataclass(frozen=True)
class TargetRows:
    """Held-out rows at the deployment's natural prevalence, scored by one method: what the
    temperature of the shifted test set is fit on (e.g. every labelled validation row)."""

    logits: np.ndarray  # (S, m) one row per seed of the method, like its test logits
    labels: np.ndarray  # (m,) 1 = correct
    source: str  # what the rows are, for the report

    def __post_init__(self) -> None:
        logits = np.atleast_2d(np.asarray(self.logits, dtype=np.float64))
        object.__setattr__(self, "logits", logits)
        object.__setattr__(self, "labels", np.asarray(self.labels).astype(np.int64))
        if logits.shape[1] != len(self.labels):
            raise ValueError(f"target logits {logits.shape} do not match {len(self.labels)} labels")


FALLBACK_SOURCE = "a stratified half of the balanced test rows (no held-out target rows scored)"


@dataclass(frozen=True)
class PrevalenceShift:
    prevalence: float
    n_replicates: int
    n_fit: int  # distinct target rows the temperature was fit on (each replicate)
    n_eval: int  # resampled target rows scored (each replicate)
    ece_raw: dict  # mean and 2.5/97.5 percentiles over replicates (seed-averaged ECE)
    ece_prior_shift: dict
    ece_temperature: dict
    temperature: dict
    fit_source: str = FALLBACK_SOURCE  # where the temperature's rows come from


def _replicate_rows(
    y: np.ndarray, prevalence: float, config: CalibrationConfig, rng, target: TargetRows | None
) -> tuple[np.ndarray, np.ndarray]:
    """(rows T is fit on, resampled test rows scored): fit rows index ``target`` when given,
    else the test rows (one stratified half; the other half is scored)."""
    if target is not None:
        fit = distinct_at_prevalence(target.labels, prevalence, config.target_fit_rows, rng)
        return fit, class_conditional_resample(y, prevalence, len(y), rng)
    fit_pool, eval_pool = stratified_halves(y, rng)
    fit = fit_pool[distinct_at_prevalence(y[fit_pool], prevalence, config.target_fit_rows, rng)]
    return fit, eval_pool[class_conditional_resample(y[eval_pool], prevalence, len(eval_pool), rng)]


def prevalence_shift(
    scores: SeedScores,
    prevalence: float,
    config: CalibrationConfig = CalibrationConfig(),
    target: TargetRows | None = None,
) -> PrevalenceShift:
    """Replicates of the balanced test rows resampled to ``prevalence`` (see the module);
    the temperature is fit on ``target`` (held-out rows, same seeds as ``scores``) when
    given, else on half of the test rows."""
    if not 0.0 < prevalence < 1.0:
        raise ValueError(f"prevalence must lie strictly between 0 and 1, got {prevalence}")
    if target is not None and len(target.logits) != len(scores.logits):
        raise ValueError(
            f"{scores.method}: target rows scored by {len(target.logits)} seeds, "
            f"test rows by {len(scores.logits)}"
        )
    y = scores.labels
    rng = np.random.default_rng(config.seed)
    raw, prior, scaled, temps = [], [], [], []
    n_fit = n_eval = 0
    for _ in range(config.n_replicates):
        fit, evaluate = _replicate_rows(y, prevalence, config, rng, target)
        n_fit, n_eval = len(fit), len(evaluate)
        fit_logits, fit_labels = (
            (target.logits[:, fit], target.labels[fit])
            if target is not None
            else (scores.logits[:, fit], y[fit])
        )
        per_seed = []
        for z, z_fit in zip(scores.logits, fit_logits, strict=True):
            p_eval = sigmoid(z[evaluate])
            t = metrics.fit_temperature(z_fit, fit_labels)
            per_seed.append(
                (
                    metrics.ece(p_eval, y[evaluate], config.n_bins),
                    metrics.ece(
                        shift_to_prevalence(p_eval, prevalence), y[evaluate], config.n_bins
                    ),
                    metrics.ece(sigmoid(z[evaluate] / t), y[evaluate], config.n_bins),
                    t,
                )
            )
        means = np.mean(per_seed, axis=0)
        raw.append(means[0])
        prior.append(means[1])
        scaled.append(means[2])
        temps.append(means[3])
    return PrevalenceShift(
        prevalence,
        config.n_replicates,
        n_fit,
        n_eval,
        _spread(raw),
        _spread(prior),
        _spread(scaled),
        _spread(temps),
        FALLBACK_SOURCE if target is None else target.source,
    )


@dataclass(frozen=True)
class SelectivePrediction:
    coverage: list[float]  # the risk-coverage curve of the first seed
    risk: list[float]
    coverage_at_risk: Interval  # seed mean, bootstrap over rows
    risk_at_coverage: Interval


def selective_prediction(
    scores: SeedScores, config: CalibrationConfig = CalibrationConfig()
) -> SelectivePrediction:
    coverage, risk = metrics.risk_coverage_curve(scores.confidence[0], scores.labels)
    cov = coverage_at_risk_metric(config.risk)  # computed on all resamples at once
    rsk = risk_at_coverage_metric(config.coverage)
    kwargs = {"n_resamples": config.n_resamples, "seed": config.seed}
    return SelectivePrediction(
        coverage.tolist(),
        risk.tolist(),
        bootstrap(scores.confidence, scores.labels, cov, **kwargs),
        bootstrap(scores.confidence, scores.labels, rsk, **kwargs),
    )


@dataclass(frozen=True)
class MethodCalibration:
    method: str
    n: int
    seeds: tuple[int, ...]
    probability: bool
    auroc: float  # seed mean
    selective: SelectivePrediction
    reliability: Reliability | None = None  # of the first seed
    ece: float | None = None  # seed mean, all test rows
    temperature: dict | None = None  # seed means of temperature_scaled_ece
    shift: PrevalenceShift | None = None


@dataclass(frozen=True)
class Calibration:
    prevalence: float | None  # the natural accuracy the shift targets
    prevalence_source: str
    config: CalibrationConfig
    methods: list[MethodCalibration] = field(default_factory=list)

    def method(self, name: str) -> MethodCalibration:
        return next(m for m in self.methods if m.method == name)

    def to_json(self) -> dict:
        return {
            "prevalence": self.prevalence,
            "prevalence_source": self.prevalence_source,
            "config": dataclasses.asdict(self.config),
            "methods": [dataclasses.asdict(m) for m in self.methods],
        }

    def to_markdown(self) -> str:
        c = self.config
        lines = [
            f"| method | AUROC | ECE | T (half fit) | ECE before → after T | "
            f"coverage @ {100 * c.risk:g}% risk | risk @ {100 * c.coverage:g}% coverage | n |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m in self.methods:
            t = m.temperature
            lines.append(
                f"| {m.method} | {m.auroc:.3f} | "
                + ("n/a" if m.ece is None else f"{m.ece:.3f}")
                + " | "
                + (
                    "n/a | n/a"
                    if t is None
                    else (
                        f"{t['temperature']:.2f} | {t['ece_before']:.3f} → {t['ece_after']:.3f} "
                        f"(fit {t['n_fit']:.0f}, eval {t['n_eval']:.0f})"
                    )
                )
                + f" | {m.selective.coverage_at_risk} | {m.selective.risk_at_coverage} | {m.n} |"
            )
        shifted = [m for m in self.methods if m.shift is not None]
        if shifted:
            s0 = shifted[0].shift
            lines += [
                "",
                f"Prevalence shift to the natural accuracy {self.prevalence:.3f} "
                f"({self.prevalence_source}): {s0.n_replicates} replicates of the balanced test "
                "rows resampled class-conditionally to that accuracy. The temperature is fit on "
                f"held-out rows at that accuracy (at most {c.target_fit_rows} distinct), never "
                "the rows scored; the table says which rows each method's T was fit on. "
                "Mean [2.5%, 97.5%] over replicates.",
                "",
                "| method | ECE raw | ECE prior-shifted | ECE temperature-scaled | T | "
                "T fit on (rows) | scored rows |",
                "|---|---|---|---|---|---|---|",
            ]
            for m in shifted:
                s = m.shift
                lines.append(
                    f"| {m.method} | {_fmt(s.ece_raw)} | {_fmt(s.ece_prior_shift)} | "
                    f"{_fmt(s.ece_temperature)} | {_fmt(s.temperature, 2)} | "
                    f"{s.fit_source} ({s.n_fit}) | {s.n_eval} |"
                )
        return "\n".join(lines) + "\n"


def _fmt(spread: dict, digits: int = 3) -> str:
    return f"{spread['mean']:.{digits}f} [{spread['low']:.{digits}f}, {spread['high']:.{digits}f}]"


def calibrate_method(
    scores: SeedScores,
    prevalence: float | None,
    config: CalibrationConfig = CalibrationConfig(),
    target: TargetRows | None = None,
) -> MethodCalibration:
    selective = selective_prediction(scores, config)
    auroc = float(np.mean(scores.per_seed()))
    if not scores.probability:
        return MethodCalibration(
            scores.method, len(scores.labels), scores.seeds, False, auroc, selective
        )
    per_seed = [
        metrics.temperature_scaled_ece(z, scores.labels, seed=config.seed + i, n_bins=config.n_bins)
        for i, z in enumerate(scores.logits)
    ]
    temperature = {k: float(np.mean([d[k] for d in per_seed])) for k in per_seed[0]}
    return MethodCalibration(
        scores.method,
        len(scores.labels),
        scores.seeds,
        True,
        auroc,
        selective,
        reliability(scores.confidence[0], scores.labels, config.n_bins),
        float(np.mean(scores.per_seed(lambda p, y: metrics.ece(p, y, config.n_bins)))),
        temperature,
        None if prevalence is None else prevalence_shift(scores, prevalence, config, target),
    )


def run_calibration(
    methods: Sequence[SeedScores],
    prevalence: float | None,
    config: CalibrationConfig = CalibrationConfig(),
    prevalence_source: str = "",
    targets: Mapping[str, TargetRows] | None = None,
) -> Calibration:
    """Every method's calibration and selective prediction on its (shared) test rows;
    ``targets``: {method: held-out rows at the natural prevalence} for the prevalence shift's
    temperature (a method without them falls back to half of the test rows)."""
    labels = methods[0].labels
    for m in methods[1:]:
        if not np.array_equal(m.labels, labels):
            raise ValueError(f"{m.method} is not scored on the same rows as {methods[0].method}")
    return Calibration(
        prevalence,
        prevalence_source,
        config,
        [calibrate_method(m, prevalence, config, (targets or {}).get(m.method)) for m in methods],
    )


def split_prevalence(store, split: str = "train") -> tuple[float, str]:
    """The generator's fraction correct over every labelled row of ``split`` (not the
    balanced rows; `actmap.store.rows.natural_accuracy`), and a sentence saying so."""
    n = len(natural_ids(store).get(split, []))
    if not n:
        raise ValueError(f"{store.root} has no labelled {split} rows")
    return natural_accuracy(store)[split], f"fraction correct of the {n} labelled {split} rows"


def strongest(candidates: Sequence[SeedScores], k: int = 2) -> list[SeedScores]:
    """The ``k`` methods with the highest seed-mean AUROC on their (test) rows -- chosen on
    the rows they are then shown on, which favours them over ActMap."""
    return sorted(candidates, key=lambda s: -float(np.mean(s.per_seed())))[:k]


__all__ = ["logit"]
