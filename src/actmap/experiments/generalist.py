"""A generalist detector per generator: one stacked actmap-plus fit on several tasks' stores.

    open_tasks(paths)                          ->  [TaskRows], one per store (same generator)
    fit_generalist(tasks, preset)              ->  StackedPlus fit on every task at once
    train_generalist_run(paths, out, preset)   ->  the run folder `actmap train --store A
                                                   --store B ...` writes (`serve` loads it)

Every store must hold answers of one generator (model name, revision, dtype) read through one
map configuration (map settings and map shape); any other is refused, naming both stores and
what differs. One store per task.

Training knows the tasks apart without needing a task label when it scores: each task gives
its *balanced* training rows (as many correct as incorrect answers, so no task's accuracy can
be learnt as a shortcut: "GSM8K-like answers are wrong" is not correctness), and every task
carries the same total weight (a task with 60 balanced rows counts as much as one with 600;
`StackedPlus.fit`'s ``sample_weight``). Every choice (layers, L2 strengths, the fallback) is
made on the tasks' balanced validation rows pooled. The fitted detector reads one answer as
any other run does; its p(correct) holds at a prevalence of 0.5 and is prior-corrected where
it serves (`actmap.scoring.prior`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from actmap.artifacts import write_json
from actmap.detectors import DetectorInputs, read_inputs
from actmap.detectors.stacked import PRESETS, StackConfig, StackedPlus
from actmap.errors import ActmapUserError
from actmap.experiments.stacked import preset_for_store, with_positions_only
from actmap.scoring import metrics
from actmap.scoring.prior import sigmoid
from actmap.store import MapStore
from actmap.store.rows import Rows

log = logging.getLogger(__name__)

PRESET_ORDER = ("v1", "deployable", "full")  # richer to the right


@dataclass
class TaskRows:
    """One task's store and its row sets (`store_rows`, read without writing into the store)."""

    name: str
    store: Any  # MapStore
    sets: dict[str, Rows]
    _cache: dict[tuple, DetectorInputs] = field(default_factory=dict, repr=False)

    def inputs(self, rows: Rows, requires: Sequence[str]) -> DetectorInputs:
        """What ``requires`` names of ``rows`` of this store (read once per row set)."""
        key = (tuple(rows.row_ids()), tuple(requires))
        if key not in self._cache:
            self._cache[key] = read_inputs(self.store, rows, requires)
        return self._cache[key]


def generator_of(store) -> dict[str, Any]:
    """What makes two stores' answers one generator's: model name, revision, GGUF file, dtype."""
    model = (store.manifest.get("config") or {}).get("model") or {}
    return {
        "name": model.get("name"),
        "revision": model.get("revision"),
        "gguf_file": model.get("gguf_file"),
        "dtype": model.get("dtype", "float32"),
    }


def map_setup_of(store) -> dict[str, Any]:
    """The map configuration a store's maps were built with, and their shape."""
    config = (store.manifest.get("config") or {}).get("map") or {}
    return {"map": config, "map_shape": list(store.map_shape or ())}


def task_name(store) -> str:
    task = (store.manifest.get("config") or {}).get("task") or {}
    return str(task.get("task") or Path(store.root).name)


def setup_difference(a_store, b_store) -> tuple[str, str] | None:
    """None when two stores hold one generator's answers through one map configuration,
    else (what differs: "generator" or "map configuration", the fields that differ)."""
    for what, read in (("generator", generator_of), ("map configuration", map_setup_of)):
        a, b = read(a_store), read(b_store)
        if a != b:
            return what, ", ".join(
                f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in a if a[k] != b.get(k)
            )
    return None


def check_one_generator(stores: Sequence[Any]) -> None:
    """Refuse stores of different generators or map configurations, or two of one task."""
    if len(stores) < 2:
        raise ActmapUserError("a generalist is fit on two or more stores (one per task)")
    first = stores[0]
    for store in stores[1:]:
        problem = setup_difference(first, store)
        if problem is not None:
            what, differs = problem
            raise ActmapUserError(
                f"{store.root} and {first.root} are stores of different {what}s ({differs}); "
                "a generalist reads one generator's answers through one map configuration"
            )
    names = [task_name(s) for s in stores]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ActmapUserError(
            f"two stores of task {', '.join(twice)}: a generalist takes one store per task"
        )


def open_tasks(paths: Sequence[str | Path]) -> list[TaskRows]:
    """Each store's row sets, after `check_one_generator`; nothing is written into a store."""
    resolved = [Path(p).resolve() for p in paths]
    if len(set(resolved)) < len(resolved):
        raise ActmapUserError("a store is given twice; give each task's store once")
    stores = [MapStore.open(p) for p in paths]
    check_one_generator(stores)
    return [TaskRows(task_name(s), s, task_sets(s)) for s in stores]


def task_sets(store) -> dict[str, Rows]:
    """`store_rows` of one store, read without writing into it; a split without both labels
    (no balanced rows) or without labelled rows is left out, not refused: a task may still
    train a generalist, or be held out, with the splits it has."""
    from actmap.capture.answer_scalars import with_scalars
    from actmap.data.splits import SPLITS
    from actmap.store.rows import balanced_rows, natural_rows

    sets = {}
    for split in SPLITS:
        balanced = partial(balanced_rows, persist=False)
        for name, read in ((split, balanced), (f"{split}_all", natural_rows)):
            try:
                rows = read(store, splits=(split,))[split]
            except ActmapUserError:
                continue
            sets[name] = with_scalars(store, rows)
    return with_positions_only(store, sets)


def require_sets(task: TaskRows, names: Sequence[str], why: str) -> None:
    missing = [n for n in names if n not in task.sets]
    if missing:
        raise ActmapUserError(
            f"{task.name} ({task.store.root}) has no {', '.join(missing)} rows holding both a "
            f"correct and an incorrect answer; {why}"
        )


def common_preset(tasks: Sequence[TaskRows], preset: str = "auto") -> str:
    """``preset``, or with "auto" the richest preset every store can train; a stacked preset
    a store cannot train is refused naming the store."""
    can = {t.name: preset_for_store(t.store) for t in tasks}
    if preset == "auto":
        preset = min(can.values(), key=PRESET_ORDER.index)
    if preset not in PRESETS:
        raise ActmapUserError(
            f"a generalist is a stacked actmap-plus: preset {preset!r} is not one of "
            f"{', '.join(PRESETS)} (every store needs position states: capture --keep-positions)"
        )
    short = [n for n, p in can.items() if PRESET_ORDER.index(p) < PRESET_ORDER.index(preset)]
    if short:
        raise ActmapUserError(
            f"the {preset} preset needs what the store(s) of {', '.join(short)} lack "
            f"({', '.join(f'{n}: {can[n]} at most' for n in short)})"
        )
    return preset


def preset_requires(preset: str) -> tuple[str, ...]:
    """What a stacked fit of ``preset`` reads (every block of the preset)."""
    return StackedPlus(StackConfig(preset=preset)).requires


def concat_stack_rows(parts: Sequence[DetectorInputs]) -> DetectorInputs:
    """Row sets of several stores as one (a side input any part lacks is left out)."""

    def joined(name: str):
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else np.concatenate(values)

    gens = [p.generations for p in parts]
    return DetectorInputs(
        np.concatenate([p.maps for p in parts]),
        joined("scalars"),
        joined("positions"),
        None if any(g is None for g in gens) else [g for part in gens for g in part],
    )


def task_weights(sizes: Sequence[int]) -> np.ndarray:
    """Per-row weights giving every task the same total weight, averaging 1 over the rows."""
    total = sum(sizes)
    return np.concatenate([np.full(n, total / (len(sizes) * n)) for n in sizes])


def pooled(
    tasks: Sequence[TaskRows], split: str, requires: Sequence[str]
) -> tuple[DetectorInputs, np.ndarray]:
    """The tasks' ``split`` rows (e.g. "train": balanced) as one input set, and their labels."""
    rows = [t.sets[split] for t in tasks]
    x = concat_stack_rows([t.inputs(r, requires) for t, r in zip(tasks, rows, strict=True)])
    return x, np.concatenate([np.asarray(r.labels) for r in rows])


def fit_generalist(
    tasks: Sequence[TaskRows], preset: str, fallback: bool = True, seed: int = 0
) -> StackedPlus:
    """The stacked detector on every task's balanced training rows, each task weighing the
    same; every choice on the tasks' balanced validation rows pooled (module doc)."""
    for t in tasks:
        require_sets(t, ("train", "validation"), "a generalist trains on its balanced rows")
    est = StackedPlus(StackConfig(preset=preset, fallback=fallback, seed=seed))
    train, y = pooled(tasks, "train", preset_requires(preset))
    val, y_val = pooled(tasks, "validation", preset_requires(preset))
    weights = task_weights([len(t.sets["train"]) for t in tasks])
    est.fit(train, y, val, y_val, sample_weight=weights)
    log.info(
        "generalist %s over %s: %s (validation AUROC %.4f)",
        preset, ", ".join(t.name for t in tasks), est.selected_, est.validation_["stack"],
    )  # fmt: skip
    return est


def train_generalist_run(
    paths: Sequence[str | Path], out: str | Path, preset: str = "auto", fallback: bool = True
) -> dict[str, Any]:
    """Fit the generalist on ``paths`` (one store per task), save it, score every task's
    balanced test rows once.

    Writes the layout `actmap train` writes: ``<out>/seed-0/{model.safetensors, config.json,
    test_scores.parquet (with a ``task`` column), metrics.json}`` and ``<out>/summary.json``
    (the pooled test metrics and each task's AUROC). `actmap serve --detector <out>` loads it
    like any run: the map settings it reads are the stores' (one configuration)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from actmap.experiments.seeds import RowScores, scoring_metrics, summarize_runs

    tasks = open_tasks(paths)
    preset = common_preset(tasks, preset)
    est = fit_generalist(tasks, preset, fallback)
    out = Path(out)
    folder = out / "seed-0"
    requires = preset_requires(preset)  # the inputs the fit read (cached per row set)
    val, y_val = pooled(tasks, "validation", requires)
    details = {
        "generalist": True,
        "stores": [str(p) for p in paths],
        "tasks": [t.name for t in tasks],
        "n_train_per_task": {t.name: len(t.sets["train"]) for t in tasks},
        "inputs": {"store_config": tasks[0].store.manifest.get("config")},
        "preset": preset,
        "selected": est.selected_,
        "validation_auroc": metrics.auroc(est.decision_function(val), y_val),
        "n_train": est.n_train_,
    }
    est.save(folder, metadata=details)
    ids, labels, logits, names, per_task = [], [], [], [], {}
    for t in tasks:
        if "test" not in t.sets:
            log.warning("%s has no balanced test rows: not scored", t.name)
            continue
        test = t.sets["test"]
        z = est.decision_function(t.inputs(test, requires))
        y = np.asarray(test.labels)
        ids += test.row_ids()
        labels.append(y)
        logits.append(z)
        names += [t.name] * len(y)
        per_task[t.name] = {"n_test": len(y), "auroc": metrics.auroc(z, y)}
    z, y = np.concatenate(logits), np.concatenate(labels)
    p = sigmoid(z)  # `StackedPlus.predict_proba` of the same rows
    scores = RowScores(ids, y, z.astype(np.float32), p.astype(np.float32))
    table = pa.table(
        {
            "id": ids,
            "label": y,
            "logit": scores.logits,
            "p_correct": scores.p_correct,
            "task": names,
        }
    )
    pq.write_table(table, folder / "test_scores.parquet")
    result = scoring_metrics(scores)
    write_json(folder / "metrics.json", result)
    summary = summarize_runs([SimpleNamespace(seed=0, test_metrics=result)])
    write_json(out / "summary.json", {"detector": "actmap-plus", **summary, **details,
                                      "per_task": per_task})  # fmt: skip
    return {**summary, "detector": f"actmap-plus generalist ({preset})", "selected": est.selected_,
            "per_task": per_task, "tasks": details["tasks"]}  # fmt: skip
