"""Cost: timings against a model of known latency, bytes and training seconds recomputed."""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
from report_stores import synthetic_store
from test_report_in_domain import write_result

from actmap.experiments.cost import (
    CaptureCost,
    ScoringCost,
    cost_quality_points,
    storage_costs,
    time_scoring,
    training_costs,
)
from actmap.report.assemble import build_report
from actmap.report.inputs import store_refs
from actmap.report.parts import cost, in_domain
from actmap.report.sections import ReportContext
from actmap.store import MapStore
from actmap.store.rows import rows_to_score


class Sleeper(torch.nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x.sum(dim=1)


def test_time_scoring_reports_the_median_batch_time_per_map():
    (cost_,) = time_scoring({"s": (Sleeper(0.02), torch.zeros(8, 3))}, repeats=5, warmup=1)
    assert cost_.batch == 8 and cost_.repeats == 5 and cost_.peak_mib is None
    assert 0.02e3 / 8 <= cost_.ms_per_map < 0.2e3 / 8  # the sleep, plus a little


def test_storage_and_training_costs_are_the_recorded_ones(tmp_path, monkeypatch):
    root = synthetic_store(tmp_path / "s")
    store = MapStore.open(root)
    shapes = [[30, 5, 128], [30, 9, 128]]
    table = pa.table(
        {
            "id": ["a", "b"],
            "shape": pa.array(shapes, pa.list_(pa.int32())),
            "trajectory": [b"", b""],
        }
    )
    store.write_table("trajectories", table)
    store.close()
    got = storage_costs(MapStore.open(root), "s")
    assert got.map_bytes == 2 * 12 * 8 * 16
    assert got.trajectory_bytes == pytest.approx(np.mean([2 * 30 * 5 * 128, 2 * 30 * 9 * 128]))
    assert got.actvit_bytes is None and got.n_trajectories == 2
    run = tmp_path / "run" / "seed-1"
    run.mkdir(parents=True)
    history = [{"epoch_time_s": 1.5}, {"epoch_time_s": 2.0}]
    (run / "history.json").write_text(json.dumps(history))
    (run / "config.json").write_text(json.dumps({"detector": "mlp", "train_config": {}}))
    from actmap.training.run_folder import RunFolder

    folder = RunFolder(tmp_path / "run", "mlp", {}, {1: run})
    monkeypatch.setattr("actmap.experiments.cost.read_run", lambda path: folder)
    assert training_costs(tmp_path / "run", "s", "mlp").seconds_per_seed == [3.5]


def test_cost_quality_points_add_capture_overhead_to_actmap():
    scoring = [ScoringCost("actmap-mlp", 256, 3, 0.05, 20000.0, None, "cpu")]
    capture = CaptureCost("m", 16, 32, [1.0], [1.1], 1.1, True, 200.0)
    points = cost_quality_points(
        {"actmap-mlp": (0.8, 2), "perplexity": (0.6, 2), "tad": (0.7, 1)},
        {"perplexity": 0.01},
        scoring,
        capture,
    )
    assert points["actmap-mlp"] == pytest.approx((0.1 * 200.0 + 0.05, 0.8, 2))
    assert points["perplexity"] == (0.01, 0.6, 2) and "tad" not in points


def test_cost_quality_points_count_each_methods_capture():
    scoring = [ScoringCost("actmap-mlp", 256, 3, 0.05, 20000.0, None, "cpu")]
    capture = CaptureCost(
        "m", 16, 32, [1.0], [1.1], 1.1, True, 200.0, {"greybox": 1.2, "attention": 1.5}
    )
    points = cost_quality_points(
        {"actmap-mlp": (0.8, 2), "perplexity": (0.6, 2), "tad": (0.7, 1), "actvit": (0.7, 1)},
        {"perplexity": 0.01, "tad": 0.1, "actvit": 0.3},
        scoring,
        capture,
    )
    assert points["actmap-mlp"][0] == pytest.approx(0.1 * 200.0 + 0.05)  # map-only capture
    assert points["perplexity"][0] == pytest.approx(0.2 * 200.0 + 0.01)  # grey-box capture
    assert points["tad"][0] == pytest.approx(0.5 * 200.0 + 0.1)  # attention weights
    assert points["actvit"][0] == pytest.approx(0.3)  # dense capture not measured: adds 0
    assert capture.added_ms("dense") is None and capture.added_ms("map-only") == pytest.approx(20)


def test_cost_section_renders_the_cost_quality_plot(tmp_path):
    root = synthetic_store(tmp_path / "s", signal=2.0)
    ids = rows_to_score(MapStore.open(root), "balanced").ids
    write_result(root, "perplexity", ids, np.linspace(0, 1, len(ids)), True)
    store = MapStore.open(root)
    store.set_manifest_key(["results", "perplexity", "latency_ms_per_answer"], 0.2)
    store.close()
    context = ReportContext(
        stores=store_refs([root]),
        runs={},
        out=tmp_path / "out",
        scratch=tmp_path / "scratch",
        n_resamples=50,
        options={"cost": {"repeats": 2, "batch": 4, "capture": False, "detectors": ["mlp"]}},
    )
    done = build_report(context, [in_domain.SECTION, cost.SECTION])
    assert done.sections["cost"] == "done", done.sections
    result = json.loads((done.json_dir / "cost.json").read_text())
    assert result["cost_quality"]["perplexity"]["ms_per_answer"] == 0.2
    assert {s["name"] for s in result["scoring"]} == {"actmap-mlp", "actvit"}
    assert (done.figure_dir / "cost_quality.png").is_file()


def test_timing_stops_at_its_budget_with_the_same_repeats_for_every_call():
    models = {"a": (Sleeper(0.02), torch.zeros(4, 3)), "b": (Sleeper(0.01), torch.zeros(4, 3))}
    costs = time_scoring(models, repeats=200, warmup=0, budget_s=0.2)
    # rounds of 0.03 s: the budget is passed after 7 rounds (5 at least); far fewer than 200
    assert {c.repeats for c in costs} == {costs[0].repeats} and 5 <= costs[0].repeats <= 8
    assert all(c.budget_s == 0.2 for c in costs)
    (full,) = time_scoring({"a": models["a"]}, repeats=3, warmup=0, budget_s=10.0)
    assert full.repeats == 3 and full.budget_s is None  # every asked repeat was timed


def test_cost_quality_labels_of_near_coincident_points_do_not_overlap():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    from actmap.report.plots.cost import plot_cost_quality

    # the full run's three ActMap points: 4.3-8.7 ms, AUROC .742-.748 (labels overlapped)
    points = {
        "actmap-logreg": (4.3, 0.748, 6),
        "actmap-mlp": (4.4, 0.745, 6),
        "actmap-vit": (8.7, 0.742, 6),
        "tad": (0.3, 0.772, 6),
        "perplexity": (0.012, 0.62, 6),
    }
    figure = plot_cost_quality(points, {m: "actmap" for m in points})
    renderer = FigureCanvasAgg(figure).get_renderer()
    figure.draw(renderer)  # the boxes as drawn, measured by matplotlib itself
    texts = [t for t in figure.axes[0].texts if "(6)" in t.get_text()]
    boxes = [Text.get_window_extent(t, renderer) for t in texts]  # the text, not its leader line
    assert len(boxes) == 5
    overlapping = [
        (texts[i].get_text(), texts[j].get_text())
        for i in range(5)
        for j in range(i + 1, 5)
        if boxes[i].overlaps(boxes[j])
    ]
    assert overlapping == []
