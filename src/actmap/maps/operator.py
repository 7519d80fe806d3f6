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
states ACT-ViT reads. The paper's ablation transforms (channel groups removed,
last-token channels, permuted or projected coordinates, the mean-pooled final
layer) live beside it, in `actmap.maps.ablations`.
"""

from __future__ import annotations

import functools
import math
import threading
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
_CHUNK_BYTES = 1 << 21  # CPU trajectory bytes per chunk of answers: the passes stay in a 2 MB L2

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


def segment_channel_names(n_segments: int) -> tuple[str, ...]:
    return tuple(f"seg_mean_{i}" for i in range(n_segments))


def all_channel_names(n_segments: int = 4) -> tuple[str, ...]:
    """Every channel in canonical order: n_segments segment means, then the eight others."""
    return segment_channel_names(n_segments) + _TAIL_CHANNELS


CHANNELS = all_channel_names(4)  # the paper's twelve channels


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
    """Token weights of the channels that are linear in the tokens: (B,) -> (B, k+3, Tmax).

    Rows: k segment means, final window, slope, mean. Padded tokens get weight
    0. Built in float64 on the CPU, returned float32. (Final and drift are a
    token and a difference of two: read, not multiplied.)
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
    centred = torch.where(valid, t - (n - 1) / 2, 0.0)  # t - tbar on valid tokens
    denominator = torch.clamp((centred**2).sum(1, keepdim=True), min=SLOPE_EPS)
    slope = centred / denominator  # sum_t (t-tbar)(x_t - xbar) = sum_t (t-tbar) x_t
    mean = valid / n
    rows = torch.stack([final_window, slope, mean], dim=1)  # (B, 3, Tmax)
    return torch.cat([segments, rows], dim=1).float()  # (B, k+3, Tmax)


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


def _padded_copy(x: torch.Tensor, lengths: list[int], scratch: torch.Tensor) -> torch.Tensor:
    """(b, L, Tmax, D') answers with every padded token replaced by the answer's final token.

    Garbage there (even NaN) then never reaches a statistic: the maximum is
    unchanged, token-to-token differences there are 0, and the linear weights
    give it 0. The input is never written; a full-length, contiguous float32
    batch is used as it is. (One bulk copy, then one fill per padded answer: a masked
    `torch.where` costs six copies on the CPU.)
    """
    t_max = x.shape[2]
    if x.dtype == torch.float32 and x.is_contiguous() and all(n == t_max for n in lengths):
        return x
    y = scratch.copy_(x)  # (b, L, T, D')
    for row, n in enumerate(lengths):
        if n < t_max:
            y[row, :, n:] = y[row, :, n - 1 : n]  # (L, T - n, D') <- (L, 1, D')
    return y


def _statistics(
    x: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor,
    n_segments: int,
    workspace: _Workspace | None = None,
) -> torch.Tensor:
    """Unnormalised statistics of a right-padded batch: (B, L, Tmax, D') -> (B, C, L, D').

    Every pass covers all (answer, layer) rows at once and writes its channel
    straight into the channel-major result (which the layer pooling reads as
    it is); the result lives in `workspace` when given.
    """
    batch, n_layers, t_max, width = x.shape
    n_rows = batch * n_layers
    n_channels = n_segments + len(_TAIL_CHANNELS)
    if workspace is None:
        workspace = _Workspace.allocate(
            batch, n_layers, t_max, weights.shape[1], n_channels, width, x.device
        )
    stats = workspace.stats[:batch]  # (b, C, L, D')
    scratch = workspace.scratch[:, :n_rows, :t_max]
    answer_lengths = lengths.tolist()
    y4 = _padded_copy(x, answer_lengths, scratch[0].view(x.shape))  # (B, L, T, D')
    y = y4.view(n_rows, t_max, width)  # (B*L, T, D')
    # every layer of an answer shares its token weights: (B, K, T) -> (B*L, K, T)
    row_weights = weights[:, None].expand(-1, n_layers, -1, -1).reshape(n_rows, -1, t_max)
    linear = workspace.linear[:n_rows]
    torch.bmm(row_weights, y, out=linear)  # (B*L, k+3, D'): segments, window, slope, mean
    linear = linear.view(batch, n_layers, -1, width).transpose(1, 2)  # (B, k+3, L, D')
    segments, final_window, slope, mean = linear.split([n_segments, 1, 1, 1], dim=1)
    channel = dict(zip(all_channel_names(n_segments), stats.unbind(1), strict=True))
    stats[:, :n_segments].copy_(segments)
    channel["final"].copy_(y4[:, :, -1])  # the final token, repeated over the padding
    channel["final_window"].copy_(final_window[:, 0])
    channel["slope"].copy_(slope[:, 0])
    torch.sub(y4[:, :, -1], y4[:, :, 0], out=channel["drift"])  # 0 for T = 1
    torch.amax(y4, dim=2, out=channel["max"])
    work = scratch[1]  # (B*L, T, D')
    steps = work[:, : t_max - 1]
    torch.sub(y[:, 1:], y[:, :-1], out=steps).abs_()  # (B*L, T-1, D'), 0 over the padding
    torch.sum(steps.view(batch, n_layers, t_max - 1, width), dim=2, out=channel["mean_abs_diff"])
    deviations = work.view_as(y4)  # (B, L, T, D'): two-pass, around the mean
    torch.sub(y4, mean[:, 0, :, None], out=deviations).square_()
    for row, n in enumerate(answer_lengths):
        if n < t_max:
            deviations[row, :, n:] = 0.0  # the padding repeats the final token
    sum_sq_dev = channel["std"]  # sum_t (x_t - xbar)^2 first, the std below
    torch.sum(deviations, dim=2, out=sum_sq_dev)
    n = lengths.to(stats.dtype)[:, None, None]  # (B, 1, 1)
    # sum_t x_t^2 = sum_t (x_t - xbar)^2 + T xbar^2, summed over coordinates
    sum_sq = torch.addcmul(sum_sq_dev, mean[:, 0].square(), n).sum(dim=-1, keepdim=True)
    channel["layer_rms"].copy_((sum_sq / (n * width)).sqrt_().expand(-1, -1, width))
    denominator = (n - 1).clamp_(min=1)  # T = 1: both sums are exactly 0 and stay 0
    sum_sq_dev.div_(denominator).sqrt_()
    channel["mean_abs_diff"].div_(denominator)
    return stats  # (B, C, L, D')


@dataclass
class _Workspace:
    """Buffers for the statistics of one chunk of answers, reused from chunk to chunk."""

    scratch: torch.Tensor  # (2, b*L, Tmax, D') float32: padded copy of the input, temporaries
    linear: torch.Tensor  # (b*L, k+3, D') the linear channels
    stats: torch.Tensor  # (b, C, L, D') every channel, channel-major

    @classmethod
    def allocate(
        cls,
        batch: int,
        n_layers: int,
        t_max: int,
        n_linear: int,
        n_channels: int,
        width: int,
        device,
        storage: torch.Tensor | None = None,
    ) -> _Workspace:
        """Fresh buffers, or views into `storage` (a flat float32 tensor, see `_reused_storage`)."""
        n_rows = batch * n_layers
        shapes = (
            (2, n_rows, t_max, width),
            (n_rows, n_linear, width),
            (batch, n_channels, n_layers, width),
        )
        if storage is None:
            return cls(*(torch.empty(shape, device=device) for shape in shapes))
        sizes = [math.prod(shape) for shape in shapes]
        parts = storage[: sum(sizes)].split(sizes)
        return cls(*(part.view(shape) for part, shape in zip(parts, shapes, strict=True)))


_STORAGE = threading.local()  # per thread and device: the flat buffer `build_maps` works in


def _reused_storage(n_elements: int, device: torch.device) -> torch.Tensor:
    """This thread's flat float32 work buffer on the CPU `device`, grown when too small.

    Streaming callers (capture, scoring servers) call `build_maps` batch after
    batch; fresh megabytes per call would page-fault on every call.
    """
    if not hasattr(_STORAGE, "buffers"):
        _STORAGE.buffers = {}
    buffer = _STORAGE.buffers.get(device)
    if buffer is None or buffer.numel() < n_elements:
        # a normal tensor even when made under inference_mode: callers inside and outside
        # inference mode write into it (an inference tensor refuses in-place updates outside)
        with torch.inference_mode(False):
            buffer = _STORAGE.buffers[device] = torch.empty(n_elements, device=device)
    return buffer


def temporal_statistics(trajectory: torch.Tensor, n_segments: int = 4) -> torch.Tensor:
    """Unnormalised, unpooled channel statistics S of one trajectory: (L, T, D') -> (C, L, D')."""
    check_single_trajectory(trajectory)
    lengths = torch.tensor([trajectory.shape[1]])
    _check_batch(trajectory[None], lengths)
    weights = _linear_weights(lengths, trajectory.shape[1], n_segments)
    weights, lengths = weights.to(trajectory.device), lengths.to(trajectory.device)
    stats = _statistics(trajectory[None], lengths, weights, n_segments)[0]  # (C, L, D')
    _raise_if_non_finite(stats, trajectory[None], lengths)
    return stats


def check_single_trajectory(trajectory: torch.Tensor) -> None:
    """Refuse anything but one (L, T, D') tensor with T >= 1, naming its shape."""
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


@functools.lru_cache(maxsize=32)
def _layer_windows(n_in: int, n_out: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """`adaptive_avg_pool1d` from n_in to n_out as a few gathers: ((index (R,), weight (R, 1)), ...).

    Output row r is sum_j weight_j[r] * input[index_j[r]]: the j-th row of its
    window with weight 1 / window size, or (past the end of a shorter window)
    the window's last row with weight 0. As many terms as the widest window
    (2 for 30 -> 32 layers), where the product with the (R, L) pooling matrix
    would cost R * L multiply-adds per entry.
    """
    matrix = _pooling_matrix(n_in, n_out)  # (R, L)
    windows = [torch.nonzero(row).flatten() for row in matrix]
    widest = max(len(w) for w in windows)
    terms = []
    for j in range(widest):
        index = torch.tensor([int(w[min(j, len(w) - 1)]) for w in windows])
        weight = torch.tensor(
            [float(matrix[r, w[j]]) if j < len(w) else 0.0 for r, w in enumerate(windows)]
        )
        terms.append((index, weight[:, None]))
    return tuple(terms)


def _pool_layers_(stats: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> None:
    """Adaptive average pooling of the layer axis: (b, C, L, D') -> `out` (b, C, R, D').

    `scratch` is a buffer of out's shape for the second and later window terms.
    """
    terms = _layer_windows(stats.shape[2], out.shape[2])
    device = stats.device
    (index, weight), rest = terms[0], terms[1:]
    torch.index_select(stats, 2, index.to(device), out=out)
    if not rest and bool((weight == 1).all()):
        return  # every window is one layer: a plain gather
    out.mul_(weight.to(device))
    for index, weight in rest:
        torch.index_select(stats, 2, index.to(device), out=scratch)
        out.addcmul_(scratch, weight.to(device))


def _pool_and_normalize(
    stats: torch.Tensor, config: MapConfig, out: torch.Tensor, scratch: torch.Tensor
) -> None:
    """(b, C_all, L, D') statistics -> (b, C, R, K) maps, written into `out`.

    `scratch` is a (b, C, R, D') buffer.
    """
    if config.channels is not None:
        canonical = all_channel_names(config.n_segments)
        index = torch.tensor([canonical.index(c) for c in config.channels], device=stats.device)
        stats = stats.index_select(1, index)  # (b, C, L, D')
    width = stats.shape[-1]
    if config.coords_out == width:
        _pool_layers_(stats, out, scratch)  # (b, C, R, D' = K)
    else:  # coarser map: pool the coordinates D' -> K too
        pooled = torch.empty_like(scratch)
        _pool_layers_(stats, pooled, scratch)  # (b, C, R, D')
        coord_pool = _pooling_matrix(width, config.coords_out).T.to(stats.device)  # (D', K)
        torch.matmul(pooled, coord_pool, out=out)  # (b, C, R, K)
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
    pooled_shape = (chunk, shape[1], config.layers_out, width)  # (b, C, R, D')
    sizes = (
        2 * chunk * n_layers * t_max * width,  # the workspace's scratch, linear and stats
        chunk * n_layers * weights.shape[1] * width,
        chunk * n_channels * n_layers * width,
        math.prod(pooled_shape),
    )
    if device.type == "cpu":
        storage = _reused_storage(sum(sizes), device)
    else:  # the device's caching allocator reuses memory already
        storage = torch.empty(sum(sizes), device=device)
    workspace = _Workspace.allocate(
        chunk, n_layers, t_max, weights.shape[1], n_channels, width, device, storage
    )
    pooled = storage[sum(sizes[:3]) : sum(sizes)].view(pooled_shape)
    # Layer RMS reads every valid value of its layer: a non-finite input (or an
    # overflow) reaches the maps through it. Without it, the statistics are checked.
    check_stats = "layer_rms" not in channel_names(config)
    for start in range(0, batch, chunk):
        part = slice(start, start + chunk)
        stats = _statistics(
            trajectories[part], lengths_here[part], weights[part], config.n_segments, workspace
        )  # (b, C_all, L, D')
        if check_stats:
            _raise_if_non_finite(stats, trajectories, lengths)
        _pool_and_normalize(stats, config, maps[part], pooled[: len(stats)])
        _raise_if_non_finite(maps[part], trajectories, lengths)  # the chunk, still in cache
    return maps


def build_map(trajectory: torch.Tensor, config: MapConfig = MapConfig()) -> torch.Tensor:
    """Phi of one answer: pooled trajectory (L, T, D') -> map (C, R, K) float32."""
    check_single_trajectory(trajectory)
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


FLOAT16_MAX = 65504.0  # float16's largest finite value


def saturated_float16(x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    """``x`` in float16, saturated at ``±FLOAT16_MAX`` instead of overflowing to infinity (and an
    inf already stored becomes ``±FLOAT16_MAX``); NaN stays NaN. The one float16 form of a
    kept *state* (trajectories, dense and position states), as `stored_form` is of a map.

    Some residual streams leave float16's range: Gemma-3-270M's reach past 65,504 at layers
    10-15 (2 of 200 TriviaQA answers' mean states), where a plain cast stored inf and every
    probe fit on that column gave NaN. Capture keeps every step's state this way, so the answer
    mean of a state that leaves the range is the mean of saturated steps; readers of a store
    written before that pass its states through here too. (A map that leaves the range is
    refused instead, by `stored_form`: a map is pooled and a detector's input, where such a
    value means something went wrong; a kept state is the model's raw output, which can be
    that large.)

    A torch tensor comes back as a new float16 tensor; a float16 numpy array is clipped in
    place (a store's side table can be gigabytes), any other numpy array is copied."""
    if isinstance(x, torch.Tensor):
        return x.clamp(-FLOAT16_MAX, FLOAT16_MAX).to(torch.float16)
    if x.dtype == np.float16:
        return np.clip(x, -FLOAT16_MAX, FLOAT16_MAX, out=x)
    return np.clip(x, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16)


def stored_form(maps: torch.Tensor | np.ndarray) -> np.ndarray:
    """Maps of any shape (one map or a batch; torch or numpy) -> the float16 numpy array a
    map store keeps (12 * 32 * 128 * 2 = 98,304 bytes for the default map).

    The one place maps become float16 (capture, the store, serving). Finiteness is checked
    *after* the cast: a value beyond float16's range (|x| > 65,504) turns into inf there and
    is refused like NaN and inf, so no map reaches disk or a detector as inf.
    """
    if isinstance(maps, torch.Tensor):
        half = maps.detach().to(device="cpu", dtype=torch.float16).numpy()
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below
            half = np.asarray(maps, dtype=np.float16)
    if not np.isfinite(half).all():
        raise ValueError(
            "map does not fit float16: non-finite values after conversion "
            "(a value beyond +-65504, inf or NaN)"
        )
    return np.ascontiguousarray(half)


# ------------------------------------------- pooling the capture uses (hooks, dense states)


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
