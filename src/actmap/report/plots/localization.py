"""The localization atlas: occlusion, integrated gradients and attention rollout on one grid."""

from __future__ import annotations

import numpy as np

from actmap.report.plots import new_figure


def plot_atlas(localization):
    """Heatmaps over depth bands (rows, shallow at the top) x coordinate bands: the AUROC drop
    when a region is occluded, the share of |integrated gradients|, and (ViT only) the share
    of class-token attention rollout."""
    views = [("AUROC drop when occluded", localization.occlusion_drop, "RdBu_r")]
    views.append(("share of |integrated gradients|", localization.integrated_gradients, "viridis"))
    if localization.rollout is not None:
        views.append(("share of attention rollout", localization.rollout, "viridis"))
    figure = new_figure(4.0 * len(views), 4.0)
    axes = figure.subplots(1, len(views), squeeze=False)[0]
    rows, cols = localization.row_edges, localization.col_edges
    for ax, (title, values, cmap) in zip(axes, views, strict=True):
        values = np.asarray(values)
        if cmap == "RdBu_r":
            bound = max(abs(values).max(), 1e-6)
            image = ax.imshow(values, cmap=cmap, vmin=-bound, vmax=bound, aspect="auto")
        else:
            image = ax.imshow(values, cmap=cmap, aspect="auto")
        figure.colorbar(image, ax=ax, shrink=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(cols) - 1), [str(c) for c in cols[:-1]], fontsize=7)
        ax.set_yticks(range(len(rows) - 1), [str(r) for r in rows[:-1]], fontsize=7)
        ax.set_xlabel("coordinate band (first column)")
        ax.set_ylabel("depth band (first map row)")
    figure.suptitle(
        f"Where the frozen {localization.detector} reads: AUROC {localization.auroc:.3f}, "
        f"whole map occluded {localization.whole_map_auroc:.3f}, n={localization.n_test}",
        fontsize=10,
    )
    return figure


def plot_depth_profile(localization):
    """The test AUROC drop when a whole depth band (every coordinate) is occluded, per band
    (where along depth the frozen detector reads)."""
    figure = new_figure(5.0, 3.4)
    ax = figure.add_subplot()
    profile = np.asarray(localization.band_drop)
    rows = localization.row_edges
    labels = [f"{rows[i]}-{rows[i + 1] - 1}" for i in range(len(rows) - 1)]
    ax.bar(range(len(profile)), profile, color="#1f77b4")
    ax.set_xticks(range(len(profile)), labels, fontsize=8)
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_xlabel("depth band (map rows, shallow to deep)")
    ax.set_ylabel("test AUROC drop, band occluded")
    ax.set_title("Occlusion by depth", fontsize=10)
    return figure
