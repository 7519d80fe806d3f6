"""Small helpers shared by the CLI commands: progress bars and error reporting."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

console = Console(stderr=True)


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
    )


@contextmanager
def user_errors() -> Iterator[None]:
    """Expected failures (bad input, missing files) become one red line and exit code 2."""
    from actmap.capture.layers import UnknownModelLayout
    from actmap.data.base import DataError
    from actmap.store import StoreError

    try:
        yield
    except (DataError, StoreError, UnknownModelLayout, FileNotFoundError, ValueError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(2) from None


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def fraction(value: float) -> str:
    """A figure such as an accuracy, or "n/a" when there was nothing to compute it on."""
    return "n/a" if value != value else f"{value:.3f}"  # NaN is the only value != itself
