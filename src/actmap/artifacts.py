"""What every saved artifact carries: the package version and strict JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from actmap.atomic import atomic_write_text


def package_version() -> str:
    """The installed actmap version, recorded with every artifact."""
    from actmap import __version__

    return __version__


def json_safe(value: Any) -> Any:
    """Plain JSON types: non-finite floats become None, dict keys strings, arrays lists."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, np.generic):
        return json_safe(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None where there is none (missing, unreadable or torn): a
    marker a killed or older run did not leave is the same as no marker."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj: Any) -> None:
    """Strict JSON (NaN -> null), written to a temporary file then renamed into place."""
    atomic_write_text(path, json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n")
