"""What baselines share beyond the scoring contract (that lives in `actmap.scoring.contract`)."""

from __future__ import annotations


class BaselineUnavailable(RuntimeError):
    """A method cannot run here (missing weights, missing captured features); the message says why."""
