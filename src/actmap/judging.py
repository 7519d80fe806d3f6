"""Label a store of summaries with a factuality judge, as a separate resumable pass.

Capturing CNN/DailyMail summaries needs only the generator; judging them needs a
second, larger model (one pass per summary sentence over the article). Keeping the
two apart lets summaries be captured without a judge and labelled later, elsewhere
or in pieces:

    actmap capture --task cnn_dm --out stores/cnn               # labels None
    actmap judge --store stores/cnn --judge qwen.gguf --out stores/cnn-judged

The judged store shares the source's side tables (links) and holds a ``judgments``
table: per summary the judge's name, threshold, sentences and support
probabilities, and the label. Judgments are committed a batch at a time, so a
killed pass continues where it stopped; at the end of every pass the store's
maps are rewritten with the labels judged so far (rows not judged yet: None).
Sentences are judged in order and a summary stops at its first unsupported
sentence (the label is then known), as in ``summary_is_factual``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from actmap.data.factuality import SUPPORT_THRESHOLD, SummaryFactualityJudge, judge_summary
from actmap.errors import ActmapUserError
from actmap.relabel import write_labelled_copy
from actmap.store import MapStore, StoreError

log = logging.getLogger(__name__)

JUDGMENTS = "judgments"


def _judgment_table(rows: list[tuple[str, object]]) -> pa.Table:
    return pa.table(
        {
            "id": [key for key, _ in rows],
            "label": pa.array([int(j.factual) for _, j in rows], pa.int8()),
            "judge": [j.judge for _, j in rows],
            "threshold": pa.array([j.threshold for _, j in rows], pa.float32()),
            "sentences": [list(j.sentences) for _, j in rows],
            "support": pa.array([list(j.support) for _, j in rows], pa.list_(pa.float32())),
        }
    )


def judge_store(
    source: MapStore,
    target: str | Path,
    judge: SummaryFactualityJudge,
    threshold: float = SUPPORT_THRESHOLD,
    batch_size: int = 8,
    limit: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> MapStore:
    """Judge every summary of ``source`` not judged yet in ``target``; returns the target store.

    ``limit`` caps the summaries judged by this call (the rest wait for the next one).
    """
    config = source.manifest.get("config", {})
    task = config.get("task", {})
    if task.get("task") != "cnn_dm":
        raise StoreError(
            f"{source.root} holds task {task.get('task')!r}; judging is for cnn_dm summaries"
        )
    if not source.has_table("generations"):
        raise StoreError(f"{source.root} has no generations table to judge")
    if batch_size < 1:
        raise ActmapUserError(f"batch_size must be >= 1, got {batch_size}")
    generations = source.read_latest("generations", ["question", "label_text"])
    committed = source.ids("maps")
    rows = [
        (key, article, summary)
        for key, article, summary in zip(
            *(generations.column(c).to_pylist() for c in ("id", "question", "label_text")),
            strict=True,
        )
        if key in committed
    ]
    store = MapStore.create(
        target,
        {
            **config,
            "task": {**task, "judge": judge.name, "threshold": threshold},
            "judged": {"source": str(source.root)},
        },
    )
    done = store.ids(JUDGMENTS)
    todo = [row for row in rows if row[0] not in done]
    if progress is not None and len(rows) > len(todo):
        progress(len(rows) - len(todo))
    todo = todo[:limit] if limit is not None else todo
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        judged = [
            (key, judge_summary(judge, article, summary, threshold, early_stop=True))
            for key, article, summary in batch
        ]
        store.write_table(JUDGMENTS, _judgment_table(judged))
        if progress is not None:
            progress(len(batch))
    labels = judged_labels(store)
    write_labelled_copy(source, store, labels)
    log.info("%d of %d summaries judged in %s", len(labels), len(rows), store.root)
    return store


def judged_labels(store: MapStore) -> dict[str, int]:
    """id -> label of every judgment in ``store`` (the latest one per id)."""
    if not store.has_table(JUDGMENTS):
        return {}
    table = store.read_latest(JUDGMENTS, ["label"])
    return dict(zip(table.column("id").to_pylist(), table.column("label").to_pylist(), strict=True))
