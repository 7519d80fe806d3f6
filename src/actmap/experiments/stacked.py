"""actmap-plus on a store: train a run of any version, and compare the stacked presets with
every single-pass baseline.

    train_plus_run(store, out, preset)       ->  the run folder `actmap train` writes (v1 or a
                                                 stacked preset)
    compare_stacked(store)                   ->  StackedComparison (to_json, to_markdown)

The stacked detector trains on every labelled training row (class-weighted), makes every choice
on the balanced validation rows, and scores the balanced test rows once. The baselines are
fit and chosen exactly as in `actmap.experiments.compare_product` (the strongest single-pass baseline: the best
balanced-validation AUROC). Each method gets its balanced-test AUROC with a 95% bootstrap
interval, each preset the paired interval of its difference to every method, and on every
labelled test row (natural prevalence) AUROC and ECE, raw and prior-corrected to the
training split's accuracy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from actmap.artifacts import write_json
from actmap.detectors import new_detector, read_inputs
from actmap.detectors.stacked import PRESETS, StackedPlus
from actmap.errors import ActmapUserError
from actmap.experiments.compare_product import (
    SINGLE_PASS_BASELINES,
    Scored,
    measure,
    plus_scored,
    single_pass_scored,
    store_rows,
)
from actmap.experiments.seeds import RowScores, scoring_metrics, summarize_runs
from actmap.scoring import metrics
from actmap.scoring.intervals import Interval
from actmap.store import MapStore
from actmap.store.rows import Rows
from actmap.training.run_folder import ONE_FIT_SEED, seed_folder

log = logging.getLogger(__name__)

TRAIN_ROWS = "train_all"  # every labelled training row; class weights balance them


def fit_stacked(
    store, sets: dict[str, Rows], preset: str, fallback: bool = True
) -> tuple[StackedPlus, Any]:
    """(fitted detector, row-set -> StackRows) on a store's row sets (`comparison.store_rows`);
    ``fallback``: `StackConfig.fallback`."""
    cache: dict[tuple[str, ...], Any] = {}
    est = new_detector(f"actmap-plus:{preset}", fallback=fallback)
    requires = est.requires  # the preset's every block: read once, for every fit of these rows

    def inputs(rows: Rows):
        key = tuple(rows.ids)
        if key not in cache:
            cache[key] = read_inputs(store, rows, requires)
        return cache[key]

    train, val = sets[TRAIN_ROWS], sets["validation"]
    est.fit(inputs(train), train.labels, inputs(val), val.labels)
    log.info(
        "stacked %s: %s (validation AUROC %.4f)", preset, est.selected_, est.validation_["stack"]
    )
    return est, inputs


def stacked_scored(store, sets: dict[str, Rows], preset: str, fallback: bool = True) -> Scored:
    est, inputs = fit_stacked(store, sets, preset, fallback)
    return scored_of(est, inputs, sets, preset)


def presets_scored(store, sets: dict[str, Rows], presets: Sequence[str]) -> list[Scored]:
    """Every preset of ``presets``; one full fit gives the deployable preset too
    (`StackedPlus.restricted`: the same blocks, re-stacked on the subset)."""
    if "full" not in presets:
        return [stacked_scored(store, sets, p) for p in presets]
    full, inputs = fit_stacked(store, sets, "full")
    fits = {p: full if p == "full" else full.restricted(p) for p in presets}
    return [scored_of(fits[p], inputs, sets, p) for p in presets]


def scored_of(est: StackedPlus, inputs, sets: dict[str, Rows], preset: str) -> Scored:
    val = est.predict_proba(inputs(sets["validation"]))
    return Scored(
        f"actmap-plus {preset}",
        val,
        calibrated_prevalence=est.calibrated_prevalence_,
        details={
            "validation_auroc": metrics.auroc(val, sets["validation"].labels),
            "selected": est.selected_,
            "blocks": {b: est.validation_.get(b) for b in est.blocks_},
            "layers": {
                b: blk.choices.get("layer") for b, blk in est.blocks_.items() if blk.choices
            },
            "train_rows": TRAIN_ROWS,
            "n_train": est.n_train_,
        },
        score_test=lambda rows: est.predict_proba(inputs(rows)),
        estimator=est,
    )


def preset_for_store(store) -> str:
    """The richest actmap-plus preset a store can train: "full" (position states and attention
    weights stored), "deployable" (position states), else "v1"."""
    if not store.has_table("positions"):
        return "v1"
    return "full" if store.has_table("attention") else "deployable"


PLUS_PRESETS = ("auto", "v1", *PRESETS)  # what `train_plus_preset` takes


def plus_preset(detector: str, preset: str | None = None) -> str:
    """The preset an actmap-plus name trains: ``actmap-plus:<preset>`` names its own; plain
    ``actmap-plus`` means ``actmap-plus:v1`` unless ``preset`` (one of `PLUS_PRESETS`, "auto"
    included) says otherwise. A named version with another ``preset`` is refused."""
    from actmap.detectors import detector_name

    named = detector_name(detector).split(":", 1)[1]  # plain actmap-plus: v1
    if ":" not in detector:
        return preset or named
    if preset is not None and preset != named:
        raise ActmapUserError(
            f"--detector {detector} trains the {named} preset; --preset {preset} says otherwise "
            "(give plain actmap-plus with --preset, or the name alone)"
        )
    return named


def train_plus_preset(
    store_path: str | Path, out: str | Path, preset: str = "auto", fallback: bool = True
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Train actmap-plus on a store into the run folder ``out`` with ``preset``: "v1", a
    stacked preset, or "auto", the richest the store can train (`preset_for_store`). Returns
    (the preset trained, the run summary, the fit's details: `train_plus_run`'s)."""
    if preset not in PLUS_PRESETS:
        raise ActmapUserError(f"--preset must be one of {', '.join(PLUS_PRESETS)}, got {preset!r}")
    if preset == "auto":
        preset = preset_for_store(MapStore.open(store_path))
    return preset, *train_plus_run(store_path, out, preset, fallback)


def train_plus_run(
    store_path: str | Path, out: str | Path, preset: str = "v1", fallback: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fit actmap-plus ``preset`` ("v1": `plus_scored`'s settings chosen on validation; a
    stacked preset: `stacked_scored`, ``fallback``: `StackConfig.fallback`) on a store, save it,
    score the balanced test rows once. Returns (the run summary, the fit's details: the
    setting or blocks ``selected``, the validation AUROC, ...).

    Writes ``<out>/seed-0/{model.safetensors, config.json, test_scores.parquet, metrics.json}``
    and ``<out>/summary.json``: the layout of an `actmap train` run folder, which `evaluate`,
    `compare`, the report and the server read."""
    if preset != "v1" and preset not in PRESETS:
        raise ValueError(f"preset must be v1 or one of {', '.join(PRESETS)}, got {preset!r}")
    store = MapStore.open(store_path)
    sets = store_rows(store)
    scored = plus_scored(sets) if preset == "v1" else stacked_scored(store, sets, preset, fallback)
    est, test, out = scored.estimator, sets["test"], Path(out)
    folder = seed_folder(out, ONE_FIT_SEED)
    inputs = {"store_config": store.manifest.get("config")}  # the map settings serving reads
    details = {**scored.details, "validation_auroc": scored.validation_auroc, "preset": preset}
    est.save(folder, metadata={"store": str(store_path), "inputs": inputs, **details})
    rows = read_inputs(store, test, est.requires)
    scores = RowScores(
        list(test.ids),
        test.labels,
        est.decision_function(rows).astype(np.float32),
        est.predict_proba(rows).astype(np.float32),
    )
    scores.write_parquet(folder / "test_scores.parquet")
    result = scoring_metrics(scores)
    write_json(folder / "metrics.json", result)
    summary = summarize_runs([SimpleNamespace(seed=ONE_FIT_SEED, test_metrics=result)])
    write_json(
        out / "summary.json",
        {
            "detector": "actmap-plus",
            **summary,
            "store": str(store_path),
            "inputs": inputs,
            **details,
        },
    )
    log.info(
        "actmap-plus %s: %s (validation AUROC %.3f)",
        preset, details["selected"], scored.validation_auroc,
    )  # fmt: skip
    return {**summary, "detector": f"actmap-plus ({preset})"}, details


# --- the comparison -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StackedRow:
    method: str
    role: str  # "preset" | "strongest baseline" | "baseline" | "actmap-plus v1"
    validation_auroc: float
    test_auroc: Interval  # balanced test rows
    vs: dict[str, Interval]  # preset name -> preset minus this method, paired, balanced test
    natural_auroc: float
    natural_ece: float | None
    natural_ece_corrected: float | None
    details: dict[str, Any]


def preset_columns(rows) -> tuple[list[str], str]:
    """The presets among a comparison's ``rows`` and their paired-difference header cells."""
    presets = [r.method for r in rows if r.role == "preset"]
    head = " | ".join(f"{p.removeprefix('actmap-plus ')} - method [95%, paired]" for p in presets)
    return presets, head


@dataclass(frozen=True)
class StackedComparison:
    store: str
    n_test: int
    n_test_all: int
    test_prevalence: float
    deployment_prevalence: float
    rows: list[StackedRow]

    def to_json(self) -> dict:
        return asdict(self)

    def to_markdown(self) -> str:
        presets, head = preset_columns(self.rows)
        lines = [
            f"store {self.store}: balanced test n={self.n_test}; all test n={self.n_test_all} "
            f"({self.test_prevalence:.1%} correct); prior correction to the training split's "
            f"{self.deployment_prevalence:.1%}",
            "",
            f"| method | role | val AUROC | test AUROC [95%] | {head} | natural AUROC "
            "| natural ECE raw | natural ECE corrected |",
            "|---|---|---|---|" + "---|" * len(presets) + "---|---|---|",
        ]
        for r in self.rows:
            diffs = " | ".join(str(r.vs[p]) if p in r.vs else "" for p in presets)
            lines.append(
                f"| {r.method} | {r.role} | {r.validation_auroc:.3f} | {r.test_auroc} | {diffs} "
                f"| {r.natural_auroc:.3f} | {_fmt(r.natural_ece)} | {_fmt(r.natural_ece_corrected)} |"
            )
        for r in self.rows:
            if r.role == "preset":
                lines.append(f"\n{r.method}: blocks {r.details['selected']}, layers "
                             f"{r.details['layers']}")  # fmt: skip
        return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def with_positions_only(store, sets: dict[str, Rows]) -> dict[str, Rows]:
    """``sets`` cut to the rows with position states (all of them when every row has them)."""
    if not store.has_table("positions"):
        return sets
    have = store.ids("positions")
    out = {}
    for name, rows in sets.items():
        keep = [i for i, k in enumerate(rows.ids) if k in have]
        if len(keep) == len(rows.ids):
            out[name] = rows
            continue
        log.warning("%s: %d of %d rows have position states", name, len(keep), len(rows.ids))
        out[name] = Rows(
            [rows.ids[i] for i in keep],
            np.asarray(rows.labels)[keep],
            np.asarray(rows.maps)[keep],
            None if rows.scalars is None else np.asarray(rows.scalars)[keep],
        )
    return out


def compare_stacked(
    store,
    presets: Sequence[str] = ("deployable", "full"),
    baselines: Sequence[str] = SINGLE_PASS_BASELINES,
    n_resamples: int = 2000,
    with_v1: bool = True,
) -> StackedComparison:
    """Both presets vs every single-pass baseline (and actmap-plus v1), choices on validation.

    Every method reads the same rows: when the store's ``positions`` table covers only part
    of them (`scripts/add_positions.py` still running), each row set keeps the rows it covers
    (logged), so no method sees a row another does not."""
    sets = with_positions_only(store, store_rows(store))
    stacked = presets_scored(store, sets, presets)
    strongest, others = single_pass_scored(store, sets, baselines)
    v1 = []
    if with_v1:
        try:
            v1 = [plus_scored(sets)]
        except ActmapUserError as err:  # too few rows for its folds: the others still compare
            log.warning("actmap-plus v1 cannot run on %s: %s", store.root, err)
    for m in v1:
        m.name = "actmap-plus v1"
    methods = stacked + [strongest] + others + v1

    def role(m: Scored) -> str:
        if any(m is s for s in stacked):
            return "preset"
        if m is strongest:
            return "strongest baseline"
        return "actmap-plus v1" if any(m is s for s in v1) else "baseline"

    rows = [
        StackedRow(
            m.scored.name,
            role(m.scored),
            m.scored.validation_auroc,
            m.test_auroc,
            m.vs,
            *m.natural,
            {k: v for k, v in m.scored.details.items() if k != "grid"},
        )
        for m in measure(methods, stacked, sets, n_resamples)
    ]
    y, y_all = sets["test"].labels, sets["test_all"].labels
    deploy = sets["train_all"].prevalence
    return StackedComparison(str(store.root), len(y), len(y_all), float(y_all.mean()), deploy, rows)
