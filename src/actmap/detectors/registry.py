"""Detectors by name: a decorator registers a factory, `create_detector` builds one.

Every registered factory accepts the map shape (`in_channels`, `map_height`,
`map_width`) as keyword arguments, so one saved (name, kwargs) pair rebuilds
the exact module and the same code serves the resolution and channel ablations.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from actmap.errors import ActmapUserError

DetectorFactory = Callable[..., nn.Module]

_REGISTRY: dict[str, DetectorFactory] = {}


def register_detector(name: str) -> Callable[[DetectorFactory], DetectorFactory]:
    """Class or function decorator: make `create_detector(name, **kwargs)` call it."""

    def decorator(factory: DetectorFactory) -> DetectorFactory:
        if name in _REGISTRY:
            raise ValueError(f"detector {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def create_detector(name: str, **kwargs) -> nn.Module:
    """Build the registered detector `name` with constructor arguments `kwargs`."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ActmapUserError(
            f"unknown detector {name!r}; registered: {', '.join(list_detectors())}"
        ) from None
    return factory(**kwargs)


def list_detectors() -> list[str]:
    """Names of all registered detectors, sorted."""
    return sorted(_REGISTRY)
