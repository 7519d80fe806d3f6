"""Every detector by one unambiguous name, built new or loaded from its saved folder.

    vit | mlp | mlp4x | logreg      the paper's map detectors (`CorrectnessDetector`)
    actmap-plus:v1                  map PCA + the six scalars, one logistic regression (`ActMapPlus`)
    actmap-plus:deployable          the stacked actmap-plus without attention (`StackedPlus`)
    actmap-plus:full                the stacked actmap-plus, attention blocks included

Plain ``actmap-plus`` is an alias with one meaning: ``actmap-plus:v1`` (what a saved
actmap-plus of schema 1 is, and what `actmap reproduce` trains under that name).
`new_detector(name)` builds an unfitted one; `load_detector(folder)` opens any saved one (one
loader for every artifact: config.json names its kind, ``schema_version`` 2 the stacked one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.plus import ActMapPlus, PlusConfig
from actmap.detectors.registry import list_detectors
from actmap.detectors.stacked import PRESETS, StackConfig, StackedPlus
from actmap.errors import ActmapUserError

PLUS = "actmap-plus"
PLUS_NAMES = (f"{PLUS}:v1", *(f"{PLUS}:{preset}" for preset in PRESETS))
ALIASES = {PLUS: f"{PLUS}:v1"}


def all_detectors() -> tuple[str, ...]:
    """Every detector by its name: the registered map detectors, then actmap-plus's versions."""
    return (*list_detectors(), *PLUS_NAMES)


def detector_name(name: str) -> str:
    """``name`` as `all_detectors` spells it (an alias resolved); an unknown name is refused,
    naming the known ones."""
    name = ALIASES.get(name, name)
    if name not in all_detectors():
        known = ", ".join([*all_detectors(), *ALIASES])
        raise ActmapUserError(f"unknown detector {name!r}; known: {known}")
    return name


def new_detector(name: str, **settings: Any):
    """An unfitted detector ``name``; ``settings`` go to its constructor (the paper's:
    `CorrectnessDetector`'s arguments; ``actmap-plus:v1``: `PlusConfig` fields; the stacked
    presets: `StackConfig` fields)."""
    name = detector_name(name)
    if name == f"{PLUS}:v1":
        return ActMapPlus(PlusConfig(**settings))
    if name.startswith(f"{PLUS}:"):
        return StackedPlus(StackConfig(preset=name.split(":", 1)[1], **settings))
    return CorrectnessDetector(name, **settings)


def load_detector(directory: str | Path, device: str | None = None):
    """The detector saved in ``directory`` (config.json + model.safetensors), of any kind; it
    scores exactly as the one saved. ``device``: where a torch detector scores."""
    config = Path(directory) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist")
    try:
        saved = json.loads(config.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ActmapUserError(f"{config} is not valid JSON ({error})") from None
    kind = saved.get("detector") if isinstance(saved, dict) else None
    if kind == PLUS:
        stacked = saved.get("schema_version") == StackedPlus.schema_version
        return (StackedPlus if stacked else ActMapPlus).load(directory, device=device)
    return CorrectnessDetector.load(directory, device=device)
