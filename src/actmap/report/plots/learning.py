"""The learning curve: test AUROC against labelled training rows, one line per method."""

from __future__ import annotations

from actmap.report.plots import new_figure


def plot_learning_curve(curve):
    """Seed-mean test AUROC (95% bootstrap band) against the number of balanced training
    rows, one line per method, log-scaled x axis."""
    figure = new_figure()
    ax = figure.add_subplot()
    for method in dict.fromkeys(p.method for p in curve.points):
        points = curve.curve(method)
        x = [p.n_train for p in points]
        y = [p.summary.auroc.estimate for p in points]
        ax.plot(x, y, marker="o", label=method)
        ax.fill_between(
            x,
            [p.summary.auroc.low for p in points],
            [p.summary.auroc.high for p in points],
            alpha=0.15,
        )
    ax.axhline(0.5, color="k", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ticks = sorted({p.n_train for p in curve.points})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("labelled balanced training rows")
    n_test = curve.rows.get("test")
    ax.set_ylabel(f"test AUROC (mean of {len(curve.config.seeds)} seeds, n={n_test})")
    ax.set_title("Labels needed", fontsize=10)
    ax.legend(fontsize=8)
    return figure
