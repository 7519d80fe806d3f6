"""The map operator as it was before the fused version: the reference of `bench_maps.py`.

A frozen copy of `actmap.maps.build_maps` (blocked (answer, layer) rows, per
(answer, channel) layer pooling); `tests/test_maps.py` checks the library's
operator against it to float tolerance. Not imported by the library.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

MAP_SHAPE = (12, 32, 128)  # (C, layers, pooled coordinates) of the paper's map
MAP_BYTES = 98_304  # 12 * 32 * 128 float16 values = 96 KiB per generation

FINAL_WINDOW = 8  # final-window mean covers the last min(8, T) tokens
SLOPE_EPS = 1e-8  # floor of the least-squares slope's denominator
STD_FLOOR = 1e-6  # floor of the standardisation's std, so constant channels map to 0
_BLOCK_BYTES = 1 << 19  # CPU trajectory bytes per statistics step (see `_statistics`)
_GROUP_BYTES = 1 << 23  # CPU trajectory bytes per group of answers (see `build_maps`)

# Canonical channel order after the segment means (SPEC section 2, channels 5-12).
_TAIL_CHANNELS = (
    "final",  # x[T-1]
    "final_window",  # mean of the last min(8, T) tokens
    "std",  # sample std over tokens (ddof = 1), 0 for T = 1
    "max",  # temporal maximum
    "drift",  # x[T-1] - x[0]
    "slope",  # least-squares slope vs token index, 0 for T = 1
    "layer_rms",  # ||X[l]||_2 / sqrt(T * D'), broadcast over coordinates
    "mean_abs_diff",  # mean |x[t] - x[t-1]|, 0 for T = 1
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


def segment_channel_names(n_segments: int) -> tuple[str, ...]:
    return tuple(f"seg_mean_{i}" for i in range(n_segments))


def all_channel_names(n_segments: int = 4) -> tuple[str, ...]:
    """Every channel in canonical order: n_segments segment means, then the eight others."""
    return segment_channel_names(n_segments) + _TAIL_CHANNELS


CHANNELS = all_channel_names(4)  # the paper's twelve channels


def channel_groups(n_segments: int = 4) -> dict[str, tuple[str, ...]]:
    """The five channel families of the grouped ablation, each in canonical order."""
    return {"segment_means": segment_channel_names(n_segments), **_TAIL_GROUPS}


@dataclass(frozen=True)
class MapConfig:
    """How a trajectory becomes a map; defaults are the paper's main setting."""

    n_segments: int = 4  # temporal segment means; the paper ablates 1 / 4 / 8 (C = n_segments + 8)
    layers_out: int = 32  # map rows: layer axis pooled L -> 32 (ablations 16, 64)
    coords_out: int = 128  # map columns; < D' pools coordinates further, > D' needs re-capture
    channels: tuple[str, ...] | None = None  # subset in canonical order; None = all channels
    normalization: Literal["channel", "global"] = "channel"  # per-channel or one mean/std for all

    def __post_init__(self) -> None:
        for name in ("n_segments", "layers_out", "coords_out"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MapConfig.{name} must be a positive int, got {value!r}")
        if self.normalization not in ("channel", "global"):
            raise ValueError(
                f"MapConfig.normalization must be 'channel' or 'global', got {self.normalization!r}"
            )
        if self.channels is not None:
            _check_channels(tuple(self.channels), self.n_segments)
            object.__setattr__(self, "channels", tuple(self.channels))


def _check_channels(channels: tuple[str, ...], n_segments: int) -> None:
    canonical = all_channel_names(n_segments)
    unknown = [c for c in channels if c not in canonical]
    if unknown:
        raise ValueError(
            f"MapConfig.channels has unknown names {unknown} for n_segments={n_segments}; "
            f"known: {canonical}"
        )
    if not channels:
        raise ValueError("MapConfig.channels is empty; use None for all channels")
    positions = [canonical.index(c) for c in channels]
    if positions != sorted(set(positions)):
        raise ValueError(
            f"MapConfig.channels must be distinct and in canonical order {canonical}, "
            f"got {channels}"
        )


def channel_names(config: MapConfig = MapConfig()) -> tuple[str, ...]:
    """The channels a map built with `config` holds, in order."""
    return config.channels if config.channels is not None else all_channel_names(config.n_segments)


def map_shape(config: MapConfig = MapConfig()) -> tuple[int, int, int]:
    return (len(channel_names(config)), config.layers_out, config.coords_out)


def without_group(config: MapConfig, group: str) -> MapConfig:
    """`config` with one channel family removed (the grouped channel ablation)."""
    groups = channel_groups(config.n_segments)
    if group not in groups:
        raise ValueError(f"unknown channel group {group!r}; known: {tuple(groups)}")
    kept = tuple(c for c in channel_names(config) if c not in groups[group])
    return dataclasses.replace(config, channels=kept)


def segment_bounds(n_tokens: int, n_segments: int = 4) -> list[tuple[int, int]]:
    """Half-open token intervals of the segment means for an answer of `n_tokens` tokens.

    Boundaries are ``np.linspace(0, T, n_segments + 1).astype(int)``; an empty
    segment ``[s, s)`` becomes the one-token interval ``[s, s + 1)`` (T = 5 gives
    0, 1, 2, 3, 5; T = 2 gives [0,1) [0,1) [1,2) [1,2)).
    """
    if n_tokens < 1:
        raise ValueError(f"segment_bounds needs at least one token, got n_tokens={n_tokens}")
    starts, ends = _segment_bounds(np.array([n_tokens]), n_segments)
    return [(int(s), int(e)) for s, e in zip(starts[0], ends[0], strict=True)]


def _segment_bounds(lengths: np.ndarray, n_segments: int) -> tuple[np.ndarray, np.ndarray]:
    bounds = np.linspace(0, lengths, n_segments + 1, axis=-1).astype(int)  # (B, k+1)
    starts, ends = bounds[:, :-1], bounds[:, 1:]
    starts = np.minimum(starts, lengths[:, None] - 1)  # an empty [T, T) cannot occur; guard anyway
    ends = np.maximum(ends, starts + 1)  # empty [s, s) -> [s, s+1)
    return starts, ends


def _linear_weights(lengths: torch.Tensor, t_max: int, n_segments: int) -> torch.Tensor:
    """Token weights of the channels that are linear in the tokens: (B,) -> (B, k+4, Tmax).

    Rows: k segment means, final window, drift, slope, mean. Padded tokens get
    weight 0. Built in float64 on the CPU, returned float32.
    """
    n = lengths.to(torch.float64)[:, None]  # (B, 1)
    t = torch.arange(t_max, dtype=torch.float64)[None, :]  # (1, Tmax)
    valid = t < n  # (B, Tmax)
    starts, ends = _segment_bounds(lengths.numpy(), n_segments)  # (B, k) each
    starts, ends = torch.from_numpy(starts), torch.from_numpy(ends)
    in_segment = (t[:, None, :] >= starts[..., None]) & (t[:, None, :] < ends[..., None])
    segments = in_segment / (ends - starts)[..., None]  # (B, k, Tmax)
    window = torch.clamp(n, max=FINAL_WINDOW)
    final_window = ((t >= n - window) & valid) / window
    drift = (t == n - 1).double() - (t == 0).double()  # zero for T = 1
    centred = torch.where(valid, t - (n - 1) / 2, 0.0)  # t - tbar on valid tokens
    denominator = torch.clamp((centred**2).sum(1, keepdim=True), min=SLOPE_EPS)
    slope = centred / denominator  # sum_t (t-tbar)(x_t - xbar) = sum_t (t-tbar) x_t
    mean = valid / n
    rows = torch.stack([final_window, drift, slope, mean], dim=1)  # (B, 4, Tmax)
    return torch.cat([segments, rows], dim=1).float()  # (B, k+4, Tmax)


def _check_batch(trajectories: torch.Tensor, lengths: torch.Tensor) -> None:
    if not isinstance(trajectories, torch.Tensor) or trajectories.ndim != 4:
        shape = tuple(trajectories.shape) if isinstance(trajectories, torch.Tensor) else None
        raise ValueError(f"trajectories must be a (B, L, T, D') tensor, got shape {shape}")
    if not trajectories.is_floating_point():
        raise ValueError(f"trajectories must be floating point, got dtype {trajectories.dtype}")
    batch, n_layers, t_max, width = trajectories.shape
    if n_layers == 0 or width == 0:
        raise ValueError(
            f"trajectories need L >= 1 layers and D' >= 1 coordinates, got shape "
            f"{tuple(trajectories.shape)}"
        )
    if lengths.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},), got {tuple(lengths.shape)}")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
    empty = torch.nonzero(lengths < 1).flatten().tolist()
    if empty:
        raise ValueError(f"empty answer (T = 0 tokens) at batch rows {empty}; a map needs T >= 1")
    if batch and int(lengths.max()) > t_max:
        raise ValueError(
            f"lengths exceed the padded token axis T = {t_max}: max length {int(lengths.max())}"
        )


def _token_reductions(
    x: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor, out: tuple[torch.Tensor, ...]
) -> None:
    """The passes over the token axis of right-padded (answer, layer) rows (N, Tmax, D').

    Writes into `out`: the linear channels `weights @ x` (N, K, D'; the last one
    is the mean) and x[T-1], sum_t (x_t - xbar)^2, max_t x, sum_t |x_t - x_(t-1)|
    (N, D' each), all over valid tokens only.
    """
    linear, last, sum_sq_dev, maximum, abs_diff = out
    n_rows, t_max, width = x.shape
    last.copy_(x[torch.arange(n_rows, device=x.device), lengths - 1])  # (N, D')
    valid = torch.arange(t_max, device=x.device) < lengths[:, None]  # (N, T)
    padded = not bool(valid.all())
    y = x.to(torch.float32, copy=padded)  # (N, T, D'); the input itself is never written
    if padded:
        # Padding repeats the row's final token: garbage there (even NaN) never
        # reaches a statistic, the maximum is unchanged, token-to-token differences
        # there are 0 and the linear weights give it 0. Only padded pairs are written.
        index = (~valid).flatten().nonzero()[:, 0]  # row * Tmax + token
        y.view(n_rows * t_max, width).index_copy_(0, index, last[index // t_max])
    torch.matmul(weights, y, out=linear)  # (N, K, D')
    deviation = (y - linear[:, -1:]).square_()  # (N, T, D'): two-pass, around the mean
    if padded:
        torch.matmul(valid.float()[:, None, :], deviation, out=sum_sq_dev[:, None, :])
    else:
        torch.sum(deviation, dim=1, out=sum_sq_dev)
    del deviation
    torch.amax(y, dim=1, out=maximum)
    torch.sum((y[:, 1:] - y[:, :-1]).abs_(), dim=1, out=abs_diff)


def _finish_statistics(
    reductions: tuple[torch.Tensor, ...], lengths: torch.Tensor, n_segments: int, out: torch.Tensor
) -> None:
    """Channel statistics (N, C, D') from the token reductions of N rows of lengths (N,)."""
    linear, last, sum_sq_dev, maximum, abs_diff = (
        r[:, None] if r.ndim == 2 else r for r in reductions
    )
    segments, final_window, drift, slope, mean = linear.split([n_segments, 1, 1, 1, 1], 1)
    n = lengths.float()[:, None, None]  # (N, 1, 1)
    several = (lengths > 1)[:, None, None]  # (N, 1, 1): statistics that vanish for T = 1
    denominator = (n - 1).clamp(min=1)
    std = torch.where(several, (sum_sq_dev / denominator).sqrt(), 0.0)
    mean_abs_diff = torch.where(several, abs_diff / denominator, 0.0)
    # sum_t x_t^2 = sum_t (x_t - xbar)^2 + T xbar^2, summed over coordinates
    sum_sq = (sum_sq_dev + n * mean.square()).sum(dim=-1, keepdim=True)
    layer_rms = (sum_sq / (n * last.shape[-1])).sqrt().expand_as(last)  # (N, 1, D')
    channels = [segments, last, final_window, std, maximum, drift, slope, layer_rms]
    torch.cat([*channels, mean_abs_diff], dim=1, out=out)  # (N, C, D')


def _workspace(n_rows: int, n_linear: int, n_channels: int, width: int, device) -> list:
    """Buffers for `_statistics` over up to n_rows rows, reused from group to group."""
    return [
        torch.empty(n_rows, n_linear, width, device=device),  # linear channels
        *torch.empty(4, n_rows, width, device=device),  # x[T-1], sum dev^2, max, sum |dx|
        torch.empty(n_rows, n_channels, width, device=device),  # the statistics
    ]


def _statistics(
    x: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor,
    n_segments: int,
    workspace: list | None = None,
) -> torch.Tensor:
    """Unnormalised statistics of a right-padded batch: (B, L, Tmax, D') -> (B, L, C, D').

    On the CPU the (answer, layer) rows go through in blocks of about
    `_BLOCK_BYTES` of trajectory: the temporaries stay small and are reused by
    the allocator, where whole-batch temporaries would page-fault a fresh copy
    of the batch for every pass. The result lives in `workspace` when given.
    """
    batch, n_layers, t_max, width = x.shape
    device = x.device
    n_rows = batch * n_layers
    n_channels = n_segments + len(_TAIL_CHANNELS)
    if workspace is None:
        workspace = _workspace(n_rows, weights.shape[1], n_channels, width, device)
    *reductions, stats = (buffer[:n_rows] for buffer in workspace)
    rows = x.reshape(n_rows, t_max, width)  # (B*L, T, D')
    row_answer = torch.arange(batch, device=device).repeat_interleave(n_layers)  # (B*L,)
    row_lengths = lengths[row_answer]  # (B*L,)
    block = n_rows if device.type != "cpu" else max(1, _BLOCK_BYTES // (t_max * width * 4))
    for start in range(0, n_rows, block):
        part = slice(start, start + block)
        out = tuple(r[part] for r in reductions)
        _token_reductions(rows[part], row_lengths[part], weights[row_answer[part]], out)
    _finish_statistics(reductions, row_lengths, n_segments, out=stats)
    return stats.view(batch, n_layers, n_channels, width)  # (B, L, C, D')


def temporal_statistics(trajectory: torch.Tensor, n_segments: int = 4) -> torch.Tensor:
    """Unnormalised, unpooled channel statistics S of one trajectory: (L, T, D') -> (C, L, D')."""
    _check_single(trajectory)
    lengths = torch.tensor([trajectory.shape[1]])
    _check_batch(trajectory[None], lengths)
    weights = _linear_weights(lengths, trajectory.shape[1], n_segments)
    weights, lengths = weights.to(trajectory.device), lengths.to(trajectory.device)
    stats = _statistics(trajectory[None], lengths, weights, n_segments)[0]  # (L, C, D')
    _raise_if_non_finite(stats, trajectory[None], lengths)
    return stats.transpose(0, 1)  # (C, L, D')


def _check_single(trajectory: torch.Tensor) -> None:
    if not isinstance(trajectory, torch.Tensor) or trajectory.ndim != 3:
        shape = tuple(trajectory.shape) if isinstance(trajectory, torch.Tensor) else None
        raise ValueError(f"trajectory must be an (L, T, D') tensor, got shape {shape}")
    if trajectory.shape[1] == 0:
        raise ValueError(
            f"empty answer: trajectory has T = 0 tokens (shape {tuple(trajectory.shape)}); "
            "a map needs T >= 1"
        )


def _raise_if_non_finite(result: torch.Tensor, x: torch.Tensor, lengths: torch.Tensor) -> None:
    """Check the (small) result; only on failure count the bad input values."""
    if result.numel() == 0:
        return
    low, high = torch.aminmax(result)  # NaN propagates into both
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return
    lengths = lengths.to(x.device)
    valid = (torch.arange(x.shape[2], device=x.device) < lengths[:, None])[:, None, :, None]
    bad = ~torch.isfinite(x) & valid
    n_nan = int((torch.isnan(x) & valid).sum())
    n_bad = int(bad.sum())
    if n_bad:
        rows = torch.nonzero(bad.flatten(1).any(1)).flatten().tolist()
        raise ValueError(
            f"trajectory has {n_bad} non-finite values ({n_nan} NaN, {n_bad - n_nan} inf) "
            f"in batch rows {rows}"
        )
    raise ValueError("map statistics overflowed float32; the trajectory values are too large")


@functools.lru_cache(maxsize=32)
def _pooling_matrix(n_in: int, n_out: int) -> torch.Tensor:
    """(n_out, n_in) matrix whose product is `adaptive_avg_pool1d` from n_in to n_out."""
    return F.adaptive_avg_pool1d(torch.eye(n_in)[None], n_out)[0].T.contiguous()


def _pool_and_normalize(stats: torch.Tensor, config: MapConfig, out: torch.Tensor) -> None:
    """(b, L, C_all, D') statistics -> (b, C, R, K) maps, written into `out`."""
    device = stats.device
    if config.channels is not None:
        canonical = all_channel_names(config.n_segments)
        index = torch.tensor([canonical.index(c) for c in config.channels], device=device)
        stats = stats.index_select(2, index)  # (b, L, C, D')
    by_channel = stats.transpose(1, 2)  # (b, C, L, D')
    # Adaptive average pooling of the ordered layer axis L -> R, as a product.
    layer_pool = _pooling_matrix(by_channel.shape[2], config.layers_out).to(device)  # (R, L)
    if config.coords_out == by_channel.shape[3]:
        torch.matmul(layer_pool, by_channel, out=out)  # (b, C, R, K)
    else:  # coarser map: pool the coordinates D' -> K too
        coord_pool = _pooling_matrix(by_channel.shape[3], config.coords_out).T.to(device)
        torch.matmul(torch.matmul(layer_pool, by_channel), coord_pool, out=out)
    _standardize_(out, config.normalization)


def _standardize_(maps: torch.Tensor, normalization: str) -> None:
    """In place: (b, C, R, K) -> (S - mean) / max(std, 1e-6), per channel or over all channels."""
    batch, n_channels = maps.shape[:2]
    flat = maps.view(batch, n_channels if normalization == "channel" else 1, -1)
    # Shifting by one entry first keeps an exactly constant channel exactly 0
    # (a float32 mean of equal values need not equal them).
    flat.sub_(flat[..., :1].clone())
    flat.sub_(flat.mean(dim=-1, keepdim=True))
    std = torch.linalg.vector_norm(flat, dim=-1, keepdim=True) / flat.shape[-1] ** 0.5  # population
    flat.div_(std.clamp(min=STD_FLOOR))


def build_maps(
    trajectories: torch.Tensor,
    lengths: torch.Tensor | Sequence[int],
    config: MapConfig = MapConfig(),
) -> torch.Tensor:
    """Maps of a right-padded batch: (B, L, Tmax, D') with lengths (B,) -> (B, C, R, K) float32.

    R = config.layers_out, K = config.coords_out. Row b uses tokens [0, lengths[b])
    only; padding values, whatever they are (NaN included), never affect the
    result. Identical to `build_map` on each trimmed trajectory. K must not
    exceed D': a coarser map pools coordinates further (adaptive average
    pooling), a finer one needs a trajectory captured at that width.
    """
    lengths = torch.as_tensor(lengths).cpu()
    _check_batch(trajectories, lengths)
    batch, n_layers, t_max, width = trajectories.shape
    if config.coords_out > width:
        raise ValueError(
            f"coords_out={config.coords_out} exceeds the trajectory width D'={width}; "
            f"re-capture with pooled_dim={config.coords_out} instead of upsampling"
        )
    device = trajectories.device
    weights = _linear_weights(lengths, t_max, config.n_segments).to(device)  # (B, K, T)
    lengths_here = lengths.to(device)
    maps = torch.empty(batch, *map_shape(config), device=device)  # (B, C, R, K)
    # Answers go through in groups of about `_GROUP_BYTES` of trajectory or
    # statistics, so that the group's buffers stay small too.
    n_channels = config.n_segments + len(_TAIL_CHANNELS)
    per_answer = n_layers * max(t_max, n_channels) * width * 4
    group = batch if device.type != "cpu" else max(1, _GROUP_BYTES // per_answer)
    group = max(1, min(group, batch))
    workspace = _workspace(group * n_layers, weights.shape[1], n_channels, width, device)
    for start in range(0, batch, group):
        part = slice(start, start + group)
        stats = _statistics(
            trajectories[part], lengths_here[part], weights[part], config.n_segments, workspace
        )  # (b, L, C_all, D')
        # std and layer RMS read every valid token: a non-finite input shows up
        # here even when the selected channels would not see it.
        _raise_if_non_finite(stats, trajectories, lengths)
        _pool_and_normalize(stats, config, out=maps[part])
    _raise_if_non_finite(maps, trajectories, lengths)
    return maps


def build_map(trajectory: torch.Tensor, config: MapConfig = MapConfig()) -> torch.Tensor:
    """Phi of one answer: pooled trajectory (L, T, D') -> map (C, R, K) float32."""
    _check_single(trajectory)
    return build_maps(trajectory[None], torch.tensor([trajectory.shape[1]]), config)[0]


def pad_trajectories(trajectories: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L, T_i, D') tensors into (B, L, Tmax, D') with zeros; returns (batch, lengths)."""
    if len(trajectories) == 0:
        raise ValueError("no trajectories given")
    for i, t in enumerate(trajectories):
        if not isinstance(t, torch.Tensor) or t.ndim != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"trajectory {i} must be an (L, T, D') tensor, got shape {shape}")
    n_layers, _, width = trajectories[0].shape
    for i, t in enumerate(trajectories):
        if (t.shape[0], t.shape[2]) != (n_layers, width):
            raise ValueError(
                f"trajectory {i} has shape {tuple(t.shape)}; all must share L = {n_layers} and "
                f"D' = {width}"
            )
    lengths = torch.tensor([t.shape[1] for t in trajectories])
    t_max = max(int(lengths.max()), 1)
    device = trajectories[0].device
    batch = torch.zeros(len(trajectories), n_layers, t_max, width, device=device)
    for i, t in enumerate(trajectories):  # copying ragged rows; the statistics stay vectorised
        batch[i, :, : t.shape[1]] = t
    return batch, lengths


def build_maps_from_list(
    trajectories: Sequence[torch.Tensor], config: MapConfig = MapConfig()
) -> torch.Tensor:
    """Maps of ragged (L, T_i, D') trajectories sharing L and D': -> (B, C, R, K)."""
    batch, lengths = pad_trajectories(trajectories)
    return build_maps(batch, lengths, config)


def to_float16(activation_map: torch.Tensor) -> torch.Tensor:
    """The stored form of a map: float16 (12 * 32 * 128 * 2 = 98,304 bytes for the default)."""
    half = activation_map.to(torch.float16).contiguous()
    if half.numel() and not bool(torch.isfinite(half.abs().amax())):  # NaN propagates
        raise ValueError("map does not fit float16: non-finite values after conversion")
    return half
