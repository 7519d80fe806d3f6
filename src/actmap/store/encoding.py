"""Arrays as bytes and tables as Parquet: how values reach disk and come back.

    encode_array / decode_array   C-order bytes of an array (float16 by default) and back
    maps_from_column              the ``map`` column (fixed-size binary) as (n, C, H, W) float16
    write_parquet                 one Parquet file, written atomically
    latest_rows                   the last row per id of a table (a rerun supersedes)
    decode_rows                   {id: array} of a side table of arrays (trajectories, dense,
                                  positions, attention), the one decoder of such a table

The float16 stored form of a map itself (checked after the cast) is `actmap.maps.stored_form`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actmap.atomic import atomic_path
from actmap.maps import MAP_SHAPE
from actmap.store.errors import StoreError


def encode_array(array: np.ndarray, dtype=np.float16) -> bytes:
    """C-order bytes of ``array`` cast to ``dtype`` (float16 by default)."""
    return np.ascontiguousarray(np.asarray(array, dtype=dtype)).tobytes()


def decode_array(blob: bytes, shape: Sequence[int], dtype=np.float16) -> np.ndarray:
    array = np.frombuffer(blob, dtype=dtype)
    if array.size != int(np.prod(shape)):
        raise StoreError(f"stored array has {array.size} values, expected shape {tuple(shape)}")
    return array.reshape(shape)


ARRAY_COLUMNS = {"trajectories": "trajectory"}  # a side table's array column: else its own name


def array_column(table: str) -> str:
    """The column holding the arrays of side table ``table`` (beside ``id`` and ``shape``)."""
    return ARRAY_COLUMNS.get(table, table)


def decode_rows(data: pa.Table, table: str, ids: Iterable[str]) -> dict[str, np.ndarray]:
    """{id: float16 array} of the rows of ``data`` (side table ``table``, one row per id as
    `latest_rows` leaves it) whose id is in ``ids``; an id without a row is left out."""
    wanted = set(ids)
    out: dict[str, np.ndarray] = {}
    for batch in data.to_batches(max_chunksize=256):
        keys, shapes = batch.column("id").to_pylist(), batch.column("shape")
        blobs = batch.column(array_column(table))
        for i, key in enumerate(keys):
            if key in wanted:
                out[key] = decode_array(blobs[i].as_py(), shapes[i].as_py())
    return out


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
