"""The map store: Parquet shards of maps and metadata, a manifest, atomic writes, resume.

Layout of a store folder::

    manifest.json                 config, package version, schema version, map shape,
                                  created_at, and the row count of every shard
    writer.lock                   the pid of the process writing the store (see `lock`)
    maps/part-<n>-<tag>.parquet   one row per generation: metadata + the float16 map
                                  (98,304 bytes for the paper's 12x32x128 map)
    <table>/part-<n>-<tag>.parquet
                                  side tables keyed by ``id``: generations, trajectories,
                                  attention, dense, splits, results/<method>, ...
    quarantine/                   shards set aside by ``actmap store repair`` (never deleted)

The store's rules, all kept here:

- Every shard is written to a temporary file and renamed into place
  (`actmap.atomic`), so a killed writer leaves either a whole shard or none;
  its row count is then recorded in the manifest.
- Shard names cannot collide: a sequence number (the write order) plus the
  writer's pid and a random tag.
- One process writes a store at a time (`actmap.store.lock`).
- In ``maps`` every id appears once; side tables may hold several rows per id
  (a rerun of an unfinished batch) and readers keep the last (`latest_rows`).
- Configs are compared by meaning (`normalize_config`).

Pandas and pyarrow read each table folder directly (``pd.read_parquet(store / "maps")``).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from actmap.artifacts import package_version
from actmap.atomic import atomic_path, atomic_write_text
from actmap.maps import MAP_BYTES, MAP_SHAPE, stored_form
from actmap.store.errors import StoreError  # noqa: F401  (raised here and re-exported)
from actmap.store.lock import acquire

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

# Options whose "off" may be written None, 0 or False: one value, stored as absent.
SWITCHES = (
    ("keep", "trajectories"),
    ("keep", "attention_keys"),
    ("keep", "dense"),
    ("capture", "attention_keys"),
    ("capture", "keep_dense"),
    ("capture", "share_prefix"),
)


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


def encode_array(array: np.ndarray, dtype=np.float16) -> bytes:
    """C-order bytes of ``array`` cast to ``dtype`` (float16 by default)."""
    return np.ascontiguousarray(np.asarray(array, dtype=dtype)).tobytes()


def decode_array(blob: bytes, shape: Sequence[int], dtype=np.float16) -> np.ndarray:
    array = np.frombuffer(blob, dtype=dtype)
    if array.size != int(np.prod(shape)):
        raise StoreError(f"stored array has {array.size} values, expected shape {tuple(shape)}")
    return array.reshape(shape)


def write_parquet(table: pa.Table, target: Path) -> None:
    """One Parquet file, written atomically (zstd: ~13% smaller than snappy on maps)."""
    with atomic_path(target) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def latest_rows(table: pa.Table) -> pa.Table:
    """Keep the last row per id (a rerun of an unfinished batch supersedes its earlier rows).

    A filter, not a take: filtering works chunk by chunk, while taking from a chunked binary
    column joins its chunks first and fails once they hold 2 GiB (a long-form store's
    attention table does)."""
    ids = table.column("id").to_pylist()
    last = {key: i for i, key in enumerate(ids)}
    keep = np.zeros(len(ids), dtype=bool)
    keep[list(last.values())] = True
    return table.filter(pa.array(keep))


# -- configs ---------------------------------------------------------------------------------
def normalize_config(config: dict) -> dict:
    """``config`` as stored: JSON values, switched-off options (None, 0, False) left out."""
    out = json.loads(json.dumps(config))
    for section, key in SWITCHES:
        part = out.get(section)
        if isinstance(part, dict) and key in part and part[key] in (None, 0, False):
            del part[key]
    return out


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


# recorded by later versions only: a store made before them resumes without them
ADDED_LATER = (("task", "demonstrations"),)


def check_config(root: Path, stored: dict, wanted: dict, ignore: Sequence[str] = ()) -> None:
    """Raise `StoreError` naming the differences when ``wanted`` means another config."""
    wanted = json.loads(json.dumps(wanted))
    for section, key in ADDED_LATER:
        if key not in (stored.get(section) or {}) and isinstance(wanted.get(section), dict):
            wanted[section].pop(key, None)
    changed = [
        (k, a, b)
        for k, a, b in config_differences(normalize_config(stored), normalize_config(wanted))
        if k.split(".")[0] not in ignore
    ]
    if changed:
        raise StoreError(
            f"{root} holds a store made with another config; use a new folder. "
            "Differences (stored -> new): "
            + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed[:8])
            + (f"; and {len(changed) - 8} more" if len(changed) > 8 else "")
        )


def claim_store(root: str | Path, config: dict, ignore: Sequence[str] = ("model",)):
    """Before an expensive load (a model): become ``root``'s writer and check its config.

    Refuses at once, with `StoreLocked` or `StoreError`, what `MapStore.create` would
    refuse later; the ``ignore``d sections (known only after the load) are checked then.
    Returns the lock's ticket: release it once the store is created.
    """

    root = Path(root)
    ticket = acquire(root)
    try:
        if (root / MANIFEST).exists():
            check_config(root, read_manifest(root).get("config") or {}, config, ignore)
    except BaseException:
        ticket.release()
        raise
    return ticket


# -- shards ----------------------------------------------------------------------------------
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


class MapStore:
    """A folder of Parquet tables sharing the ``id`` key, described by ``manifest.json``."""

    def __init__(self, root: Path, manifest: dict) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self._writer = None  # the writer lock, taken on the first write (see `acquire_writer`)

    # -- opening ----------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        root: str | Path,
        config: dict,
        resume: bool = True,
        map_shape: Sequence[int] = MAP_SHAPE,
    ) -> MapStore:
        """A new store, or the existing one at ``root`` when its config matches (resume).

        The caller becomes the store's writer (a second process gets a `StoreLocked`).
        """
        root = Path(root)
        if (root / MANIFEST).exists():
            store = cls.open(root)
            if not resume:
                raise StoreError(f"{root} already holds a store; pass resume=True to continue it")
            check_config(root, store.manifest.get("config") or {}, config)
            if tuple(map_shape) != store.map_shape:
                raise StoreError(
                    f"{root} holds maps of shape {store.map_shape}, not {tuple(map_shape)}"
                )
            store.acquire_writer()
            return store
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "package": "actmap",
            "package_version": package_version(),
            "created_at": datetime.now(UTC).isoformat(),
            "map_shape": [int(n) for n in map_shape],
            "map_dtype": "float16",
            "config": normalize_config(config),
            "shards": {},
        }
        root.mkdir(parents=True, exist_ok=True)
        store = cls(root, manifest)
        store.acquire_writer()
        if (root / MANIFEST).exists():  # another process created it meanwhile
            return cls.create(root, config, resume, map_shape)
        store._write_manifest()
        return store

    @classmethod
    def open(cls, root: str | Path) -> MapStore:
        root = Path(root)
        return cls(root, read_manifest(root))

    @property
    def map_shape(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.manifest.get("map_shape", MAP_SHAPE))

    @property
    def map_bytes(self) -> int:
        return int(np.prod(self.map_shape)) * 2

    # -- the writer lock --------------------------------------------------------------------
    def acquire_writer(self) -> None:
        """Become the store's only writer, or raise `StoreLocked` naming the holder's pid."""
        if self._writer is None:
            self._writer = acquire(self.root)
            weakref.finalize(self, self._writer.release)

    @contextmanager
    def writing(self) -> Iterator[MapStore]:
        """Be the store's writer for the block only (unless this handle was one already)."""
        held = self._writer is not None
        self.acquire_writer()
        try:
            yield self
        finally:
            if not held:
                self.close()

    def close(self) -> None:
        """Give up the writer lock (also done when the handle is collected or the process ends)."""
        if self._writer is not None:
            self._writer.release()
            self._writer = None

    def __enter__(self) -> MapStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the manifest -----------------------------------------------------------------------
    def _write_manifest(self) -> None:
        atomic_write_text(self.root / MANIFEST, json.dumps(self.manifest, indent=2, sort_keys=True))

    def edit_manifest(self, edit: Callable[[dict], None]) -> dict:
        """Apply ``edit`` to the manifest on disk, re-read under a file lock, and save it."""
        self.acquire_writer()
        with open(self.root / ".manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            current = read_manifest(self.root)
            edit(current)
            self.manifest = current
            self._write_manifest()
        return self.manifest

    def set_manifest_key(self, path: Sequence[str], value: Any) -> None:
        """Set one (nested) key, e.g. ``("results", "ppl")``, leaving every other key as it is."""

        def edit(manifest: dict) -> None:
            node = manifest
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value

        self.edit_manifest(edit)

    def update_manifest(self, **entries) -> None:
        """Record run facts (timings, counts, results) next to the config.

        The manifest on disk is re-read and merged one level deep (a dict entry such
        as ``results`` gains keys, it is not replaced).
        """

        def edit(current: dict) -> None:
            for key, value in entries.items():
                old = current.get(key)
                current[key] = (
                    {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
                )

        self.edit_manifest(edit)

    def recorded_rows(self, table: str) -> dict[str, int] | None:
        """{shard name: rows} as recorded in the manifest; None for stores older than the record."""
        shards = self.manifest.get("shards")
        return None if shards is None else dict(shards.get(table, {}))

    # -- writing ----------------------------------------------------------------------------
    def shards(self, table: str) -> list[Path]:
        return list_shards(self.root / table)

    def _next_shard(self, table: str) -> Path:
        existing = self.shards(table)
        index = max(shard_order(existing[-1])[0] + 1, 0) if existing else 0
        return self.root / table / f"part-{index:05d}-{os.getpid()}-{secrets.token_hex(3)}.parquet"

    def write_table(self, table: str, data: pa.Table) -> Path:
        """Append one shard to ``table`` (a folder name such as ``"trajectories"`` or ``"results/ppl"``)."""
        if "id" not in data.column_names:
            raise StoreError(f"table '{table}' rows need an 'id' column")
        self.acquire_writer()
        target = self._next_shard(table)
        write_parquet(data, target)
        self.set_manifest_key(("shards", table, target.name), data.num_rows)
        return target

    def replace_table(self, table: str, data: pa.Table) -> Path:
        """Write ``data`` as the newest shard of ``table``, then drop the older shards."""
        older = self.shards(table)
        target = self.write_table(table, data)
        self.forget_shards(table, older, unlink=True)
        return target

    def forget_shards(self, table: str, shards: Sequence[Path], unlink: bool = False) -> None:
        """Drop ``shards`` from the manifest (and from disk when ``unlink``)."""
        names = {s.name for s in shards}

        def edit(manifest: dict) -> None:
            recorded = manifest.setdefault("shards", {}).get(table, {})
            for name in names:
                recorded.pop(name, None)

        self.edit_manifest(edit)
        if unlink:
            for shard in shards:
                shard.unlink(missing_ok=True)

    def quarantine(self, path: Path) -> Path:
        """Move a file of the store into ``quarantine/`` (same relative path; never deleted)."""
        self.acquire_writer()
        relative = path.relative_to(self.root)
        target = self.root / QUARANTINE / relative
        if target.exists():
            target = target.with_name(f"{target.stem}-{secrets.token_hex(3)}{target.suffix}")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        return target

    def maps_table(self, records: Sequence[MapRecord]) -> pa.Table:
        """The Parquet rows of ``records``; every map must have the store's shape and be finite."""
        now = datetime.now(UTC)
        blobs = []
        for record in records:
            array = np.asarray(record.map)
            if array.shape != self.map_shape:
                raise StoreError(
                    f"map of '{record.id}' has shape {array.shape}, expected {self.map_shape}"
                )
            try:
                half = stored_form(array)
            except ValueError as err:
                raise StoreError(f"map of '{record.id}' has non-finite values: {err}") from None
            blobs.append(half.tobytes())
        schema = maps_schema(self.map_bytes)
        columns = {
            name: [getattr(r, name) for r in records]
            for name in schema.names
            if name not in ("created_at", "map")
        }
        columns["created_at"] = [now] * len(records)
        columns["map"] = blobs
        return pa.table(columns, schema=schema)

    def write_maps(self, records: Sequence[MapRecord]) -> Path:
        """Append one shard of maps: the commit of a batch."""
        return self.write_table("maps", self.maps_table(records))

    def link_tables(self, source: MapStore, skip: Callable[[str], bool]) -> None:
        """Give this store the shards of ``source``'s tables (hard links, else copies).

        Tables for which ``skip(name)`` is true are left out; shards already here are kept.
        """
        for name in source.tables():
            if skip(name):
                continue
            for shard in source.shards(name):
                target = self.root / name / shard.name
                if target.exists():
                    continue
                with atomic_path(target) as tmp:
                    tmp.unlink()
                    try:
                        os.link(shard, tmp)
                    except OSError:
                        shutil.copy2(shard, tmp)
                rows = (source.recorded_rows(name) or {}).get(shard.name)
                if rows is None:
                    rows = pq.ParquetFile(target).metadata.num_rows
                self.set_manifest_key(("shards", name, shard.name), rows)

    # -- reading ----------------------------------------------------------------------------
    def tables(self) -> list[str]:
        found = []
        for shard in self.root.rglob(SHARD_GLOB):
            relative = shard.parent.relative_to(self.root)
            if relative.parts and relative.parts[0] != QUARANTINE:
                found.append(relative.as_posix())
        return sorted(set(found))

    def dataset(self, table: str = "maps") -> ds.Dataset:
        shards = self.shards(table)
        if not shards:
            raise StoreError(f"{self.root} has no table '{table}'")
        try:
            return ds.dataset([str(s) for s in shards], format="parquet")
        except pa.ArrowInvalid as error:
            raise StoreError(
                f"a shard of '{table}' in {self.root} is corrupt: {error}; "
                f"run `actmap store verify {self.root}`"
            ) from error

    def has_table(self, table: str) -> bool:
        return bool(self.shards(table))

    def read_table(
        self, table: str = "maps", columns: Sequence[str] | None = None, where=None
    ) -> pa.Table:
        """``table``'s ``columns`` (all by default), the rows that match ``where`` (a
        `pyarrow.compute` expression, applied as each shard is read)."""
        try:
            return self.dataset(table).to_table(
                columns=list(columns) if columns else None, filter=where
            )
        except (pa.ArrowInvalid, OSError) as error:
            raise StoreError(
                f"cannot read table '{table}' of {self.root}: {error}; "
                f"run `actmap store verify {self.root}`"
            ) from error

    def read_latest(
        self,
        table: str,
        columns: Sequence[str] | None = None,
        ids: Iterable[str] | None = None,
    ) -> pa.Table:
        """``table`` with one row per id, the last written (see `latest_rows`); with ``ids``,
        only those rows, filtered as the shards are read (a big table never sits whole)."""
        wanted = None if columns is None else list(dict.fromkeys(["id", *columns]))
        where = None
        if ids is not None:
            where = pc.field("id").isin(pa.array(sorted(set(ids)), pa.string()))
        return latest_rows(self.read_table(table, wanted, where))

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
        """Stream (maps (n, C, H, W) float16, metadata batch) without loading the whole store."""
        wanted = list(dict.fromkeys([*columns, "map"]))
        for batch in self.dataset("maps").to_batches(columns=wanted, batch_size=batch_size):
            yield maps_from_column(batch.column("map"), self.map_shape), batch.drop_columns(["map"])

    def load_maps(self, ids: Sequence[str] | None = None) -> tuple[np.ndarray, object]:
        """(maps (N, C, H, W) float16, metadata DataFrame) in the order of ``ids`` (or storage order)."""
        # only the rows asked for, filtered as the shards are read (the last row of an id, as
        # everywhere): a caller reading a big store 512 rows at a time reads 512 maps, not all
        table = self.read_table("maps") if ids is None else self.read_latest("maps", ids=ids)
        if ids is not None:
            index = {key: i for i, key in enumerate(table.column("id").to_pylist())}
            missing = [key for key in ids if key not in index]
            if missing:
                raise StoreError(f"{len(missing)} ids are not in the store, e.g. {missing[:3]}")
            table = table.take(pa.array([index[key] for key in ids]))
        maps = maps_from_column(table.column("map"), self.map_shape)
        return maps, table.drop_columns(["map"]).to_pandas()


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


def maps_from_column(
    column: pa.ChunkedArray | pa.Array, shape: Sequence[int] = MAP_SHAPE
) -> np.ndarray:
    """Zero-copy-ish view of a fixed-size-binary map column as (n, *shape) float16."""
    shape = tuple(shape)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if len(column) == 0:
        return np.zeros((0, *shape), dtype=np.float16)
    if column.null_count:
        raise StoreError("the map column has missing values")
    width = int(np.prod(shape)) * 2
    if not pa.types.is_fixed_size_binary(column.type) or column.type.byte_width != width:
        raise StoreError(f"stored maps are {column.type}, expected fixed_size_binary[{width}]")
    buffer = column.buffers()[1]
    values = np.frombuffer(
        buffer, dtype=np.float16, count=len(column) * width // 2, offset=column.offset * width
    )
    return values.reshape(len(column), *shape)
