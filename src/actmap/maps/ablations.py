"""The paper's ablation transforms of the map (paper section "Ablations").

Each changes one thing about how an answer becomes a map, so that the ablation
study (`actmap.experiments.ablations`) can say which part carries the signal:

    without_group(config, group)   one channel family removed (GROUP_NAMES)
    last_token_map(trajectory)     the last-token channels only (LAST_TOKEN_CHANNELS)
    mean_pooled_final_layer(x)     the single mean-pooled final-layer state (the usual probe)
    permute_coordinates(hidden)    a fixed random permutation of the hidden coordinates
    gaussian_projection(hidden)    a seeded Gaussian projection instead of contiguous pooling

The operator itself (Phi, `build_maps`, the stored form) is `actmap.maps.operator`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from actmap.maps.operator import (
    MapConfig,
    build_map,
    channel_names,
    check_single_trajectory,
    segment_channel_names,
)

# Channel groups the paper removes one at a time ("any one channel group removed").
_TAIL_GROUPS = {
    "final_states": ("final", "final_window"),
    "dispersion": ("std", "max"),
    "drift_slope": ("drift", "slope"),
    "magnitude_dynamics": ("layer_rms", "mean_abs_diff"),
}
GROUP_NAMES = ("segment_means", *_TAIL_GROUPS)
LAST_TOKEN_CHANNELS = ("final", "final_window")  # the "last-token channels only" ablation


def channel_groups(n_segments: int = 4) -> dict[str, tuple[str, ...]]:
    """The five channel families of the grouped ablation, each in canonical order."""
    return {"segment_means": segment_channel_names(n_segments), **_TAIL_GROUPS}


def without_group(config: MapConfig, group: str) -> MapConfig:
    """`config` with one channel family removed (the grouped channel ablation)."""
    groups = channel_groups(config.n_segments)
    if group not in groups:
        raise ValueError(f"unknown channel group {group!r}; known: {tuple(groups)}")
    kept = tuple(c for c in channel_names(config) if c not in groups[group])
    return dataclasses.replace(config, channels=kept)


@functools.lru_cache(maxsize=16)
def _permutation(width: int, seed: int) -> torch.Tensor:
    return torch.randperm(width, generator=torch.Generator().manual_seed(seed))


def permute_coordinates(hidden: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Fixed random permutation of the hidden coordinates (..., D), applied before pooling.

    The same (D, seed) always gives the same permutation, so every layer, token
    and answer is permuted alike; only the contiguous grouping is destroyed.
    """
    return hidden[..., _permutation(hidden.shape[-1], seed).to(hidden.device)]


@functools.lru_cache(maxsize=16)
def _projection(width: int, out_dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(width, out_dim, generator=generator) / out_dim**0.5  # N(0, 1/out_dim)


def gaussian_projection(hidden: torch.Tensor, out_dim: int = 128, seed: int = 0) -> torch.Tensor:
    """Seeded Gaussian random projection instead of pooling: (..., D) -> (..., out_dim) float32.

    Entries of the (D, out_dim) matrix are N(0, 1/out_dim), fixed by (D, out_dim, seed).
    """
    matrix = _projection(hidden.shape[-1], out_dim, seed).to(hidden.device)
    return hidden.float() @ matrix


def last_token_map(trajectory: torch.Tensor, config: MapConfig = MapConfig()) -> torch.Tensor:
    """The "last-token channels only" ablation: a map of the final and final-window channels."""
    return build_map(trajectory, dataclasses.replace(config, channels=LAST_TOKEN_CHANNELS))


def mean_pooled_final_layer(trajectory: torch.Tensor) -> torch.Tensor:
    """The single mean-pooled final-layer state (the usual probe input): (L, T, D') -> (D',)."""
    check_single_trajectory(trajectory)
    return trajectory[-1].float().mean(dim=0)
