"""Out of domain: the first labels' learning curve of each held-out task."""

from __future__ import annotations

from actmap.report.plots import new_figure


def plot_first_labels(result):
    """One panel per held-out task of an `OutOfDomain` result: balanced-test AUROC (mean over
    draws, the draws' 2.5-97.5% band) against the labelled rows k of the task, one line per
    step; the task's in-domain detector (all its training rows) dashed, RAUQ dotted."""
    held = [h for h in result.held_out if h.curve]
    figure = new_figure(4.0 * max(len(held), 1), 3.6)
    axes = figure.subplots(1, max(len(held), 1), squeeze=False)[0]
    for ax, h in zip(axes, held, strict=False):
        for step in dict.fromkeys(p.step for p in h.curve):
            points = [p for p in h.curve if p.step == step]
            x = [p.k for p in points]
            ax.plot(x, [p.auroc for p in points], marker="o", label=step)
            ax.fill_between(x, [p.auroc_low for p in points], [p.auroc_high for p in points],
                            alpha=0.15)  # fmt: skip
        if "auroc" in h.in_domain:
            ax.axhline(h.in_domain["auroc"], color="k", linestyle="--", linewidth=1,
                       label="in-domain (all rows)")  # fmt: skip
        rauq = next((m for m in h.methods if m.method == "rauq"), None)
        if rauq is not None:
            ax.axhline(rauq.auroc.estimate, color="grey", linestyle=":", linewidth=1,
                       label="RAUQ (no labels)")  # fmt: skip
        ax.set_xlabel(f"labelled rows of {h.task}")
        ax.set_title(f"held out: {h.task} (n={h.n_test})", fontsize=10)
    axes[0].set_ylabel("balanced test AUROC")
    axes[0].legend(fontsize=7)
    name = result.generator.get("gguf_file") or result.generator.get("name")
    figure.suptitle(f"First labels: {name}", fontsize=10)
    return figure
