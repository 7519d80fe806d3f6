"""Running-score AUROC by answer position, against a naive per-answer loop."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from serve_helpers import save_tiny_detector
from sklearn.metrics import roc_auc_score

from actmap.maps import MapConfig, build_map, stored_form
from actmap.serve.loaded_run import load_detector_run, prefix_maps
from actmap.serve.streaming import default_positions, running_auroc
from actmap.store import MapRecord, MapStore, encode_array


def store_with_trajectories(path, n=16, seed=0):
    rng = np.random.default_rng(seed)
    store = MapStore.create(path, {"synthetic": True})
    records, trajectories = [], []
    for i in range(n):
        label = i % 2
        length = int(rng.integers(1, 9))
        traj = rng.normal(0.4 * label, 1.0, size=(4, length, 128)).astype(np.float32)
        trajectories.append(traj)
        split = "test" if i < 12 else "train"
        grid = stored_form(build_map(torch.from_numpy(traj)))
        records.append(
            MapRecord(f"r{i}", str(i), "s", split, "m", "r", "", "", length, label, grid)
        )
    store.write_table(
        "trajectories",
        pa.table(
            {
                "id": [r.id for r in records],
                "shape": pa.array([list(t.shape) for t in trajectories], pa.list_(pa.int32())),
                "trajectory": [encode_array(t) for t in trajectories],
            }
        ),
    )
    store.write_maps(records)
    return store, trajectories, records


def test_prefix_maps_equal_build_map_on_the_prefix():
    traj = torch.randn(5, 6, 128)
    maps = prefix_maps(traj, [1, 3, 6, 10], MapConfig())
    for row, k in zip(maps, [1, 3, 6, 6], strict=True):
        np.testing.assert_array_equal(row, stored_form(build_map(traj[:, :k])))


def test_running_auroc_matches_a_naive_loop(tmp_path):
    store, trajectories, records = store_with_trajectories(tmp_path / "s")
    save_tiny_detector(tmp_path / "run")
    detector = load_detector_run(tmp_path / "run")
    result = running_auroc(store, detector, split="test", positions=[1, 2, 4])
    test = [(t, r) for t, r in zip(trajectories, records, strict=True) if r.split == "test"]
    labels = np.array([r.label for _, r in test])
    assert result.n == 12 and result.n_correct == labels.sum()
    running = 0
    for position in result.positions:
        k = position.position
        scores, alive = [], []
        for traj, _ in test:
            cut = torch.from_numpy(traj[:, : min(k, traj.shape[1])])
            grid = stored_form(build_map(cut))[None]
            scores.append(detector.detector.predict_proba(grid)[0])
            alive.append(traj.shape[1] >= k)
        scores, alive = np.array(scores), np.array(alive)
        assert position.auroc == pytest.approx(roc_auc_score(labels, scores), abs=1e-9)
        assert position.n_running == alive.sum()
        if len(np.unique(labels[alive])) == 2:
            assert position.auroc_running == pytest.approx(
                roc_auc_score(labels[alive], scores[alive]), abs=1e-9
            )
            running += 1
        else:
            assert position.auroc_running is None
    assert running >= 2  # the running AUROC was compared at positions 1 and 2 at least
    # whole answers: the stored maps' scores
    maps, meta = store.load_maps([r.id for _, r in test])
    assert result.final_auroc == pytest.approx(
        roc_auc_score(labels, detector.predict_proba(maps)), abs=1e-9
    )
    assert default_positions(20) == [1, 2, 4, 8, 16, 20]


def test_running_auroc_needs_trajectories(tmp_path):
    store = MapStore.create(tmp_path / "s", {"x": 1})
    with pytest.raises(ValueError, match="keeps no trajectories; capture with --keep-trajectories"):
        running_auroc(store, None)


def test_running_auroc_reads_a_rewritten_id_as_the_store_does(tmp_path):
    # an id whose maps row was written twice counts once, with its last row (its label and
    # its last trajectory), as `MapStore.load_maps` and every reader of `store.rows` read it
    store, trajectories, records = store_with_trajectories(tmp_path / "s")
    save_tiny_detector(tmp_path / "run")
    detector = load_detector_run(tmp_path / "run")
    old = records[0]  # a test row, label 0
    longer = np.random.default_rng(7).normal(2.0, 1.0, size=(4, 9, 128)).astype(np.float32)
    new = MapRecord(
        old.id, old.source_key, "s", "test", "m", "r", "", "", 9, 1 - old.label,
        stored_form(build_map(torch.from_numpy(longer))),
    )  # fmt: skip
    store.write_table(
        "trajectories",
        pa.table({
            "id": [old.id], "shape": pa.array([list(longer.shape)], pa.list_(pa.int32())),
            "trajectory": [encode_array(longer)],
        }),
    )  # fmt: skip
    store.write_maps([new])
    result = running_auroc(store, detector, split="test", positions=[1, 8])
    test = [new if r.id == old.id else r for r in records if r.split == "test"]
    traj = {r.id: t for t, r in zip(trajectories, records, strict=True)} | {old.id: longer}
    labels = np.array([r.label for r in test])
    assert (result.n, result.n_correct) == (12, labels.sum()) == (12, 7)
    maps, _ = store.load_maps([r.id for r in test])
    assert result.final_auroc == pytest.approx(
        roc_auc_score(labels, detector.predict_proba(maps)), abs=1e-9
    )
    (at_eight,) = [p for p in result.positions if p.position == 8]
    alive = np.array([traj[r.id].shape[1] >= 8 for r in test])
    assert at_eight.n_running == alive.sum()
    assert at_eight.n_running_correct == labels[alive].sum()
