"""Reliability diagrams and risk-coverage curves."""

from __future__ import annotations

from actmap.report.plots import new_figure


def plot_reliability(calibration):
    """Fraction correct against mean p(correct) per bin (first seed), one line per method
    with a probability; marker size grows with the bin's count; the diagonal is perfect
    calibration."""
    figure = new_figure(5.2, 5.0)
    ax = figure.add_subplot()
    ax.plot([0, 1], [0, 1], color="k", linestyle=":", linewidth=1, label="perfect")
    for m in calibration.methods:
        if m.reliability is None:
            continue
        r = m.reliability
        points = [
            (p, f, c)
            for p, f, c in zip(r.mean_p, r.fraction_correct, r.count, strict=True)
            if c > 0
        ]
        ax.plot(
            [p for p, _, _ in points],
            [f for _, f, _ in points],
            marker="o",
            label=f"{m.method} (this seed's ECE {r.ece:.3f})",
        )
        ax.scatter(
            [p for p, _, _ in points],
            [f for _, f, _ in points],
            s=[8 + 2 * c for _, _, c in points],
            alpha=0.3,
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("mean p(correct) in bin")
    ax.set_ylabel("fraction correct in bin")
    n = calibration.methods[0].n if calibration.methods else 0
    ax.set_title(f"Reliability on the balanced test rows (n={n})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return figure


def plot_risk_coverage(calibration):
    """Risk (error rate among accepted answers) against coverage, accepting the most
    confident first, one line per method (first seed); the dotted lines mark 5% risk and
    80% coverage."""
    figure = new_figure()
    ax = figure.add_subplot()
    for m in calibration.methods:
        s = m.selective
        ax.step(
            s.coverage,
            s.risk,
            where="post",
            label=f"{m.method} (seed means: cov@5% {s.coverage_at_risk.estimate:.2f}, "
            f"risk@80% {s.risk_at_coverage.estimate:.2f})",
        )
    c = calibration.config
    ax.axhline(c.risk, color="k", linestyle=":", linewidth=1)
    ax.axvline(c.coverage, color="k", linestyle=":", linewidth=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, None)
    ax.set_xlabel("coverage (fraction of answers accepted)")
    ax.set_ylabel("risk (error rate among accepted)")
    n = calibration.methods[0].n if calibration.methods else 0
    ax.set_title(f"Selective prediction on the balanced test rows (n={n})", fontsize=10)
    ax.legend(fontsize=7)
    return figure
