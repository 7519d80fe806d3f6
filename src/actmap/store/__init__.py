"""The map store: Parquet shards of maps and metadata, a manifest, atomic writes, resume.

Layout of a store folder::

    manifest.json                 config, package version, schema version, created_at
    maps/part-<n>.parquet         one row per generation: metadata + the float16 map (98,304 bytes)
    <table>/part-<n>.parquet      side tables keyed by ``id``: generations, trajectories,
                                  attention, dense, splits, results/<method>, ...

Every shard is written to a temporary file and renamed into place, so a killed
writer leaves either a whole shard or none. Pandas and pyarrow read each table
folder directly (``pd.read_parquet(store / "maps")``).
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from actmap import __version__
from actmap.maps import MAP_BYTES, MAP_SHAPE

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"

MAPS_SCHEMA = pa.schema(
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
        ("map", pa.binary(MAP_BYTES)),  # float16, C-order (12, 32, 128)
    ]
)


class StoreError(RuntimeError):
    """A store folder, manifest or shard is missing, corrupt or of another schema."""


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
    map: np.ndarray  # (12, 32, 128), any float dtype; stored as float16


def encode_array(array: np.ndarray, dtype=np.float16) -> bytes:
    """C-order bytes of ``array`` cast to ``dtype`` (float16 by default)."""
    return np.ascontiguousarray(np.asarray(array, dtype=dtype)).tobytes()


def decode_array(blob: bytes, shape: Sequence[int], dtype=np.float16) -> np.ndarray:
    array = np.frombuffer(blob, dtype=dtype)
    if array.size != int(np.prod(shape)):
        raise StoreError(f"stored array has {array.size} values, expected shape {tuple(shape)}")
    return array.reshape(shape)


def _write_atomically(table: pa.Table, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=".parquet")
    os.close(fd)
    try:
        pq.write_table(table, tmp, compression="zstd")  # ~13% smaller than snappy on maps
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def config_differences(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs; missing = None."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, name + "."))
        elif a != b:
            out.append((name, a, b))
    return out


class MapStore:
    """A folder of Parquet tables sharing the ``id`` key, described by ``manifest.json``."""

    def __init__(self, root: Path, manifest: dict) -> None:
        self.root = Path(root)
        self.manifest = manifest

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, config: dict, resume: bool = True) -> MapStore:
        """A new store, or the existing one at ``root`` when its config matches (resume)."""
        root = Path(root)
        if (root / MANIFEST).exists():
            store = cls.open(root)
            if not resume:
                raise StoreError(f"{root} already holds a store; pass resume=True to continue it")
            stored, wanted = store.manifest.get("config"), json.loads(json.dumps(config))
            if stored != wanted:
                changed = config_differences(stored or {}, wanted)
                raise StoreError(
                    f"{root} holds a store made with another config; use a new folder. "
                    "Differences (stored -> new): "
                    + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
                    + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
                )
            return store
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "package": "actmap",
            "package_version": __version__,
            "created_at": datetime.now(UTC).isoformat(),
            "map_shape": list(MAP_SHAPE),
            "map_dtype": "float16",
            "config": config,
        }
        root.mkdir(parents=True, exist_ok=True)
        store = cls(root, manifest)
        store._write_manifest()
        return store

    @classmethod
    def open(cls, root: str | Path) -> MapStore:
        root = Path(root)
        path = root / MANIFEST
        if not path.is_file():
            raise StoreError(f"{root} is not an actmap store: {MANIFEST} is missing")
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise StoreError(f"{path} is not valid JSON: {error}") from error
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"{path} has schema_version {version}; this actmap reads {SCHEMA_VERSION}"
            )
        return cls(root, manifest)

    def _write_manifest(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.manifest, handle, indent=2, sort_keys=True)
        os.replace(tmp, self.root / MANIFEST)

    def update_manifest(self, **entries) -> None:
        """Record run facts (timings, counts, results) next to the config.

        Several processes may work on one store (a capture and a baseline run, two
        baseline runs): under a file lock, the manifest on disk is re-read and merged
        one level deep (a dict entry such as ``results`` gains keys, it is not replaced).
        """
        with open(self.root / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = json.loads((self.root / MANIFEST).read_text())
            for key, value in entries.items():
                old = current.get(key)
                current[key] = (
                    {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
                )
            self.manifest = current
            self._write_manifest()

    # -- writing ----------------------------------------------------------------------------
    def _next_shard(self, table: str) -> Path:
        folder = self.root / table
        existing = sorted(folder.glob("part-*.parquet")) if folder.exists() else []
        index = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        return folder / f"part-{index:05d}.parquet"

    def write_table(self, table: str, data: pa.Table) -> Path:
        """Append one shard to ``table`` (a folder name such as ``"trajectories"`` or ``"results/ppl"``)."""
        if "id" not in data.column_names:
            raise StoreError(f"table '{table}' rows need an 'id' column")
        target = self._next_shard(table)
        _write_atomically(data, target)
        return target

    def replace_table(self, table: str, data: pa.Table) -> Path:
        """Write ``data`` as the newest shard of ``table``, then drop the older shards."""
        folder = self.root / table
        older = sorted(folder.glob("part-*.parquet")) if folder.exists() else []
        target = self.write_table(table, data)
        for shard in older:
            shard.unlink()
        return target

    def write_maps(self, records: Sequence[MapRecord]) -> Path:
        """Append one shard of maps; every map must be (12, 32, 128) and finite."""
        now = datetime.now(UTC)
        blobs = []
        for record in records:
            array = np.asarray(record.map)
            if array.shape != MAP_SHAPE:
                raise StoreError(
                    f"map of '{record.id}' has shape {array.shape}, expected {MAP_SHAPE}"
                )
            if not np.isfinite(array).all():
                raise StoreError(f"map of '{record.id}' has non-finite values")
            blobs.append(encode_array(array))
        columns = {
            name: [getattr(r, name) for r in records]
            for name in MAPS_SCHEMA.names
            if name not in ("created_at", "map")
        }
        columns["created_at"] = [now] * len(records)
        columns["map"] = blobs
        return self.write_table("maps", pa.table(columns, schema=MAPS_SCHEMA))

    # -- reading ----------------------------------------------------------------------------
    def tables(self) -> list[str]:
        found = []
        for shard in self.root.rglob("part-*.parquet"):
            found.append(str(shard.parent.relative_to(self.root)))
        return sorted(set(found))

    def dataset(self, table: str = "maps") -> ds.Dataset:
        folder = self.root / table
        shards = sorted(folder.glob("part-*.parquet")) if folder.exists() else []
        if not shards:
            raise StoreError(f"{self.root} has no table '{table}'")
        try:
            return ds.dataset([str(s) for s in shards], format="parquet")
        except pa.ArrowInvalid as error:
            raise StoreError(f"a shard of '{table}' in {self.root} is corrupt: {error}") from error

    def has_table(self, table: str) -> bool:
        folder = self.root / table
        return folder.exists() and any(folder.glob("part-*.parquet"))

    def read_table(self, table: str = "maps", columns: Sequence[str] | None = None) -> pa.Table:
        try:
            return self.dataset(table).to_table(columns=list(columns) if columns else None)
        except pa.ArrowInvalid as error:
            raise StoreError(f"cannot read table '{table}' of {self.root}: {error}") from error

    def ids(self, table: str = "maps") -> set[str]:
        if not self.has_table(table):
            return set()
        return set(self.read_table(table, ["id"]).column("id").to_pylist())

    def metadata(self, table: str = "maps"):
        """All columns except the map bytes, as a pandas DataFrame."""
        names = [n for n in self.dataset(table).schema.names if n != "map"]
        return self.read_table(table, names).to_pandas()

    def iter_maps(
        self, batch_size: int = 256, columns: Sequence[str] = ("id", "label")
    ) -> Iterator[tuple[np.ndarray, pa.RecordBatch]]:
        """Stream (maps (n, 12, 32, 128) float16, metadata batch) without loading the whole store."""
        wanted = list(dict.fromkeys([*columns, "map"]))
        for batch in self.dataset("maps").to_batches(columns=wanted, batch_size=batch_size):
            yield maps_from_column(batch.column("map")), batch.drop_columns(["map"])

    def load_maps(self, ids: Sequence[str] | None = None) -> tuple[np.ndarray, object]:
        """(maps (N, 12, 32, 128) float16, metadata DataFrame) in the order of ``ids`` (or storage order)."""
        table = self.read_table("maps")
        if ids is not None:
            index = {key: i for i, key in enumerate(table.column("id").to_pylist())}
            missing = [key for key in ids if key not in index]
            if missing:
                raise StoreError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
            table = table.take(pa.array([index[key] for key in ids]))
        maps = maps_from_column(table.column("map"))
        return maps, table.drop_columns(["map"]).to_pandas()


def maps_from_column(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Zero-copy-ish view of a fixed-size-binary map column as (n, 12, 32, 128) float16."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if len(column) == 0:
        return np.zeros((0, *MAP_SHAPE), dtype=np.float16)
    if column.null_count:
        raise StoreError("the map column has missing values")
    buffer = column.buffers()[1]
    values = np.frombuffer(
        buffer,
        dtype=np.float16,
        count=len(column) * MAP_BYTES // 2,
        offset=column.offset * MAP_BYTES,
    )
    return values.reshape(len(column), *MAP_SHAPE)
