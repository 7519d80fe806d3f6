"""The calibration section: reliability, temperature scaling, prevalence shift and
risk-coverage (`actmap.experiments.calibration`) of ActMap and the strongest stored baselines."""

from __future__ import annotations

from pathlib import Path

from actmap.report.parts.choice import balanced_maps, largest_stores, open_store
from actmap.report.sections import (
    ReportContext,
    Section,
    Skipped,
    figure_markdown,
    skipped_markdown,
)

CALIBRATION_BASELINES = 3  # the strongest stored baselines shown beside ActMap


def compute_calibration(context: ReportContext):
    import numpy as np

    from actmap.experiments.calibration import (
        CalibrationConfig,
        natural_accuracy,
        run_calibration,
        strongest,
    )
    from actmap.experiments.common import scores_from_results, scores_from_run, train_seeds
    from actmap.experiments.runs import recipe_config

    refs = largest_stores(context, "calibration")
    if not refs:
        return Skipped("no store")
    ref = refs[0]
    store = open_store(ref)
    splits = balanced_maps(store)
    test = splits["test"]
    ids, labels = list(test.ids), np.asarray(test.labels)
    runs = context.runs.get(ref.name, {})
    actmap = [scores_from_run(run, ids, labels) for run in runs.values()]
    if not actmap:
        actmap = [
            train_seeds(
                splits["train"],
                splits["validation"],
                test,
                "mlp",
                context.seeds,
                recipe_config(context.max_epochs),
                method="actmap-mlp",
            )
        ]
    stored = sorted(t.split("/", 1)[1] for t in store.tables() if t.startswith("results/"))
    baselines = []
    for method in stored:
        try:
            baselines.append(scores_from_results(store, method, ids, labels))
        except Exception:  # noqa: BLE001 -- a result on other rows is left out, not fatal
            continue
    k = int(context.option("calibration", "baselines", CALIBRATION_BASELINES))
    prevalence, source = natural_accuracy(store)
    config = CalibrationConfig(
        n_replicates=int(context.option("calibration", "replicates", 100)),
        n_resamples=context.n_resamples,
    )
    return run_calibration(actmap + strongest(baselines, k), prevalence, config, source)


def render_calibration(result, figure_dir: Path) -> str:
    from actmap.report.plots import save_figure
    from actmap.report.plots.calibration import plot_reliability, plot_risk_coverage

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
