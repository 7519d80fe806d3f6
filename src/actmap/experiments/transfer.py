"""Transfer with frozen detectors and no target labels (paper: "Transfer and Generalization").

    transfer_rows(stores, runs, ...) -> TransferResult

Four kinds of row, each a detector fit on a source and scored, frozen, on a target it
never saw (the target's labels only score it):
- cross-dataset: each short-form dataset to each other one, same generator;
- cross-task: short-form to CNN/DailyMail and back, same generator (needs a labelled
  CNN/DM store);
- leave-one-generator-out: a detector fit on the pooled balanced rows of the other
  generators of one dataset, scored on the held-out generator;
- model scale: Qwen2.5-Coder 0.5B to 1.5B and back, same dataset and dtype;
- dtype: one generator and dataset captured in two dtypes (float32 and bfloat16), each
  to the other, on the target's test rows (the stores share their questions): does a
  detector fit on one serve answers generated in the other?
Every row carries the AUROC on the target rows with its bootstrap interval and n, and
the target's in-domain AUROC (its own detector on its balanced test rows) beside it.
A row that cannot be made says why (``skipped``). Target stores are only read.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actmap.artifacts import json_safe, read_json, write_json
from actmap.experiments.seeds import frozen_scores, recipe_config, run_seeds
from actmap.scoring.intervals import N_RESAMPLES, Interval, bootstrap
from actmap.store import MapStore
from actmap.store.rows import (
    Rows,
    balanced_splits,
    read_rows,
    rows_fingerprint,
    rows_to_score,
    with_empty_answers,
)
from actmap.training.run_folder import extend_run_record, read_run, seed_finished

log = logging.getLogger(__name__)

LONG_FORM = ("cnn_dm",)
SCALE_PAIRS = (("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"),)


@dataclass(frozen=True)
class StoreInfo:
    name: str
    path: Path
    generator: str
    task: str
    dtype: str = "float32"  # the generator's, at capture


@dataclass(frozen=True)
class TransferRow:
    kind: str  # cross-dataset | cross-task | leave-one-generator-out | model scale | dtype
    source: str  # store name(s) the detector was fit on
    target: str
    detector: str
    auroc: Interval | None = None  # frozen detector on the target rows
    in_domain: Interval | None = None  # the target's own detector on its balanced test rows
    rows: str = ""  # which target rows: balanced | test | all
    n_empty: int = 0  # empty answers counted as incorrect (scored 0)
    skipped: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "source": self.source,
            "target": self.target,
            "detector": self.detector,
            "auroc": None if self.auroc is None else self.auroc.to_json(),
            "in_domain": None if self.in_domain is None else self.in_domain.to_json(),
            "rows": self.rows,
            "n_empty": self.n_empty,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class TransferResult:
    rows: list[TransferRow]
    detector: str
    target_rows: str
    notes: list[str] = field(default_factory=list)
    judge_notes: dict[str, str] = field(default_factory=dict)  # judge-labelled store -> check

    def by_kind(self, kind: str) -> list[TransferRow]:
        return [r for r in self.rows if r.kind == kind]

    def to_json(self) -> dict[str, Any]:
        return {
            "detector": self.detector,
            "target_rows": self.target_rows,
            "rows": [r.to_json() for r in self.rows],
            "notes": self.notes,
            "judge_notes": self.judge_notes,
        }


# a fitted detector for a store: run folder (seed-*/) or None when it cannot be made
DetectorFor = Callable[[Sequence[StoreInfo]], Path | None]


def score_target(run: Path, target: StoreInfo, rows: str, n_resamples: int) -> tuple[Interval, int]:
    """The frozen run's seed-mean p(correct) on the target rows: AUROC interval, empty count."""

    store = MapStore.open(target.path)
    chosen = rows_to_score(store, rows)
    per_seed = frozen_scores(run, store, chosen.ids)
    p = np.mean(list(per_seed.values()), axis=0)
    p, y = with_empty_answers(p, chosen.labels, chosen.n_empty)
    return bootstrap(p, y, None, n_resamples), chosen.n_empty


def in_domain_auroc(run: Path | None, n_resamples: int) -> Interval | None:
    """A run's own balanced-test AUROC (seed-mean p) with its interval."""
    import pandas as pd

    if run is None:
        return None
    frames = [pd.read_parquet(f / "test_scores.parquet") for f in read_run(run).seed_dirs.values()]
    ids = frames[0]["id"].astype(str).tolist()
    p = np.mean([f.set_index(f["id"].astype(str)).loc[ids, "p_correct"] for f in frames], 0)
    return bootstrap(p, frames[0]["label"].to_numpy(), None, n_resamples)


def _row(kind, sources, target, detector_for, own_run, detector, rows, n_resamples):
    source = "+".join(s.name for s in sources)
    run = detector_for(sources)
    if run is None:
        return TransferRow(kind, source, target.name, detector, skipped="no detector for source")
    try:
        auroc, n_empty = score_target(run, target, rows, n_resamples)
    except ValueError as error:  # a target with one class
        return TransferRow(kind, source, target.name, detector, skipped=str(error))
    return TransferRow(
        kind,
        source,
        target.name,
        detector,
        auroc,
        in_domain_auroc(own_run(target), n_resamples),
        rows,
        n_empty,
    )


def transfer_rows(
    stores: Sequence[StoreInfo],
    detector_for: DetectorFor,
    own_run: Callable[[StoreInfo], Path | None],
    detector: str,
    rows: str = "all",
    n_resamples: int = N_RESAMPLES,
) -> TransferResult:
    """Every transfer row the stores allow; a kind with no pair gets one skipped row saying why."""
    args = (detector_for, own_run, detector, rows, n_resamples)
    out: list[TransferRow] = []
    short = [s for s in stores if s.task not in LONG_FORM]
    long = [s for s in stores if s.task in LONG_FORM]
    # cross-dataset
    pairs = [
        (a, b)
        for a in short
        for b in short
        if a is not b and a.generator == b.generator and a.task != b.task
    ]
    out += [_row("cross-dataset", [a], b, *args) for a, b in pairs]
    if not pairs:
        out.append(_skip("cross-dataset", "no generator has two short-form stores"))
    # cross-task
    pairs = [(a, b) for a in short for b in long if a.generator == b.generator]
    pairs += [(b, a) for a, b in pairs]
    out += [_row("cross-task", [a], b, *args) for a, b in pairs]
    if not pairs:
        out.append(_skip("cross-task", "no labelled CNN/DailyMail store beside a short-form one"))
    # leave one generator out
    logo = []
    for task in sorted({s.task for s in stores}):
        same = [s for s in stores if s.task == task]
        for held in same:
            # one store per other generator, the first listed (a generator captured in two
            # dtypes counts once)
            others: list[StoreInfo] = []
            for s in same:
                if s.generator not in {held.generator, *(o.generator for o in others)}:
                    others.append(s)
            if others:
                logo.append(_row("leave-one-generator-out", others, held, *args))
    out += logo
    if not logo:
        out.append(_skip("leave-one-generator-out", "no dataset has stores of two generators"))
    # model scale
    scale = []
    for small, large in SCALE_PAIRS:
        for a in stores:
            for b in stores:
                if (
                    a.task == b.task
                    and a.dtype == b.dtype  # a scale pair differs in scale only
                    and small in a.generator.lower()
                    and large in b.generator.lower()
                ):
                    scale += [
                        _row("model scale", [a], b, *args),
                        _row("model scale", [b], a, *args),
                    ]
    out += scale
    if not scale:
        out.append(_skip("model scale", "no dataset has both Qwen2.5-Coder 0.5B and 1.5B stores"))
    # dtype: the same generator and dataset captured in two dtypes
    pairs = [
        (a, b)
        for a in stores
        for b in stores
        if a.generator == b.generator and a.task == b.task and a.dtype != b.dtype
    ]
    # the same questions in both stores: the target's test rows only, or the source's
    # training questions would be scored again (in the other dtype)
    held_out = (detector_for, own_run, detector, "test", n_resamples)
    out += [_row("dtype", [a], b, *held_out) for a, b in pairs]
    if not pairs:
        out.append(_skip("dtype", "no generator and dataset captured in two dtypes"))
    return TransferResult(out, detector, rows)


def _skip(kind: str, reason: str) -> TransferRow:
    return TransferRow(kind, "", "", "", skipped=reason)


# --- detectors for sources ------------------------------------------------------------------


def pooled_run(
    sources: Sequence[StoreInfo],
    detector: str,
    out: Path,
    seeds: Sequence[int],
    max_epochs: int | None,
    device: str | None,
) -> Path:
    """A detector fit on the pooled balanced train rows of ``sources`` (selected on their
    pooled validation rows), written to ``out``. A fit already there is reused only when it
    was made from the same rows (each source's ids and labels), seeds and epoch cap: a source
    that grew or was relabelled since gets a new fit, never a stale one. A killed fit of the
    same inputs keeps its finished seeds and the epoch checkpoint of the seed it was training."""

    stores = [MapStore.open(source.path) for source in sources]
    metas = [store.metadata() for store in stores]
    inputs = {
        "pooled_stores": [str(s.path) for s in sources],
        "pooled_rows": [rows_fingerprint(m["id"], m["label"]) for m in metas],
        "seeds": [int(s) for s in seeds],
        "max_epochs": max_epochs,
    }
    if fit_is_current(out, seeds, inputs):
        return out
    if read_json(out / FIT_INPUTS) != json_safe(inputs) and out.exists():
        shutil.rmtree(out)  # another fit's seeds must not be read beside the new ones
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / FIT_INPUTS, inputs)
    todo = [int(s) for s in seeds if not seed_finished(out, s)]
    if todo:
        train, validation = _pooled_balanced(sources, stores)
        run_seeds(
            train,
            validation,
            validation,  # no test rows of the sources are needed: the target is the test
            out,
            detector=detector,
            config=recipe_config(max_epochs),
            seeds=tuple(todo),
            device=device,
            inputs=inputs,
        )
    extend_run_record(out)  # summary and manifest cover the kept seeds too
    return out


def _pooled_balanced(sources: Sequence[StoreInfo], stores: Sequence[Any]):
    """(train, validation) `Rows`: each source's balanced rows of the split, pooled."""

    parts: dict[str, list[Rows]] = {"train": [], "validation": []}
    for store in stores:
        splits = balanced_splits(store, persist=False)
        for split in parts:
            parts[split].append(read_rows(store, splits[split], f"balanced '{split}' split"))

    def pooled(split: str) -> Rows:
        chunks = parts[split]
        return Rows(
            [f"{s.name}/{k}" for s, c in zip(sources, chunks, strict=True) for k in c.ids],
            np.concatenate([c.labels for c in chunks]),
            np.concatenate([c.maps for c in chunks]),
        )

    return pooled("train"), pooled("validation")


FIT_INPUTS = "fit-inputs.json"  # written before a pooled fit's first seed: what it is fit on


def fit_is_current(out: Path, seeds: Sequence[int], inputs: dict[str, Any]) -> bool:
    """``out`` holds a finished fit (every seed's metrics) made from ``inputs``."""
    made_from = read_json(out / FIT_INPUTS)
    if made_from is None:  # a fit older than the inputs file: its manifest's inputs
        made_from = (read_json(out / "manifest.json") or {}).get("inputs")
    done = all(seed_finished(out, s) for s in seeds)
    return done and made_from is not None and made_from == json_safe(inputs)


def detectors_from_runs(
    runs: Mapping[str, Mapping[str, Path]],
    detector: str,
    scratch: Path,
    seeds: Sequence[int],
    max_epochs: int | None,
    device: str | None,
) -> DetectorFor:
    """A single source uses its `actmap train` run when there is one; pooled sources (and
    sources without a run) get a detector fit into ``scratch``."""

    def detector_for(sources: Sequence[StoreInfo]) -> Path | None:
        if len(sources) == 1 and detector in runs.get(sources[0].name, {}):
            return Path(runs[sources[0].name][detector])
        name = "+".join(s.name for s in sources)
        return pooled_run(sources, detector, scratch / name / detector, seeds, max_epochs, device)

    return detector_for
