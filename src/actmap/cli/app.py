"""The typer ``app`` every command module registers itself on."""

from __future__ import annotations

import logging

import typer

app = typer.Typer(
    help="actmap: capture activation maps while an LLM generates, and score p(correct).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _setup(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log library messages."),
    debug: bool = typer.Option(
        False, "--debug", help="Show the full traceback of errors (default: one line)."
    ),
) -> None:
    from actmap.cli.common import SHOW_TRACEBACKS

    SHOW_TRACEBACKS.set(debug)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
