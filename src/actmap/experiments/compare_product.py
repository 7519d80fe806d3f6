"""The honest comparison: actmap-plus against the strongest single-pass baseline and the ViT.

    compare_product(store)  ->  ProductComparison (to_json, to_markdown)

Every choice is made on validation rows, then the test rows are scored once:
actmap-plus picks its settings (`select_plus`), the strongest single-pass
baseline is the one with the best balanced-validation AUROC among perplexity,
mean token entropy, answer length, RAUQ and TAD, and the paper's ViT selects
its epoch on validation. On the balanced test rows each gets its AUROC with a
95% bootstrap interval and actmap-plus the paired interval of its difference
to each (2,000 resamples, `actmap.scoring.intervals`). On every labelled test row (the
natural prevalence) each gets its AUROC and, when its confidence is a
probability, its ECE raw and prior-corrected to the natural accuracy of the
*training* split (known before any test row is read; `actmap.scoring.prior`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from actmap.capture.answer_scalars import with_scalars
from actmap.detectors import DetectorInputs
from actmap.detectors.plus import ActMapPlus, PlusConfig
from actmap.scoring import metrics
from actmap.scoring.intervals import Interval, bootstrap, paired_bootstrap
from actmap.store.rows import Rows, balanced_rows, natural_rows

log = logging.getLogger(__name__)

SINGLE_PASS_BASELINES = ("perplexity", "mean_token_entropy", "answer_length", "rauq", "tad")
# actmap-plus's validation grid: (principal components, scalars, class weights)
PLUS_GRID = tuple(
    PlusConfig(n_components=k, use_scalars=s)
    for k in (0, 16, 64, 128)
    for s in (True, False)
    if k > 0 or s
)


def store_rows(store, persist: bool = True) -> dict[str, Rows]:
    """Balanced rows ("train", "validation", "test") and every labelled row ("<split>_all"),
    each with its per-answer scalars (``persist=False``: nothing is written into the store)."""
    sets = dict(balanced_rows(store, persist=persist))
    sets.update({f"{split}_all": rows for split, rows in natural_rows(store).items()})
    return {name: with_scalars(store, rows) for name, rows in sets.items()}


# --- the methods, each fit on train and selected on validation ----------------------------------


@dataclass
class Scored:
    """One method's confidences on the balanced validation and test rows and on all test rows."""

    name: str
    validation: np.ndarray
    test: np.ndarray | None = None  # filled once every choice is made
    test_all: np.ndarray | None = None
    calibrated_prevalence: float | None = None  # None: the confidence is not a probability
    details: dict[str, Any] = field(default_factory=dict)
    score_test: Callable[[Rows], np.ndarray] | None = None  # scores a row set; called on test once
    estimator: Any = None  # the fitted model, when there is one to save
    control: Callable[[int], float] | None = None  # permutation seed -> permuted-label test AUROC

    @property
    def validation_auroc(self) -> float:
        return float(self.details["validation_auroc"])


def select_plus(
    train: Rows, validation: Rows, grid: Sequence[PlusConfig] = PLUS_GRID
) -> tuple[ActMapPlus, dict[str, float]]:
    """Fit every setting on ``train``; keep the best balanced-validation AUROC (ties: the first)."""
    best, best_auc, table = None, -np.inf, {}
    for cfg in grid:
        est = ActMapPlus(cfg).fit(DetectorInputs(train.maps, train.scalars), train.labels)
        logits = est.decision_function(validation.maps, validation.scalars)
        auc = metrics.auroc(logits, validation.labels)
        table[plus_label(cfg)] = auc
        if auc > best_auc:
            best, best_auc = est, auc
    log.info("actmap-plus: %s (validation AUROC %.4f)", plus_label(best.config_), best_auc)
    return best, table


class PlusScorer:
    """actmap-plus in the scorer contract over `Rows`: fit selects on validation, score scores.

    ``fixed_choices()`` hands the permuted-label control the setting and the L2
    strength chosen on the real labels.
    """

    name = "actmap-plus"
    supervised = True
    requires = ("maps", "generations")  # the map and the per-answer scalars
    probability = True

    def __init__(self, grid: Sequence[PlusConfig] = PLUS_GRID) -> None:
        self.grid = tuple(grid)

    def fit(self, train: Rows, y_train, val: Rows | None = None, y_val=None) -> PlusScorer:
        train = replace(train, labels=np.asarray(y_train))
        if len(self.grid) == 1:
            inputs = DetectorInputs(train.maps, train.scalars)
            self.model_ = ActMapPlus(self.grid[0]).fit(inputs, train.labels)
        else:
            if val is None or y_val is None:
                raise ValueError("actmap-plus selects on validation rows: pass val and y_val")
            self.model_, _ = select_plus(train, replace(val, labels=np.asarray(y_val)), self.grid)
        return self

    @classmethod
    def of(cls, estimator: ActMapPlus) -> PlusScorer:
        """A fitted scorer around an already fitted actmap-plus."""
        scorer = cls([estimator.config_])
        scorer.model_ = estimator
        return scorer

    def fixed_choices(self) -> PlusScorer:
        return PlusScorer([replace(self.model_.config_, C=self.model_.C_)])

    def score(self, rows: Rows):
        from actmap.scoring.contract import ScoreResult

        logits = self.model_.decision_function(rows.maps, rows.scalars)
        return ScoreResult(
            confidence=self.model_.predict_proba(rows.maps, rows.scalars),
            raw=logits,
            raw_name="logit",
            details={"setting": plus_label(self.model_.config_), "C": self.model_.C_},
        )


def plus_label(cfg: PlusConfig) -> str:
    weights = "class-weighted" if cfg.class_weight == "balanced" else "unweighted"
    return f"pca={cfg.n_components},scalars={'yes' if cfg.use_scalars else 'no'},{weights}"


def plus_candidates(grid: Sequence[PlusConfig]) -> dict[str, tuple[str, list[PlusConfig]]]:
    """{label: (training rows, settings)}: ``grid`` on the balanced training rows and on every
    labelled training row, and every labelled row without class weights (its probabilities
    then hold at the natural prevalence); in this order, which breaks ties."""
    unweighted = [replace(c, class_weight=None) for c in grid]
    return {
        "train": ("train", list(grid)),
        "train_all": ("train_all", list(grid)),
        "train_all unweighted": ("train_all", list(dict.fromkeys(unweighted))),
    }


def plus_scored(sets: dict[str, Rows], grid: Sequence[PlusConfig] | None = None) -> Scored:
    """actmap-plus: every setting of ``grid`` on the balanced training rows and on every
    labelled training row (class-weighted and unweighted); the best balanced-validation
    AUROC wins."""
    candidates = plus_candidates(PLUS_GRID if grid is None else grid)
    fits = {
        label: select_plus(sets[rows], sets["validation"], configs)
        for label, (rows, configs) in candidates.items()
    }
    label = max(candidates, key=lambda n: max(fits[n][1].values()))  # ties: the earlier
    name = candidates[label][0]
    est = fits[label][0]
    val = est.predict_proba(sets["validation"].maps, sets["validation"].scalars)
    return Scored(
        "actmap-plus",
        val,
        calibrated_prevalence=est.calibrated_prevalence_,
        details={
            "validation_auroc": metrics.auroc(val, sets["validation"].labels),
            "selected": plus_label(est.config_),
            "train_rows": name,
            "n_train": est.n_train_,
            "C": est.C_,
            "grid": {f"{n}: {k}": v for n in candidates for k, v in fits[n][1].items()},
        },
        score_test=lambda rows: est.predict_proba(rows.maps, rows.scalars),
        estimator=est,
        control=lambda seed: permuted_auroc(PlusScorer.of(est), sets, seed, train=name),
    )


class GenerationReader:
    """The captured generations of a row set, read from the store once per set."""

    def __init__(self, store) -> None:
        self.store = store
        self._cache: dict[tuple[str, ...], list] = {}

    def __call__(self, rows: Rows) -> list:
        from actmap.capture.from_store import read_generations

        key = tuple(rows.ids)
        if key not in self._cache:
            self._cache[key] = read_generations(self.store, rows.ids)
        return self._cache[key]


def baseline_scored(store, sets: dict[str, Rows], method: str, gens=None) -> Scored:
    """One single-pass baseline fit (when supervised) on balanced train, selected on validation.

    ``gens``: a `GenerationReader` shared between methods (default: a new one).
    """
    gens = gens or GenerationReader(store)
    scorer = scorer_template(method)
    if getattr(scorer, "supervised", False):
        train, val = sets["train"], sets["validation"]
        scorer.fit(gens(train), train.labels, gens(val), val.labels)
    val = scorer.score(gens(sets["validation"])).confidence
    details = {"validation_auroc": metrics.auroc(val, sets["validation"].labels)}
    if method == "tad":
        details.update(aggregation=scorer.aggregation_, alpha=scorer.alpha_)
    return Scored(
        method,
        val,
        calibrated_prevalence=0.5 if method == "answer_length" else None,  # fit on balanced rows
        details=details,
        score_test=lambda rows: scorer.score(gens(rows)).confidence,
        control=None
        if not getattr(scorer, "supervised", False)
        else (lambda seed: permuted_auroc(scorer, sets, seed, gens)),
    )


def scorer_template(method: str):
    from actmap.baselines.registry import create_baseline

    return create_baseline(method)


def permuted_auroc(
    fitted, sets: dict[str, Rows], seed: int, inputs=lambda rows: rows, train="train"
) -> float:
    """Balanced-test AUROC of ``fitted`` refit on permuted training labels (`PermutedLabelControl`).

    ``fitted`` was fit on the real labels of ``sets[train]``; a scorer with
    ``fixed_choices()`` keeps the choices it made there (one real-label fit shared by
    every permutation seed), any other is refit from scratch on the permuted labels.
    """
    from actmap.baselines.controls import PermutedLabelControl

    tr, val, test = sets[train], sets["validation"], sets["test"]
    if hasattr(fitted, "fixed_choices"):
        control = PermutedLabelControl.from_fitted(fitted, seed=seed)
    else:
        control = PermutedLabelControl(fitted, seed=seed)
    control.fit(inputs(tr), tr.labels, inputs(val), val.labels)
    return metrics.auroc(control.score(inputs(test)).confidence, test.labels)


def vit_scored(sets: dict[str, Rows], max_epochs: int, seeds: Sequence[int], device=None) -> Scored:
    """The paper's ViT on the balanced rows, one per seed; its confidence is the mean p over seeds."""
    from actmap.detectors.base import CorrectnessDetector
    from actmap.training.recipe import TrainConfig

    config = replace(TrainConfig(), max_epochs=max_epochs)
    train, val = sets["train"], sets["validation"]
    fitted = [
        CorrectnessDetector("vit", config=config, seed=s, device=device).fit(
            train.maps, train.labels, val.maps, val.labels
        )
        for s in seeds
    ]
    return vit_from_detectors(fitted, val, max_epochs)


def vit_from_detectors(fitted: Sequence[Any], val: Rows, max_epochs: int | None) -> Scored:
    def score(rows: Rows) -> np.ndarray:
        return np.mean([d.predict_proba(rows.maps) for d in fitted], axis=0).astype(np.float64)

    v = score(val)
    return Scored(
        "vit",
        v,
        calibrated_prevalence=0.5,
        details={
            "validation_auroc": metrics.auroc(v, val.labels),
            "seeds": [d.seed for d in fitted],
            "max_epochs": max_epochs,
            "best_epochs": [d.best_epoch_ for d in fitted],
        },
        score_test=score,
    )


# --- the test rows, touched once ------------------------------------------------------------------


@dataclass(frozen=True)
class MethodRow:
    method: str
    role: str  # "product" | "strongest baseline" | "baseline" | "paper ViT"
    validation_auroc: float
    test_auroc: Interval  # balanced test rows
    difference: Interval | None  # actmap-plus minus this method, paired, balanced test rows
    natural_auroc: float  # every labelled test row
    natural_ece: float | None  # raw probabilities; None when the confidence is no probability
    natural_ece_corrected: float | None  # prior-corrected to the training split's accuracy
    details: dict[str, Any]


@dataclass(frozen=True)
class ProductComparison:
    store: str
    n_test: int
    n_test_all: int
    test_prevalence: float
    deployment_prevalence: float  # natural accuracy of the training split
    rows: list[MethodRow]
    controls: dict[str, list[float]]  # method -> balanced-test AUROC per permutation seed

    def to_json(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        lines = [
            f"store {self.store}: balanced test n={self.n_test}; all test n={self.n_test_all} "
            f"({self.test_prevalence:.1%} correct); prior correction to the training split's "
            f"{self.deployment_prevalence:.1%}",
            "",
            "| method | role | val AUROC | test AUROC [95%] | plus - method [95%, paired] "
            "| natural AUROC | natural ECE raw | natural ECE corrected |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| {r.method} | {r.role} | {r.validation_auroc:.3f} | {r.test_auroc} "
                f"| {'' if r.difference is None else r.difference} | {r.natural_auroc:.3f} "
                f"| {_fmt(r.natural_ece)} | {_fmt(r.natural_ece_corrected)} |"
            )
        if self.controls:
            lines += [
                "",
                "| permuted-label control | test AUROC per permutation | mean |",
                "|---|---|---|",
            ]
            for method, aucs in self.controls.items():
                each = ", ".join(f"{a:.3f}" for a in aucs)
                lines.append(f"| {method} | {each} | {np.mean(aucs):.3f} |")
        return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def natural_metrics(scored: Scored, labels: np.ndarray, prevalence: float) -> tuple:
    """(AUROC, ECE raw, ECE prior-corrected) on every labelled test row."""
    s = scored.test_all
    auc = metrics.auroc(s, labels)
    if scored.calibrated_prevalence is None:
        return auc, None, None
    return auc, *metrics.natural_ece(s, labels, prevalence, scored.calibrated_prevalence)


def score_test_once(methods: Sequence[Scored], sets: dict[str, Rows]) -> None:
    for m in methods:
        m.test = np.asarray(m.score_test(sets["test"]), dtype=np.float64)
        m.test_all = np.asarray(m.score_test(sets["test_all"]), dtype=np.float64)


def single_pass_scored(
    store, sets: dict[str, Rows], baselines: Sequence[str]
) -> tuple[Scored, list[Scored]]:
    """(the strongest, every other) of the single-pass ``baselines`` that run on ``store``: the
    strongest has the best balanced-validation AUROC."""
    others = []
    gens = GenerationReader(store)
    for method in baselines:
        try:
            others.append(baseline_scored(store, sets, method, gens))
        except Exception as err:  # e.g. a store without attention: the others still compare
            log.warning("%s cannot run on %s: %s", method, store.root, err)
    if not others:
        raise ValueError(f"{store.root}: none of the baselines {', '.join(baselines)} could run")
    strongest = max(others, key=lambda m: m.validation_auroc)
    return strongest, [m for m in others if m is not strongest]


@dataclass(frozen=True)
class Measured:
    """One method's test figures in a comparison (`measure`)."""

    scored: Scored
    test_auroc: Interval  # balanced test rows
    vs: dict[str, Interval]  # lead's name -> lead minus this method, paired, balanced test rows
    natural: tuple  # (AUROC, ECE raw, ECE prior-corrected) on every labelled test row


def measure(
    methods: Sequence[Scored], leads: Sequence[Scored], sets: dict[str, Rows], n_resamples: int
) -> list[Measured]:
    """Score the test rows once (every choice was made on validation rows), then each method's
    bootstrap interval, each lead's paired difference to it, and its natural-prevalence
    metrics (prior correction to the training split's accuracy)."""
    score_test_once(methods, sets)
    y, y_all = sets["test"].labels, sets["test_all"].labels
    deploy = sets["train_all"].prevalence
    return [
        Measured(
            m,
            bootstrap(m.test, y, n_resamples=n_resamples),
            {
                lead.name: paired_bootstrap(lead.test, m.test, y, n_resamples=n_resamples)
                for lead in leads
                if lead is not m
            },
            natural_metrics(m, y_all, deploy),
        )
        for m in methods
    ]


def compare_product(
    store,
    baselines: Sequence[str] = SINGLE_PASS_BASELINES,
    vit_epochs: int = 80,
    vit_seeds: Sequence[int] = (42, 123, 456),
    vit_detectors: Sequence[Any] | None = None,
    device: str | None = None,
    n_resamples: int = 2000,
    plus_grid: Sequence[PlusConfig] | None = None,
    n_permutations: int = 3,
) -> ProductComparison:
    """actmap-plus vs the strongest single-pass baseline vs the ViT, choices on validation only.

    ``vit_detectors``: already-trained ViTs (e.g. loaded from an `actmap train` run on the same
    store) instead of training ``vit_seeds`` for ``vit_epochs`` here.
    """
    sets = store_rows(store)
    plus = plus_scored(sets, plus_grid)
    strongest, others = single_pass_scored(store, sets, baselines)
    if vit_detectors is not None:
        vit = vit_from_detectors(vit_detectors, sets["validation"], None)
    else:
        vit = vit_scored(sets, vit_epochs, vit_seeds, device)
    methods = [plus, strongest, vit] + others
    role = {plus.name: "product", strongest.name: "strongest baseline", "vit": "paper ViT"}
    rows = [
        MethodRow(
            m.scored.name,
            role.get(m.scored.name, "baseline"),
            m.scored.validation_auroc,
            m.test_auroc,
            m.vs.get(plus.name),
            *m.natural,
            dict(m.scored.details),
        )
        for m in measure(methods, [plus], sets, n_resamples)
    ]
    y, y_all = sets["test"].labels, sets["test_all"].labels
    deploy = sets["train_all"].prevalence
    controls = {
        m.name: [m.control(seed) for seed in range(n_permutations)]
        for m in methods
        if m.control is not None and m.name in (plus.name, strongest.name, "tad")
    }
    return ProductComparison(
        str(store.root), len(y), len(y_all), float(y_all.mean()), deploy, rows, controls
    )
