"""The ``actmap`` command: a thin typer app over the library.

Each command group lives in its own module and registers itself on ``app``;
heavy imports (torch, transformers) happen inside the commands so ``--help``
is fast.
"""

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


from actmap.cli import baselines as _baselines  # noqa: E402,F401
from actmap.cli import capture as _capture  # noqa: E402,F401  (registers commands)
from actmap.cli import demo as _demo  # noqa: E402,F401
from actmap.cli import product as _product  # noqa: E402,F401
from actmap.cli import serve as _serve  # noqa: E402,F401
from actmap.cli import store as _store  # noqa: E402,F401
from actmap.cli import train as _train  # noqa: E402,F401


def main() -> None:
    app()
