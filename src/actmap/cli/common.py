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


def debug_requested() -> bool:
    """True when the command line carried ``actmap --debug``."""
    import click

    context = click.get_current_context(silent=True)
    return bool(context and (context.find_root().obj or {}).get("debug"))


@contextmanager
def user_errors() -> Iterator[None]:
    """A user's mistake becomes one red line and exit code 2; ``--debug`` shows its traceback.

    Only `ActmapUserError` (raised by the library for bad input) and a missing file count
    as the user's; any other exception is a bug and keeps its traceback.
    """
    from actmap.errors import ActmapUserError

    try:
        yield
    except (ActmapUserError, FileNotFoundError) as error:
        if debug_requested():
            raise
        console.print(f"[red]error:[/red] {one_line(error)}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None


def one_line(error: BaseException) -> str:
    """The error's message on one line (a FileNotFoundError from the OS names its path)."""
    if isinstance(error, OSError) and error.filename:
        text = f"{error.filename}: {error.strerror or 'not found'}"
    else:
        text = str(error)
    return " ".join(text.split())


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


def fraction(value: float) -> str:
    """A figure such as an accuracy, or "n/a" when there was nothing to compute it on."""
    return "n/a" if value != value else f"{value:.3f}"  # NaN is the only value != itself
