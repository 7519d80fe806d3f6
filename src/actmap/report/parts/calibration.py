"""The calibration section: reliability, temperature scaling, prevalence shift and
risk-coverage (`actmap.experiments.calibration`) of ActMap and the strongest stored baselines."""

from __future__ import annotations

from pathlib import Path

from actmap.experiments.calibration import (
    CalibrationConfig,
    TargetRows,
    run_calibration,
    split_prevalence,
    strongest,
)
from actmap.experiments.common import scores_from_results
from actmap.experiments.in_domain import family_of
from actmap.report.parts.choice import balanced_maps, fitted, largest_stores, open_store
from actmap.report.plots import save_figure
from actmap.report.plots.calibration import plot_reliability, plot_risk_coverage
from actmap.report.sections import (
    ReportContext,
    Section,
    Skipped,
    figure_markdown,
    skipped_markdown,
)
from actmap.store.rows import natural_ids, split_labels

CALIBRATION_BASELINES = 3  # the strongest stored baselines shown beside ActMap
ACTMAP_DETECTORS = ("vit", "mlp", "mlp4x", "logreg")
TARGET_POOL = 1024  # validation rows scored for the prevalence-shift temperature (at most)


def compute_calibration(context: ReportContext):

    refs = largest_stores(context, "calibration")
    if not refs:
        return Skipped("no store")
    ref = refs[0]
    store = open_store(ref)
    test = balanced_maps(store, context)["test"]
    ids, labels = list(test.ids), test.labels
    detectors = [d for d in context.runs.get(ref.name, {}) if d in ACTMAP_DETECTORS] or ["mlp"]
    found = {d: fitted(context, ref, d) for d in detectors}
    actmap = [f.scores for f in found.values()]
    stored = sorted(t.split("/", 1)[1] for t in store.tables() if t.startswith("results/"))
    baselines = []
    for method in stored:
        if family_of(method) == "control":  # a control is not a baseline to calibrate beside
            continue
        try:
            baselines.append(scores_from_results(store, method, ids, labels))
        except Exception:  # noqa: BLE001 -- a result on other rows is left out, not fatal
            continue
    k = int(context.option("calibration", "baselines", CALIBRATION_BASELINES))
    prevalence, source = split_prevalence(store)
    config = CalibrationConfig(
        n_replicates=int(context.option("calibration", "replicates", 100)),
        n_resamples=context.n_resamples,
    )
    pool = int(context.option("calibration", "target_pool", TARGET_POOL))
    targets = {f.scores.method: validation_target(store, f, pool) for f in found.values()}
    return run_calibration(actmap + strongest(baselines, k), prevalence, config, source, targets)


def validation_target(store, fit, pool: int = TARGET_POOL, seed: int = 0):
    """Labelled validation rows of the store at the natural prevalence (all of them, or a
    random ``pool`` of them when there are more) scored by each seed of the fitted detector:
    the held-out rows its prevalence-shift temperature is fit on. None when they hold a
    single class."""
    import numpy as np

    ids = natural_ids(store)["validation"]  # empty answers have no map and are not among them
    labels = split_labels(store, ids)
    total = len(ids)
    if total > pool:
        keep = np.sort(np.random.default_rng(seed).choice(total, pool, replace=False))
        ids, labels = [ids[i] for i in keep], labels[keep]
    if not ids or labels.min() == labels.max():
        return None
    logits = []
    for start in range(0, len(ids), 512):  # maps a chunk at a time
        maps, _ = store.load_maps(ids[start : start + 512])
        logits.append([fit.models[s].decision_function(maps) for s in fit.scores.seeds])
    which = f"all {total}" if total == len(ids) else f"a random {len(ids)} of the {total}"
    return TargetRows(
        np.concatenate(logits, axis=1),
        labels,
        f"{which} labelled validation rows (natural prevalence)",
    )


def render_calibration(result, figure_dir: Path) -> str:

    if isinstance(result, Skipped):
        return skipped_markdown(result)
    reliability = save_figure(plot_reliability(result), figure_dir / "reliability.png")
    risk = save_figure(plot_risk_coverage(result), figure_dir / "risk-coverage.png")
    return (
        "ActMap next to the stored baselines with the highest test AUROC (chosen on the rows "
        "shown, which favours them). Intervals: 95% bootstrap over the balanced test rows.\n\n"
        + result.to_markdown()
        + "\n"
        + figure_markdown(reliability, "Reliability diagram (first seed), balanced test rows.")
        + "\n"
        + figure_markdown(risk, "Risk-coverage curves (first seed), balanced test rows.")
    )


SECTION = Section(
    "calibration",
    "Calibration and selective prediction",
    compute_calibration,
    render_calibration,
)
