"""Served rows: an audit store (``actmap serve --audit``) read as a labelled map store.

An audit store is a map store whose manifest config says ``kind = "audit"``; its ``maps``
rows are written with no label and the endpoint as their ``split``. Every reader of rows
(`actmap.store.rows.row_metadata`, hence ``store info``, ``evaluate``, ``policy fit``,
``train``, ``store subset``) sees them through `served_view`:

- **split**: a served row's split is drawn from a seeded hash of its map id
  (`actmap.data.splits.key_uniform`, salt ``"served-split"``, seed ``SERVED_SPLIT_SEED``)
  at 80 / 10 / 10 train / validation / test (``DEFAULT_FRACTIONS``). It depends on the id
  alone: a row never changes split as rows are added, labelled or dropped by retention.
- **label**: the latest row of the ``labels`` side table for that id (feedback API and
  review page: ``id, label, source, labelled_at, correct_answer``; append-only, earlier
  labels stay as history); no label row: unlabelled.
- **which labels count** (`served_sampling`): the ``review`` side table records, per
  queued answer, why it was queued (``reason``: "review" for answers decided review,
  "sample" for the uniform random sample), the probability it had of being queued
  (``rate``) and whether it was drawn in the uniform random sample (``in_sample``). The
  review band is over-represented among reviewed answers, so under "sample" only the
  labels of answers in the uniform random sample count: those rows are a uniform draw of
  all served answers, so natural prevalence, calibration and risk fitted on them are
  unbiased. "all" counts every label (user thumbs, downstream checks, the review band):
  more rows, sampled with a bias nothing here corrects. "auto" (the default) is "sample"
  when the queue holds a random sample (``serve --review-sample`` above 0), else "all"
  (labels from the feedback API alone).

A served store's balanced splits are never written into it (the server is its writer).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import pandas as pd

from actmap.data.splits import DEFAULT_FRACTIONS, _pick, key_uniform
from actmap.errors import ActmapUserError

SERVED_KIND = "audit"
LABELS_TABLE = "labels"  # id, label, source, labelled_at, correct_answer (append-only)
REVIEW_TABLE = "review"  # id, queued_at, reason, rate, in_sample, decision, p_correct
SCALARS_TABLE = "audit_scalars"  # id + the six per-answer scalars, when the detector reads them
# columns a table gained after stores were first written: older shards lack them (readers
# pass the full schema and read nulls; `actmap store verify` does not call them damage)
COLUMNS_ADDED_LATER = {"audit": ("policy",)}
SERVED_SPLIT_SEED = 0
SAMPLING_CHOICES = ("auto", "sample", "all")

_sampling: ContextVar[str] = ContextVar("served_sampling", default="auto")


def is_served(store) -> bool:
    """Whether ``store`` is an audit store written by ``actmap serve --audit``."""
    return (store.manifest.get("config") or {}).get("kind") == SERVED_KIND


@contextmanager
def served_sampling(choice: str) -> Iterator[None]:
    """Within the block, served stores count the labels of ``choice`` rows ("sample": the
    uniform random sample only; "all": every labelled row; "auto", the default: "sample"
    when the store holds a random sample, else "all")."""
    if choice not in SAMPLING_CHOICES:
        raise ActmapUserError(
            f"sampling must be one of {', '.join(SAMPLING_CHOICES)}, not {choice!r}"
        )
    token = _sampling.set(choice)
    try:
        yield
    finally:
        _sampling.reset(token)


def current_sampling(store) -> str:
    """ "sample" or "all": the choice in force for ``store`` ("auto" resolved)."""
    choice = _sampling.get()
    if choice != "auto":
        return choice
    queue = review_rows(store)
    return "sample" if queue["in_sample"].astype(bool).any() else "all"


def served_splits(ids: Sequence[str], seed: int = SERVED_SPLIT_SEED) -> list[str]:
    """The split of each served map id: a seeded hash of the id at 80 / 10 / 10."""
    shares = list(DEFAULT_FRACTIONS.items())
    return [_pick(key_uniform(str(key), seed, salt="served-split"), shares) for key in ids]


def latest_labels(store) -> pd.DataFrame:
    """The latest label row of every labelled id (the feedback log's last word), by id."""
    columns = ["id", "label", "source", "labelled_at", "correct_answer"]
    if not store.has_table(LABELS_TABLE):
        return pd.DataFrame(columns=columns).set_index("id")
    # one writer appends the shards in order: the last row of an id in write order is the latest
    frame = store.read_table(LABELS_TABLE).to_pandas().drop_duplicates("id", keep="last")
    return frame.set_index("id")


def review_rows(store) -> pd.DataFrame:
    """The review queue: one row per queued answer (reason, rate, in_sample), by id."""
    if not store.has_table(REVIEW_TABLE):
        return pd.DataFrame(
            columns=["id", "queued_at", "reason", "rate", "in_sample", "decision", "p_correct"]
        ).set_index("id")
    return (
        store.read_table(REVIEW_TABLE)
        .to_pandas()
        .drop_duplicates("id", keep="last")
        .set_index("id")
    )


def served_view(store, meta: pd.DataFrame) -> pd.DataFrame:
    """``meta`` (the maps metadata, one row per id) with the served split rule and the
    labels that count under `served_sampling` (the module docstring)."""
    meta = meta.copy()
    meta["split"] = served_splits(meta["id"].tolist())
    labels = latest_labels(store)["label"]
    label = meta["id"].map(labels).astype("float64")
    if current_sampling(store) == "sample":
        queue = review_rows(store)
        in_sample = queue.index[queue["in_sample"].astype(bool)]
        label = label.where(meta["id"].isin(in_sample), np.nan)
    meta["label"] = label
    return meta


def label_counts(store) -> dict[str, int]:
    """{labelled: ids with a label, in_sample: of those, in the uniform random sample,
    queued: answers in the review queue, history: label rows written}."""
    labels = latest_labels(store)
    queue = review_rows(store)
    sampled = set(queue.index[queue["in_sample"].astype(bool)])
    history = (
        store.read_table(LABELS_TABLE, ["id"]).num_rows if store.has_table(LABELS_TABLE) else 0
    )
    return {
        "labelled": len(labels),
        "in_sample": len(set(labels.index) & sampled),
        "queued": len(queue),
        "history": history,
    }
