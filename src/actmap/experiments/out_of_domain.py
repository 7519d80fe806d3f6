"""Out of domain: each task held out from a generalist fit on the others, and its first labels.

    leave_one_task_out(paths, OutOfDomainConfig()) -> OutOfDomain (to_json, to_markdown)

For each store (one task of one generator) held out, on its balanced test rows:
- the generalist (`actmap.experiments.generalist`) fit on the other stores only;
- the label-free single-pass baselines (RAUQ, perplexity, mean token entropy), which need
  no training at all;
- TAD and the paper's MLP over the map, each fit on the other stores' pooled balanced
  training rows and chosen on their pooled validation rows;
- (reference, not out of domain) the task's own stacked detector, trained on its rows.
Each gets AUROC and PRR (`actmap.scoring.metrics.prr`) with 95% bootstrap intervals, and the
paired difference generalist minus method of both. On every labelled test row (the natural
prevalence) each probability gets its ECE raw, after prior correction to the prior estimated
from the unlabelled scores (EM, `actmap.scoring.prior.em_prevalence`), and to the known prior
(the test rows' own accuracy, which a deployment does not know).

The first labels (`first_labels_curve`): k labelled rows of the held-out task, drawn at random
(so at its natural prevalence) from its **training** rows only, repeated ``draws`` times:
    recalibrate    the generalist's logit, prior and temperature refit on the k rows (k = 0:
                   the prior from EM on the unlabelled test scores, temperature 1)
    head refit     the stack's head refit on the generalist's block logits of the k rows
    in-domain refit every block and the head refit on the k rows alone, at the generalist's
                   choices (blocks, layers, L2 strengths; TAD's confidence is kept as fitted)
A draw whose rows hold one class (or, for the in-domain refit, fewer than 2 of a class) cannot
refit: that draw serves the previous step's detector and is counted (``fell_back``). Each point
reads AUROC on the balanced test rows and ECE on every labelled test row (natural prevalence),
each the mean over draws with the 2.5-97.5 percentiles of the draws as its interval; the
in-domain detector fit on all the task's training rows is the line to reach.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from actmap.detectors.stacked import LinearBlock, StackedPlus
from actmap.errors import ActmapUserError
from actmap.experiments.generalist import (
    TaskRows,
    common_preset,
    fit_generalist,
    generator_of,
    open_tasks,
    preset_requires,
)
from actmap.scoring import metrics
from actmap.scoring.intervals import N_RESAMPLES, Interval, bootstrap, paired_bootstrap
from actmap.scoring.prior import em_prevalence, logit, shift_to_prevalence, sigmoid
from actmap.store.rows import Rows

log = logging.getLogger(__name__)

LABEL_FREE = ("rauq", "perplexity", "mean_token_entropy")
CURVE_K = (0, 25, 50, 100, 200)
STEPS = ("recalibrate", "head refit", "in-domain refit")


@dataclass(frozen=True)
class OutOfDomainConfig:
    preset: str = "auto"  # the generalist's: auto = the richest every store can train
    label_free: tuple[str, ...] = LABEL_FREE
    tad: bool = True  # TAD trained on the other tasks
    mlp: bool = True  # the paper's MLP trained on the other tasks
    mlp_epochs: int | None = None  # the recipe's 80 when None
    mlp_seed: int = 42
    in_domain: bool = True  # the held-out task's own stacked detector (the line to reach)
    curve_k: tuple[int, ...] = CURVE_K  # () skips the learning curve
    draws: int = 10  # labelled draws per k
    max_rejection: float = 0.5  # PRR's rejection range
    n_resamples: int = N_RESAMPLES
    seed: int = 0

    def __post_init__(self) -> None:
        if any(k < 0 for k in self.curve_k) or self.draws < 1:
            raise ValueError(
                f"curve_k must be >= 0 and draws >= 1, got {self.curve_k}, {self.draws}"
            )


# --- rows ----------------------------------------------------------------------------------------


def draw_labelled(train: Rows, k: int, seed: int) -> np.ndarray:
    """Indices of ``k`` rows of ``train`` (the held-out task's labelled training rows), drawn
    at random without replacement: the first labels a deployment gets, at its natural
    prevalence. Never more rows than ``train`` holds."""
    n = len(train)
    if k > n:
        raise ValueError(f"cannot draw {k} labelled rows from {n} training rows")
    return np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False))


def balanced_index(test_all: Rows, test: Rows) -> np.ndarray:
    """Where the balanced test rows sit among every labelled test row."""
    where = {key: i for i, key in enumerate(test_all.row_ids())}
    return np.asarray([where[key] for key in test.row_ids()], dtype=np.int64)


# --- one method's result -------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """ECE of p(correct) on every labelled test row (natural prevalence), 10 bins."""

    raw: float
    em: Interval  # prior-corrected to the EM estimate from the unlabelled scores
    known: float  # prior-corrected to the rows' own accuracy
    em_prevalence: float  # the estimate; the rows' own accuracy is the held-out's prevalence


@dataclass(frozen=True)
class MethodResult:
    method: str
    role: str  # generalist | label-free | trained on the others | in-domain (reference)
    auroc: Interval  # balanced test rows
    prr: Interval
    vs_auroc: Interval | None  # generalist minus this method, paired
    vs_prr: Interval | None
    calibration: Calibration | None  # None: the confidence is not a probability


@dataclass(frozen=True)
class CurvePoint:
    step: str
    k: int
    auroc: float  # mean over draws, balanced test rows
    auroc_low: float  # 2.5 / 97.5 percentiles over draws
    auroc_high: float
    ece: float  # mean over draws, every labelled test row
    ece_low: float
    ece_high: float
    draws: int
    fell_back: int  # draws that could not refit this step (one class, too few of a class)
    mean_correct: float  # correct answers per draw, mean


@dataclass(frozen=True)
class HeldOut:
    task: str
    store: str
    sources: list[str]
    n_test: int = 0  # balanced test rows
    n_test_all: int = 0  # every labelled test row
    test_prevalence: float = float("nan")
    n_train_all: int = 0  # the labelled training rows the curve draws from
    methods: list[MethodResult] = field(default_factory=list)
    curve: list[CurvePoint] = field(default_factory=list)
    in_domain: dict[str, float] = field(default_factory=dict)  # the line the curve reaches for
    generalist: dict[str, Any] = field(default_factory=dict)  # blocks, validation AUROC
    note: str = ""  # why this task could not be evaluated (one line)


@dataclass(frozen=True)
class OutOfDomain:
    generator: dict[str, Any]
    preset: str
    config: OutOfDomainConfig
    held_out: list[HeldOut]

    def to_json(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        lines = [
            f"generator {self.generator.get('name')} ({self.generator.get('dtype')}); generalist "
            f"preset {self.preset}; PRR rejects up to {self.config.max_rejection:.0%}; "
            f"intervals: 95% bootstrap, {self.config.n_resamples} resamples",
        ]
        for h in self.held_out:
            lines += ["", f"### held out: {h.task} (trained on {', '.join(h.sources)})", ""]
            if h.note:
                lines.append(h.note)
                continue
            lines += [
                f"balanced test n={h.n_test}; every labelled test row n={h.n_test_all} "
                f"({h.test_prevalence:.1%} correct); generalist blocks "
                f"{h.generalist.get('selected')}",
                "",
                "| method | role | AUROC [95%] | generalist - method | PRR [95%] "
                "| generalist - method | ECE raw | ECE, EM prior [95%] (prior) | ECE, known prior |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for m in h.methods:
                c = m.calibration
                cal = (
                    "n/a | n/a | n/a"
                    if c is None
                    else f"{c.raw:.3f} | {c.em} ({c.em_prevalence:.3f}) | {c.known:.3f}"
                )
                lines.append(
                    f"| {m.method} | {m.role} | {m.auroc} | {_opt(m.vs_auroc)} | {m.prr} "
                    f"| {_opt(m.vs_prr)} | {cal} |"
                )
            if h.curve:
                ref = h.in_domain
                lines += [
                    "",
                    f"first labels (from {h.n_train_all} labelled training rows, "
                    f"{self.config.draws} draws per k); in-domain detector on all of them: "
                    f"AUROC {ref.get('auroc', float('nan')):.3f}, ECE "
                    f"{ref.get('ece', float('nan')):.3f}",
                    "",
                    "| step | k | correct per draw | AUROC (draws 2.5-97.5%) | ECE (draws 2.5-97.5%) "
                    "| fell back |",
                    "|---|---|---|---|---|---|",
                ]
                for p in h.curve:
                    lines.append(
                        f"| {p.step} | {p.k} | {p.mean_correct:.1f} | {p.auroc:.3f} "
                        f"[{p.auroc_low:.3f}, {p.auroc_high:.3f}] | {p.ece:.3f} "
                        f"[{p.ece_low:.3f}, {p.ece_high:.3f}] | {p.fell_back}/{p.draws} |"
                    )
        return "\n".join(lines) + "\n"


def _opt(value: Interval | None) -> str:
    return "" if value is None else f"{value.estimate:+.3f} [{value.low:+.3f}, {value.high:+.3f}]"


def calibration(p: np.ndarray, y: np.ndarray, calibrated_prevalence: float, n_resamples: int):
    """`Calibration` of p(correct) held at ``calibrated_prevalence`` on rows ``y``."""
    em = em_prevalence(p, calibrated_prevalence)  # the labels are not read
    known = float(np.clip(y.mean(), 1e-6, 1 - 1e-6))
    return Calibration(
        metrics.ece(p, y),
        bootstrap(em.probs, y, metrics.ece, n_resamples=n_resamples),
        metrics.ece(shift_to_prevalence(p, known, calibrated_prevalence), y),
        em.prevalence,
    )


# --- the methods ---------------------------------------------------------------------------------


@dataclass
class Scores:
    """One method's confidences on every labelled test row of the held-out task."""

    method: str
    role: str
    test_all: np.ndarray
    calibrated_prevalence: float | None = None  # None: not a probability


def label_free_scores(held: TaskRows, methods: Sequence[str]) -> list[Scores]:
    from actmap.baselines.registry import create_baseline
    from actmap.capture.from_store import read_generations

    if not methods:
        return []
    gens = read_generations(held.store, held.sets["test_all"].row_ids())
    out = []
    for method in methods:
        try:
            conf = create_baseline(method).score(gens).confidence
        except Exception as err:  # e.g. RAUQ without attention weights: the others still run
            log.warning("%s cannot score %s: %s", method, held.name, err)
            continue
        out.append(Scores(method, "label-free", np.asarray(conf, dtype=np.float64)))
    return out


def tad_scores(sources: Sequence[TaskRows], held: TaskRows) -> Scores:
    """TAD fit on the sources' pooled balanced training rows, chosen on their validation rows."""
    from actmap.capture.from_store import read_generations
    from actmap.detectors.inputs import DetectorInputs
    from actmap.signals.tad import TAD

    def gens(split: str) -> tuple[list, np.ndarray]:
        parts = [read_generations(t.store, t.sets[split].row_ids()) for t in sources]
        labels = np.concatenate([np.asarray(t.sets[split].labels) for t in sources])
        return [g for part in parts for g in part], labels

    (train, y), (val, y_val) = gens("train"), gens("validation")
    stored = int(train[0].attention.shape[-1])  # K the capture kept
    tad = TAD(n_previous=min(TAD().n_previous, stored))  # fit and scored on the one input bundle
    tad.fit(DetectorInputs(generations=train), y, DetectorInputs(generations=val), y_val)
    test = read_generations(held.store, held.sets["test_all"].row_ids())
    conf = tad.score(DetectorInputs(generations=test)).confidence
    return Scores("tad", "trained on the others", np.asarray(conf, dtype=np.float64))


def mlp_scores(sources: Sequence[TaskRows], held: TaskRows, epochs, seed: int) -> Scores:
    """The paper's MLP over the map, on the sources' pooled balanced training rows, its epoch
    chosen on their pooled balanced validation rows."""
    from actmap.experiments.common import train_seeds
    from actmap.experiments.seeds import recipe_config

    def pooled(split: str) -> Rows:
        parts = [t.sets[split] for t in sources]
        return Rows(
            [f"{t.name}/{key}" for t in sources for key in t.sets[split].row_ids()],
            np.concatenate([np.asarray(p.labels) for p in parts]),
            np.concatenate([np.asarray(p.maps) for p in parts]),
        )

    test = held.sets["test_all"]
    scores = train_seeds(pooled("train"), pooled("validation"), test, "mlp", (seed,),
                         recipe_config(epochs))  # fmt: skip
    return Scores("mlp", "trained on the others", scores.confidence[0], 0.5)


def stack_scores(
    name: str, role: str, est: StackedPlus, held: TaskRows
) -> tuple[Scores, np.ndarray]:
    rows = held.inputs(held.sets["test_all"], preset_requires(est.config.preset))
    z = est.decision_function(rows)
    return Scores(name, role, sigmoid(z), est.calibrated_prevalence_), z


def in_domain_fit(held: TaskRows, preset: str) -> StackedPlus:
    """The held-out task's own stacked detector: every labelled training row (class-weighted),
    chosen on its balanced validation rows (as `actmap compare-stacked` fits it)."""
    requires = preset_requires(preset)
    train, val = held.sets["train_all"], held.sets["validation"]
    est = StackedPlus(replace(StackedPlus().config, preset=preset))
    return est.fit(held.inputs(train, requires), train.labels,
                   held.inputs(val, requires), val.labels)  # fmt: skip


# --- the first labels ----------------------------------------------------------------------------


class BlockLogits:
    """The generalist's features and block logits of a row set, computed once."""

    def __init__(self, est: StackedPlus, rows) -> None:
        self.features = {b: est._features(b, rows) for b in est.selected_}
        self.logits = np.column_stack(
            [est.blocks_[b].logits(self.features[b]) for b in est.selected_]
        )
        self.stack = est.meta_.logits(self.logits)


def recalibration(
    z: np.ndarray, y: np.ndarray, prior0: float, held_at: float
) -> tuple[float, float]:
    """(slope, intercept) of the recalibrated logit ``slope * z + intercept`` fit on labelled
    rows: with both classes, a logistic regression on the logit (a temperature and a prior:
    Platt scaling); with one class or none, or when that regression would reverse the ranking
    (a negative slope, a few correct answers), the prior alone: the label-free prior ``prior0``
    updated by the labels (as two pseudo-rows at it). ``held_at``: the prevalence sigmoid(z)
    holds at (0.5 for a class-weighted fit)."""
    from sklearn.linear_model import LogisticRegression

    if len(np.unique(y)) == 2:
        fit = LogisticRegression(C=1.0).fit(np.asarray(z)[:, None], y)
        if fit.coef_[0, 0] > 0:  # a temperature is positive: never turn the ranking around
            return float(fit.coef_[0, 0]), float(fit.intercept_[0])
    prior = (float(np.sum(y)) + 2 * prior0) / (len(y) + 2)
    return 1.0, float(logit(prior) - logit(held_at))


def head_refit(x: np.ndarray, y: np.ndarray) -> LinearBlock | None:
    """The stack's head refit on the generalist's block logits ``x`` of labelled rows
    (unweighted: p holds at their prevalence); None with one class."""
    if len(np.unique(y)) < 2:
        return None
    return LinearBlock.fit("stack", x, y, 1.0, None)


def adapt_generalist(
    est: StackedPlus, rows, labels, step: str = "recalibrate", prior0: float | None = None
) -> StackedPlus:
    """The generalist adapted to a new task's first labelled answers (``rows``: their
    `DetectorInputs`, ``labels``: 1 = correct, drawn as they come, i.e. at the task's prevalence):
    "recalibrate" (prior and temperature of its logit) or "head refit" (the stack's head on
    its block logits; with one class it recalibrates instead). The copy scores, saves and
    serves like any fitted `StackedPlus`; its p(correct) holds at the labelled rows'
    prevalence (``calibrated_prevalence_``). ``prior0``: the label-free prior the labels
    update when they hold one class (default: EM on these rows' own scores).

    `actmap train --store SMALL --generalist RUN` calls it (`actmap.experiments.new_task`)."""
    import copy

    y = np.asarray(labels).astype(np.int64)
    new = copy.copy(est)
    head = head_refit(BlockLogits(est, rows).logits, y) if step == "head refit" else None
    if step not in ("recalibrate", "head refit"):
        raise ValueError(f"step must be 'recalibrate' or 'head refit', got {step!r}")
    if head is None:
        z = est.decision_function(rows)
        if prior0 is None:
            prior0 = em_prevalence(sigmoid(z), est.calibrated_prevalence_).prevalence
        slope, intercept = recalibration(z, y, prior0, est.calibrated_prevalence_)
        m = est.meta_
        head = replace(m, coef=m.coef * slope, intercept=m.intercept * slope + intercept)
        step = "recalibrate"
    new.meta_ = head
    new.calibrated_prevalence_ = float(np.clip(y.mean(), 1e-3, 1 - 1e-3)) if len(y) else 0.5
    new.metadata_ = {**est.metadata_, "adapted": {"step": step, "labelled_rows": len(y)}}
    return new


def _fold_count(y: np.ndarray) -> int:
    return int(min(5, np.bincount(y, minlength=2).min()))


def refit_blocks(est: StackedPlus, train: BlockLogits, y: np.ndarray, seed: int):
    """Every selected block refit on ``y``'s rows at the generalist's choices, and the head
    on their out-of-fold logits: a scorer of `BlockLogits`; None when a class has < 2 rows."""
    from sklearn.model_selection import StratifiedKFold

    from actmap.detectors.stacked import out_of_fold_logits

    folds = _fold_count(y)
    if folds < 2:
        return None
    cut = StratifiedKFold(folds, shuffle=True, random_state=seed)
    blocks, oof = {}, []
    for b in est.selected_:
        x, C = train.features[b], est.blocks_[b].C
        blocks[b] = LinearBlock.fit(b, x, y, C, None)
        oof.append(out_of_fold_logits(x, y, C, None, cut))
    head = LinearBlock.fit("stack", np.column_stack(oof), y, 1.0, None)

    def score(rows: BlockLogits) -> np.ndarray:
        return head.logits(
            np.column_stack([blocks[b].logits(rows.features[b]) for b in est.selected_])
        )

    return score


def first_labels_curve(
    est: StackedPlus,
    held: TaskRows,
    z_all: np.ndarray,
    ks: Sequence[int],
    draws: int,
    seed: int = 0,
) -> tuple[list[CurvePoint], list[list[str]]]:
    """The learning curve of the module doc; returns its points and, per draw, the ids drawn
    (always among the held-out task's training rows)."""
    requires = preset_requires(est.config.preset)
    train_all, test_all, test = (held.sets[s] for s in ("train_all", "test_all", "test"))
    y_train = np.asarray(train_all.labels).astype(np.int64)
    y_all = np.asarray(test_all.labels).astype(np.int64)
    balanced = balanced_index(test_all, test)
    y_bal = y_all[balanced]
    on_train = BlockLogits(est, held.inputs(train_all, requires))
    on_test = BlockLogits(est, held.inputs(test_all, requires))
    held_at = est.calibrated_prevalence_
    prior0 = em_prevalence(sigmoid(z_all), held_at).prevalence  # label-free
    points, drawn = [], []
    for k in ks:
        if k > len(train_all):
            log.warning(
                "%s: k=%d exceeds its %d training rows; skipped", held.name, k, len(train_all)
            )
            continue
        per_step: dict[str, list[tuple[float, float, bool]]] = {s: [] for s in STEPS}
        correct = []
        for r in range(draws if k > 0 else 1):
            idx = draw_labelled(train_all, k, seed + 1000 * r + k)
            drawn.append([train_all.row_ids()[i] for i in idx])
            y = y_train[idx]
            correct.append(float(y.sum()))
            slope, intercept = recalibration(on_train.stack[idx], y, prior0, held_at)
            p_cal = sigmoid(slope * z_all + intercept)
            results = {"recalibrate": (p_cal, False)}
            if k:  # k = 0: nothing to refit, the label-free generalist alone
                head = head_refit(on_train.logits[idx], y)
                results["head refit"] = (
                    (p_cal, True) if head is None else (sigmoid(head.logits(on_test.logits)), False)
                )
                scorer = refit_blocks(est, _subset(on_train, idx), y, seed + r)
                results["in-domain refit"] = (
                    (results["head refit"][0], True)
                    if scorer is None
                    else (sigmoid(scorer(on_test)), False)
                )
            for step, (p, fell) in results.items():
                per_step[step].append(
                    (metrics.auroc(p[balanced], y_bal), metrics.ece(p, y_all), fell)
                )
        for step in (s for s in STEPS if per_step[s]):
            a = np.array([v[0] for v in per_step[step]])
            e = np.array([v[1] for v in per_step[step]])
            points.append(
                CurvePoint(
                    step,
                    k,
                    float(a.mean()),
                    *np.percentile(a, [2.5, 97.5]).tolist(),
                    float(e.mean()),
                    *np.percentile(e, [2.5, 97.5]).tolist(),
                    len(a),
                    sum(v[2] for v in per_step[step]),
                    float(np.mean(correct)),
                )
            )
    return points, drawn


def _subset(rows: BlockLogits, idx: np.ndarray) -> BlockLogits:
    out = object.__new__(BlockLogits)
    out.features = {b: f[idx] for b, f in rows.features.items()}
    out.logits, out.stack = rows.logits[idx], rows.stack[idx]
    return out


# --- the whole comparison ------------------------------------------------------------------------


def _result(s: Scores, ref: Scores | None, y_all, balanced, cfg: OutOfDomainConfig) -> MethodResult:
    y = y_all[balanced]
    prr = lambda a, b: metrics.prr(a, b, cfg.max_rejection)  # noqa: E731
    n = cfg.n_resamples
    mine = s.test_all[balanced]
    vs_auc = vs_prr = None
    if ref is not None and ref is not s:
        other = ref.test_all[balanced]
        vs_auc = paired_bootstrap(other, mine, y, n_resamples=n)
        vs_prr = paired_bootstrap(other, mine, y, prr, n_resamples=n)
    cal = None
    if s.calibrated_prevalence is not None:
        cal = calibration(s.test_all, y_all, s.calibrated_prevalence, n)
    return MethodResult(
        s.method, s.role, bootstrap(mine, y, n_resamples=n), bootstrap(mine, y, prr, n_resamples=n),
        vs_auc, vs_prr, cal,
    )  # fmt: skip


def held_out_note(held: TaskRows | None, name: str, error: Exception | None = None) -> str:
    """One line saying why a held-out task cannot be evaluated, or "" when it can."""
    if held is None or error is not None:
        return f"held out {name}: cannot be evaluated ({error})"
    if "test_all" not in held.sets:
        return f"held out {name}: no labelled test rows"
    y = np.asarray(held.sets["test_all"].labels)
    if y.sum() == 0:
        return f"held out {name}: no correct answer among its {len(y)} labelled test rows"
    if y.sum() == len(y):
        return f"held out {name}: every one of its {len(y)} labelled test rows is correct"
    return ""


def evaluate_held_out(
    tasks: Sequence[TaskRows],
    held: TaskRows,
    preset: str,
    cfg: OutOfDomainConfig,
    progress: Callable[[str], None] | None = None,
) -> HeldOut:
    sources = [t for t in tasks if t is not held]
    names = [t.name for t in sources]
    note = held_out_note(held, held.name)
    if not note and "test" not in held.sets:
        note = f"held out {held.name}: no balanced test rows (its test split lacks a label)"
    fewest = math.ceil(2 / cfg.max_rejection)  # PRR needs 2 rejected rows
    if not note and len(held.sets["test"]) < fewest:
        n = len(held.sets["test"])
        note = (
            f"held out {held.name}: {n} balanced test rows ({n // 2} of them correct); PRR "
            f"rejecting up to {cfg.max_rejection:.0%} needs at least {fewest}"
        )
    if note:
        return HeldOut(held.name, str(held.store.root), names, note=note)
    say = progress or (lambda text: log.info("%s", text))
    test_all, test = held.sets["test_all"], held.sets["test"]
    y_all = np.asarray(test_all.labels).astype(np.int64)
    balanced = balanced_index(test_all, test)
    say(f"{held.name}: generalist on {', '.join(names)}")
    est = fit_generalist(sources, preset, seed=cfg.seed)
    general, z_all = stack_scores("generalist", "generalist", est, held)
    scored = [general, *label_free_scores(held, cfg.label_free)]
    if cfg.tad and all(t.store.has_table("attention") for t in tasks):
        say(f"{held.name}: TAD on the others")
        scored.append(tad_scores(sources, held))
    if cfg.mlp:
        say(f"{held.name}: the paper's MLP on the others")
        scored.append(mlp_scores(sources, held, cfg.mlp_epochs, cfg.mlp_seed))
    in_domain = {}
    own = None
    if cfg.in_domain:
        say(f"{held.name}: its own stacked detector")
        own = in_domain_fit(held, preset)
        mine, _ = stack_scores("in-domain stacked", "in-domain (reference)", own, held)
        scored.append(mine)
        in_domain = {
            "auroc": metrics.auroc(mine.test_all[balanced], y_all[balanced]),
            "ece": metrics.ece(
                shift_to_prevalence(
                    mine.test_all, held.sets["train_all"].prevalence, own.calibrated_prevalence_
                ),
                y_all,
            ),  # prior-corrected to its training rows' accuracy, known without test labels
            "n_train": int(own.n_train_),
        }
    methods = [_result(s, general, y_all, balanced, cfg) for s in scored]
    curve: list[CurvePoint] = []
    if cfg.curve_k:
        say(f"{held.name}: first labels")
        curve, _ = first_labels_curve(est, held, z_all, cfg.curve_k, cfg.draws, cfg.seed)
    return HeldOut(
        held.name,
        str(held.store.root),
        names,
        len(test),
        len(test_all),
        float(y_all.mean()),
        len(held.sets["train_all"]),
        methods,
        curve,
        in_domain,
        {"selected": est.selected_, "validation": {k: v for k, v in est.validation_.items()
                                                   if not isinstance(v, list)}},
    )  # fmt: skip


def leave_one_task_out(
    paths: Sequence[str | Path],
    config: OutOfDomainConfig = OutOfDomainConfig(),
    held_out: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> OutOfDomain:
    """Each store held out in turn (or only the tasks named in ``held_out``) from a generalist
    fit on the others (module doc). Stores are only read."""
    tasks = open_tasks(paths)
    preset = common_preset(tasks, config.preset)
    unknown = sorted(set(held_out or ()) - {t.name for t in tasks})
    if unknown:
        raise ActmapUserError(
            f"no store of task {', '.join(unknown)} (tasks: {', '.join(t.name for t in tasks)})"
        )
    results = []
    for held in tasks:
        if held_out and held.name not in held_out:
            continue
        try:
            results.append(evaluate_held_out(tasks, held, preset, config, progress))
        except (ActmapUserError, ValueError) as error:  # the other held-out tasks still run
            log.warning("held out %s: %s", held.name, error)
            note = held_out_note(held, held.name, error)
            results.append(HeldOut(held.name, str(held.store.root),
                                   [t.name for t in tasks if t is not held], note=note))  # fmt: skip
    return OutOfDomain(generator_of(tasks[0].store), preset, config, results)


# --- reading a result back ----------------------------------------------------------------------


def _interval(value: dict | None) -> Interval | None:
    return None if value is None else Interval(**value)


def from_json(data: dict) -> OutOfDomain:
    """The `OutOfDomain` that ``to_json`` wrote (``actmap out-of-domain``'s out_of_domain.json)."""
    config = dict(data["config"])
    config["label_free"] = tuple(config.get("label_free", LABEL_FREE))
    config["curve_k"] = tuple(config.get("curve_k", ()))
    held = []
    for h in data["held_out"]:
        methods = []
        for m in h.get("methods", []):
            c = m.get("calibration")
            cal = None if c is None else Calibration(c["raw"], Interval(**c["em"]), c["known"],
                                                     c["em_prevalence"])  # fmt: skip
            methods.append(
                MethodResult(m["method"], m["role"], Interval(**m["auroc"]), Interval(**m["prr"]),
                             _interval(m.get("vs_auroc")), _interval(m.get("vs_prr")), cal)
            )  # fmt: skip
        fields = {k: v for k, v in h.items() if k not in ("methods", "curve")}
        curve = [CurvePoint(**p) for p in h.get("curve", [])]
        held.append(HeldOut(**fields, methods=methods, curve=curve))
    return OutOfDomain(data["generator"], data["preset"], OutOfDomainConfig(**config), held)


def read_out_of_domain(folder: str | Path) -> OutOfDomain:
    """The result in ``folder`` (``actmap out-of-domain --out folder``); a folder without
    out_of_domain.json, or with one this version cannot read, is refused naming it."""
    import json

    path = Path(folder) / "out_of_domain.json"
    if not path.is_file():
        raise ActmapUserError(
            f"{folder} holds no out_of_domain.json (`actmap out-of-domain --out`)"
        )
    try:
        return from_json(json.loads(path.read_text()))
    except (KeyError, TypeError, ValueError) as error:
        raise ActmapUserError(
            f"{path} is not a result of `actmap out-of-domain`: {error!r}"
        ) from None
