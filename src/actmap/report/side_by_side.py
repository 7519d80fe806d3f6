"""Compare methods on a store's balanced test rows: every stored baseline result, the
answer-length control, and `actmap train` runs, as rows and a Markdown table.

    compare_methods(store, run_dirs) -> one metrics row per method (and per ActMap run)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from actmap.baselines.controls import AnswerLengthPredictor
from actmap.detectors.inputs import DetectorInputs
from actmap.errors import ActmapUserError
from actmap.scoring.contract import is_probability
from actmap.scoring.metrics import auprc, auroc, ece, seed_summary
from actmap.store import MapStore, latest_rows
from actmap.store.rows import balanced_splits
from actmap.training.run_folder import method_name, read_run

# raw_name of methods whose confidence estimates p(correct), for results stored before each
# record carried its scorer's ``probability``
CONTROLS = ("answer_length", "permuted_label")


def _metric_row(method: str, kind: str, per_seed: list[dict], n: int, note: str = "") -> dict:
    """Mean (and std over seeds, ddof=1, when there are several) of per-seed metrics."""

    row = {"method": method, "kind": kind, "n": n, "seeds": len(per_seed), "note": note}
    for name in ("auroc", "auprc", "ece"):
        values = [m[name] for m in per_seed]
        if any(v is None for v in values):
            row[name], row[f"{name}_std"] = None, None
            continue
        mean, std = seed_summary(values)
        row[name], row[f"{name}_std"] = mean, (std if len(values) > 1 else None)
    return row


def _metrics(confidence: np.ndarray, labels: np.ndarray, probability: bool) -> dict:

    return {
        "auroc": auroc(confidence, labels),
        "auprc": auprc(confidence, labels),
        "ece": ece(confidence, labels) if probability else None,
    }


def baseline_row(store: MapStore, method: str, test: list[str], labels: np.ndarray) -> dict:
    frame = latest_rows(store.read_table(f"results/{method}")).to_pandas().set_index("id")
    keep = np.array([key in frame.index for key in test])
    present = [key for key, k in zip(test, keep, strict=True) if k]
    y = labels[keep]
    record = store.manifest.get("results", {}).get(method, {})
    kind = "control" if method in CONTROLS else "baseline"
    notes = [] if len(present) == len(test) else [f"scored {len(present)}/{len(test)} test rows"]
    if len(np.unique(y)) < 2:
        return _metric_row(
            method,
            kind,
            [{"auroc": None, "auprc": None, "ece": None}],
            len(y),
            "; ".join([*notes, "test rows lack a class"]),
        )
    seed_columns = sorted(c for c in frame.columns if c.startswith("confidence_by_seed_"))
    columns = seed_columns if len(seed_columns) > 1 else ["confidence"]
    per_seed = []
    for column in columns:
        confidence = frame.loc[present, column].to_numpy(dtype=np.float64)
        probability = is_probability(record, confidence)
        per_seed.append(_metrics(confidence, y, probability))
    if per_seed[0]["ece"] is None:
        notes.append(f"ECE n/a: confidence is not a probability ({record.get('raw_name', '?')})")
    row = _metric_row(method, kind, per_seed, len(y), "; ".join(notes))
    row["latency_ms"] = record.get("latency_ms_per_answer")
    return row


def length_control_row(store: MapStore, splits: dict[str, list[str]]) -> dict:
    """The answer-length-only control, fit here on the balanced train rows when not stored."""

    meta = store.metadata().set_index("id")

    def rows(split: str) -> tuple[list, np.ndarray]:
        ids = splits[split]
        lengths = meta.loc[ids, "n_tokens"].tolist()
        return [SimpleNamespace(n_tokens=n) for n in lengths], meta.loc[ids, "label"].to_numpy(
            dtype=np.int64
        )

    (x_train, y_train), (x_test, y_test) = rows("train"), rows("test")
    if len(np.unique(y_train)) < 2:
        return _metric_row(
            "answer_length",
            "control",
            [{"auroc": None, "auprc": None, "ece": None}],
            len(y_test),
            "balanced train rows lack a class",
        )
    # the one input bundle, its generations standing in by their token counts (all the length reads)
    length = AnswerLengthPredictor().fit(DetectorInputs(generations=x_train), y_train)
    scores = length.score(DetectorInputs(generations=x_test)).confidence
    row = _metric_row(
        "answer_length",
        "control",
        [_metrics(scores, y_test, True)],
        len(y_test),
        "fit by compare (not stored)",
    )
    row["latency_ms"] = None
    return row


def actmap_row(run: Path, test: list[str], labels: np.ndarray) -> dict:
    """An `actmap train` run folder: per-seed test metrics, mean ± std over seeds."""
    import pandas as pd

    run = Path(run)
    checked = read_run(run)  # refuses seeds of different detectors or recipes
    seed_dirs = list(checked.seed_dirs.values())
    expected = dict(zip(test, labels.tolist(), strict=True))
    per_seed = []
    for folder in seed_dirs:
        scores = pd.read_parquet(folder / "test_scores.parquet")
        ids = [str(k) for k in scores["id"]]
        if set(ids) != set(expected) or len(ids) != len(expected):
            raise ActmapUserError(
                f"{folder} scored {len(ids)} rows that are not the store's {len(expected)} "
                f"balanced test rows ({len(set(ids) - set(expected))} unknown ids); "
                "was the run trained on another store?"
            )
        y = np.array([expected[k] for k in ids])
        if not np.array_equal(y, scores["label"].to_numpy(dtype=np.int64)):
            raise ActmapUserError(f"{folder}: stored labels differ from the store's labels")
        per_seed.append(_metrics(scores["p_correct"].to_numpy(dtype=np.float64), y, True))
    row = _metric_row(
        f"{method_name(checked.detector)} ({run.name})", "actmap", per_seed, len(test)
    )
    row["latency_ms"] = None
    return row


def compare_methods(store: MapStore, run_dirs: Sequence[Path] | None = None) -> list[dict]:
    """AUROC / AUPRC / ECE of every stored method and ActMap run on the balanced test rows.

    Rows are sorted by AUROC, best first; a method without a metric sorts last.
    """
    splits = balanced_splits(store)
    test = splits["test"]
    if not test:
        raise ActmapUserError(f"{store.root}: the balanced test split is empty (need both labels)")
    labels = store.metadata().set_index("id").loc[test, "label"].to_numpy(dtype=np.int64)
    methods = sorted(t.split("/", 1)[1] for t in store.tables() if t.startswith("results/"))
    rows = [baseline_row(store, m, test, labels) for m in methods]
    if "answer_length" not in methods:
        rows.append(length_control_row(store, splits))
    rows += [actmap_row(run, test, labels) for run in run_dirs or []]
    return sorted(rows, key=lambda r: -r["auroc"] if r["auroc"] is not None else math.inf)


def _cell(row: dict, name: str) -> str:
    value, std = row.get(name), row.get(f"{name}_std")
    if value is None:
        return "n/a"
    return f"{value:.3f} ± {std:.3f}" if std is not None and math.isfinite(std) else f"{value:.3f}"


def format_table(rows: Sequence[dict]) -> str:
    """A Markdown table of `compare_methods` rows (mean ± std over seeds where there are seeds)."""
    lines = [
        "| method | kind | AUROC | AUPRC | ECE | n | seeds | ms/answer | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        latency = row.get("latency_ms")
        lines.append(
            f"| {row['method']} | {row['kind']} | {_cell(row, 'auroc')} | {_cell(row, 'auprc')} "
            f"| {_cell(row, 'ece')} | {row['n']} | {row['seeds']} "
            f"| {'n/a' if latency is None else f'{latency:.2f}'} | {row.get('note', '')} |"
        )
    return "\n".join(lines) + "\n"
