"""The analysis sections (ablations, learning curve, localization, calibration) in the report:
each computes on the synthetic store, writes its JSON and figures, and leaves the store as
it was (no splits table written into a store the report reads)."""

from __future__ import annotations

import json

import pytest
from experiment_helpers import synthetic_store

from actmap.report.assemble import build_report
from actmap.report.inputs import store_refs
from actmap.report.parts import ablations, calibration, learning_curve, localization
from actmap.report.registry import report_sections
from actmap.report.sections import ReportContext
from actmap.store import MapStore


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("analysis") / "synthetic-store").root


def test_analysis_sections_render_without_writing_into_the_store(store_path, tmp_path):
    before = sorted(p.name for p in store_path.iterdir())
    context = ReportContext(
        stores=store_refs([store_path]),
        runs={},
        out=tmp_path / "out",
        scratch=tmp_path / "scratch",
        seeds=(1,),
        n_resamples=50,
        max_epochs=2,
        options={
            "ablations": {
                "variants": ("full", "segments_1", "answer_length"),
                "recapture": False,
            },
            "learning_curve": {"fractions": (0.5, 1.0), "methods": ("logreg",)},
            "localization": {"detectors": ("logreg",)},
            "calibration": {"replicates": 3},
        },
    )
    sections = [ablations.SECTION, learning_curve.SECTION, localization.SECTION]
    done = build_report(context, [*sections, calibration.SECTION])
    assert set(done.sections.values()) == {"done"}, done.sections
    text = done.report.read_text()
    for title in ("Ablations and controls", "Labels needed", "Depth-wise localization"):
        assert title in text
    figures = {p.name for p in done.figure_dir.iterdir()}
    assert {"ablations.png", "atlas-logreg.png", "reliability.png", "risk-coverage.png"} <= figures
    assert "learning-synthetic-store.png" in figures
    loc = json.loads((done.json_dir / "localization.json").read_text())
    assert loc["detectors"]["logreg"]["whole_map_auroc"] == 0.5
    abl = json.loads((done.json_dir / "ablations.json").read_text())
    assert [v["name"] for v in abl["variants"]] == ["full", "segments_1", "answer_length"]
    cal = json.loads((done.json_dir / "calibration.json").read_text())
    assert cal["methods"][0]["method"] == "actmap-mlp" and cal["prevalence"] == pytest.approx(0.5)
    assert sorted(p.name for p in store_path.iterdir()) == before  # nothing written
    assert not MapStore.open(store_path).has_table("splits")


def test_sections_are_registered_in_report_order():
    names = [s.name for s in report_sections()]
    order = ["ablations", "learning_curve", "localization", "calibration"]
    assert [n for n in names if n in order] == order
