"""Logistic regression over the flattened map: C*H*W + 1 parameters (49,153 by default)."""

from __future__ import annotations

import torch
from torch import nn

from actmap.detectors.registry import register_detector


@register_detector("logreg")
class LogisticRegression(nn.Module):
    """flatten -> Linear(C*H*W, 1); one logit per map."""

    def __init__(self, in_channels: int = 12, map_height: int = 32, map_width: int = 128) -> None:
        super().__init__()
        self.linear = nn.Linear(in_channels * map_height * map_width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)).squeeze(-1)  # (B, C*H*W) -> (B,)
