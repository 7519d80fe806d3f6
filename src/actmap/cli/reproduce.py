"""``actmap reproduce``: capture, baselines, training and the report from one config file."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, progress_bar, task_progress, user_errors


@app.command()
def reproduce(
    config: Path = typer.Option(..., help="reproduce TOML file (see configs/reproduce-*.toml)."),
    dry_run: bool = typer.Option(False, help="List the stages and whether each is done; run none."),
    store: list[str] = typer.Option(
        [],
        "--store",
        help="Run only this store's stages (repeatable); the report reads only these.",
    ),
    report: bool = typer.Option(
        True,
        "--report/--no-report",
        help="End with the report (--no-report: only the stores' stages, e.g. for calls that "
        "each run some stores side by side before one call renders the report).",
    ),
) -> None:
    """Run the paper's evaluation end to end; finished stages are skipped when run again."""
    with user_errors():
        from actmap.reproduce import load_config, plan, run_plan, select_stores

        settings = select_stores(load_config(config), store)
        stages = plan(settings, report=report)
        if dry_run:
            for stage in stages:
                console.print(f"{stage.name}: {'done' if stage.done() else 'to run'}")
            return
        with progress_bar() as bar:

            def progress_for(stage):
                return task_progress(bar, bar.add_task(stage.name, total=None, info=""))

            status = run_plan(stages, progress_for)
        for name, state in status.items():
            console.print(f"{name}: {state}")
        if report:
            console.print(f"report: {settings.out / 'report' / 'report.md'}")
