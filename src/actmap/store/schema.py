"""The store's layout on disk: file and folder names, the schema version, the ``maps``
table's schema and its record, the manifest and the order of shards.

A store folder (described in `actmap.store`) holds ``manifest.json`` and one folder per
table of Parquet shards named ``part-<n>-<pid>-<tag>.parquet``; ``n`` is the write order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from actmap.maps import MAP_BYTES
from actmap.store.errors import StoreError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
QUARANTINE = "quarantine"
SHARD_GLOB = "part-*.parquet"


def maps_schema(map_bytes: int = MAP_BYTES) -> pa.Schema:
    """The ``maps`` table's schema for maps of ``map_bytes`` bytes (float16 values)."""
    return pa.schema(
        [
            ("id", pa.string()),
            ("source_key", pa.string()),
            ("dataset", pa.string()),
            ("split", pa.string()),
            ("model_name", pa.string()),
            ("model_revision", pa.string()),
            ("prompt", pa.string()),
            ("answer", pa.string()),
            ("n_tokens", pa.int32()),
            ("label", pa.int8()),  # 1 correct, 0 incorrect, null unknown
            ("created_at", pa.timestamp("us", tz="UTC")),
            ("map", pa.binary(map_bytes)),  # float16, C-order (C, layers, coordinates)
        ]
    )


MAPS_SCHEMA = maps_schema()


@dataclass(frozen=True)
class MapRecord:
    """One generation's map and the metadata stored with it."""

    id: str
    source_key: str
    dataset: str
    split: str
    model_name: str
    model_revision: str
    prompt: str
    answer: str
    n_tokens: int
    label: int | None
    map: np.ndarray  # (12, 32, 128) or the store's map shape, any float dtype; stored as float16


def shard_order(path: Path) -> tuple[int, str]:
    """Write order of a shard: its sequence number, then its name (``part-00012`` or
    ``part-00012-<pid>-<tag>``)."""
    parts = path.stem.split("-")
    try:
        return int(parts[1]), path.name
    except (IndexError, ValueError):
        return -1, path.name


def list_shards(folder: Path) -> list[Path]:
    """The shards of one table folder, in write order."""
    return sorted(folder.glob(SHARD_GLOB), key=shard_order) if folder.is_dir() else []


def read_manifest(root: Path) -> dict:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise StoreError(f"{root} is not an actmap store: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise StoreError(f"{path} is not valid JSON: {error}") from error
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise StoreError(f"{path} has schema_version {version}; this actmap reads {SCHEMA_VERSION}")
    return manifest
