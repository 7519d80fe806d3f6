"""A real generation's activation map, one panel per channel."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from actmap.report.plots import new_figure


def plot_map_channels(
    activation_map: np.ndarray, channels: list[str], title: str, columns: int = 4
) -> Figure:
    """Every channel of one (C, layers, coordinates) map as a heatmap: depth bottom to top."""
    n = len(channels)
    rows = -(-n // columns)
    figure = new_figure(3.2 * columns, 1.9 * rows + 0.6)
    grid = figure.subplots(rows, columns, squeeze=False)
    # a few outlier coordinates reach 20 standard deviations: clip the shared colour scale at
    # the 99th percentile of |value| so every channel's structure stays visible
    limit = float(np.nanpercentile(np.abs(activation_map), 99)) or 1.0
    image = None
    for k, axis in enumerate(grid.flat):
        if k >= n:
            axis.set_axis_off()
            continue
        image = axis.imshow(
            activation_map[k],
            origin="lower",
            aspect="auto",
            cmap="RdBu_r",
            vmin=-limit,
            vmax=limit,
            interpolation="nearest",
        )
        axis.set_title(channels[k], fontsize=9)
        axis.set_xticks([0, activation_map.shape[2] - 1])
        axis.set_yticks([0, activation_map.shape[1] - 1])
        if k % columns == 0:
            axis.set_ylabel("depth (layer row)", fontsize=8)
        if k >= n - columns:
            axis.set_xlabel("pooled coordinate", fontsize=8)
    if image is not None:
        figure.colorbar(
            image,
            ax=grid,
            shrink=0.6,
            label="standardised value (per channel), clipped at the 99th percentile of |value|",
        )
    figure.suptitle(title, fontsize=10)
    return figure
