"""Transfer rows: frozen detectors scored on stores they never saw, checked against sklearn."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from report_stores import synthetic_store
from sklearn.metrics import roc_auc_score
from test_report_rows import snapshot

from actmap.experiments.seeds import frozen_scores
from actmap.experiments.transfer import StoreInfo, detectors_from_runs, pooled_run, transfer_rows
from actmap.store import MapStore
from actmap.store.rows import rows_fingerprint


def test_transfer_rows_kinds_values_and_read_only_targets(tmp_path):
    specs = {
        "a-qa": dict(generator="gen-a", task="qa", seed=1),
        "a-math": dict(generator="gen-a", task="math", seed=2, signal=-2.0),  # flipped signal
        "b-qa": dict(generator="gen-b", task="qa", seed=3),
    }
    stores = []
    for name, kw in specs.items():
        kw = {"signal": 2.0, **kw}
        synthetic_store(tmp_path / name, **kw)
        stores.append(StoreInfo(name, tmp_path / name, kw["generator"], kw["task"]))
    before = {s.name: snapshot(s.path) for s in stores}
    detector_for = detectors_from_runs({}, "logreg", tmp_path / "scratch", (1,), 10, "cpu")
    result = transfer_rows(stores, detector_for, lambda t: None, "logreg", "all", 200)
    assert {s.name: snapshot(s.path) for s in stores} == before
    kinds = {}
    for row in result.rows:
        kinds.setdefault(row.kind, []).append(row)
    assert {(r.source, r.target) for r in kinds["cross-dataset"]} == {
        ("a-qa", "a-math"),
        ("a-math", "a-qa"),
    }
    assert {(r.source, r.target) for r in kinds["leave-one-generator-out"]} == {
        ("b-qa", "a-qa"),
        ("a-qa", "b-qa"),
    }
    assert kinds["cross-task"][0].skipped and kinds["model scale"][0].skipped
    same = next(r for r in kinds["leave-one-generator-out"] if r.target == "b-qa")
    flipped = next(r for r in kinds["cross-dataset"] if r.target == "a-math")
    assert same.auroc.estimate > 0.8 and flipped.auroc.estimate < 0.2
    # the row's AUROC is the seed-mean p of the frozen detector on every target row
    target = MapStore.open(tmp_path / "b-qa")
    meta = target.metadata()
    p = np.mean(
        list(
            frozen_scores(
                tmp_path / "scratch" / "a-qa" / "logreg", target, meta["id"].tolist()
            ).values()
        ),
        axis=0,
    )
    assert same.auroc.estimate == pytest.approx(roc_auc_score(meta["label"], p))
    assert same.auroc.n == len(meta)


def test_cross_task_and_model_scale_rows_appear_when_their_stores_exist(tmp_path):
    """A labelled CNN/DM store beside a short-form one of its generator gives cross-task rows
    both ways; Qwen2.5-Coder 0.5B and 1.5B stores of one dataset give model-scale rows both
    ways (generator names as captured: a .gguf path or a model name)."""
    small = "/models/qwen2.5-coder-0.5b-instruct.gguf"
    specs = {
        "small-qa": dict(generator=small, task="triviaqa", seed=1),
        "large-qa": dict(generator="Qwen2.5-Coder-1.5B-Instruct", task="triviaqa", seed=2),
        "small-cnn": dict(generator=small, task="cnn_dm", seed=3, signal=-2.0),
    }
    stores = []
    for name, kw in specs.items():
        kw = {"signal": 2.0, **kw}
        synthetic_store(tmp_path / name, **kw)
        stores.append(StoreInfo(name, tmp_path / name, kw["generator"], kw["task"]))
    detector_for = detectors_from_runs({}, "logreg", tmp_path / "scratch", (1,), 10, "cpu")
    result = transfer_rows(stores, detector_for, lambda t: None, "logreg", "all", 100)
    by_kind = {}
    for row in result.rows:
        by_kind.setdefault(row.kind, []).append(row)
    scale = {(r.source, r.target): r for r in by_kind["model scale"]}
    assert set(scale) == {("small-qa", "large-qa"), ("large-qa", "small-qa")}
    assert all(not r.skipped and r.auroc.estimate > 0.8 for r in scale.values())  # same signal
    task = {(r.source, r.target): r for r in by_kind["cross-task"]}
    assert set(task) == {("small-qa", "small-cnn"), ("small-cnn", "small-qa")}
    assert all(not r.skipped and r.auroc.estimate < 0.2 for r in task.values())  # flipped


def test_dtype_rows_pair_one_generator_and_dataset_captured_in_two_dtypes(tmp_path):
    """float32 and bfloat16 captures of one generator and dataset transfer both ways as
    "dtype" rows, never as "cross-dataset" ones; a model-scale pair needs one dtype."""
    small, large = "/m/qwen2.5-coder-0.5b-instruct.gguf", "/m/qwen2.5-coder-1.5b-instruct.gguf"
    specs = {
        "small-32": (small, "triviaqa", "float32", 1),
        "small-16": (small, "triviaqa", "bfloat16", 2),
        "large-16": (large, "triviaqa", "bfloat16", 3),
        "small-nq": (small, "nq_open", "float32", 4),
    }
    stores = []
    for name, (generator, task, dtype, seed) in specs.items():
        synthetic_store(tmp_path / name, generator=generator, task=task, signal=2.0, seed=seed)
        stores.append(StoreInfo(name, tmp_path / name, generator, task, dtype))
    detector_for = detectors_from_runs({}, "logreg", tmp_path / "scratch", (1,), 10, "cpu")
    result = transfer_rows(stores, detector_for, lambda t: None, "logreg", "all", 100)
    pairs = {}
    for row in result.rows:
        pairs.setdefault(row.kind, set()).add((row.source, row.target))
    assert pairs["dtype"] == {("small-32", "small-16"), ("small-16", "small-32")}
    assert pairs["cross-dataset"] == {
        (a, b) for a in ("small-32", "small-16") for b in ("small-nq",)
    } | {(b, a) for a in ("small-32", "small-16") for b in ("small-nq",)}
    assert pairs["model scale"] == {("small-16", "large-16"), ("large-16", "small-16")}
    # leave-one-generator-out pools one store per other generator (the first listed)
    assert ("small-32", "large-16") in pairs["leave-one-generator-out"]
    assert not any("small-16" in source for source, _ in pairs["leave-one-generator-out"])
    dtype_rows = [r for r in result.rows if r.kind == "dtype"]
    assert all(r.auroc.estimate > 0.8 for r in dtype_rows)  # one signal, either dtype
    # the two stores share their questions: only the target's test rows are scored
    test_rows = (MapStore.open(tmp_path / "small-16").metadata()["split"] == "test").sum()
    assert all(r.rows == "test" and r.auroc.n == test_rows for r in dtype_rows)


def test_a_pooled_fit_is_reused_only_while_made_from_the_same_rows_and_seeds(tmp_path):
    """A scratch fit is read again only while its sources hold the rows it was fit on: a
    source captured again (other rows and labels) or other seeds get a new fit, and the old
    fit's seeds do not linger beside it."""
    synthetic_store(tmp_path / "a", generator="gen-a", task="qa", seed=1, signal=2.0)
    source = StoreInfo("a", tmp_path / "a", "gen-a", "qa")
    out = tmp_path / "scratch" / "a" / "logreg"
    model = out / "seed-1" / "model.safetensors"
    pooled_run([source], "logreg", out, (1,), 10, "cpu")
    first = model.stat().st_mtime_ns
    pooled_run([source], "logreg", out, (1,), 10, "cpu")
    assert model.stat().st_mtime_ns == first  # the same rows and seeds: reused

    shutil.rmtree(tmp_path / "a")  # the source grows and its labels change
    synthetic_store(
        tmp_path / "a",
        generator="gen-a",
        task="qa",
        seed=2,
        signal=2.0,
        sizes={"train": 60, "validation": 30, "test": 30},
    )
    pooled_run([source], "logreg", out, (1,), 10, "cpu")
    assert model.stat().st_mtime_ns != first
    meta = MapStore.open(tmp_path / "a").metadata()
    made_from = json.loads((out / "manifest.json").read_text())["inputs"]
    assert made_from["pooled_rows"] == [rows_fingerprint(meta["id"], meta["label"])]

    pooled_run([source], "logreg", out, (2, 3), 10, "cpu")  # other seeds: a new fit alone
    assert sorted(p.name for p in out.glob("seed-*")) == ["seed-2", "seed-3"]


def test_a_killed_pooled_fit_keeps_its_finished_seeds_and_resumes_the_one_in_training(
    tmp_path, ending_session
):
    """A session that ends inside a pooled fit's third seed keeps the first two seeds and the
    third's epoch checkpoint: the rerun trains only the epochs the kill lost."""
    synthetic_store(tmp_path / "a", generator="gen-a", task="qa", seed=1, signal=2.0)
    source = StoreInfo("a", tmp_path / "a", "gen-a", "qa")
    out = tmp_path / "scratch" / "a" / "mlp"
    ending_session.restart(kill_at=3)
    with pytest.raises(RuntimeError, match="the session ended"):
        pooled_run([source], "mlp", out, (1, 2, 3), 2, "cpu")
    assert ending_session.fitted == [1, 2, 3]
    assert (out / ".checkpoint-seed-3.safetensors").is_file()
    first = (out / "seed-1" / "model.safetensors").read_bytes()

    ending_session.restart()
    pooled_run([source], "mlp", out, (1, 2, 3), 2, "cpu")
    assert ending_session.fitted == [3]
    assert len(ending_session.epochs) == 1  # of seed 3's two epochs, the one the kill lost
    assert (out / "seed-1" / "model.safetensors").read_bytes() == first
    assert not list(out.glob(".checkpoint-*"))
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert summary["seeds"] == manifest["seeds"] == [1, 2, 3]

    ending_session.restart()
    pooled_run([source], "mlp", out, (1, 2, 3), 2, "cpu")
    assert ending_session.fitted == []  # finished: reused as it is
