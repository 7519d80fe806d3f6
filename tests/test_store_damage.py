"""Damaged stores: verify names the damage, repair sets it aside, a resume restores the store.

Also one writer at a time (lock, refusal naming the pid, stale lock taken over) and writes
that cannot tear (an injected failure mid-shard, SIGKILL mid-shard). Every case is made on
a small store in the test.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_store import record as store_record

import actmap.store.encoding as store_module
from actmap.store import MapRecord, MapStore, StoreError
from actmap.store.check import repair_store, verify_store
from actmap.store.lock import LOCK_FILE, StoreLocked, acquire, read_holder

ROOT = Path(__file__).resolve().parents[1]
IDS = [f"d:{i}" for i in range(12)]


def record(key: str, rng: np.random.Generator) -> MapRecord:
    """The map row of ``key`` ("d:<n>"), labelled by the parity of its last digit."""
    return store_record(int(key.split(":")[1]), rng, label=int(key[-1]) % 2)


def commit(store: MapStore, keys: list[str], rng, drop_side: tuple[str, ...] = ()) -> None:
    """One batch as a capture commits it: side table first, maps shard last."""
    side = [k for k in keys if k not in drop_side]
    store.write_table("generations", pa.table({"id": side, "question": [f"q {k}" for k in side]}))
    store.write_maps([record(k, rng) for k in keys])


def resume(store: MapStore, rng) -> list[str]:
    """What a resumed capture does: commit every id of the task not yet in maps."""
    todo = [k for k in IDS if k not in store.ids("maps")]
    for start in range(0, len(todo), 4):
        commit(store, todo[start : start + 4], rng)
    return todo


def small_store(root: Path, seed: int = 0) -> MapStore:
    store = MapStore.create(root, {"task": {"task": "d"}})
    rng = np.random.default_rng(seed)
    for start in range(0, len(IDS), 4):
        commit(store, IDS[start : start + 4], rng)
    return store


def map_ids(store: MapStore) -> list[str]:
    return store.read_table("maps", ["id"]).column("id").to_pylist()


def messages(report) -> str:
    return "\n".join(str(f) for f in report.findings)


def test_a_sound_store_verifies(tmp_path):
    store = small_store(tmp_path / "s")
    report = verify_store(tmp_path / "s")
    assert report.ok and report.findings == []
    assert report.rows == {"generations": 12, "maps": 12} and report.shards["maps"] == 3
    recorded = store.recorded_rows("maps")
    assert sorted(recorded.values()) == [4, 4, 4]  # the manifest records every shard's rows
    assert sorted(recorded) == sorted(s.name for s in store.shards("maps"))


def test_truncated_shard_is_named_quarantined_and_resume_restores(tmp_path):
    store = small_store(tmp_path / "s")
    shard = store.shards("maps")[1]
    original = shard.read_bytes()
    shard.write_bytes(original[: len(original) // 2])
    with pytest.raises(StoreError, match="store verify"):
        store.load_maps()  # readers point at the remedy
    report = verify_store(store)
    assert not report.ok
    assert f"damage maps/{shard.name}: unreadable" in messages(report)
    result = repair_store(store)
    moved = tmp_path / "s" / "quarantine" / "maps" / shard.name
    assert moved.read_bytes() == original[: len(original) // 2]  # set aside, never deleted
    assert result.regenerate == IDS[4:8]  # known from the batch's side-table rows
    assert result.lost_rows == 4 and result.after.ok
    assert MapStore.open(tmp_path / "s").manifest["repairs"][-1]["regenerate"] == IDS[4:8]
    assert resume(store, np.random.default_rng(1)) == IDS[4:8]
    final = verify_store(tmp_path / "s")
    assert final.ok and final.findings == []
    assert sorted(map_ids(store)) == sorted(IDS)


def test_duplicate_ids_are_all_set_aside_and_regenerated_once(tmp_path):
    store = small_store(tmp_path / "s")
    first = store.shards("maps")[0]
    shutil.copy(first, first.with_name("part-00007-999-abcdef.parquet"))  # a second writer's copy
    report = verify_store(store)
    text = messages(report)
    assert not report.ok and "4 ids appear more than once" in text
    assert first.name in text and "part-00007-999-abcdef.parquet" in text
    assert "not recorded in the manifest" in text  # the copy was never recorded
    result = repair_store(store)
    assert result.regenerate == IDS[:4]
    assert [dropped for _, _, dropped in result.rewritten] == [4, 4]
    quarantined = sorted(p.name for p in (tmp_path / "s" / "quarantine" / "maps").iterdir())
    assert quarantined == sorted([first.name, "part-00007-999-abcdef.parquet"])
    assert sorted(map_ids(store)) == sorted(IDS[4:])
    assert result.after.ok
    resume(store, np.random.default_rng(2))
    assert verify_store(store).ok
    ids = map_ids(store)
    assert sorted(ids) == sorted(IDS) and len(ids) == len(set(ids))
    # readers see the regenerated side-table row (the last one), matching the new map row
    latest = store.read_latest("generations")
    assert sorted(latest.column("id").to_pylist()) == sorted(IDS)


def test_missing_side_table_row_drops_the_map_row_for_regeneration(tmp_path):
    store = MapStore.create(tmp_path / "s", {})
    rng = np.random.default_rng(3)
    commit(store, IDS[:4], rng)
    commit(store, IDS[4:8], rng, drop_side=("d:5",))
    report = verify_store(store)
    assert not report.ok
    assert "damage generations: 1 maps rows have no row here: d:5" in messages(report)
    result = repair_store(store)
    assert result.regenerate == ["d:5"]
    assert sorted(map_ids(store)) == sorted(set(IDS[:8]) - {"d:5"})
    resume(store, rng)
    assert verify_store(store).ok and sorted(map_ids(store)) == sorted(IDS)


def test_bad_maps_splits_and_counts_are_named(tmp_path):
    store = small_store(tmp_path / "s")
    # balanced rows naming an id that is not in maps
    store.write_table("splits", pa.table({"id": ["d:0", "d:99"], "split": ["train", "test"]}))
    # a non-finite map written behind the store's back
    table = store.maps_table([record("d:50", np.random.default_rng(4))])
    blob = np.frombuffer(table.column("map")[0].as_py(), np.float16).copy()
    blob[7] = np.inf
    table = table.set_column(11, "map", pa.array([blob.tobytes()], table.schema.field("map").type))
    pq.write_table(table, tmp_path / "s" / "maps" / "part-00008-1-aaaaaa.parquet")
    # a shard whose row count differs from the manifest's record
    generations = store.shards("generations")[0]
    pq.write_table(pq.read_table(generations).slice(0, 3), generations)
    text = messages(verify_store(store))
    assert "damage splits: balanced rows name 1 ids not in maps: d:99" in text
    assert "damage maps/part-00008-1-aaaaaa.parquet: 1 map not finite: d:50" in text
    assert f"damage generations/{generations.name}: holds 3 rows, the manifest records 4" in text
    result = repair_store(store)
    moved = {path for path, _ in result.quarantined}
    assert f"generations/{generations.name}" in moved and any("splits/" in p for p in moved)
    assert set(result.regenerate) == {"d:0", "d:1", "d:2", "d:3", "d:50"}
    assert result.after.ok and not store.has_table("splits")


def test_injected_write_failure_leaves_no_shard_and_no_manifest_entry(tmp_path, monkeypatch):
    store = small_store(tmp_path / "s")
    before = sorted(p.name for p in store.shards("maps"))
    manifest_before = json.loads((tmp_path / "s" / "manifest.json").read_text())["shards"]
    real = store_module.pq.write_table

    def disk_full(table, where, **kwargs):
        real(table, where, **kwargs)
        with open(where, "r+b") as handle:  # half the file is on disk when the disk fills up
            handle.truncate(os.path.getsize(where) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.pq, "write_table", disk_full)
    with pytest.raises(OSError, match="No space left"):
        store.write_maps([record("d:40", np.random.default_rng(5))])
    monkeypatch.undo()
    assert sorted(p.name for p in store.shards("maps")) == before
    assert not list((tmp_path / "s").rglob(".tmp-*"))  # the partial file is gone too
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["shards"] == manifest_before
    assert verify_store(store).ok
    store.write_maps([record("d:40", np.random.default_rng(5))])  # the next write works
    assert "d:40" in store.ids()


KILL_MID_WRITE = """
import os, signal, sys
sys.path.insert(0, {src!r}); sys.path.insert(0, {tests!r})
import numpy as np
import actmap.store.encoding as store_module
from test_store_damage import small_store, record
store = small_store(__import__("pathlib").Path({root!r}))
real = store_module.pq.write_table
def killed(table, where, **kwargs):
    real(table, where, **kwargs)
    with open(where, "r+b") as handle:
        handle.truncate(os.path.getsize(where) // 2)
    os.kill(os.getpid(), signal.SIGKILL)  # killed with half a shard written
store_module.pq.write_table = killed
store.write_maps([record("d:40", np.random.default_rng(0))])
"""


def test_sigkill_mid_shard_write_tears_nothing_and_the_lock_is_taken_over(tmp_path, caplog):
    root = tmp_path / "s"
    script = KILL_MID_WRITE.format(src=str(ROOT / "src"), tests=str(ROOT / "tests"), root=str(root))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    dead_pid = read_holder(root)["pid"]
    store = MapStore.open(root)
    assert sorted(store.ids()) == sorted(IDS)  # the torn shard is invisible
    assert len(store.shards("maps")) == 3 and len(store.recorded_rows("maps")) == 3
    leftovers = list((root / "maps").glob(".tmp-*"))
    assert len(leftovers) == 1
    report = verify_store(store)
    assert report.ok and "temporary file of an interrupted write" in messages(report)
    with caplog.at_level(logging.WARNING, logger="actmap.store.lock"):
        result = repair_store(store)
    assert f"taking over the writer lock of process {dead_pid}, which is no longer running" in (
        caplog.text
    )
    assert read_holder(root)["pid"] == os.getpid()
    assert [why for _, why in result.quarantined] == ["temporary file of an interrupted write"]
    assert result.after.findings == []


HOLD_LOCK = """
import sys, time
sys.path.insert(0, {src!r})
from actmap.store import MapStore
store = MapStore.create({root!r}, {{}})
print("holding", flush=True)
time.sleep(60)
"""


def test_a_second_writer_is_refused_with_the_holders_pid(tmp_path):
    root = tmp_path / "s"
    script = HOLD_LOCK.format(src=str(ROOT / "src"), root=str(root))
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        store = MapStore.open(root)
        with pytest.raises(StoreLocked, match=f"being written by process {holder.pid}"):
            store.write_table("results/x", pa.table({"id": ["a"]}))
        with pytest.raises(StoreLocked, match=str(holder.pid)):
            MapStore.create(root, {})
        with pytest.raises(StoreLocked, match=str(holder.pid)):
            repair_store(root)
        assert not store.has_table("results/x")
        assert verify_store(root).writer["pid"] == holder.pid  # reading is never refused
    finally:
        holder.kill()
        holder.wait()
    MapStore.open(root).write_table("results/x", pa.table({"id": ["a"]}))  # free again


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    root = tmp_path / "s"
    root.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "command": "actmap capture"}))
    with caplog.at_level(logging.WARNING, logger="actmap.store.lock"):
        ticket = acquire(root)
    assert ticket.took_over == dead.pid and "no longer running" in caplog.text
    assert read_holder(root)["pid"] == os.getpid()
    again = acquire(root)  # the same process shares its lock
    again.release()
    ticket.release()
    assert read_holder(root) == {}


HELD_CAPTURE = """
import sys, time
from pathlib import Path
import actmap.capture.run as run
original = run.commit_batch
def held(*args, **kwargs):  # the first batch waits until the test lets it go on
    go = Path({go!r})
    for _ in range(1200):
        if go.exists():
            break
        time.sleep(0.1)
    return original(*args, **kwargs)
run.commit_batch = held
from actmap.cli import main
sys.argv = ["actmap", *sys.argv[1:]]
main()
"""


def test_two_concurrent_captures_end_with_no_duplicate_id(tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"red blue {i}", "split": "test"}) + "\n" for i in range(12))
    )
    store, go = tmp_path / "store", tmp_path / "go"
    args = ["capture", "--prompts", str(prompts), "--model", str(tiny_model_dir), "--out"]
    args += [str(store), "--splits", "test", "--max-new-tokens", "4", "--batch-size", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    script = HELD_CAPTURE.format(go=str(go))
    first = subprocess.Popen(
        [sys.executable, "-c", script, *args], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        for _ in range(1200):  # until the first capture holds the store
            if read_holder(store).get("pid") == first.pid or first.poll() is not None:
                break
            time.sleep(0.1)
        assert read_holder(store).get("pid") == first.pid
        second = subprocess.run(
            [sys.executable, "-m", "actmap.cli", *args], env=env, capture_output=True, text=True
        )
    finally:
        go.touch()
        _, first_err = first.communicate(timeout=300)
    assert second.returncode == 2, second.stderr
    assert f"is being written by process {first.pid} (actmap capture" in " ".join(
        second.stderr.split()
    )
    assert first.returncode == 0, first_err
    ids = MapStore.open(store).read_table("maps", ["id"]).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 12
    assert verify_store(store).findings == []


def test_configs_compare_by_meaning_and_older_stores_still_open(tmp_path):
    demo = {"task": {"task": "builtin"}, "keep": {}, "capture": {"max_new_tokens": 16}}
    store = MapStore.create(tmp_path / "s", demo)
    store.close()
    off = {"trajectories": False, "attention_keys": 0, "dense": False}
    MapStore.create(tmp_path / "s", {**demo, "keep": off}).close()  # same meaning: resumes
    with pytest.raises(StoreError, match="keep.trajectories: None -> True"):
        MapStore.create(tmp_path / "s", {**demo, "keep": {**off, "trajectories": True}})
    # a store written before configs were normalised: "off" spelled None
    older = tmp_path / "older"
    MapStore.create(older, {}).close()
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["config"] = {**demo, "keep": {"trajectories": None, "attention_keys": None}}
    del manifest["shards"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    resumed = MapStore.create(older, {**demo, "keep": off})
    resumed.write_maps([record("d:1", np.random.default_rng(6))])
    assert verify_store(older).ok  # shards written before the record are not damage
    assert MapStore.open(tmp_path / "s").manifest["config"]["keep"] == {}  # normalised on write
