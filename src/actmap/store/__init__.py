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

The store's rules, kept by the modules below:

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

The package's modules, each with one job (every public name is re-exported here):

    schema     names on disk, SCHEMA_VERSION, the ``maps`` schema and `MapRecord`, the manifest
    encoding   arrays <-> bytes, the map column, atomic Parquet files, the last row per id
    config     configs compared by meaning; `claim_store` before an expensive load
    map_store  `MapStore`
    lock, check, derived, rows, errors   the writer lock, verify/repair, derived stores, rows
"""

from actmap.maps import MAP_BYTES, MAP_SHAPE
from actmap.store.config import (
    ADDED_LATER,
    SWITCHES,
    check_config,
    claim_store,
    config_differences,
    normalize_config,
)
from actmap.store.encoding import (
    array_column,
    decode_array,
    decode_rows,
    encode_array,
    latest_rows,
    maps_from_column,
    write_parquet,
)
from actmap.store.errors import StoreError
from actmap.store.map_store import MapStore
from actmap.store.schema import (
    MANIFEST,
    MAPS_SCHEMA,
    QUARANTINE,
    SCHEMA_VERSION,
    SHARD_GLOB,
    MapRecord,
    list_shards,
    maps_schema,
    read_manifest,
    shard_order,
)

__all__ = [
    "ADDED_LATER",
    "MANIFEST",
    "MAPS_SCHEMA",
    "MAP_BYTES",
    "MAP_SHAPE",
    "QUARANTINE",
    "SCHEMA_VERSION",
    "SHARD_GLOB",
    "SWITCHES",
    "MapRecord",
    "MapStore",
    "StoreError",
    "check_config",
    "claim_store",
    "config_differences",
    "array_column",
    "decode_array",
    "decode_rows",
    "encode_array",
    "latest_rows",
    "list_shards",
    "maps_from_column",
    "maps_schema",
    "normalize_config",
    "read_manifest",
    "shard_order",
    "write_parquet",
]
