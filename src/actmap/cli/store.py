"""``actmap store verify`` and ``actmap store repair``."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, user_errors

store_app = typer.Typer(
    help="Check a map store and set damaged shards aside.", no_args_is_help=True
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
