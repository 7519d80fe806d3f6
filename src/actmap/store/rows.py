"""Which rows every method uses, and the one form they are read in: `Rows`.

The ``splits`` table of a store lists, per split, the balanced row ids (equal
correct and incorrect). It is derived deterministically from the stored labels
and a seed, written next to the maps, and rewritten only when the committed
rows change, so ActMap detectors and every baseline read identical rows.

    balanced_rows(store)   {split: Rows} on the balanced rows (what training and the paper use)
    natural_rows(store)    {split: Rows} on every labelled row (the generator's own prevalence)
    read_rows(store, ids)  any rows; a map with NaN or inf is refused here, once, for everyone
    natural_accuracy(store)  fraction correct among labelled rows, per split and overall
    row_metadata(store)    the maps table's metadata, one row per id (the last written)

Every reader here takes its rows from `row_metadata`: an id the ``maps`` table holds more
than once counts once, with its last row, as `MapStore.load_maps` reads it.

The per-answer scalars a detector may read beside the map are added by
`actmap.capture.answer_scalars.with_scalars` (they come from the generations table).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from actmap.data.splits import SPLITS, balanced_ids
from actmap.errors import ActmapUserError
from actmap.store import MapStore
from actmap.store.served import current_sampling, is_served, label_counts, served_view

BALANCE_SEED = 0


@dataclass(frozen=True)
class Rows:
    """One set of labelled rows: ids, labels (1 = correct), maps (N, C, H, W) and, when read,
    the per-answer scalars (N, 6). Training, evaluation, comparison, calibration and the
    report all take their rows in this form."""

    ids: Sequence[Any] | None  # one id per row (the store's row id); None = the row index
    labels: Any  # (N,) int64 numpy (or a tensor), 1 = correct
    maps: Any  # (N, C, H, W) float16 numpy as stored (or a tensor)
    scalars: np.ndarray | None = None  # (N, 6) float64; None until read

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def prevalence(self) -> float:
        """Fraction correct among these rows."""
        return float(np.asarray(self.labels, dtype=np.float64).mean())

    def row_ids(self) -> list[Any]:
        if self.ids is None:
            return list(range(len(self.labels)))
        if len(self.ids) != len(self.labels):
            raise ValueError(f"ids has {len(self.ids)} rows but labels has {len(self.labels)}")
        return [i.item() if hasattr(i, "item") else i for i in self.ids]


def row_metadata(store: MapStore):
    """The maps table's metadata (a DataFrame, no map bytes), one row per id: the last
    written, as `MapStore.load_maps` and `MapStore.read_latest` read it. An audit store's
    rows get their split and label by `actmap.store.served.served_view`."""
    meta = store.metadata(latest=True)
    return served_view(store, meta) if is_served(store) else meta


def read_rows(store: MapStore, ids: Sequence[str], what: str = "rows") -> Rows:
    """The maps and labels of the store rows ``ids`` (in that order). A map with NaN or
    infinite values is refused here, naming its id (``what`` names the rows in the message)."""
    ids = list(ids)
    maps, meta = store.load_maps(ids)
    finite = np.isfinite(maps.reshape(len(maps), -1)).all(axis=1)
    if not finite.all():
        bad = [key for key, ok in zip(ids, finite, strict=True) if not ok]
        raise ActmapUserError(
            f"store {store.root}: the map of id '{bad[0]}' has NaN or infinite values "
            f"({len(bad)} such maps in its {what})"
        )
    if is_served(store):  # the label a served row has is in its feedback log
        meta = row_metadata(store).set_index("id").loc[ids].reset_index()
    unlabelled = meta["label"].isna()
    if unlabelled.any():
        raise ActmapUserError(
            f"store {store.root}: the row '{ids[int(np.argmax(unlabelled))]}' in its {what} "
            "has no label"
        )
    return Rows(ids, meta["label"].to_numpy(dtype=np.int64), maps)


def balanced_rows(
    store: MapStore, persist: bool = True, splits: Sequence[str] = SPLITS
) -> dict[str, Rows]:
    """{split: Rows} on the store's balanced rows (`balanced_splits`) of each of ``splits``;
    an empty split fails. ``persist=False`` writes nothing into the store."""
    out = {}
    chosen = balanced_splits(store, persist=persist)
    for split in splits:
        ids = chosen.get(split)  # a split that is not one of SPLITS is empty
        if not ids:
            raise ActmapUserError(
                f"the balanced '{split}' split of {store.root} is empty (need both labels)"
            )
        out[split] = read_rows(store, ids, f"balanced '{split}' split")
    return out


def natural_ids(store: MapStore) -> dict[str, list[str]]:
    """{split: every labelled row id}: the natural prevalence (empty answers have no map)."""
    meta = row_metadata(store)
    meta = meta[meta["label"].notna()]
    return {s: meta.loc[meta["split"] == s, "id"].astype(str).tolist() for s in SPLITS}


def natural_rows(store: MapStore, splits: Sequence[str] = SPLITS) -> dict[str, Rows]:
    """{split: Rows} on every labelled row of each of ``splits``; an empty split fails."""
    ids = natural_ids(store)
    out = {}
    for split in splits:
        if not ids.get(split):  # a split that is not one of SPLITS has none
            raise ActmapUserError(f"{store.root} has no labelled rows in split '{split}'")
        out[split] = read_rows(store, ids[split], f"labelled '{split}' rows")
    return out


def natural_accuracy(store: MapStore) -> dict[str, float]:
    """Fraction correct among labelled rows, per split and overall ("all")."""
    frame = row_metadata(store)
    frame = frame[frame["label"].notna()]
    result = {split: float(group["label"].mean()) for split, group in frame.groupby("split")}
    result["all"] = float(frame["label"].mean()) if len(frame) else float("nan")
    return result


def balanced_splits(
    store: MapStore, seed: int = BALANCE_SEED, persist: bool = True
) -> dict[str, list[str]]:
    """{split: balanced ids}; reads the stored table when it matches the committed rows.

    ``persist=False`` computes the same ids without writing the ``splits`` table (a frozen
    evaluation reads a store and must not write into it)."""
    meta = row_metadata(store)
    fingerprint = rows_fingerprint(meta["id"], meta["label"], seed)
    if is_served(store):  # never written: the server writes its audit store
        persist = False
    elif store.has_table("splits"):
        table = store.read_table("splits")
        if table.num_rows and table.column("fingerprint")[0].as_py() == fingerprint:
            frame = table.to_pandas()
            return {s: frame.loc[frame["split"] == s, "id"].tolist() for s in SPLITS}
    labels = [None if np.isnan(x) else bool(x) for x in meta["label"].astype(float)]
    chosen = balanced_ids(meta["id"].tolist(), meta["split"].tolist(), labels, seed=seed)
    if not persist:
        return {s: list(chosen.ids[s]) for s in SPLITS}
    rows = [(key, split) for split in SPLITS for key in chosen.ids[split]]
    table = pa.table(
        {
            "id": [r[0] for r in rows],
            "split": [r[1] for r in rows],
            "fingerprint": [fingerprint] * len(rows),
        }
    )
    with store.writing():  # a reader (train, evaluate) is a writer only for this moment
        store.replace_table("splits", table)
        store.update_manifest(balanced={s: c.__dict__ for s, c in chosen.counts.items()})
    return {s: list(chosen.ids[s]) for s in SPLITS}


def rows_fingerprint(ids, labels, seed: int = BALANCE_SEED) -> str:
    """A hash of the committed (id, label) pairs and the seed: any added, removed or
    relabelled row changes it, whatever the order of the rows."""
    pairs = sorted(
        (str(key), "none" if label is None or label != label else str(int(label)))
        for key, label in zip(ids, labels, strict=True)
    )
    digest = hashlib.sha256(json.dumps([seed, pairs]).encode())
    return digest.hexdigest()[:32]


def split_labels(store: MapStore, ids: list[str]) -> np.ndarray:
    meta = row_metadata(store).set_index("id")
    return meta.loc[ids, "label"].to_numpy(dtype=np.int64)


ROW_CHOICES = ("balanced", "test", "all")


@dataclass(frozen=True)
class ScoredRows:
    """The rows a frozen detector scores: store ids with their labels, plus the empty
    answers of those rows (stop token first: no map, so not in the maps table), which
    natural-prevalence metrics count as incorrect answers."""

    which: str
    ids: list[str]
    labels: np.ndarray  # (N,) int64, 1 = correct
    n_empty: int = 0  # empty answers among these rows (each an incorrect answer)
    empty_split_unknown: int = 0  # empty answers recorded without a split (older stores)


def rows_to_score(store: MapStore, which: str = "balanced") -> ScoredRows:
    """balanced: the balanced test split; test: every labelled test row (natural prevalence);
    all: every labelled row of the store. Never writes into the store."""
    if which not in ROW_CHOICES:
        raise ActmapUserError(f"rows must be one of {', '.join(ROW_CHOICES)}, not '{which}'")
    meta = row_metadata(store)
    if which == "balanced":
        ids = balanced_splits(store, persist=False)["test"]
    else:
        keep = meta["label"].notna()
        if which == "test":
            keep &= meta["split"] == "test"
        ids = meta.loc[keep, "id"].tolist()
    if not ids:
        raise ActmapUserError(f"{store.root}: no labelled rows in its '{which}' rows")
    labels = meta.set_index("id").loc[ids, "label"].to_numpy(dtype=np.int64)
    if which == "balanced":
        return ScoredRows(which, list(ids), labels)
    n_empty, unknown = empty_answers(store, None if which == "all" else "test")
    return ScoredRows(which, list(ids), labels, n_empty, unknown)


def empty_answers(store: MapStore, split: str | None) -> tuple[int, int]:
    """(empty answers in ``split`` (None: every split), empty answers without a split)."""
    if not store.has_table("skipped"):
        return 0, 0
    frame = store.read_table("skipped").to_pandas().drop_duplicates("id", keep="last")
    frame = frame[frame["reason"] == "empty answer"]
    if "split" not in frame.columns:
        return (len(frame), 0) if split is None else (0, len(frame))
    known = frame["split"].notna()
    if split is None:
        return len(frame), 0
    return int((frame["split"] == split).sum()), int((~known).sum())


def with_empty_answers(
    confidence: np.ndarray, labels: np.ndarray, n_empty: int
) -> tuple[np.ndarray, np.ndarray]:
    """Scores and labels with ``n_empty`` empty answers appended as incorrect rows scored 0:
    an empty answer is never a correct one, and any deployment flags it without a detector."""
    return (
        np.concatenate([np.asarray(confidence, dtype=np.float64), np.zeros(n_empty)]),
        np.concatenate([np.asarray(labels, dtype=np.int64), np.zeros(n_empty, dtype=np.int64)]),
    )


@dataclass(frozen=True)
class SplitCounts:
    rows: int  # answers with a map
    labelled: int
    correct: int
    balanced: int  # balanced rows (equal correct and incorrect)

    @property
    def accuracy(self) -> float:
        """Natural accuracy of the labelled answers (nan when none is labelled)."""
        return self.correct / self.labelled if self.labelled else float("nan")


@dataclass(frozen=True)
class StoreSummary:
    """What a store holds: per split rows, labels, natural accuracy and balanced rows, the
    empty answers (no map) and every capture run's rows and wall time."""

    root: str
    task: str | None
    model: str | None
    dtype: str
    splits: dict[str, SplitCounts]
    empty_answers: int
    capture_runs: list[dict]
    served: dict | None = None  # an audit store's labels (`actmap.store.served.label_counts`)

    @property
    def total(self) -> SplitCounts:
        parts = self.splits.values()
        return SplitCounts(
            *(sum(getattr(c, f) for c in parts) for f in SplitCounts.__annotations__)
        )

    @property
    def capture_rows_per_s(self) -> float | None:
        """Rows per second over the capture runs that wrote rows (a resumed run that found
        its work done writes none and took no capture time); None when no run is timed."""
        timed = [r for r in self.capture_runs if r["written"] and r["wall_time_s"]]
        wall = sum(r["wall_time_s"] for r in timed)
        return sum(r["written"] for r in timed) / wall if wall else None

    def to_json(self) -> dict:
        def counts(c: SplitCounts) -> dict:
            return {**c.__dict__, "accuracy": None if c.labelled == 0 else c.accuracy}

        return {
            "root": self.root,
            "task": self.task,
            "model": self.model,
            "dtype": self.dtype,
            "splits": {s: counts(c) for s, c in self.splits.items()},
            "total": counts(self.total),
            "empty_answers": self.empty_answers,
            "capture_runs": self.capture_runs,
            "capture_rows_per_s": self.capture_rows_per_s,
            "served": self.served,
        }


def rate_text(rows_per_s: float | None) -> str:
    """A capture rate as printed: two decimals, or two significant digits under 0.1 (a
    CNN/DM summary takes minutes: 0.0094, not 0.01); "-" when unknown."""
    if rows_per_s is None:
        return "-"
    return f"{rows_per_s:.2f}" if rows_per_s >= 0.1 else f"{rows_per_s:.2g}"


def store_summary(store: MapStore) -> StoreSummary:
    """Counts read from the store, never written into it (balanced rows as training sees them)."""
    meta = row_metadata(store)
    balanced = balanced_splits(store, persist=False)
    splits = {}
    for split in SPLITS:
        part = meta[meta["split"] == split]
        labelled = part["label"].dropna()
        splits[split] = SplitCounts(
            len(part), len(labelled), int((labelled == 1).sum()), len(balanced[split])
        )
    config = store.manifest.get("config", {})
    model = config.get("model") or {}
    task = config.get("task") or {}
    runs = [
        {
            "written": int(run.get("written", 0)),
            "wall_time_s": run.get("wall_time_s"),
            "rows_per_s": run["written"] / run["wall_time_s"]
            if run.get("written") and run.get("wall_time_s")
            else None,
            # a run records itself after every batch and sets finished_at when it ends
            "finished": run.get("finished_at", 0) is not None,
        }
        for run in store.manifest.get("runs", [])
    ]
    served = None
    if is_served(store):  # no task or model in its config: served answers of one model
        served = {**label_counts(store), "counted": current_sampling(store)}
        task = {"task": "served"}
        names = meta["model_name"].dropna()
        model = {"name": names.mode().iloc[0] if len(names) else None}
    return StoreSummary(
        root=str(store.root),
        task=task.get("task"),
        model=model.get("name"),
        dtype=model.get("dtype", "float32"),
        splits=splits,
        empty_answers=empty_answers(store, None)[0],
        capture_runs=runs,
        served=served,
    )


# Tables a subset leaves out: ``splits`` is derived (the subset draws its own, the same rows),
# ``skipped`` holds the empty answers, which have no map and so are never balanced rows, and a
# method's ``results/<method>`` scores go with their record in the manifest, which stays behind
# (run the method again on the subset).
NOT_SUBSET = ("splits", "skipped")


def carried(table: str) -> bool:
    """Whether `balanced_subset` can carry ``table``."""
    return table not in NOT_SUBSET and not table.startswith("results/")


def balanced_subset(
    source: MapStore, target: str | Path, tables: Sequence[str] | None = None
) -> dict[str, int]:
    """Write a new store at ``target`` holding only ``source``'s balanced rows: the maps and,
    for those ids, the last row of each table in ``tables`` (default: every table the source
    has that `carried` allows: not the derived splits, the empty answers or a method's results).
    Returns the rows written per table.

    A store small enough to carry to another machine (a GPU box, say) that trains and scores
    on exactly the rows it would use here: each split of the subset holds as many correct as
    wrong rows, so drawing balanced rows from it again keeps every one. ``source`` is only
    read; ``target`` must be new."""
    target = Path(target)
    if target.exists() and any(target.iterdir()):
        raise ActmapUserError(f"{target} is not empty; give a new folder for the subset")
    have = [t for t in source.tables() if carried(t)]
    wanted = ["maps", *(t for t in (have if tables is None else tables) if t != "maps")]
    derived = [t for t in wanted if not carried(t)]
    if derived:
        raise ActmapUserError(
            f"a subset does not carry {', '.join(map(repr, derived))}: the subset draws its own "
            "splits, and a method's results go with the manifest record that stays behind"
        )
    missing = [t for t in wanted if t not in have]
    if missing:
        raise ActmapUserError(
            f"{source.root} has no table {', '.join(map(repr, missing))} "
            f"(it has {', '.join(have) or 'none'})"
        )
    balanced = balanced_splits(source, persist=False)
    ids = list(chain.from_iterable(balanced.values()))
    if not ids:
        raise ActmapUserError(
            f"{source.root} has no balanced rows (no split holds both a correct and a wrong "
            "labelled answer)"
        )
    subset = MapStore.create(
        target, source.manifest.get("config") or {}, map_shape=source.map_shape
    )
    written = {}
    try:
        for table in wanted:
            kept = source.read_latest(table, ids=ids)  # a big store's maps never sit whole
            subset.write_table(table, kept)
            written[table] = kept.num_rows
        subset.update_manifest(
            subset_of={
                "root": str(source.root),
                "rows": "balanced",
                "ids": {split: len(keys) for split, keys in balanced.items()},
            }
        )
    finally:
        subset.close()
    return written
