"""Relabel a QA store under another named label rule, without generating again.

The new store shares every side table with the source (hard links where the
file system allows, copies otherwise) and rewrites only the ``label`` column
of its maps, from the stored post-processed answers and gold aliases. Its
manifest names the rule, so results made on it are reported with it.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from actmap.data.labels import get_label_rule
from actmap.store import MapStore, StoreError


def relabel_store(source: MapStore, target: str | Path, rule: str) -> MapStore:
    """A sibling store at ``target`` whose labels follow ``rule`` (see ``LABEL_RULES``)."""
    labeler = get_label_rule(rule)
    if not source.has_table("generations"):
        raise StoreError(f"{source.root} has no generations table to relabel from")
    generations = source.read_latest("generations", ["label_text", "references"])
    labels = {
        key: int(labeler(text, refs))
        for key, text, refs in zip(
            generations.column("id").to_pylist(),
            generations.column("label_text").to_pylist(),
            generations.column("references").to_pylist(),
            strict=True,
        )
    }
    if not any(refs for refs in generations.column("references").to_pylist()):
        raise StoreError(f"{source.root} stores no gold aliases; only QA stores can be relabelled")
    config = {**source.manifest["config"], "relabel": {"source": str(source.root), "rule": rule}}
    store = MapStore.create(target, config, resume=False)
    write_labelled_copy(source, store, labels)
    return store


def write_labelled_copy(source: MapStore, store: MapStore, labels: dict[str, int | None]) -> None:
    """Give ``store`` the maps of ``source`` with ``labels`` (absent ids: None) and its tables.

    Side tables are linked (or copied) once; ``splits`` and ``results`` are left out since
    they depend on the labels. Maps already in ``store`` are replaced, new shards first, so
    an interrupted call never leaves the store without maps. Maps that already hold these
    rows and labels are left as they are: a repeated call changes nothing in the store.
    """
    if not _holds_labelled_maps(source, store, labels):
        older = store.shards("maps")
        for shard in source.shards("maps"):
            table = pq.read_table(shard)
            new = pa.array([labels.get(key) for key in table.column("id").to_pylist()], pa.int8())
            store.write_table(
                "maps", table.set_column(table.schema.get_field_index("label"), "label", new)
            )
        store.forget_shards("maps", older, unlink=True)
    # labels changed: balanced rows and scores are made anew
    store.link_tables(
        source, skip=lambda name: name in ("maps", "splits") or name.startswith("results")
    )


def _holds_labelled_maps(source: MapStore, store: MapStore, labels: dict[str, int | None]) -> bool:
    """``store``'s maps are ``source``'s rows, in order, with ``labels`` already."""
    if not store.has_table("maps"):
        return False
    ours = store.read_table("maps", ["id", "label"])
    ids = source.read_table("maps", ["id"]).column("id").to_pylist()
    return ours.column("id").to_pylist() == ids and ours.column("label").to_pylist() == [
        labels.get(key) for key in ids
    ]
