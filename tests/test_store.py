"""The map store: exact bytes, atomic shards, manifest checks, streaming and direct Parquet reads."""

from __future__ import annotations

import json
import os

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
    # a rerun of an id supersedes its earlier row; an unknown id is named
    again = record(0, rng)
    store.write_maps([again])
    maps3, meta3 = store.load_maps(["d:1", "d:0"])
    np.testing.assert_array_equal(maps3[1], again.map.astype(np.float16))
    np.testing.assert_array_equal(maps3[0], maps[1])
    assert meta3["id"].tolist() == ["d:1", "d:0"]
    with pytest.raises(StoreError, match="d:9"):
        store.load_maps(["d:0", "d:9"])


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
    big_map = bad.map.astype(np.float32)  # finite in float32, inf once stored as float16
    big_map[3, 4, 5] = 70000.0
    with pytest.raises(StoreError, match=f"map of '{bad.id}' has non-finite values.*float16"):
        store.write_maps([MapRecord(**{**bad.__dict__, "map": big_map})])
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


# -- the store's rules ---------------------------------------------------------------------------
def test_latest_rows_keep_the_last_row_per_id_in_write_order(tmp_path):
    from actmap.store import latest_rows

    table = pa.table({"id": ["a", "b", "a", "c", "b"], "v": [1, 2, 3, 4, 5]})
    kept = latest_rows(table).to_pydict()
    # naive reference: the last value seen per id, in the order of each id's last row
    last = {}
    for key, value in zip(table["id"].to_pylist(), table["v"].to_pylist(), strict=True):
        last.pop(key, None)
        last[key] = value
    assert list(zip(kept["id"], kept["v"], strict=True)) == list(last.items())
    store = MapStore.create(tmp_path, {})
    store.write_table("generations", pa.table({"id": ["a", "b"], "v": [1, 2]}))
    store.write_table("generations", pa.table({"id": ["a"], "v": [3]}))  # a rerun of 'a'
    assert store.read_latest("generations", ["v"]).to_pydict() == {"id": ["b", "a"], "v": [2, 3]}


def test_latest_rows_keeps_a_chunked_binary_column_past_2_gib_chunk_by_chunk():
    """A long-form store's attention table holds more than 2 GiB of bytes: taking rows from it
    joined its chunks and failed (int32 offsets). The chunks here share one untouched buffer,
    so the test allocates almost nothing."""
    from actmap.store import latest_rows

    big = (1 << 30) + (1 << 26)  # two of these pass 2 GiB
    data = pa.allocate_buffer(big + 16)

    def batch(ids, sizes):
        offsets = pa.py_buffer(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
        column = pa.Array.from_buffers(pa.binary(), len(sizes), [None, offsets, data])
        return pa.record_batch([pa.array(ids), column], names=["id", "blob"])

    # 'a' and 'b' are written big, then rewritten small: the small ones are the latest
    table = pa.Table.from_batches(
        [batch(["a"], [big]), batch(["b"], [big]), batch(["a", "b"], [3, 5])]
    )
    assert table.column("blob").chunks[0].nbytes + table.column("blob").chunks[1].nbytes > 2**31
    kept = latest_rows(table)
    assert kept.column("id").to_pylist() == ["a", "b"]
    assert [len(b) for b in kept.column("blob").to_pylist()] == [3, 5]


def test_read_latest_of_some_ids_matches_filtering_the_whole_table(tmp_path):
    store = MapStore.create(tmp_path, {})
    store.write_table("generations", pa.table({"id": ["a", "b", "c"], "v": [1, 2, 3]}))
    store.write_table("generations", pa.table({"id": ["c", "a"], "v": [4, 5]}))  # reruns
    whole = store.read_latest("generations").to_pylist()
    for ids in (["a"], ["c", "b"], ["b", "b", "z"], []):
        some = store.read_latest("generations", ["v"], ids=ids).to_pylist()
        assert some == [row for row in whole if row["id"] in ids]


def test_shard_names_cannot_collide_and_sort_in_write_order(tmp_path):
    from actmap.store import list_shards

    store = MapStore.create(tmp_path, {})
    (tmp_path / "t").mkdir()
    pq.write_table(pa.table({"id": ["old"]}), tmp_path / "t" / "part-00000.parquet")  # older name
    written = [store.write_table("t", pa.table({"id": [str(i)]})) for i in range(12)]
    names = [p.name for p in written]
    assert len(set(names)) == 12
    assert all(name.startswith(f"part-{i + 1:05d}-{os.getpid()}-") for i, name in enumerate(names))
    assert list_shards(tmp_path / "t") == [tmp_path / "t" / "part-00000.parquet", *written]
    # two writers that compute the same sequence number still get different files
    again = {store._next_shard("t").name for _ in range(50)}
    assert len(again) == 50


def test_manifest_updates_of_one_key_leave_the_rest(tmp_path):
    first = MapStore.create(tmp_path, {"c": 1})
    first.update_manifest(results={"ppl": {"rows": 3, "auroc": 0.6}})
    second = MapStore.open(tmp_path)
    first.set_manifest_key(("results", "actvit"), {"rows": 5})
    second.set_manifest_key(("results", "ppl", "auroc"), 0.7)  # re-read on disk: keeps actvit
    merged = MapStore.open(tmp_path).manifest
    assert merged["results"] == {"ppl": {"rows": 3, "auroc": 0.7}, "actvit": {"rows": 5}}
    assert merged["config"] == {"c": 1}


def test_split_fingerprint_hashes_ids_and_labels(tmp_path):
    from actmap.store.rows import balanced_splits, rows_fingerprint

    rng = np.random.default_rng(7)
    store = MapStore.create(tmp_path, {})
    records = [record(i, rng, label=i % 2) for i in range(8)]
    store.write_maps(records)
    first = balanced_splits(store)
    ids, labels = [r.id for r in records], [r.label for r in records]
    assert rows_fingerprint(ids, labels) == rows_fingerprint(ids[::-1], labels[::-1])
    swapped = [1 - x if i in (0, 1) else x for i, x in enumerate(labels)]  # same class counts
    assert rows_fingerprint(ids, swapped) != rows_fingerprint(ids, labels)
    assert rows_fingerprint(ids, labels, seed=1) != rows_fingerprint(ids, labels)
    stored = store.read_table("splits").column("fingerprint")[0].as_py()
    assert stored == rows_fingerprint(ids, labels)
    assert balanced_splits(store) == first  # unchanged rows: read back, not recomputed


def test_generations_are_read_through_the_store(tmp_path):
    from actmap.capture.from_store import read_generations

    store = MapStore.create(tmp_path, {})
    rng = np.random.default_rng(8)
    store.write_maps([record(0, rng)])
    row = {
        "id": ["d:0"],
        "token_ids": pa.array([[5, 6]], pa.list_(pa.int32())),
        "logprobs": pa.array([[-0.5, -1.0]], pa.list_(pa.float32())),
        "entropies": pa.array([[0.1, 0.2]], pa.list_(pa.float32())),
        "stopped": [True],
        "prompt_tokens": pa.array([4], pa.int32()),
        "eos_logprob": pa.array([None], pa.float32()),
        "eos_entropy": pa.array([None], pa.float32()),
    }
    store.write_table("generations", pa.table(row))
    store.write_table(
        "generations", pa.table({**row, "token_ids": pa.array([[7]], pa.list_(pa.int32()))})
    )
    (generation,) = read_generations(store, ["d:0"])
    assert generation.token_ids == [7]  # the rerun's row
    assert generation.prompt == "p0" and generation.answer == "a0"
    with pytest.raises(StoreError, match="'d:9' has no row in the generations table"):
        read_generations(store, ["d:9"])


def test_ablation_maps_become_a_store_that_training_reads(tmp_path):
    import torch

    from actmap.experiments.seeds import load_balanced
    from actmap.maps import MapConfig, build_maps_from_list
    from actmap.store.derived import build_map_store

    rng = np.random.default_rng(9)
    source = MapStore.create(tmp_path / "src", {"task": "t"})
    records = [record(i, rng, label=i % 2) for i in range(12)]
    records = [
        MapRecord(**{**r.__dict__, "split": ("train", "validation", "test")[i % 3]})
        for i, r in enumerate(records)
    ]
    trajectories = [rng.standard_normal((30, 3 + i, 128)).astype(np.float32) for i in range(12)]
    source.write_maps(records)
    records[0] = MapRecord(**{**records[0].__dict__, "label": 1 - records[0].label})
    source.write_maps([records[0]])  # a rewritten id: its last row is the one derived
    source.write_table(
        "trajectories",
        pa.table(
            {
                "id": [r.id for r in records],
                "shape": pa.array([list(t.shape) for t in trajectories], pa.list_(pa.int32())),
                "trajectory": [t.astype(np.float16).tobytes() for t in trajectories],
            }
        ),
    )
    source.write_table("generations", pa.table({"id": [r.id for r in records]}))
    config = MapConfig(layers_out=16, coords_out=64, n_segments=8)
    derived = build_map_store(source, tmp_path / "ablation", config, batch_size=5)
    assert derived.map_shape == (16, 16, 64) and derived.manifest["map_shape"] == [16, 16, 64]
    assert derived.manifest["config"]["map"]["n_segments"] == 8
    maps, meta = MapStore.open(tmp_path / "ablation").load_maps([r.id for r in records])
    expected = build_maps_from_list(
        [torch.from_numpy(t.astype(np.float16).astype(np.float32)) for t in trajectories], config
    ).half()
    np.testing.assert_array_equal(maps, expected.numpy())
    assert meta["label"].tolist() == [r.label for r in records]
    assert derived.has_table("generations")  # side tables shared with the source
    splits, _ = load_balanced(tmp_path / "ablation")
    assert splits["train"].maps.shape[1:] == (16, 16, 64)
    with pytest.raises(StoreError, match="shape"):
        derived.write_maps([record(99, rng)])  # a 12x32x128 map does not fit this store


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_store_files_take_the_umask_modes_of_ordinary_files(tmp_path, umask):
    from actmap.atomic import atomic_path

    old = os.umask(umask)
    try:
        # the reference: what a plain open() and mkdir give under the same umask
        (tmp_path / "plain.txt").write_text("x")
        (tmp_path / "plain-dir").mkdir()
        store = MapStore.create(tmp_path / "s", {"a": 1})
        store.write_maps([record(0, np.random.default_rng(0))])
        with atomic_path(tmp_path / "folder", directory=True) as tmp:
            (tmp / "inside.txt").write_text("y")
    finally:
        os.umask(old)
    file_mode = (tmp_path / "plain.txt").stat().st_mode & 0o777
    dir_mode = (tmp_path / "plain-dir").stat().st_mode & 0o777
    assert file_mode == 0o666 & ~umask and dir_mode == 0o777 & ~umask
    written = [p for p in (tmp_path / "s").rglob("*") if p.is_file() and p.name != "writer.lock"]
    assert any(p.suffix == ".parquet" for p in written) and any(
        p.name == "manifest.json" for p in written
    )
    assert {p.stat().st_mode & 0o777 for p in written} == {file_mode}
    assert (tmp_path / "folder").stat().st_mode & 0o777 == dir_mode


def test_rows_come_in_one_form_and_a_non_finite_map_is_refused_by_name(tmp_path):
    from actmap.errors import ActmapUserError
    from actmap.store.rows import natural_accuracy, natural_ids, natural_rows, read_rows

    rng = np.random.default_rng(5)
    store = MapStore.create(tmp_path / "s", {"a": 1})
    labels = [1, 0, 0, None, 1, 0]  # one unlabelled row; the labelled ones are 2 of 5 correct
    records = [record(i, rng, label=y) for i, y in enumerate(labels)]
    store.write_maps(records)
    assert natural_ids(store)["train"] == ["d:0", "d:1", "d:2", "d:4", "d:5"]
    assert natural_accuracy(store) == {"train": 0.4, "all": 0.4}
    rows = natural_rows(store, ("train",))["train"]
    assert rows.prevalence == 0.4 and len(rows) == 5 and rows.scalars is None
    picked = read_rows(store, ["d:5", "d:0"])  # in the order asked for
    assert picked.labels.tolist() == [0, 1]
    np.testing.assert_array_equal(picked.maps[1], records[0].map.astype(np.float16))
    # a map that is not finite (a store written before the store checked) is refused once,
    # here, for every reader of rows
    real = store.load_maps

    def damaged(ids=None):
        maps, meta = real(ids)
        maps = maps.copy()
        maps[-1, 0, 0, 0] = np.inf
        return maps, meta

    store.load_maps = damaged
    with pytest.raises(ActmapUserError, match="the map of id 'd:0' has NaN or infinite values"):
        read_rows(store, ["d:5", "d:0"], "test rows")


def test_an_id_written_twice_is_one_row_with_its_last_label(tmp_path):
    """An id ``maps`` holds twice (one process appending a batch again); every row reader
    counts it once, with the label and map of its last row (as `MapStore.load_maps` does)."""
    from actmap.store.rows import (
        balanced_rows,
        balanced_splits,
        natural_accuracy,
        natural_rows,
        rows_to_score,
        store_summary,
    )

    rng = np.random.default_rng(6)
    store = MapStore.create(tmp_path / "s", {"a": 1})
    first = [record(i, rng, label=y) for i, y in enumerate([1, 1, 0, 0, 1, 0])]
    store.write_maps(first)
    again = record(0, rng, label=0)  # d:0 rewritten, now incorrect
    store.write_maps([again])
    assert len(store.metadata()) == 7  # the raw table holds d:0 twice
    # by hand: d:0..d:5 once each, labels 0 1 0 0 1 0 -> 2 of 6 correct
    assert natural_accuracy(store) == {"train": pytest.approx(2 / 6), "all": pytest.approx(2 / 6)}
    rows = natural_rows(store, ("train",))["train"]
    assert rows.row_ids() == ["d:1", "d:2", "d:3", "d:4", "d:5", "d:0"]
    assert rows.labels.tolist() == [1, 0, 0, 1, 0, 0]
    np.testing.assert_array_equal(rows.maps[-1], again.map.astype(np.float16))
    ids = balanced_splits(store, persist=False)["train"]
    assert len(ids) == len(set(ids)) == 4  # 2 correct + 2 of the 4 incorrect
    balanced = balanced_rows(store, persist=False, splits=("train",))["train"]
    assert balanced.labels.sum() == 2 and not store.has_table("splits")
    assert len(rows_to_score(store, "all").ids) == 6
    summary = store_summary(store).splits["train"]
    assert (summary.rows, summary.labelled, summary.correct) == (6, 6, 2)
