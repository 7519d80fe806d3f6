"""Which rows every method uses: the balanced splits of a store, computed once and stored.

The ``splits`` table of a store lists, per split, the balanced row ids (equal
correct and incorrect). It is derived deterministically from the stored labels
and a seed, written next to the maps, and rewritten only when the committed
rows change, so ActMap detectors and every baseline read identical rows.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

from actmap.data.splits import SPLITS, balanced_ids
from actmap.store import MapStore

BALANCE_SEED = 0


def balanced_splits(store: MapStore, seed: int = BALANCE_SEED) -> dict[str, list[str]]:
    """{split: balanced ids}; reads the stored table when it matches the committed rows."""
    meta = store.metadata()
    fingerprint = rows_fingerprint(meta["id"], meta["label"], seed)
    if store.has_table("splits"):
        table = store.read_table("splits")
        if table.num_rows and table.column("fingerprint")[0].as_py() == fingerprint:
            frame = table.to_pandas()
            return {s: frame.loc[frame["split"] == s, "id"].tolist() for s in SPLITS}
    labels = [None if np.isnan(x) else bool(x) for x in meta["label"].astype(float)]
    chosen = balanced_ids(meta["id"].tolist(), meta["split"].tolist(), labels, seed=seed)
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
    meta = store.metadata().set_index("id")
    return meta.loc[ids, "label"].to_numpy(dtype=np.int64)
