"""Which torch device: one place for the choice every loader, trainer and scorer makes."""

from __future__ import annotations

import torch

from actmap.errors import ActmapUserError


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """ "auto" (or None) picks cuda when available, else cpu; anything else is passed to torch."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return check_device(name)


def check_device(name: str | torch.device) -> torch.device:
    """``torch.device(name)``, refusing a CUDA device on a machine without CUDA."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ActmapUserError(f"unknown device {str(name)!r} ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ActmapUserError(f"device {str(name)!r} asked for, but CUDA is not available here")
    return device
