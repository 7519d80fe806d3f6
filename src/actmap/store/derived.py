"""Ablation maps as stores: maps rebuilt from a store's trajectories with other operator settings.

The derived store keeps the source's metadata (ids, splits, labels) and links its
side tables, so ``actmap train``, ``actmap evaluate`` and the experiments read it
like any store; its manifest records the map shape and the `MapConfig` used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from actmap.maps import MapConfig, build_maps_from_list, map_shape
from actmap.store import MapRecord, MapStore, StoreError, decode_array

RECORD_FIELDS = (
    "source_key",
    "dataset",
    "split",
    "model_name",
    "model_revision",
    "prompt",
    "answer",
)


def build_map_store(
    source: MapStore,
    target: str | Path,
    config: MapConfig,
    batch_size: int = 256,
    progress: Callable[[int], None] | None = None,
) -> MapStore:
    """A store at ``target`` of maps built with ``config`` from ``source``'s trajectories.

    Only committed rows (ids in ``source``'s maps) are built; a rerun continues where a
    killed one stopped.
    """
    if not source.has_table("trajectories"):
        raise StoreError(f"{source.root} has no trajectories; capture with --keep-trajectories")
    store = MapStore.create(
        target,
        {
            **source.manifest.get("config", {}),
            "map": asdict(config),
            "derived": {"source": str(source.root)},
        },
        map_shape=map_shape(config),
    )
    meta = source.metadata().set_index("id")
    done = store.ids("maps")
    table = source.read_latest("trajectories")
    for batch in table.to_batches(max_chunksize=batch_size):
        rows = [
            (key, shape, blob)
            for key, shape, blob in zip(
                *(batch.column(c).to_pylist() for c in ("id", "shape", "trajectory")), strict=True
            )
            if key in meta.index and key not in done
        ]
        if rows:
            trajectories = [
                torch.from_numpy(decode_array(blob, shape).astype(np.float32))
                for _, shape, blob in rows
            ]
            maps = build_maps_from_list(trajectories, config).half().numpy()  # (B, C, H, W)
            store.write_maps(
                [_record(key, meta.loc[key], m) for (key, _, _), m in zip(rows, maps, strict=True)]
            )
        if progress is not None:
            progress(batch.num_rows)
    store.link_tables(
        source, skip=lambda name: name in ("maps", "splits") or name.startswith("results")
    )
    return store


def _record(key: str, row, array: np.ndarray) -> MapRecord:
    label = row["label"]
    return MapRecord(
        id=key,
        **{name: row[name] for name in RECORD_FIELDS},
        n_tokens=int(row["n_tokens"]),
        label=None
        if label is None or (isinstance(label, float) and math.isnan(label))
        else int(label),
        map=array,
    )


def read_arrays(store: MapStore, table: str, ids: list[str]) -> dict[str, np.ndarray]:
    """{id: float16 array} of a side table of arrays (``trajectories``, ``dense``) for ``ids``
    (the latest row of each id); an id without a row raises `StoreError`."""
    column = {"trajectories": "trajectory"}.get(table, table)
    wanted = set(ids)
    out: dict[str, np.ndarray] = {}
    data = store.read_latest(table)
    for batch in data.to_batches(max_chunksize=256):
        keys, shapes = batch.column("id").to_pylist(), batch.column("shape").to_pylist()
        blobs = batch.column(column)
        for i, (key, shape) in enumerate(zip(keys, shapes, strict=True)):
            if key in wanted:
                out[key] = decode_array(blobs[i].as_py(), shape)
    missing = [key for key in ids if key not in out]
    if missing:
        raise StoreError(
            f"{store.root}: {len(missing)} rows have no {table} (e.g. {missing[:3]}); "
            f"{data.num_rows} rows stored"
        )
    return out
