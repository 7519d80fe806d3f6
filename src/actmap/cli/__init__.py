"""The ``actmap`` command: a thin typer app over the library.

Each command group lives in its own module and registers itself on ``app``;
heavy imports (torch, transformers) happen inside the commands so ``--help``
is fast.
"""

from __future__ import annotations

# The import order is the order of `actmap --help`.
# isort: off
from actmap.cli import baselines as _baselines  # noqa: F401  (each registers its commands)
from actmap.cli import capture as _capture  # noqa: F401
from actmap.cli import maps as _maps  # noqa: F401
from actmap.cli import labels as _labels  # noqa: F401
from actmap.cli import demo as _demo  # noqa: F401
from actmap.cli import monitor as _monitor  # noqa: F401
from actmap.cli import out_of_domain as _out_of_domain  # noqa: F401
from actmap.cli import product as _product  # noqa: F401
from actmap.cli import report as _report  # noqa: F401
from actmap.cli import reproduce as _reproduce  # noqa: F401
from actmap.cli import score as _score  # noqa: F401
from actmap.cli import serve as _serve  # noqa: F401
from actmap.cli import store as _store  # noqa: F401
from actmap.cli import train as _train  # noqa: F401

# isort: on
from actmap.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()
