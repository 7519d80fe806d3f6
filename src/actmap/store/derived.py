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
import pyarrow as pa
import torch

from actmap.maps import MapConfig, build_maps_from_list, map_shape, stored_form
from actmap.store import MapRecord, MapStore, StoreError, decode_rows

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
    meta = source.metadata(latest=True).set_index("id")  # a rewritten id: its last row
    done = store.ids("maps")
    table = source.read_latest("trajectories")
    for batch in table.to_batches(max_chunksize=batch_size):
        keys = [k for k in batch.column("id").to_pylist() if k in meta.index and k not in done]
        if keys:
            arrays = decode_rows(pa.Table.from_batches([batch]), "trajectories", keys)
            trajectories = [torch.from_numpy(arrays[k].astype(np.float32)) for k in keys]
            maps = stored_form(build_maps_from_list(trajectories, config))  # (B, C, H, W)
            store.write_maps(
                [_record(key, meta.loc[key], m) for key, m in zip(keys, maps, strict=True)]
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
