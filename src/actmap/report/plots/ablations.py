"""The ablation table as a figure: seed-mean AUROC with its 95% interval, one bar per variant."""

from __future__ import annotations

from actmap.report.plots import new_figure

GROUP_COLOURS = {
    "reference": "#333333",
    "map": "#1f77b4",
    "pooling": "#9467bd",
    "classifier": "#2ca02c",
    "control": "#d62728",
}


def plot_ablations(result):
    """Horizontal bars of seed-mean test AUROC per ablation variant, 95% bootstrap intervals
    as whiskers, chance (0.5) and the reference as vertical lines; unavailable variants omitted."""
    done = [v for v in result.variants if v.summary is not None]
    figure = new_figure(7.0, 0.32 * len(done) + 1.4)
    ax = figure.add_subplot()
    names = [v.name for v in done][::-1]
    rows = done[::-1]
    est = [v.summary.auroc.estimate for v in rows]
    low = [v.summary.auroc.estimate - v.summary.auroc.low for v in rows]
    high = [v.summary.auroc.high - v.summary.auroc.estimate for v in rows]
    colours = [GROUP_COLOURS.get(v.group, "grey") for v in rows]
    ax.barh(range(len(rows)), est, xerr=[low, high], color=colours, alpha=0.8, capsize=2)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.axvline(0.5, color="k", linestyle=":", linewidth=1, label="chance")
    reference = next((v for v in done if v.name == "full"), None)
    if reference is not None:
        ax.axvline(
            reference.summary.auroc.estimate,
            color="#333333",
            linestyle="--",
            linewidth=1,
            label="full map",
        )
    n = done[0].summary.auroc.n if done else 0
    seeds = len(result.config.seeds)
    ax.set_xlabel(f"test AUROC (mean of {seeds} seeds, 95% bootstrap CI, n={n})")
    ax.set_xlim(0.3, 1.0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Ablations and controls", fontsize=10)
    return figure
