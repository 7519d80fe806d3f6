"""Detectors that read an activation map and score p(correct).

`create_detector(name, **kwargs)` builds a registered `nn.Module` (`vit`,
`mlp`, `mlp4x`, `logreg`); `CorrectnessDetector` wraps one with the training
recipe behind a fit / predict_proba / save / load contract.
"""

from actmap.detectors import linear, mlp, vit  # noqa: F401  (registers the detectors)
from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.mlp import VIT_PARAMETERS, MatchedMLP, matched_hidden_width
from actmap.detectors.registry import create_detector, list_detectors, register_detector
from actmap.detectors.vit import MapViT, parameter_breakdown

__all__ = [
    "VIT_PARAMETERS",
    "CorrectnessDetector",
    "MapViT",
    "MatchedMLP",
    "create_detector",
    "list_detectors",
    "matched_hidden_width",
    "parameter_breakdown",
    "register_detector",
]
