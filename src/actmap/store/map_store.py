"""`MapStore`: a store folder opened for reading and writing (its layout: `actmap.store`).

Shards are written atomically and recorded in the manifest (`actmap.store.schema`),
values are encoded by `actmap.store.encoding`, a resumed store's config is checked by
`actmap.store.config`, and one process writes at a time (`actmap.store.lock`).
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
from actmap.maps import MAP_SHAPE, stored_form
from actmap.store.config import check_config, normalize_config
from actmap.store.encoding import decode_rows, latest_rows, maps_from_column, write_parquet
from actmap.store.errors import StoreError
from actmap.store.lock import acquire
from actmap.store.schema import (
    MANIFEST,
    QUARANTINE,
    SCHEMA_VERSION,
    SHARD_GLOB,
    MapRecord,
    list_shards,
    maps_schema,
    read_manifest,
    shard_order,
)


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

    def dataset(self, table: str = "maps", schema: pa.Schema | None = None) -> ds.Dataset:
        """``table``'s shards as one dataset; with ``schema``, shards written before a column
        was added read it as nulls (without it, the first shard's columns win)."""
        shards = self.shards(table)
        if not shards:
            raise StoreError(f"{self.root} has no table '{table}'")
        try:
            return ds.dataset([str(s) for s in shards], format="parquet", schema=schema)
        except pa.ArrowInvalid as error:
            raise StoreError(
                f"a shard of '{table}' in {self.root} is corrupt: {error}; "
                f"run `actmap store verify {self.root}`"
            ) from error

    def has_table(self, table: str) -> bool:
        return bool(self.shards(table))

    def read_table(
        self,
        table: str = "maps",
        columns: Sequence[str] | None = None,
        where=None,
        schema: pa.Schema | None = None,
    ) -> pa.Table:
        """``table``'s ``columns`` (all by default), the rows that match ``where`` (a
        `pyarrow.compute` expression, applied as each shard is read); ``schema``: see `dataset`."""
        try:
            return self.dataset(table, schema).to_table(
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

    def read_arrays(self, table: str, ids: Sequence[str], hint: str = "") -> dict[str, np.ndarray]:
        """{id: float16 array} of side table ``table`` (trajectories, dense, positions,
        attention) for ``ids``, the last row of each; only those rows are read. An id without
        a row raises `StoreError` (``hint`` says how to add them)."""
        out = decode_rows(self.read_latest(table, ids=ids), table, ids)
        missing = [key for key in ids if key not in out]
        if missing:
            raise StoreError(
                f"{self.root}: {len(missing)} rows have no {table} (e.g. {missing[:3]})"
                + (f"; {hint}" if hint else "")
            )
        return out

    def ids(self, table: str = "maps") -> set[str]:
        if not self.has_table(table):
            return set()
        return set(self.read_table(table, ["id"]).column("id").to_pylist())

    def metadata(self, table: str = "maps", latest: bool = False):
        """All columns except the map bytes, as a pandas DataFrame; ``latest``: one row per id,
        the last written (as `load_maps` and `read_latest` read a rewritten id)."""
        names = [n for n in self.dataset(table).schema.names if n != "map"]
        frame = self.read_table(table, names).to_pandas()
        return frame.drop_duplicates("id", keep="last") if latest else frame

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
