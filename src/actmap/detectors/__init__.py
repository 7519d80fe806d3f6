"""Detectors that read an activation map and score p(correct).

`create_detector(name, **kwargs)` builds a registered `nn.Module` (`vit`,
`mlp`, `mlp4x`, `logreg`); `CorrectnessDetector` wraps one with the training
recipe behind a fit / predict_proba / save / load contract. `ActMapPlus`
(``actmap-plus``) is the detector to deploy; `load_detector` opens either kind
from its saved folder.

Every detector honours `Detector`: ``requires`` says what it reads per answer
(``("maps",)`` or ``("maps", "scalars")``), and ``predict_proba(maps, scalars=None)``
scores (a maps-only detector does not read ``scalars``). A caller reads the scalars
only when ``"scalars" in detector.requires``. `all_detectors()` names every one;
training them from a store is `actmap.experiments.seeds` (`train_on_store`,
`train_plus_run`), which `actmap train` and `actmap reproduce` call.
"""

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from actmap.detectors import linear, mlp, vit  # noqa: F401  (registers the detectors)
from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.mlp import VIT_PARAMETERS, MatchedMLP, matched_hidden_width
from actmap.detectors.plus import ActMapPlus
from actmap.detectors.registry import create_detector, list_detectors, register_detector
from actmap.detectors.vit import MapViT, parameter_breakdown


@runtime_checkable
class Detector(Protocol):
    """What every detector is to the code that scores with it."""

    name: str

    @property
    def requires(self) -> tuple[str, ...]: ...

    def predict_proba(self, maps: Any, scalars: Any = None) -> np.ndarray: ...

    def decision_function(self, maps: Any, scalars: Any = None) -> np.ndarray: ...

    def save(self, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path: ...


def all_detectors() -> tuple[str, ...]:
    """Every detector by name: the registered map detectors, then actmap-plus."""
    return (*list_detectors(), ActMapPlus.name)


def load_detector(directory: str | Path, device: str | None = None):
    """The detector saved in ``directory`` (config.json + model.safetensors), of either kind."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist")
    if json.loads(config.read_text()).get("detector") == ActMapPlus.name:
        return ActMapPlus.from_pretrained(directory)
    return CorrectnessDetector.load(directory, device=device)


__all__ = [
    "VIT_PARAMETERS",
    "ActMapPlus",
    "CorrectnessDetector",
    "Detector",
    "MapViT",
    "MatchedMLP",
    "all_detectors",
    "create_detector",
    "list_detectors",
    "load_detector",
    "matched_hidden_width",
    "parameter_breakdown",
    "register_detector",
]
