"""The learning-curve section: `actmap.experiments.learning_curve` on the two stores with the
most balanced rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from actmap.experiments.learning_curve import (
    ACTMAP_DETECTORS,
    LearningCurveConfig,
    run_learning_curve,
)
from actmap.experiments.seeds import recipe_config
from actmap.report.parts.choice import largest_stores, open_store, read_only_splits, same_fit
from actmap.report.plots import save_figure
from actmap.report.plots.learning import plot_learning_curve
from actmap.report.sections import (
    ReportContext,
    Section,
    Skipped,
    figure_markdown,
    skipped_markdown,
)


@dataclass(frozen=True)
class LearningCurves:
    curves: dict = field(default_factory=dict)  # store name -> LearningCurve

    def to_json(self) -> dict:
        return {name: curve.to_json() for name, curve in self.curves.items()}


def compute_learning_curve(context: ReportContext):

    refs = largest_stores(context, "learning_curve", count=2)
    if not refs:
        return Skipped("no store")
    config = LearningCurveConfig(
        fractions=tuple(context.option("learning_curve", "fractions", (0.1, 0.25, 0.5, 1.0))),
        seeds=context.seeds,
        methods=tuple(context.option("learning_curve", "methods", ("mlp", "logreg", "tad"))),
        max_epochs=context.max_epochs,
        n_resamples=context.n_resamples,
    )
    curves = {}
    for ref in refs:
        with context.timings.measure("learning_curve/" + ref.name):
            store = open_store(ref)
            known = {}  # the 100% points of the report's ActMap detectors: read, not retrained
            for method in config.methods:
                if method in ACTMAP_DETECTORS:
                    recipe = recipe_config(config.max_epochs)
                    scores = same_fit(context, ref, method, recipe, config.seeds)
                    if scores is not None:
                        known[method] = scores
            curves[ref.name] = run_learning_curve(
                store, config, splits=read_only_splits(store), known=known
            )
    return LearningCurves(curves)


def render_learning_curve(result, figure_dir: Path) -> str:

    if isinstance(result, Skipped):
        return skipped_markdown(result)
    parts = []
    for name, curve in result.curves.items():
        path = save_figure(plot_learning_curve(curve), figure_dir / f"learning-{name}.png")
        caption = (
            f"{name}: seed-mean test AUROC against labelled balanced training rows "
            f"({len(curve.config.seeds)} seeds, class-balanced subsamples; "
            f"{curve.rows['test']} test rows), 95% bootstrap band."
        )
        parts.append(
            f"#### {name}\n\n" + curve.to_markdown() + "\n" + figure_markdown(path, caption)
        )
    return "\n".join(parts)


SECTION = Section(
    "learning_curve",
    "Labels needed (learning curve)",
    compute_learning_curve,
    render_learning_curve,
)
