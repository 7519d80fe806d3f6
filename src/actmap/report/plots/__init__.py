"""Pure figure functions for the report: one figure per function, from a section's result.

Each ``plot_*`` takes (part of) a result and returns a ``matplotlib.figure.Figure`` built
without pyplot (so no global state and no display: the Agg canvas draws it);
`save_figure` writes it as PNG. Nothing here reads a store or recomputes a metric.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

DPI = 120


def new_figure(width: float = 6.4, height: float = 4.0) -> Figure:
    """A figure on the Agg canvas (``Figure()`` never touches pyplot's state)."""
    return Figure(figsize=(width, height), layout="constrained")


def save_figure(figure: Figure, path: Path) -> Path:
    """Write ``figure`` as PNG to ``path`` (folders created) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, format="png")
    return path
