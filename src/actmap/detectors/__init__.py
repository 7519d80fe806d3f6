"""Detectors that read an activation map and score p(correct).

`create_detector(name, **kwargs)` builds a registered `nn.Module` (`vit`,
`mlp`, `mlp4x`, `logreg`); `CorrectnessDetector` wraps one with the training
recipe behind a fit / predict_proba / save / load contract. `ActMapPlus`
(``actmap-plus``) is the detector to deploy; `load_detector` opens either kind
from its saved folder.
"""

import json
from pathlib import Path

from actmap.detectors import linear, mlp, vit  # noqa: F401  (registers the detectors)
from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.mlp import VIT_PARAMETERS, MatchedMLP, matched_hidden_width
from actmap.detectors.plus import ActMapPlus
from actmap.detectors.registry import create_detector, list_detectors, register_detector
from actmap.detectors.vit import MapViT, parameter_breakdown


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
    "MapViT",
    "MatchedMLP",
    "create_detector",
    "list_detectors",
    "load_detector",
    "matched_hidden_width",
    "parameter_breakdown",
    "register_detector",
]
