"""Baselines: every method scores the same stored rows under one confidence contract.

One module per family (``greybox``, ``ptrue``, ``rauq``, ``tad``, ``semantic_entropy``,
``eigenscore``, ``actvit``, ``controls``); `registry` names them all, and
`actmap.baselines.runner` runs them on a map store and compares them.
"""

from actmap.baselines.registry import (
    BASELINES,
    baseline_class,
    create_baseline,
    list_baselines,
    time_per_answer,
)

__all__ = ["BASELINES", "baseline_class", "create_baseline", "list_baselines", "time_per_answer"]
