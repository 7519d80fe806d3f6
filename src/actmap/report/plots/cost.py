"""The cost-quality plot: added latency per answer (log scale) against mean AUROC."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure

from actmap.report.plots import new_figure

FAMILY_COLOURS = {
    "actmap": "tab:red",
    "black": "black",
    "grey": "tab:gray",
    "white": "tab:blue",
    "control": "tab:green",
}


def plot_cost_quality(
    points: Mapping[str, tuple[float, float, int]], families: Mapping[str, str]
) -> Figure:
    """One point per method: x = added ms per answer (log), y = mean AUROC over its stores."""
    figure = new_figure(6.4, 4.4)
    axis = figure.subplots()
    floor = 1e-3  # a method that adds nothing measurable is drawn at the floor
    for method, (ms, auroc, n) in sorted(points.items()):
        colour = FAMILY_COLOURS.get(families.get(method, "white"), "tab:blue")
        x = max(ms, floor)
        axis.scatter([x], [auroc], color=colour, s=40, zorder=3)
        axis.annotate(
            f"{method} ({n})", (x, auroc), textcoords="offset points", xytext=(4, 3), fontsize=7
        )
    axis.set_xscale("log")
    axis.axhline(0.5, color="0.7", lw=0.8, ls="--")
    axis.set_xlabel("added latency per answer (ms, log scale)")
    axis.set_ylabel("mean AUROC over stores (n stores in brackets)")
    axis.set_title(
        "red ActMap; black / grey / blue: black / grey / white-box baselines; green: controls",
        fontsize=8,
    )
    axis.grid(True, which="both", alpha=0.3)
    return figure
