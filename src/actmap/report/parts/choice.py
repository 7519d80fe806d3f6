"""Which store and which detectors the analysis sections (ablations, learning curve,
localization, calibration) read.

Each runs on the store with the most balanced rows (the learning curve on the two largest),
unless ``[report.<section>] store = "<name>"`` names one; ActMap detectors come from the
context's runs of that store, else they are trained here, once: `fitted` keeps them in the
context's cache, so the sections that read the same detector on the same store share one
fit (and the balanced maps are read once). Nothing is written into a store: splits are read
with ``persist=False``; fits stay in memory or in the scratch folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actmap.detectors import load_detector
from actmap.experiments.common import scores_from_run, scores_of_runs, select_seeds
from actmap.experiments.seeds import recipe_config, run_seeds
from actmap.report.sections import ReportContext, StoreRef
from actmap.store import MapStore
from actmap.store.rows import balanced_splits, read_rows
from actmap.training.run_folder import method_name, read_run, recipe_of


def read_only_splits(store) -> dict[str, list[str]]:
    """The store's balanced {split: ids}, computed without writing into it."""

    return balanced_splits(store, persist=False)


def balanced_rows(ref: StoreRef) -> int:
    """Balanced rows of a store (all splits), computed without writing into it."""
    return sum(len(v) for v in read_only_splits(open_store(ref)).values())


def largest_stores(
    context: ReportContext, section: str, count: int = 1, table: str | None = None
) -> list[StoreRef]:
    """The ``count`` stores with the most balanced rows (holding ``table`` when given), or
    the one ``[report.<section>] store`` names."""

    named = context.option(section, "store")
    if named is not None:
        return [context.stores[named]] if named in context.stores else []
    refs = [
        ref
        for ref in context.stores.values()
        if table is None or MapStore.open(ref.path).has_table(table)
    ]
    return sorted(refs, key=lambda r: (-balanced_rows(r), r.name))[:count]


def open_store(ref: StoreRef):

    return MapStore.open(ref.path)


@dataclass(frozen=True)
class Fitted:
    """One ActMap detector on a store's balanced rows: its test scores and a fitted model per
    seed, from the context's `actmap train` run of it or trained here with the context's
    recipe (``source`` says which)."""

    scores: Any  # SeedScores on the balanced test rows, method "actmap-<detector>"
    models: dict[int, Any]  # seed -> fitted CorrectnessDetector
    recipe: dict[str, Any]  # `run_folder.recipe_of` the TrainConfig it was trained with
    source: str

    def same_fit(self, recipe: dict[str, Any], seeds) -> Any:
        """Its test scores when trained with ``recipe`` and every seed of ``seeds`` (then a
        training with them would give the same scores again), else None."""

        return select_seeds(self.scores, tuple(seeds)) if recipe == self.recipe else None


def fitted(context: ReportContext, ref: StoreRef, detector: str) -> Fitted:
    """``detector`` on ``ref``'s balanced rows, computed once per report (the context cache)."""
    key = ("fitted", ref.name, detector)
    if key not in context.cache:
        context.cache[key] = _fit(context, ref, detector)
    return context.cache[key]


def _fit(context: ReportContext, ref: StoreRef, detector: str) -> Fitted:

    splits = balanced_maps(open_store(ref), context)
    test = splits["test"]
    run = context.runs.get(ref.name, {}).get(detector)
    if run is not None:
        checked = read_run(Path(run))
        scores = scores_from_run(run, list(test.ids), test.labels)
        models = {seed: load_detector(folder) for seed, folder in checked.seed_dirs.items()}
        return Fitted(scores, models, checked.recipe, f"the run {run}")
    config = recipe_config(context.max_epochs)
    runs = run_seeds(
        splits["train"],
        splits["validation"],
        test,
        None,
        detector=detector,
        config=config,
        seeds=context.seeds,
        device=context.device,
    )
    models = {r.seed: r.detector for r in runs.runs}
    scores = scores_of_runs(runs, method_name(detector))
    return Fitted(scores, models, recipe_of(config.to_dict()), "trained for this report")


def same_fit(context: ReportContext, ref: StoreRef, detector: str, config, seeds):
    """The test scores that training ``detector`` on ``ref``'s balanced rows with the
    TrainConfig ``config`` and ``seeds`` gives, from `fitted` (a run, or a fit made for this
    report) when it was made that way; None when it was not (the caller trains)."""

    recipe = recipe_of(config.to_dict())
    has_run = detector in context.runs.get(ref.name, {})
    if not has_run and recipe != recipe_of(recipe_config(context.max_epochs).to_dict()):
        return None  # `fitted` would train another recipe
    return fitted(context, ref, detector).same_fit(recipe, seeds)


def frozen_detector(context: ReportContext, ref: StoreRef, detector: str):
    """Seed ``context.seeds[0]`` of ``detector`` on ``ref`` (`fitted`)."""
    models = fitted(context, ref, detector).models
    return models.get(context.seeds[0], next(iter(models.values())))


def balanced_maps(store, context: ReportContext | None = None):
    """{split: Rows} of the store's balanced rows (read once per report when the context is
    given; the store is only read)."""

    key = ("balanced_maps", str(store.root))
    if context is not None and key in context.cache:
        return context.cache[key]
    out = {}
    for split, ids in read_only_splits(store).items():
        out[split] = read_rows(store, ids, f"balanced '{split}' split")
    if context is not None:
        context.cache[key] = out
    return out
