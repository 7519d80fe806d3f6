"""``actmap monitor fit`` and ``actmap monitor check``: the shift monitor of a run."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, parse_ints, user_errors

monitor_app = typer.Typer(
    help="Shift monitor: alarms when incoming maps leave the detector's domain.",
    no_args_is_help=True,
)
app.add_typer(monitor_app, name="monitor")


@monitor_app.command("fit")
def monitor_fit(
    run: Path = typer.Option(
        ..., help="Run folder from `actmap train`; the monitor goes in RUN/monitor."
    ),
    store: Path = typer.Option(..., help="The store the run was trained on."),
    split: str = typer.Option("train", help="Rows the monitor learns the domain from."),
    alpha: float = typer.Option(0.05, help="False-alarm rate of one window test."),
    map_alpha: float = typer.Option(0.01, help="A single map is flagged at p-value <= this."),
    n_reference: int = typer.Option(1000, min=2, help="Reference rows a window is compared with."),
    n_permutations: int = typer.Option(199, min=1, help="Permutations per window test."),
    components: int = typer.Option(32, min=1, help="PCA components of the layer profiles."),
    seed: int = typer.Option(0, help="Seed of the row split and the permutations."),
    out: Path = typer.Option(
        None, "--out", "-o", help="Folder for the monitor (default RUN/monitor)."
    ),
) -> None:
    """Fit the shift monitor on the maps a detector was trained on, saved next to the run."""
    with user_errors():
        from actmap.monitor import MonitorConfig
        from actmap.monitor.on_run import fit_on_run

        config = MonitorConfig(
            alpha=alpha, map_alpha=map_alpha, n_components=components, n_reference=n_reference,
            n_permutations=n_permutations, seed=seed,
        )  # fmt: skip
        monitor, path = fit_on_run(run, store, split, config, out)
    console.print(
        f"monitor fitted on {monitor.n_fit_} '{split}' maps of {store} "
        f"({len(monitor.reference_)} reference rows, {monitor.components_.shape[0]} components, "
        f"shrinkage {monitor.shrinkage_:.3f}); written to {path}"
    )


@monitor_app.command("check")
def monitor_check(
    run: Path = typer.Option(..., help="Run folder holding a monitor (`actmap monitor fit`)."),
    store: Path = typer.Option(..., help="Store whose maps are checked against the run's domain."),
    window: str = typer.Option("50,200", help="Comma-separated window sizes (maps per window)."),
    split: str = typer.Option(
        None, help="Only the rows of these splits, comma-separated (default: all rows)."
    ),
    prevalence: float = typer.Option(
        None,
        help="Resample the labelled rows to this fraction correct first (a prevalence change).",
    ),
    windows: int = typer.Option(100, min=1, help="Windows tested per size."),
    seed: int = typer.Option(0, help="Seed of the windows and the resampling."),
    monitor: Path = typer.Option(None, help="Monitor folder (default RUN/monitor)."),
    out: Path = typer.Option(None, "--out", "-o", help="Write the result as JSON here."),
) -> None:
    """Alarm rate of the run's monitor over windows of a store's maps."""
    with user_errors():
        from rich.table import Table

        from actmap.artifacts import json_safe
        from actmap.atomic import atomic_write_text
        from actmap.monitor import ShiftMonitor
        from actmap.monitor.on_run import alarm_rates, load_for_run, window_rows
        from actmap.store import MapStore

        fitted = ShiftMonitor.load(monitor) if monitor is not None else load_for_run(run)
        opened = MapStore.open(store)
        ids = window_rows(opened, split, prevalence, seed)
        maps, meta = opened.load_maps(ids)
        labels = meta["label"].dropna()
        about = {
            "run": str(run), "store": str(store), "split": split, "prevalence": prevalence,
            "accuracy": float(labels.mean()) if len(labels) else None,
        }  # fmt: skip
        result = alarm_rates(fitted, maps, parse_ints(window), windows, seed, about)
        if out is not None:
            atomic_write_text(out, json.dumps(json_safe(result.to_json()), indent=2) + "\n")
    accuracy = "n/a" if about["accuracy"] is None else f"{about['accuracy']:.3f}"
    table = Table(
        title=f"{store}: {result.rows} rows (accuracy {accuracy}), alarm at p <= {result.alpha}"
    )
    for column in ("window", "alarm rate", "95% CI (disjoint)", "windows", "mean p"):
        table.add_column(column)
    for r in result.rates:
        table.add_row(
            str(r.window), f"{r.alarm_rate:.3f}", f"[{r.interval_low:.3f}, {r.interval_high:.3f}]"
            f" of {r.independent_windows}", str(r.windows), f"{r.mean_p_value:.3f}",
        )  # fmt: skip
    console.print(table)
    console.print(f"maps flagged one by one (p <= {result.map_alpha}): {result.map_flag_rate:.3f}")
    if out is not None:
        console.print(f"result written to {out}")
