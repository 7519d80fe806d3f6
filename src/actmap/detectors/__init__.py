"""Detectors that read what one capture pass records and score p(correct).

Every detector honours `Detector`: ``requires`` says what it reads per answer (the names of
`actmap.detectors.inputs.INPUT_NAMES`: "maps", and "scalars", "positions", "attention");
``fit(inputs, y, val_inputs, y_val)``, ``predict_proba(inputs)`` and ``score(inputs)`` (the
baselines' `actmap.scoring.contract.ScoreResult`) read one `DetectorInputs`
bundle, which `read_inputs(store, rows, detector.requires)` reads from a store and
`live_inputs` builds from a capture pass; ``capture_needs()`` says what a capture must keep
for it. `all_detectors()` names every one (`actmap.detectors.catalog`: the paper's `vit`,
`mlp`, `mlp4x`, `logreg`; ``actmap-plus:v1``; the stacked ``actmap-plus:deployable`` and
``actmap-plus:full``; plain ``actmap-plus`` = ``actmap-plus:v1``), `new_detector(name)` builds
one and `load_detector(folder)` opens any saved one. Training them from a store is
`actmap.experiments.seeds.train_on_store` (the paper's) and
`actmap.experiments.stacked.train_plus_run` (actmap-plus's), which `actmap train` and
`actmap reproduce` call.
"""

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from actmap.detectors import linear, mlp, vit  # noqa: F401  (registers the detectors)
from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.catalog import (
    ALIASES,
    PLUS_NAMES,
    all_detectors,
    detector_name,
    load_detector,
    new_detector,
)
from actmap.detectors.inputs import (
    INPUT_NAMES,
    DetectorInputs,
    as_inputs,
    check_stored_inputs,
    live_inputs,
    read_inputs,
)
from actmap.detectors.mlp import VIT_PARAMETERS, MatchedMLP, matched_hidden_width
from actmap.detectors.plus import ActMapPlus
from actmap.detectors.registry import create_detector, list_detectors, register_detector
from actmap.detectors.stacked import StackedPlus
from actmap.detectors.vit import MapViT, parameter_breakdown
from actmap.scoring.contract import ScoreResult


@runtime_checkable
class Detector(Protocol):
    """What every detector is to the code that trains or scores with it."""

    @property
    def requires(self) -> tuple[str, ...]: ...

    @property
    def kind(self) -> str: ...

    def capture_needs(self) -> dict: ...

    def fit(self, inputs: Any, y: Any, val_inputs: Any, y_val: Any) -> "Detector": ...

    def predict_proba(self, inputs: Any) -> np.ndarray: ...

    def decision_function(self, inputs: Any) -> np.ndarray: ...

    def score(self, inputs: Any) -> ScoreResult: ...

    def save(self, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path: ...


__all__ = [
    "ALIASES",
    "INPUT_NAMES",
    "PLUS_NAMES",
    "VIT_PARAMETERS",
    "ActMapPlus",
    "CorrectnessDetector",
    "Detector",
    "DetectorInputs",
    "MapViT",
    "MatchedMLP",
    "StackedPlus",
    "all_detectors",
    "as_inputs",
    "check_stored_inputs",
    "create_detector",
    "detector_name",
    "list_detectors",
    "live_inputs",
    "load_detector",
    "matched_hidden_width",
    "new_detector",
    "parameter_breakdown",
    "read_inputs",
    "register_detector",
]
