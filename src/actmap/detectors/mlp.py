"""Capacity controls: one-hidden-layer MLPs over the flattened map.

The hidden width is solved from the parameter budget, params = h * (in + 2) + 1
(in * h + h weights and biases in, h + 1 out), so `mlp` matches the ViT's
2,401,985 parameters and `mlp4x` four times that, for any map shape.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from actmap.detectors.registry import register_detector

VIT_PARAMETERS = 2_401_985  # the paper's ViT; budget of the matched MLP


def mlp_parameters(in_features: int, hidden: int) -> int:
    """Trainable parameters of flatten -> Linear(in, h) -> GELU -> Linear(h, 1)."""
    return hidden * (in_features + 1) + hidden + 1


def matched_hidden_width(in_features: int, budget: int) -> int:
    """The integer width whose parameter count is closest to `budget` (ties: the smaller)."""
    if in_features < 1 or budget < mlp_parameters(in_features, 1):
        raise ValueError(f"budget {budget} cannot fit one hidden unit over {in_features} inputs")
    exact = (budget - 1) / (in_features + 2)
    candidates = {max(1, math.floor(exact)), max(1, math.ceil(exact))}
    return min(sorted(candidates), key=lambda h: abs(mlp_parameters(in_features, h) - budget))


class MatchedMLP(nn.Module):
    """flatten -> Linear(C*H*W, h) -> GELU -> Dropout -> Linear(h, 1); one logit per map."""

    def __init__(
        self,
        in_channels: int = 12,
        map_height: int = 32,
        map_width: int = 128,
        param_budget: int = VIT_PARAMETERS,  # hidden width is solved from this
        dropout: float = 0.3,  # same as the ViT's MLP and readout dropout
    ) -> None:
        super().__init__()
        in_features = in_channels * map_height * map_width
        self.hidden = matched_hidden_width(in_features, param_budget)
        self.fc1 = nn.Linear(in_features, self.hidden)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(self.hidden, 1)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.gelu(self.fc1(x.flatten(1))))  # (B, C*H*W) -> (B, h)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc2(features).squeeze(-1)  # (B,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


@register_detector("mlp")
def mlp(**kwargs) -> MatchedMLP:
    """The MLP matched to the ViT's parameter budget."""
    return MatchedMLP(param_budget=VIT_PARAMETERS, **kwargs)


@register_detector("mlp4x")
def mlp4x(**kwargs) -> MatchedMLP:
    """The MLP with four times the ViT's parameter budget."""
    return MatchedMLP(param_budget=4 * VIT_PARAMETERS, **kwargs)
