"""Baselines: every method scores the same stored rows under one confidence contract.

One module per family (``greybox``, ``ptrue``, ``rauq``, ``tad``, ``semantic_entropy``,
``eigenscore``, ``actvit``, ``controls``); `registry` names them all, and
`actmap.baselines.runner` runs them on a map store; `actmap.report.side_by_side` compares them.
Every scorer honours `actmap.scoring.contract`'s contract and declares what it reads.
"""

from actmap.baselines.registry import (
    BASELINES,
    baseline_class,
    create_baseline,
    list_baselines,
    register_baseline,
    time_per_answer,
)

__all__ = [
    "BASELINES",
    "baseline_class",
    "create_baseline",
    "list_baselines",
    "register_baseline",
    "time_per_answer",
]
