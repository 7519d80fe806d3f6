"""The analysis sections (ablations, learning curve, localization, calibration) in the report:
each computes on the synthetic store, writes its JSON and figures, and leaves the store as
it was (no splits table written into a store the report reads)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from experiment_helpers import synthetic_store

from actmap.experiments import common
from actmap.experiments.ablations import AblationConfig, run_ablations
from actmap.experiments.seeds import recipe_config, train_on_store
from actmap.report.assemble import build_report
from actmap.report.inputs import store_refs
from actmap.report.parts import ablations, calibration, learning_curve, localization
from actmap.report.parts.choice import balanced_maps, read_only_splits
from actmap.report.registry import report_sections
from actmap.report.sections import ReportContext
from actmap.store import MapStore


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("analysis") / "synthetic-store").root


def one_seed_context(root, tmp_path, options) -> ReportContext:
    """A report over one store with no runs: one seed, 2 epochs, 50 resamples."""
    return ReportContext(
        stores=store_refs([root]),
        runs={},
        out=tmp_path / "out",
        scratch=tmp_path / "scratch",
        seeds=(1,),
        n_resamples=50,
        max_epochs=2,
        options=options,
    )


def test_analysis_sections_render_without_writing_into_the_store(store_path, tmp_path):
    before = sorted(p.name for p in store_path.iterdir())
    context = one_seed_context(
        store_path,
        tmp_path,
        {
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
    shift = cal["methods"][0]["shift"]  # T fit on the store's 16 validation rows, not test rows
    assert shift["fit_source"] == "all 16 labelled validation rows (natural prevalence)"
    assert shift["n_fit"] == 16 and shift["n_eval"] == 16
    assert sorted(p.name for p in store_path.iterdir()) == before  # nothing written
    assert not MapStore.open(store_path).has_table("splits")


def test_sections_are_registered_in_report_order():
    names = [s.name for s in report_sections()]
    order = ["ablations", "learning_curve", "localization", "calibration"]
    assert [n for n in names if n in order] == order


def test_sections_read_the_runs_fits_instead_of_training_them_again(
    store_path, tmp_path, monkeypatch
):
    """The ablations' reference and classifier variants and the learning curve's 100% point
    are the report's `actmap train` runs (same detector, recipe, seeds, rows): they are read,
    and training them again gives the same scores (so reading them changes no result)."""
    store = MapStore.open(store_path)
    splits = read_only_splits(store)
    run = tmp_path / "runs" / "synthetic-store" / "logreg"
    balanced = (balanced_maps(store), store)  # read-only: the store gets no splits table
    train_on_store(store_path, "logreg", (1, 2), run, recipe_config(2), balanced=balanced)
    config = AblationConfig(detector="logreg", seeds=(1, 2), max_epochs=2, variants=("full",))
    again = run_ablations(store, config, splits=splits).variant("full").scores
    from_run = common.scores_from_run(run, splits["test"], again.labels)
    np.testing.assert_array_equal(again.confidence, from_run.confidence)

    trained = []
    real = common.train_seeds
    monkeypatch.setattr(
        "actmap.experiments.ablations.train_seeds",
        lambda *a, **k: trained.append(a[3]) or real(*a, **k),
    )
    monkeypatch.setattr(
        "actmap.experiments.learning_curve.train_seeds",
        lambda *a, **k: trained.append(a[3]) or real(*a, **k),
    )
    context = ReportContext(
        stores=store_refs([store_path]),
        runs={"synthetic-store": {"logreg": run}},
        out=tmp_path / "out",
        scratch=tmp_path / "scratch",
        seeds=(1, 2),
        n_resamples=20,
        max_epochs=2,
        options={
            "ablations": {
                "detector": "logreg",
                "variants": ("full", "classifier_logreg", "segments_1"),
                "recapture": False,
            },
            "learning_curve": {"fractions": (0.5, 1.0), "methods": ("logreg",)},
        },
    )
    done = build_report(context, [ablations.SECTION, learning_curve.SECTION])
    assert set(done.sections.values()) == {"done"}, done.sections
    abl = json.loads((done.json_dir / "ablations.json").read_text())
    full = next(v for v in abl["variants"] if v["name"] == "full")
    assert full["reason"].startswith("read:") and "full (read:" in done.report.read_text()
    np.testing.assert_allclose(full["scores"]["confidence"], from_run.confidence, atol=1e-6)
    curve = json.loads((done.json_dir / "learning_curve.json").read_text())["synthetic-store"]
    point = next(p for p in curve["points"] if p["fraction"] == 1.0)
    assert point["per_seed"] == pytest.approx(from_run.per_seed())
    # trained here: segments_1 (two seeds at once) and the 50% point (one seed at a time)
    assert trained == ["logreg", "logreg", "logreg"]


def test_calibration_shows_baselines_not_controls(tmp_path):
    """The strongest stored methods beside ActMap are baselines: a control (the permuted-label
    refit, answer length) is left out even with the highest test AUROC."""
    from test_report_in_domain import write_result

    from actmap.store.rows import rows_to_score

    root = synthetic_store(tmp_path / "s", signal=2.0).root
    store = MapStore.open(root)
    ids = rows_to_score(store, "balanced").ids
    labels = store.metadata().set_index("id").loc[ids, "label"].to_numpy()
    store.close()
    write_result(root, "permuted_label", ids, labels.astype(float), True)  # perfect AUROC
    write_result(root, "perplexity", ids, np.linspace(0, 1, len(ids)), True)
    context = one_seed_context(root, tmp_path, {"calibration": {"replicates": 2}})
    done = build_report(context, [calibration.SECTION])
    assert done.sections["calibration"] == "done", done.sections
    cal = json.loads((done.json_dir / "calibration.json").read_text())
    assert [m["method"] for m in cal["methods"]] == ["actmap-mlp", "perplexity"]
