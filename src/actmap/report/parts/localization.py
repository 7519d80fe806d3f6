"""The localization section: occlusion, integrated gradients and attention rollout of frozen
detectors (`actmap.experiments.localization`) on the store with the most balanced rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from actmap.experiments.localization import LocalizationConfig, localize
from actmap.report.parts.choice import balanced_maps, frozen_detector, largest_stores, open_store
from actmap.report.plots import save_figure
from actmap.report.plots.localization import plot_atlas, plot_depth_profile
from actmap.report.sections import (
    ReportContext,
    Section,
    Skipped,
    figure_markdown,
    skipped_markdown,
)


@dataclass(frozen=True)
class Localizations:
    store: str
    maps: dict = field(default_factory=dict)  # detector -> Localization

    def to_json(self) -> dict:
        return {"store": self.store, "detectors": {k: v.to_json() for k, v in self.maps.items()}}


def compute_localization(context: ReportContext):

    refs = largest_stores(context, "localization")
    if not refs:
        return Skipped("no store")
    ref = refs[0]
    splits = balanced_maps(open_store(ref), context)
    # the paper's detectors the context has runs of (the ViT adds attention rollout), else
    # an MLP trained here
    trained = [d for d in context.runs.get(ref.name, {}) if d in ("vit", "mlp", "mlp4x", "logreg")]
    detectors = context.option("localization", "detectors", tuple(trained) or ("mlp",))
    found = {}
    for name in detectors:
        with context.timings.measure(f"localization/{name}"):
            detector = frozen_detector(context, ref, name)
            found[name] = localize(detector, splits["test"], LocalizationConfig())
    return Localizations(ref.name, found)


def render_localization(result, figure_dir: Path) -> str:

    if isinstance(result, Skipped):
        return skipped_markdown(result)
    parts = [f"Store `{result.store}`; frozen detectors, balanced test rows.\n"]
    for name, loc in result.maps.items():
        atlas = save_figure(plot_atlas(loc), figure_dir / f"atlas-{name}.png")
        depth = save_figure(plot_depth_profile(loc), figure_dir / f"depth-{name}.png")
        parts += [
            f"#### {name}\n",
            loc.to_markdown(),
            figure_markdown(
                atlas,
                f"Occlusion atlas of the frozen {name}: AUROC drop per depth x coordinate "
                "region, share of |integrated gradients|"
                + (", attention rollout." if loc.rollout is not None else "."),
            ),
            figure_markdown(depth, f"{name}: test AUROC drop when a whole depth band is occluded."),
        ]
    return "\n".join(parts)


SECTION = Section(
    "localization", "Depth-wise localization", compute_localization, render_localization
)
