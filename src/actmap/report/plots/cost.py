"""The cost-quality plot: added latency per answer (log scale) against mean AUROC."""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

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
    labels = []
    for method, (ms, auroc, n) in sorted(points.items()):
        colour = FAMILY_COLOURS.get(families.get(method, "white"), "tab:blue")
        x = max(ms, floor)
        axis.scatter([x], [auroc], color=colour, s=40, zorder=3)
        labels.append(
            axis.annotate(
                f"{method} ({n})",
                (x, auroc),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=7,
                arrowprops={"arrowstyle": "-", "color": "0.6", "lw": 0.5, "shrinkB": 4},
            )
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
    separate_labels(figure, labels)
    return figure


# Offsets (points) tried in turn for a label that would overlap one already placed.
LABEL_OFFSETS = [(4, 3), (4, -11), (4, 13), (4, -21), (4, 23), (4, -31), (4, 33), (4, -41)]


def separate_labels(figure: Figure, labels: list, rounds: int = 4) -> None:
    """Move point labels that would overlap: top point first, each to its first free offset.

    Positions are measured after a draw (constrained layout places the axes, and moved
    labels move the layout a little), so placement is redone until no drawn box overlaps;
    a label with no free offset keeps the last one tried.
    """
    renderer = FigureCanvasAgg(figure).get_renderer()
    for _ in range(rounds):
        figure.draw_without_rendering()
        boxes = [text_box(label, renderer) for label in labels]
        if not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :]):
            return
        placed = []
        for label in sorted(labels, key=lambda t: (-t.xy[1], t.xy[0])):
            for offset in LABEL_OFFSETS:
                label.xyann = offset
                box = text_box(label, renderer)
                if not any(box.overlaps(other) for other in placed):
                    break
            placed.append(box)


def text_box(label, renderer):
    """The drawn box of an annotation's text alone (its leader line left out)."""
    return Text.get_window_extent(label, renderer)
