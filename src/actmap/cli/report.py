"""``actmap report``: the paper's evaluation as one Markdown report with figures and JSON."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, parse_ints, user_errors


@app.command()
def report(
    store: list[Path] = typer.Option(
        ..., "--store", "-s", help="A map store to report on (repeat for several)."
    ),
    runs: Path = typer.Option(
        None, help="Folder of `actmap train` runs laid out as <runs>/<store name>/<detector>/."
    ),
    out: Path = typer.Option(Path("report"), "--out", "-o", help="Report folder."),
    scratch: Path = typer.Option(
        None, help="Working folder for copies and fitted models (default <out>/scratch)."
    ),
    rows: str = typer.Option("balanced", help="Rows to score: balanced | test | all."),
    seeds: str = typer.Option("42,123,456", help="Comma-separated seeds."),
    n_resamples: int = typer.Option(2000, help="Bootstrap resamples per interval."),
    max_epochs: int = typer.Option(None, help="Cap the recipe's epochs (quick looks)."),
    device: str = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    only: str = typer.Option(None, help="Comma-separated section names to run (default: all)."),
    judge_check: list[Path] = typer.Option(
        None,
        "--judge-check",
        help="An `actmap judge check --out` folder, read beside the figures of the stores its "
        "judge labelled (repeat for several judges).",
    ),
    out_of_domain: list[Path] = typer.Option(
        None,
        "--out-of-domain",
        help="An `actmap out-of-domain --out` folder: its leave-one-task-out table and first "
        "labels go in the out_of_domain section (repeat for several generators).",
    ),
) -> None:
    """Write report.md, figures/*.png and json/*.json answering the paper's questions."""
    with user_errors():
        from actmap.report.assemble import build_report
        from actmap.report.inputs import find_runs, read_judge_checks, store_refs
        from actmap.report.registry import select_sections
        from actmap.report.sections import ReportContext, check_rows

        refs = store_refs(store)
        context = ReportContext(
            stores=refs,
            runs=find_runs(runs, refs),
            out=out,
            scratch=scratch or out / "scratch",
            seeds=parse_ints(seeds),
            rows=check_rows(rows),
            n_resamples=n_resamples,
            device=device,
            max_epochs=max_epochs,
            judge_checks=read_judge_checks(judge_check or []),
            options={"out_of_domain": {"runs": list(out_of_domain or [])}},
        )
        sections = select_sections(only.split(",") if only else None)

        def progress(name: str, state: str) -> None:
            console.print(f"{name}: {'running' if state == 'start' else state}")

        done = build_report(context, sections, progress)
        console.print(f"report written to {done.report}")
