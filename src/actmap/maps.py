"""The map operator Phi: a pooled trajectory (L, T, D') -> an activation map (C, 32, 128).

Paper appendix "Exact Activation-Map Construction", SPEC section 2. For every
(layer, pooled coordinate) cell the token axis is summarised by twelve
statistics (channels), the ordered layer axis is adaptive-average-pooled to 32
rows, and every channel is standardised over its 32 x 128 entries:

    M = Phi(X) = N(A_L(S(X)))      S: (C, L, D')  ->  A_L: (C, 32, 128)  ->  N: same

Everything is pure torch, computed in float32. `build_maps` is the batched form
over a right-padded batch; `build_map` is that form with a batch of one, so the
two agree by construction. The capture hooks use `pool_hidden` for the online
D -> 128 reduction and `pool_layers` for the layer max-pooling of the dense
states ACT-ViT reads; `permute_coordinates` and `gaussian_projection` are the
pooling-structure controls of the paper's ablations.
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

PadMode = Literal["zero", "replicate"]  # how `pool_layers` pads the layer axis

MAP_SHAPE = (12, 32, 128)  # (C, layers, pooled coordinates) of the paper's map
MAP_BYTES = 98_304  # 12 * 32 * 128 float16 values = 96 KiB per generation
DENSE_LAYER_GROUPS = 8  # dense states keep the layer axis max-pooled to 8 groups (ACT-ViT's L_eff)

FINAL_WINDOW = 8  # final-window mean covers the last min(8, T) tokens
SLOPE_EPS = 1e-8  # floor of the least-squares slope's denominator
STD_FLOOR = 1e-6  # floor of the standardisation's std, so constant channels map to 0
_CHUNK_BYTES = 1 << 22  # CPU trajectory bytes per chunk of answers (see `build_maps`)

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
    x: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor,
    out: tuple[torch.Tensor, ...],
    scratch: torch.Tensor,
) -> None:
    """The passes over the token axis of right-padded (answer, layer) rows (N, Tmax, D').

    Writes into `out`: the linear channels `weights @ x` (N, K, D'; the last one
    is the mean) and x[T-1], sum_t (x_t - xbar)^2, max_t x, sum_t |x_t - x_(t-1)|
    (N, D' each), all over valid tokens only. `scratch` is an (N, Tmax, D')
    float32 buffer reused from call to call: no pass allocates a fresh batch.
    """
    linear, last, sum_sq_dev, maximum, abs_diff = out
    n_rows, t_max, width = x.shape
    valid = torch.arange(t_max, device=x.device) < lengths[:, None]  # (N, T)
    padded = not bool(valid.all())
    if padded or x.dtype != torch.float32:
        # Padding repeats the row's final token: garbage there (even NaN) never
        # reaches a statistic, the maximum is unchanged, token-to-token differences
        # there are 0 and the linear weights give it 0. The input is never written.
        y = scratch[0].copy_(x)  # (N, T, D')
        if padded:
            final = x[torch.arange(n_rows, device=x.device), lengths - 1].to(y.dtype)  # (N, D')
            index = (~valid).flatten().nonzero()[:, 0]  # row * Tmax + token
            y.view(n_rows * t_max, width).index_copy_(0, index, final[index // t_max])
    else:
        y = x
    work = scratch[1]  # (N, T, D')
    last.copy_(y[:, -1])  # the final token, repeated over the padding
    torch.bmm(weights, y, out=linear)  # (N, K, D')
    torch.amax(y, dim=1, out=maximum)
    steps = work[:, : t_max - 1]
    torch.sub(y[:, 1:], y[:, :-1], out=steps).abs_()  # (N, T-1, D')
    torch.sum(steps, dim=1, out=abs_diff)
    torch.sub(y, linear[:, -1:], out=work).square_()  # (N, T, D'): two-pass, around the mean
    if padded:
        work.view(n_rows * t_max, width).index_fill_(0, index, 0.0)
    torch.sum(work, dim=1, out=sum_sq_dev)


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


@dataclass
class _Workspace:
    """Buffers for the statistics of one chunk of answers, reused from chunk to chunk."""

    scratch: torch.Tensor  # (2, N, Tmax, D') float32: padded copy of the input, temporaries
    reductions: list[torch.Tensor]  # linear (N, K, D'), then four (N, D') token reductions
    stats: torch.Tensor  # (N, C, D')

    @classmethod
    def allocate(
        cls, n_rows: int, t_max: int, n_linear: int, n_channels: int, width: int, device
    ) -> _Workspace:
        return cls(
            torch.empty(2, n_rows, t_max, width, device=device),
            [
                torch.empty(n_rows, n_linear, width, device=device),
                *torch.empty(4, n_rows, width, device=device),
            ],
            torch.empty(n_rows, n_channels, width, device=device),
        )


def _statistics(
    x: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor,
    n_segments: int,
    workspace: _Workspace | None = None,
) -> torch.Tensor:
    """Unnormalised statistics of a right-padded batch: (B, L, Tmax, D') -> (B, L, C, D').

    Every pass covers all (answer, layer) rows at once; the result lives in
    `workspace` when given.
    """
    batch, n_layers, t_max, width = x.shape
    device = x.device
    n_rows = batch * n_layers
    n_channels = n_segments + len(_TAIL_CHANNELS)
    if workspace is None:
        workspace = _Workspace.allocate(n_rows, t_max, weights.shape[1], n_channels, width, device)
    reductions = tuple(buffer[:n_rows] for buffer in workspace.reductions)
    stats = workspace.stats[:n_rows]
    scratch = workspace.scratch[:, :n_rows, :t_max]
    rows = x.reshape(n_rows, t_max, width)  # (B*L, T, D')
    row_lengths = lengths.repeat_interleave(n_layers)  # (B*L,)
    # every layer of an answer shares its token weights: (B, K, T) -> (B*L, K, T)
    row_weights = weights[:, None].expand(-1, n_layers, -1, -1).reshape(n_rows, -1, t_max)
    _token_reductions(rows, row_lengths, row_weights, reductions, scratch)
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
    batch, n_layers, n_channels, width = stats.shape
    # Adaptive average pooling of the ordered layer axis L -> R, as one product per answer
    # over all channels and coordinates at once.
    layer_pool = _pooling_matrix(n_layers, config.layers_out).to(device)  # (R, L)
    pooled = torch.matmul(layer_pool, stats.reshape(batch, n_layers, n_channels * width))
    pooled = pooled.view(batch, config.layers_out, n_channels, width)  # (b, R, C, D')
    if config.coords_out != width:  # coarser map: pool the coordinates D' -> K too
        coord_pool = _pooling_matrix(width, config.coords_out).T.to(device)  # (D', K)
        pooled = torch.matmul(pooled, coord_pool)  # (b, R, C, K)
    out.copy_(pooled.transpose(1, 2))  # (b, C, R, K)
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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Maps of a right-padded batch: (B, L, Tmax, D') with lengths (B,) -> (B, C, R, K) float32.

    R = config.layers_out, K = config.coords_out. Row b uses tokens [0, lengths[b])
    only; padding values, whatever they are (NaN included), never affect the
    result. Identical to `build_map` on each trimmed trajectory. K must not
    exceed D': a coarser map pools coordinates further (adaptive average
    pooling), a finer one needs a trajectory captured at that width. ``out``, a
    float32 (B, C, R, K) buffer on the trajectories' device, receives the maps
    (a caller streaming many batches reuses it instead of fresh memory).
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
    shape = (batch, *map_shape(config))
    if out is None:
        out = torch.empty(shape, device=device)  # (B, C, R, K)
    elif out.shape != shape or out.dtype != torch.float32 or out.device != device:
        raise ValueError(
            f"out must be a float32 {shape} tensor on {device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    maps = out
    # On the CPU answers go through in chunks of about `_CHUNK_BYTES` of
    # trajectory: each pass over a chunk runs in cache, and the chunk's buffers
    # are reused, where whole-batch temporaries would page-fault fresh memory.
    n_channels = config.n_segments + len(_TAIL_CHANNELS)
    per_answer = n_layers * max(t_max, n_channels) * width * 4
    chunk = batch if device.type != "cpu" else max(1, min(batch, _CHUNK_BYTES // per_answer))
    workspace = _Workspace.allocate(
        chunk * n_layers, t_max, weights.shape[1], n_channels, width, device
    )
    for start in range(0, batch, chunk):
        part = slice(start, start + chunk)
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


# ---------------------------------------------------------------- ablation helpers


def pool_layers(
    x: torch.Tensor, groups: int = DENSE_LAYER_GROUPS, pad_mode: PadMode = "zero"
) -> torch.Tensor:
    """Pad the layer axis to a multiple of `groups`, then max over contiguous groups.

    (L, N, D) -> (groups, N, D). `pad_mode="zero"` appends all-zero layers (the
    ActMap paper's rule); `"replicate"` repeats the last layer (the authors'
    helper). For L = 32 the two agree.
    """
    if x.ndim != 3:
        raise ValueError(f"x must be (L, N, D), got shape {tuple(x.shape)}")
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    if pad_mode not in ("zero", "replicate"):
        raise ValueError(f"pad_mode must be 'zero' or 'replicate', got {pad_mode!r}")
    n_layers, n_tokens, d_model = x.shape
    if n_layers == 0:
        raise ValueError("x has no layers (L = 0)")
    n_pad = (groups - n_layers % groups) % groups
    if n_pad:
        if pad_mode == "zero":
            pad = x.new_zeros(n_pad, n_tokens, d_model)
        else:
            pad = x[-1:].expand(n_pad, n_tokens, d_model)
        x = torch.cat([x, pad], dim=0)  # (L + n_pad, N, D)
    per_group = x.shape[0] // groups
    x = x.reshape(groups, per_group, n_tokens, d_model)  # (G, L / G, N, D)
    return x.amax(dim=1)  # (G, N, D)


def pool_hidden(hidden: torch.Tensor, out_dim: int = 128) -> torch.Tensor:
    """Contiguous adaptive average pooling of the last axis: (..., D) -> (..., out_dim) float32.

    `adaptive_avg_pool1d` semantics (coordinate i averages hidden dims
    [floor(i D / out), ceil((i + 1) D / out))); a reshape-mean when out_dim divides D.
    """
    width = hidden.shape[-1]
    if out_dim < 1 or width < 1:
        raise ValueError(f"pool_hidden needs D >= 1 and out_dim >= 1, got D={width}, {out_dim=}")
    hidden = hidden.float()
    if width % out_dim == 0:
        return hidden.reshape(*hidden.shape[:-1], out_dim, width // out_dim).mean(-1)
    flat = hidden.reshape(-1, 1, width)  # (N, 1, D)
    return F.adaptive_avg_pool1d(flat, out_dim).reshape(*hidden.shape[:-1], out_dim)


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
    _check_single(trajectory)
    return trajectory[-1].float().mean(dim=0)
