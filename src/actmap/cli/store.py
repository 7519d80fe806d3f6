"""``actmap store info``, ``actmap store verify`` and ``actmap store repair``."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from actmap.cli.app import app
from actmap.cli.common import console, sampling_option, user_errors

store_app = typer.Typer(
    help="What a map store holds; check it and set damaged shards aside.", no_args_is_help=True
)
app.add_typer(store_app, name="store")


def print_report(report) -> None:
    tables = ", ".join(
        f"{name} {report.rows[name]} rows in {report.shards[name]} shards" for name in report.rows
    )
    console.print(f"store {report.root}: {tables or 'no tables'}", highlight=False)
    for finding in report.findings:
        colour = "red" if finding.severity == "damage" else "yellow"
        console.print(
            f"[{colour}]{finding.severity:6s}[/{colour}] {finding.where}: {finding.message}",
            highlight=False,
            soft_wrap=True,
        )


@store_app.command("info")
def info(
    store: Path = typer.Argument(..., help="A map store folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout."),
    sampling: str = sampling_option(),
) -> None:
    """Rows, labels, natural accuracy and balanced rows per split; capture runs' rows/s."""
    from actmap.store.served import served_sampling

    with user_errors(), served_sampling(sampling):
        from actmap.store import MapStore
        from actmap.store.rows import rate_text, store_summary

        summary = store_summary(MapStore.open(store))
    if as_json:
        typer.echo(json.dumps(summary.to_json(), indent=2))
        return
    console.print(
        f"store {summary.root}: task {summary.task}, model {summary.model} ({summary.dtype})",
        highlight=False,
        soft_wrap=True,
    )
    table = Table("split", "rows", "labelled", "correct", "accuracy", "balanced")
    for name, c in [*summary.splits.items(), ("total", summary.total)]:
        accuracy = f"{c.accuracy:.3f}" if c.labelled else "-"
        table.add_row(
            name, *(str(v) for v in (c.rows, c.labelled, c.correct)), accuracy, str(c.balanced)
        )
    console.print(table)
    console.print(f"empty answers (no map): {summary.empty_answers}", highlight=False)
    if summary.served is not None:
        s = summary.served
        console.print(
            f"served answers: {s['labelled']} labelled ({s['history']} label rows), "
            f"{s['queued']} in the review queue, {s['in_sample']} labelled in its random "
            f"sample; labels counted above: {s['counted']} (split: a hash of the map id)",
            highlight=False,
        )
    idle = 0
    for i, run in enumerate(summary.capture_runs):
        if not run["written"]:  # a resumed run that found its work done
            idle += 1
            continue
        rate = f"{rate_text(run['rows_per_s'])} rows/s" if run["rows_per_s"] else "-"
        wall = run["wall_time_s"]
        console.print(
            f"capture run {i + 1}: {run['written']} rows in "
            f"{'-' if wall is None else f'{wall:.0f} s'} ({rate})"
            + ("" if run["finished"] else ", not finished (still running, or killed)"),
            highlight=False,
        )
    if idle:
        console.print(f"capture runs that wrote no rows (resumed, work done): {idle}")
    if summary.capture_rows_per_s is not None:
        console.print(
            "capture rate over the runs that wrote rows: "
            f"{rate_text(summary.capture_rows_per_s)} rows/s",
            highlight=False,
        )


@store_app.command("subset")
def subset(
    store: Path = typer.Argument(..., help="A map store folder (only read)."),
    target: Path = typer.Argument(..., help="A new folder for the subset store."),
    tables: str = typer.Option(
        "",
        help="Comma-separated tables to keep beside the maps (e.g. generations,dense); "
        "default: every table the store has.",
    ),
    sampling: str = sampling_option(),
) -> None:
    """Write a store holding only STORE's balanced rows, to carry to another machine."""
    from actmap.store.served import served_sampling

    with user_errors(), served_sampling(sampling):
        from actmap.store import MapStore
        from actmap.store.rows import balanced_subset

        wanted = [t.strip() for t in tables.split(",") if t.strip()] or None
        written = balanced_subset(MapStore.open(store), target, wanted)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    console.print(
        f"wrote {target} ({size / 2**20:.1f} MiB): "
        + ", ".join(f"{table} {rows} rows" for table, rows in written.items()),
        highlight=False,
        soft_wrap=True,
    )


@store_app.command("verify")
def verify(store: Path = typer.Argument(..., help="A map store folder.")) -> None:
    """Read every shard; name each damaged file; exit 1 when the store is damaged."""
    with user_errors():
        from actmap.store.check import verify_store

        report = verify_store(store)
        print_report(report)
        if report.ok:
            console.print("verdict: ok", highlight=False)
            return
        console.print(
            f"verdict: damaged ({len(report.damage)} problem(s)); "
            f"`actmap store repair {store}` sets the damaged shards aside",
            highlight=False,
            soft_wrap=True,
        )
    raise typer.Exit(1)


@store_app.command("repair")
def repair(store: Path = typer.Argument(..., help="A map store folder.")) -> None:
    """Move damaged shards into STORE/quarantine/ (never deleted) and say what a resume redoes."""
    with user_errors():
        from actmap.store.check import repair_store

        result = repair_store(store)
        if not result.quarantined and not result.before.findings:
            console.print(f"{store}: nothing to repair", highlight=False)
            return
        for path, why in result.quarantined:
            console.print(f"moved {path} to quarantine/ ({why})", highlight=False, soft_wrap=True)
        if result.lost_rows:
            console.print(
                f"{result.lost_rows} rows were in unreadable maps shards", highlight=False
            )
        if result.regenerate:
            shown = ", ".join(result.regenerate[:20])
            more = f" and {len(result.regenerate) - 20} more" if len(result.regenerate) > 20 else ""
            console.print(
                f"a resumed `actmap capture` will regenerate {len(result.regenerate)} ids: "
                f"{shown}{more} (all listed under 'repairs' in manifest.json)",
                highlight=False,
                soft_wrap=True,
            )
        else:
            console.print("no ids to regenerate", highlight=False)
        verdict = "ok" if result.after.ok else f"still damaged ({len(result.after.damage)})"
        console.print(f"verify after repair: {verdict}", highlight=False)
        for finding in result.after.findings:
            console.print(str(finding), highlight=False, soft_wrap=True)
    if not result.after.ok:
        raise typer.Exit(1)
