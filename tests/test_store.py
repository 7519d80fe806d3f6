"""The map store: exact bytes, atomic shards, manifest checks, streaming and direct Parquet reads."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actmap.store import MAP_BYTES, MapRecord, MapStore, StoreError


def record(i: int, rng: np.random.Generator, label: int | None = 1) -> MapRecord:
    return MapRecord(
        id=f"d:{i}",
        source_key=str(i),
        dataset="d",
        split="train",
        model_name="m",
        model_revision="r",
        prompt=f"p{i}",
        answer=f"a{i}",
        n_tokens=i + 1,
        label=label,
        map=rng.standard_normal((12, 32, 128)).astype(np.float32),
    )


def test_maps_round_trip_as_float16_with_exact_bytes(tmp_path):
    rng = np.random.default_rng(0)
    store = MapStore.create(tmp_path / "s", {"a": 1})
    records = [record(i, rng, label=i % 2 if i != 2 else None) for i in range(5)]
    store.write_maps(records[:3])
    store.write_maps(records[3:])
    assert MAP_BYTES == 12 * 32 * 128 * 2 == 98_304
    maps, meta = store.load_maps()
    assert maps.dtype == np.float16 and maps.shape == (5, 12, 32, 128)
    for i, r in enumerate(records):
        np.testing.assert_array_equal(maps[i], r.map.astype(np.float16))
    assert meta["label"].isna().tolist() == [False, False, True, False, False]
    # pandas and pyarrow read the table folder directly; each map is exactly 98,304 bytes
    frame = pd.read_parquet(tmp_path / "s" / "maps")
    assert {len(b) for b in frame["map"]} == {MAP_BYTES}
    assert pq.read_table(tmp_path / "s" / "maps").num_rows == 5
    # order by requested ids
    maps2, meta2 = store.load_maps(["d:4", "d:0"])
    assert meta2["id"].tolist() == ["d:4", "d:0"]
    np.testing.assert_array_equal(maps2[0], maps[4])


def test_streaming_matches_full_load(tmp_path):
    rng = np.random.default_rng(1)
    store = MapStore.create(tmp_path, {})
    for start in range(0, 10, 4):
        store.write_maps([record(i, rng) for i in range(start, min(start + 4, 10))])
    full, meta = store.load_maps()
    seen = []
    for maps, batch in store.iter_maps(batch_size=3):
        assert maps.shape[0] <= 3
        for row, key in enumerate(batch.column("id").to_pylist()):
            index = meta.index[meta["id"] == key][0]
            np.testing.assert_array_equal(maps[row], full[index])
            seen.append(key)
    assert sorted(seen) == sorted(meta["id"])


def test_bad_maps_and_bad_stores_are_refused(tmp_path):
    rng = np.random.default_rng(2)
    store = MapStore.create(tmp_path / "s", {"x": 1})
    bad = record(0, rng)
    with pytest.raises(StoreError, match="shape"):
        store.write_maps([MapRecord(**{**bad.__dict__, "map": np.zeros((12, 32, 127))})])
    nan_map = bad.map.copy()
    nan_map[0, 0, 0] = np.nan
    with pytest.raises(StoreError, match="non-finite"):
        store.write_maps([MapRecord(**{**bad.__dict__, "map": nan_map})])
    assert not store.has_table("maps")  # nothing half-written
    with pytest.raises(StoreError, match="another config") as refused:
        MapStore.create(tmp_path / "s", {"x": 2})
    assert "x: 1 -> 2" in str(refused.value)  # the message names what changed
    with pytest.raises(StoreError, match="manifest.json is missing"):
        MapStore.open(tmp_path / "nothing")
    (tmp_path / "s" / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="not valid JSON"):
        MapStore.open(tmp_path / "s")
    (tmp_path / "s" / "manifest.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(StoreError, match="schema_version 99"):
        MapStore.open(tmp_path / "s")


def test_corrupt_shard_is_named_and_earlier_data_survives(tmp_path):
    rng = np.random.default_rng(3)
    store = MapStore.create(tmp_path, {})
    store.write_maps([record(0, rng)])
    (tmp_path / "maps" / "part-00001.parquet").write_bytes(b"garbage")
    with pytest.raises(StoreError, match="corrupt|cannot read"):
        store.load_maps()
    (tmp_path / "maps" / "part-00001.parquet").unlink()
    assert store.ids() == {"d:0"}


def test_side_tables_and_replace(tmp_path):
    store = MapStore.create(tmp_path, {})
    store.write_table("results/x", pa.table({"id": ["a"], "v": [1.0]}))
    store.write_table("results/x", pa.table({"id": ["b"], "v": [2.0]}))
    assert store.ids("results/x") == {"a", "b"}
    store.replace_table("results/x", pa.table({"id": ["c"], "v": [3.0]}))
    assert store.ids("results/x") == {"c"}
    assert "results/x" in store.tables()
    with pytest.raises(StoreError, match="'id'"):
        store.write_table("t", pa.table({"v": [1]}))
    assert not list(tmp_path.rglob(".tmp-*"))


def test_manifest_updates_from_two_handles_merge(tmp_path):
    first = MapStore.create(tmp_path, {"c": 1})
    second = MapStore.open(tmp_path)  # another process's view, opened before the first writes
    first.update_manifest(results={"ppl": {"rows": 3}})
    second.update_manifest(results={"actvit": {"rows": 5}}, note="x")
    merged = MapStore.open(tmp_path).manifest
    assert merged["results"] == {"ppl": {"rows": 3}, "actvit": {"rows": 5}}
    assert merged["note"] == "x" and merged["config"] == {"c": 1}


def test_config_differences_name_nested_keys():
    from actmap.store import config_differences

    old = {"capture": {"max_new_tokens": 32, "batch_size": 32}, "task": "a"}
    new = {"capture": {"max_new_tokens": 32, "batch_size": 8, "stop_strings": ["\n"]}, "task": "a"}
    assert config_differences(old, new) == [
        ("capture.batch_size", 32, 8),
        ("capture.stop_strings", None, ["\n"]),
    ]
    assert config_differences(new, new) == []
