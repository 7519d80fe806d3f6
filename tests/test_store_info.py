"""`actmap store info`: a store's rows, labels and balanced rows per split, against a naive count."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
from test_cli import synthetic_store
from typer.testing import CliRunner

from actmap.cli import app
from actmap.store import MapRecord, MapStore
from actmap.store.rows import balanced_splits, store_summary

grid = np.zeros((12, 32, 128), dtype=np.float32)

runner = CliRunner()


def test_summary_counts_match_a_naive_count(tmp_path):
    store = synthetic_store(tmp_path / "s", n=120)
    extra = [
        MapRecord(f"w:{i}", str(i), "s", "train", "m", "r", "p", "a", 3, 0, grid) for i in range(30)
    ]
    store.write_maps(extra)  # 30 more wrong train answers: the classes differ there
    # synthetic_store: row i has label i % 2 and split train / validation / test for i % 10 in
    # 0-5 / 6-7 / 8-9
    store.write_table(
        "skipped",
        pa.table({"id": ["e:1", "e:2"], "split": ["test", None], "reason": ["empty answer"] * 2}),
    )
    runs = [
        {"written": 100, "wall_time_s": 60.0},
        {"written": 0, "wall_time_s": 0.02},  # a resumed run with its work done
        {"written": 50, "wall_time_s": 40.0},
        {"written": 8, "wall_time_s": 16.0, "finished_at": None},  # killed after two batches
        {"written": 32, "wall_time_s": 3402.0},  # 32 summaries of 384 tokens
    ]
    store.edit_manifest(lambda m: m.setdefault("runs", []).extend(runs))
    expected = {}
    for i in range(120):
        split = "train" if i % 10 < 6 else "validation" if i % 10 < 8 else "test"
        rows, correct = expected.get(split, (0, 0))
        expected[split] = (rows + 1, correct + i % 2)
    expected["train"] = (expected["train"][0] + 30, expected["train"][1])
    summary = store_summary(store)
    for split, (rows, correct) in expected.items():
        counts = summary.splits[split]
        assert (counts.rows, counts.labelled, counts.correct) == (rows, rows, correct)
        assert counts.balanced == 2 * min(correct, rows - correct)
        assert counts.accuracy == correct / rows
    assert summary.total.rows == 150 and summary.total.correct == 60
    assert summary.empty_answers == 2
    assert [r["rows_per_s"] for r in summary.capture_runs] == [
        100 / 60,
        None,
        50 / 40,
        0.5,
        32 / 3402,
    ]
    assert [r["finished"] for r in summary.capture_runs] == [True, True, True, False, True]
    assert summary.capture_rows_per_s == 190 / 3518  # rows over the seconds of runs that wrote
    assert not store.has_table("splits")  # read, never written

    result = runner.invoke(app, ["store", "info", str(tmp_path / "s"), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["splits"]["train"] == {
        "rows": 102,
        "labelled": 102,
        "correct": 36,
        "balanced": 72,
        "accuracy": 36 / 102,
    }
    table = runner.invoke(app, ["store", "info", str(tmp_path / "s")])
    assert table.exit_code == 0 and "empty answers" in table.output
    assert "capture run 1: 100 rows in 60 s (1.67 rows/s)" in table.output
    assert "capture run 3: 50 rows in 40 s (1.25 rows/s)\n" in table.output
    assert "capture run 4: 8 rows in 16 s (0.50 rows/s), not finished" in table.output
    assert "capture run 5: 32 rows in 3402 s (0.0094 rows/s)" in table.output  # not 0.01
    assert "capture run 2" not in table.output
    assert "wrote no rows (resumed, work done): 1" in table.output
    assert "runs that wrote rows: 0.054 rows/s" in table.output


def test_info_on_a_folder_that_is_no_store_names_it(tmp_path):
    result = runner.invoke(app, ["store", "info", str(tmp_path / "nothing")])
    assert result.exit_code == 2
    assert "nothing" in result.output


def test_subset_keeps_the_balanced_rows_and_their_side_rows(tmp_path):
    store = synthetic_store(tmp_path / "s", n=120)
    extra = [
        MapRecord(f"w:{i}", str(i), "s", "train", "m", "r", "p", "a", 3, 0, grid) for i in range(30)
    ]
    store.write_maps(extra)  # 30 more wrong train answers: only some of the wrong ones are kept
    every = store.read_table("maps", ["id"]).column("id").to_pylist()
    store.write_table("dense", pa.table({"id": every, "value": [0] * len(every)}))
    store.write_table("dense", pa.table({"id": ["s:0", "s:1"], "value": [7, 8]}))  # superseding
    store.write_table("skipped", pa.table({"id": ["e:1"], "split": ["test"], "reason": ["empty"]}))
    store.write_table("results/ppl", pa.table({"id": every, "confidence": [0.5] * len(every)}))
    before = {f: f.stat().st_mtime_ns for f in (tmp_path / "s").rglob("*") if f.is_file()}

    result = runner.invoke(app, ["store", "subset", str(tmp_path / "s"), str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    source = MapStore.open(tmp_path / "s")
    subset = MapStore.open(tmp_path / "b")
    meta = subset.metadata()
    # a naive count: per split, every kept row is a source row, the classes are equal, and
    # their number is the smaller class of the source's split (synthetic_store: row i has label
    # i % 2 and split train / validation / test for i % 10 in 0-5 / 6-7 / 8-9)
    source_meta = source.metadata().set_index("id")
    for split, part in meta.groupby("split"):
        labels = source_meta.loc[source_meta["split"] == split, "label"]
        smaller = min((labels == 1).sum(), (labels == 0).sum())
        assert (part["label"] == 1).sum() == (part["label"] == 0).sum() == smaller
        assert (source_meta.loc[part["id"], "split"] == split).all()
        assert (source_meta.loc[part["id"], "label"].to_numpy() == part["label"].to_numpy()).all()
    assert len(meta) == 2 * (36 + 12 + 12)
    # drawing balanced rows from the subset keeps every row: the rows the source draws
    drawn = balanced_splits(subset, persist=False)
    assert {s: set(v) for s, v in drawn.items()} == {
        s: set(v) for s, v in balanced_splits(source, persist=False).items()
    }
    maps, keys = subset.load_maps()
    source_maps, source_keys = source.load_maps(list(keys["id"]))
    assert list(source_keys["id"]) == list(keys["id"]) and np.array_equal(maps, source_maps)
    dense = subset.read_table("dense").to_pydict()
    assert sorted(dense["id"]) == sorted(meta["id"])  # one row each, the last written
    assert {
        k: v for k, v in zip(dense["id"], dense["value"], strict=True) if k in ("s:0", "s:1")
    } == {k: v for k, v in (("s:0", 7), ("s:1", 8)) if k in set(meta["id"])}
    assert not subset.has_table("skipped") and not subset.has_table("results/ppl")
    assert "dense 120 rows" in result.output
    assert subset.manifest["subset_of"]["root"] == str(tmp_path / "s")
    after = {f: f.stat().st_mtime_ns for f in (tmp_path / "s").rglob("*") if f.is_file()}
    assert {f: t for f, t in after.items() if f.name != "writer.lock"} == {
        f: t for f, t in before.items() if f.name != "writer.lock"
    }  # the source is only read

    again = runner.invoke(app, ["store", "subset", str(tmp_path / "s"), str(tmp_path / "b")])
    assert again.exit_code == 2 and "not empty" in again.output
    unknown = runner.invoke(
        app, ["store", "subset", str(tmp_path / "s"), str(tmp_path / "c"), "--tables", "attention"]
    )
    assert unknown.exit_code == 2 and "no table 'attention'" in unknown.output
    derived = runner.invoke(
        app,
        ["store", "subset", str(tmp_path / "s"), str(tmp_path / "d"), "--tables", "results/ppl"],
    )
    assert derived.exit_code == 2 and "does not carry 'results/ppl'" in derived.output
