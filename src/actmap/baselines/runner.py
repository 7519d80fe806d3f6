"""Run baselines on a map store's balanced rows: resolve -> provide -> fit/score -> write.

    run_baselines(store, methods) -> results/<method> tables + manifest["results"][method]

Rows: every method reads the identical balanced rows (`actmap.store.rows.balanced_splits`).
Unsupervised methods score the balanced test rows (``rows="all-balanced"``: every
balanced row); supervised ones fit on the balanced train rows, select on the
balanced validation rows and score the balanced test rows.

Each scorer declares what it reads (``requires``, `actmap.scoring.contract.INPUTS`);
`actmap.baselines.inputs.StoreInputs` provides those, each read once per run.
A result table holds ``id, split, confidence, raw`` (float64) plus any per-row
details of the method (e.g. ACT-ViT's confidence per seed). A method whose
results already cover the requested rows is skipped unless ``force``; a method
that cannot run is reported with its reason and the others still run. Comparing
methods is the report's job (`actmap.report.side_by_side`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa

from actmap.artifacts import json_safe, package_version
from actmap.baselines.base import BaselineUnavailable
from actmap.baselines.inputs import Progress, StoreInputs
from actmap.baselines.options import BaselineOptions
from actmap.baselines.registry import baseline_class, list_baselines
from actmap.data.splits import SPLITS
from actmap.detectors.inputs import DetectorInputs
from actmap.errors import ActmapUserError
from actmap.scoring.contract import ScoreResult
from actmap.store import MapStore
from actmap.store.rows import balanced_splits

log = logging.getLogger(__name__)

ALIASES = {
    "ppl": "perplexity",
    "mte": "mean_token_entropy",
    "ptrue": "p_true",
    "se": "semantic_entropy",
    "es": "eigenscore",
    "length": "answer_length",
}
# "all", cheapest first; permuted_label wraps another scorer and runs only when named
DEFAULT_METHODS = (
    "perplexity",
    "mean_token_entropy",
    "answer_length",
    "rauq",
    "tad",
    "p_true",
    "eigenscore",
    "semantic_entropy",
    "actvit",
)
ROW_SETS = {"balanced": ("test",), "all-balanced": SPLITS}  # splits unsupervised methods score


@dataclass(frozen=True)
class MethodResult:
    """What happened to one method in a `run_baselines` call."""

    method: str
    status: str  # "done" | "skipped" (results already stored) | "unavailable" | "failed"
    reason: str = ""  # why it was skipped, unavailable or failed
    rows: int = 0  # rows scored now, or already stored when skipped
    record: dict = field(default_factory=dict)  # the manifest entry of the stored results


def resolve_methods(spec: str | Sequence[str]) -> list[str]:
    """Registry names, in order and unique, from "all" or comma-separated names and aliases."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        return list(DEFAULT_METHODS)
    known = list_baselines()
    out = []
    for name in names:
        method = ALIASES.get(name, name)
        if method not in known:
            raise ActmapUserError(
                f"unknown method {name!r}; known: all, {', '.join(known)} "
                f"(aliases: {', '.join(f'{a}={m}' for a, m in ALIASES.items())})"
            )
        if method not in out:
            out.append(method)
    if not out:
        raise ActmapUserError("no method given; use 'all' or a comma-separated list")
    return out


def make_scorer(inputs: StoreInputs, method: str):
    """The registered scorer, built from the run's inputs (its ``from_inputs``, else no args)."""
    return inputs.make_scorer(method)


# -- scoring and storing ------------------------------------------------------------------------
def split_details(details: dict, n: int) -> tuple[dict, dict[str, Any]]:
    """(settings, per-row columns): 1-D arrays of length n and lists of n lists are per row."""

    def per_row(value: Any) -> bool:
        if isinstance(value, np.ndarray):
            return value.ndim == 1 and len(value) == n
        return (
            isinstance(value, list)
            and len(value) == n
            and all(isinstance(v, list | tuple | np.ndarray) for v in value)
        )

    settings, columns = {}, {}
    for key, value in details.items():
        if isinstance(value, dict) and value and all(per_row(v) for v in value.values()):
            columns.update({f"{key}_{sub}": v for sub, v in value.items()})
        elif per_row(value):
            columns[key] = value
        else:
            settings[key] = value
    return settings, columns


def chunk_of(rows, index: slice):
    """``rows[index]``; of an input bundle (`DetectorInputs`), its ``take``."""
    return rows.take(index) if isinstance(rows, DetectorInputs) else rows[index]


def score_in_chunks(inputs: StoreInputs, method: str, scorer, rows):
    """Score ``rows`` a chunk at a time -> (merged result, per-row columns, scoring seconds).

    A scorer with a persisted judge (Semantic Entropy: up to a minute of judge calls a row on a
    CPU) scores one row at a time, so progress and the ETA move with every row."""
    chunk, n = inputs.options.score_chunk, len(rows)
    confidence, raw, columns, seconds = [], [], {}, 0.0
    settings, raw_name = {}, ""
    judge = getattr(scorer, "judge", None)
    persist = getattr(judge, "path", None) is not None
    if persist:
        chunk = 1
    try:
        for start in range(0, n, chunk):
            part = chunk_of(rows, slice(start, start + chunk))
            tick = time.perf_counter()
            result = scorer.score(part)
            seconds += time.perf_counter() - tick
            settings, cols = split_details(result.details, len(part))
            raw_name = result.raw_name
            confidence.append(np.asarray(result.confidence, dtype=np.float64))
            raw.append(np.asarray(result.raw, dtype=np.float64))
            for name, values in cols.items():
                columns.setdefault(name, []).extend(list(values))
            if persist:
                judge.save()  # a killed run keeps every judged pair
            inputs.report(method, min(start + chunk, n), n, "scoring")
    finally:
        if persist:
            judge.save()
    if judge is not None and hasattr(judge, "hits"):
        settings["judge_cache"] = {"hits": judge.hits, "misses": judge.misses}
    merged = ScoreResult(np.concatenate(confidence), np.concatenate(raw), raw_name, settings)
    return merged, columns, seconds


def results_table(ids: Sequence[str], split_of: dict, result: ScoreResult, columns: dict):
    table = {
        "id": list(ids),
        "split": [split_of[k] for k in ids],
        "confidence": pa.array(result.confidence, pa.float64()),
        "raw": pa.array(result.raw, pa.float64()),
    }
    for name, values in columns.items():
        table[name] = pa.array([np.asarray(v).tolist() for v in values])
    return pa.table(table)


def timing_record(inputs: StoreInputs, scorer, ids, scoring_s: float, fit_s: float | None):
    """Latency per answer in ms; sampling methods add their sampling time per answer."""
    record = {"scoring_time_s": scoring_s, "scoring_ms_per_answer": 1000 * scoring_s / len(ids)}
    if fit_s is not None:
        record["fit_time_s"] = fit_s
    total = record["scoring_ms_per_answer"]
    if "samples" in scorer.requires:
        record["sampling_ms_per_answer"] = inputs.sampling_ms(ids)
        if "judge" in scorer.requires:
            record["judging_ms_per_answer"] = record["scoring_ms_per_answer"]
        record["samples"] = dict(inputs.sample_counts)
        total += record["sampling_ms_per_answer"]
    if hasattr(scorer, "models_per_answer"):  # e.g. ACT-ViT runs the checkpoint of every seed
        record["models_per_answer"] = scorer.models_per_answer
    record["latency_ms_per_answer"] = total
    return record


def run_method(inputs: StoreInputs, method: str, rows: str) -> MethodResult:
    started, store, splits = time.perf_counter(), inputs.store, inputs.splits
    supervised = baseline_class(method).supervised
    fit_ids, val_ids = (splits["train"], splits["validation"]) if supervised else ([], [])
    ids = splits["test"] if supervised else [k for s in ROW_SETS[rows] for k in splits[s]]
    if not ids:
        raise BaselineUnavailable(
            "no balanced rows to score (a split needs both correct and incorrect answers)"
        )
    if not inputs.options.force and set(ids) <= store.ids(f"results/{method}"):
        record = store.manifest.get("results", {}).get(method, {})
        reason = f"results already cover the {len(ids)} rows (--force recomputes)"
        return MethodResult(method, "skipped", reason, len(ids), record)
    inputs.report(method, 0, len(ids), "preparing")
    scorer = make_scorer(inputs, method)  # resolve
    fit_s = None
    if supervised:  # provide, fit
        train = inputs.scorer_inputs(scorer, fit_ids, method)
        val = inputs.scorer_inputs(scorer, val_ids, method)
        inputs.report(method, 0, len(ids), f"fitting on {len(fit_ids)} rows")
        tick = time.perf_counter()
        scorer.fit(train, inputs.labels(fit_ids), val, inputs.labels(val_ids))
        fit_s = time.perf_counter() - tick
    scored = inputs.scorer_inputs(scorer, ids, method)  # provide, score
    result, columns, scoring_s = score_in_chunks(inputs, method, scorer, scored)
    if not np.isfinite(result.confidence).all():
        bad = int((~np.isfinite(result.confidence)).sum())
        log.warning("%s: %d non-finite confidences", method, bad)
    table = results_table(ids, inputs.split_of, result, columns)  # write
    store.replace_table(f"results/{method}", table)
    record = {
        "raw_name": result.raw_name,
        "details": json_safe(result.details),
        "supervised": supervised,
        "requires": list(scorer.requires),
        "probability": bool(scorer.probability),
        "rows": len(ids),
        "splits": {s: sum(inputs.split_of[k] == s for k in ids) for s in SPLITS},
        **({"fit_rows": {"train": len(fit_ids), "validation": len(val_ids)}} if supervised else {}),
        **timing_record(inputs, scorer, ids, scoring_s, fit_s),
        "wall_time_s": time.perf_counter() - started,
        "finished_at": datetime.now(UTC).isoformat(),
        "package_version": package_version(),
    }
    store.set_manifest_key(("results", method), json_safe(record))
    return MethodResult(method, "done", "", len(ids), json_safe(record))


def run_baselines(
    store: MapStore,
    methods: str | Sequence[str],
    *,
    model=None,
    tokenizer=None,
    judge=None,
    rows: str = "balanced",
    progress: Progress | None = None,
    options: BaselineOptions = BaselineOptions(),
) -> dict[str, MethodResult]:
    """Score the store's balanced rows with every method; one `MethodResult` per method.

    ``model``/``tokenizer``: the generator (default: the store's, loaded when a
    method needs it). ``judge``: Semantic Entropy's entailment judge (default:
    ``options.judge`` loaded with `load_llm_judge`); either way it is cached in
    ``<store>/judge-cache.json``. ``progress(method, done, total, info)`` is
    called as work advances.
    """
    if rows not in ROW_SETS:
        raise ActmapUserError(f"rows must be one of {sorted(ROW_SETS)}, got {rows!r}")
    names = resolve_methods(methods)
    splits = balanced_splits(store)
    inputs = StoreInputs(store, options, splits, model, tokenizer, judge, progress)
    results = {}
    for method in names:
        try:
            results[method] = run_method(inputs, method, rows)
        except BaselineUnavailable as err:
            log.warning("%s unavailable: %s", method, err)
            results[method] = MethodResult(method, "unavailable", str(err))
        except Exception as err:  # one method's failure must not stop the others
            log.exception("%s failed", method)
            results[method] = MethodResult(method, "failed", f"{type(err).__name__}: {err}")
    return results
