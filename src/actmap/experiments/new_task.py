"""A new task's small store and a generalist run -> the generalist adapted to it, saved as a run.

    adapt_run(generalist_run, store, out, step="auto") -> summary (what ``actmap train
                                                          --store SMALL --generalist RUN`` writes)

The learning curves of docs/out_of_domain.md (SmolLM2-135M, Gemma-3-270M and
Qwen2.5-Coder-0.5B; every task held out in turn, 10 draws per k) say what the first labels of
a new task buy: recalibrating the generalist's logit (prior and temperature,
`adapt_generalist`'s "recalibrate") fixes its calibration from 25 labels on most tasks and
cannot hurt its ranking; refitting the stack's head on the generalist's block logits ("head
refit") pays or ties once the labels hold about ten answers of each class, and is a gamble
below that. Head refit minus recalibrate AUROC at the 40 points of those curves (the report's
out_of_domain section tabulates it), by the labelled answers of the rarer class per draw: from
10 on, 8 points, better on 6 and tied on 2 (mean +.074); from 3 to 10, 11 points, worse on 2
(down to -.055 at 6.7) and better on 6 (+.129 at 9.5); under 3, 21 points, worse on 15. The
two- and three-task runs beside them (24 points more) agree: never worse from 9.5 on. The
switch lies between 7 and 10; 10 keeps to the side where no point lost. (Before, at 25, `auto`
recalibrated Qwen-0.5B's built-in task at 50 labels, 19 incorrect answers per draw, where the
head refit was already .14 AUROC better.) The points are few and the intervals wide (10 draws,
32-124 balanced test rows): the threshold is what the measured curves support, not a fitted
optimum. A refit of every block cost AUROC on the open-domain tasks up to 15 correct answers
and is never the default. So ``step="auto"`` (`choose_step`) is the cheapest step that works:
"recalibrate", and "head refit" once both classes hold at least ``HEAD_REFIT_MIN`` (10)
labelled rows. A store with enough of both for a detector of its own (``OWN_RUN_MIN`` a class)
is told so: its own run (`actmap train --store`) is then the line the measured generalist never
reached.

The labelled rows are every labelled row of the store's train and validation splits at their
natural prevalence (the learning curve drew its labels at random, so at the task's prevalence);
its balanced test rows, when it has both labels there, are scored once into the run folder
(``test_scores.parquet``, ``metrics.json``), never used to adapt. The store is only read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from actmap.artifacts import write_json
from actmap.detectors import load_detector
from actmap.detectors.stacked import StackedPlus
from actmap.errors import ActmapUserError
from actmap.experiments.generalist import (
    TaskRows,
    concat_stack_rows,
    setup_difference,
    task_name,
    task_sets,
)
from actmap.experiments.out_of_domain import adapt_generalist
from actmap.store import MapStore

log = logging.getLogger(__name__)

ADAPT_STEPS = ("auto", "recalibrate", "head refit")
HEAD_REFIT_MIN = 10  # labelled rows of each class before the head is refit (learning curves)
OWN_RUN_MIN = 100  # labelled rows of each class from which the task's own run is suggested
ADAPT_SPLITS = ("train_all", "validation_all")  # every labelled row of these, natural prevalence


def choose_step(labels) -> str:
    """The cheapest adaptation that worked in the learning curve for these labels: "head
    refit" once each class holds ``HEAD_REFIT_MIN`` rows, else "recalibrate"."""
    y = np.asarray(labels).astype(np.int64)
    fewest = int(np.bincount(y, minlength=2).min()) if len(y) else 0
    return "head refit" if fewest >= HEAD_REFIT_MIN else "recalibrate"


def load_generalist(run: str | Path) -> tuple[StackedPlus, Path]:
    """The stacked actmap-plus of ``run`` (a run folder or one seed folder) and its folder;
    anything else is refused naming it."""
    from actmap.training.run_folder import seed_folders

    run = Path(run)
    folder = run if (run / "config.json").is_file() else None
    if folder is None:
        seeds = seed_folders(run) if run.is_dir() else {}
        if not seeds:
            raise ActmapUserError(
                f"--generalist {run} is not a run folder written by `actmap train` (no "
                "seed-*/ folder, no config.json)"
            )
        folder = seeds[min(seeds)]
    est = load_detector(folder)
    if not all(hasattr(est, a) for a in ("selected_", "blocks_", "meta_")):  # what adapting reads
        raise ActmapUserError(
            f"--generalist {run} holds a {type(est).__name__}, not a stacked actmap-plus: train "
            "the generalist with `actmap train --detector actmap-plus --store A --store B ...`"
        )
    return est, folder


def check_same_setup(est: StackedPlus, run: Path, store) -> None:
    """Refuse a store of another generator or map configuration than the generalist's."""
    config = (est.metadata_.get("inputs") or {}).get("store_config")
    if not config:
        raise ActmapUserError(
            f"--generalist {run} does not record the stores it was trained on (no "
            "inputs.store_config in its config.json): retrain it with this version"
        )
    trained = SimpleNamespace(manifest={"config": config}, map_shape=store.map_shape)
    problem = setup_difference(trained, store)
    if problem is not None:
        what, differs = problem
        raise ActmapUserError(
            f"{store.root} holds answers of another {what} than --generalist {run} "
            f"({differs}): adapt a generalist of the same generator and map configuration"
        )


def adapt_run(
    generalist: str | Path, store_path: str | Path, out: str | Path, step: str = "auto"
) -> dict[str, Any]:
    """Adapt the generalist of run ``generalist`` to the labelled rows of ``store_path`` (a
    new task's small store) with ``step`` ("auto": `choose_step`) and write the adapted run
    to ``out`` in `actmap train`'s layout; `actmap serve --detector out` loads it. Returns a
    summary (step, labelled rows, the balanced-test metrics when the store has them)."""
    from actmap.experiments.seeds import RowScores, scoring_metrics, summarize_runs

    if step not in ADAPT_STEPS:
        raise ActmapUserError(f"--adapt must be one of {', '.join(ADAPT_STEPS)}, got {step!r}")
    est, folder = load_generalist(generalist)
    store = MapStore.open(store_path)
    check_same_setup(est, Path(generalist), store)
    task = TaskRows(task_name(store), store, task_sets(store))
    have = [s for s in ADAPT_SPLITS if s in task.sets]
    if not have:
        raise ActmapUserError(
            f"{store_path} has no labelled train or validation rows: the generalist adapts to "
            "a new task's labelled answers (label them first: `actmap labels`, or the review "
            "queue of an audit store)"
        )
    rows = concat_stack_rows([task.inputs(task.sets[s], est.requires) for s in have])
    y = np.concatenate([np.asarray(task.sets[s].labels) for s in have]).astype(np.int64)
    chosen = choose_step(y) if step == "auto" else step
    adapted = adapt_generalist(est, rows, y, chosen)
    n_pos = int(y.sum())
    details = {
        "adapted_from": str(folder),
        "store": str(store_path),
        "task": task.name,
        "labelled_rows": len(y),
        "labelled_correct": n_pos,
        "step_asked": step,
        "step": adapted.metadata_["adapted"]["step"],  # one class: recalibration of the prior
        "own_run_suggested": min(n_pos, len(y) - n_pos) >= OWN_RUN_MIN,
    }
    out = Path(out)
    seed = out / "seed-0"
    adapted.save(seed, metadata={"adapted_run": details})
    summary: dict[str, Any] = {"detector": "actmap-plus", **details}
    if "test" in task.sets:
        test = task.sets["test"]
        x = task.inputs(test, est.requires)
        z = adapted.decision_function(x)
        scores = RowScores(list(test.ids), test.labels, z.astype(np.float32),
                           adapted.predict_proba(x).astype(np.float32))  # fmt: skip
        scores.write_parquet(seed / "test_scores.parquet")
        result = scoring_metrics(scores)
        write_json(seed / "metrics.json", result)
        summary.update(summarize_runs([SimpleNamespace(seed=0, test_metrics=result)]))
    else:
        log.warning("%s has no balanced test rows: the adapted run is not scored", store_path)
    write_json(out / "summary.json", summary)
    return summary
