"""The map operator Phi against a naive per-cell reference written here from the paper."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from actmap.maps import (
    CHANNELS,
    MAP_BYTES,
    MAP_SHAPE,
    MapConfig,
    all_channel_names,
    build_map,
    build_maps,
    build_maps_from_list,
    channel_names,
    map_shape,
    pool_hidden,
    segment_bounds,
    stored_form,
    temporal_statistics,
)
from actmap.maps import operator as maps_module
from actmap.maps.ablations import (
    GROUP_NAMES,
    channel_groups,
    gaussian_projection,
    last_token_map,
    mean_pooled_final_layer,
    permute_coordinates,
    without_group,
)

# ------------------------------------------------------------------ naive reference


def naive_segments(n_tokens: int, n_segments: int) -> list[tuple[int, int]]:
    """floor(i T / k) boundaries in integer arithmetic; an empty [s, s) becomes [s, s + 1)."""
    bounds = [i * n_tokens // n_segments for i in range(n_segments + 1)]
    return [(s, e if e > s else s + 1) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]


def naive_cell(x: np.ndarray, n_segments: int) -> list[float]:
    """Every per-cell channel except layer RMS, for one (layer, coordinate) token series."""
    n = len(x)
    values = [x[s:e].mean() for s, e in naive_segments(n, n_segments)]
    values.append(x[n - 1])
    values.append(x[max(0, n - 8) :].mean())
    values.append(math.sqrt(((x - x.mean()) ** 2).sum() / (n - 1)) if n > 1 else 0.0)
    values.append(x.max())
    values.append(x[n - 1] - x[0])
    t = np.arange(n, dtype=np.float64)
    slope = ((t - t.mean()) * (x - x.mean())).sum() / max(((t - t.mean()) ** 2).sum(), 1e-8)
    values.append(slope if n > 1 else 0.0)
    values.append(np.abs(np.diff(x)).mean() if n > 1 else 0.0)
    return values


def naive_statistics(trajectory: torch.Tensor, n_segments: int = 4) -> np.ndarray:
    """S (C, L, D') by explicit loops over (layer, coordinate) cells, in float64."""
    x = trajectory.double().numpy()
    n_layers, n_tokens, width = x.shape
    stats = np.zeros((n_segments + 8, n_layers, width))
    for layer in range(n_layers):
        rms = math.sqrt((x[layer] ** 2).sum() / (n_tokens * width))
        for coord in range(width):
            cell = naive_cell(x[layer, :, coord], n_segments)
            stats[: n_segments + 6, layer, coord] = cell[:-1]  # segments .. slope
            stats[n_segments + 6, layer, coord] = rms
            stats[n_segments + 7, layer, coord] = cell[-1]  # mean abs diff
    return stats


def naive_adaptive_pool(values: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """PyTorch's adaptive windows [floor(i n / m), ceil((i + 1) n / m)) along `axis`."""
    n_in = values.shape[axis]
    windows = []
    for i in range(n_out):
        start, end = (i * n_in) // n_out, -((-(i + 1) * n_in) // n_out)
        windows.append(np.take(values, range(start, end), axis=axis).mean(axis=axis))
    return np.stack(windows, axis=axis)


def naive_map(trajectory: torch.Tensor, config: MapConfig = MapConfig()) -> np.ndarray:
    stats = naive_statistics(trajectory, config.n_segments)
    names = all_channel_names(config.n_segments)
    keep = [names.index(c) for c in channel_names(config)]
    pooled = naive_adaptive_pool(stats[keep], config.layers_out, axis=1)
    pooled = naive_adaptive_pool(pooled, config.coords_out, axis=2)
    if config.normalization == "global":
        return (pooled - pooled.mean()) / max(pooled.std(), 1e-6)
    out = np.empty_like(pooled)
    for c in range(len(pooled)):
        out[c] = (pooled[c] - pooled[c].mean()) / max(pooled[c].std(), 1e-6)
    return out


def random_trajectory(n_layers: int, n_tokens: int, width: int = 128, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    # layer-dependent scale and offset, like real hidden states
    scale = torch.linspace(0.5, 3.0, n_layers)[:, None, None]
    offset = torch.randn(n_layers, 1, width, generator=generator)
    return offset + scale * torch.randn(n_layers, n_tokens, width, generator=generator)


# ------------------------------------------------------------------ against the reference


@pytest.mark.parametrize("n_layers", [2, 18, 30, 36, 64])
@pytest.mark.parametrize("n_tokens", [1, 2, 3, 5, 8, 33, 384])
def test_build_map_matches_naive_reference(n_tokens, n_layers):
    trajectory = random_trajectory(n_layers, n_tokens, seed=n_tokens * 100 + n_layers)
    got = build_map(trajectory)
    assert got.shape == MAP_SHAPE and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), naive_map(trajectory), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_tokens", [1, 5, 33])
def test_temporal_statistics_match_naive_reference(n_tokens):
    trajectory = 4.0 + random_trajectory(7, n_tokens, width=24, seed=n_tokens)  # offset mean
    got = temporal_statistics(trajectory).double().numpy()
    assert got.shape == (12, 7, 24)
    np.testing.assert_allclose(got, naive_statistics(trajectory), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_tokens", [8, 384])
def test_statistics_stay_precise_next_to_a_massive_activation(n_tokens):
    # a final-token spike 10^4 times the spread must not cost the other statistics precision
    trajectory = random_trajectory(3, n_tokens, width=16, seed=9) + 20.0
    trajectory[:, -1, ::3] += 1e4 * torch.arange(1.0, 4.0)[:, None]  # (L, D'/3) spikes
    got = temporal_statistics(trajectory).double().numpy()
    np.testing.assert_allclose(got, naive_statistics(trajectory), rtol=2e-6, atol=1e-5)
    # the same answer right-padded with garbage inside a longer batch
    batch = torch.full((2, 3, n_tokens + 5, 16), -3e4)
    batch[0, :, :n_tokens] = trajectory
    padded = build_maps(batch, torch.tensor([n_tokens, n_tokens + 5]), MapConfig(coords_out=16))
    single = build_map(trajectory, MapConfig(coords_out=16))
    torch.testing.assert_close(padded[0], single, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "config, width",
    [
        (MapConfig(n_segments=1), 128),
        (MapConfig(n_segments=8), 128),
        (MapConfig(layers_out=16, coords_out=64), 128),
        (MapConfig(layers_out=64, coords_out=256), 256),
        (MapConfig(coords_out=128), 200),  # 200 -> 128: overlapping coordinate windows
        (MapConfig(normalization="global"), 128),
        (MapConfig(channels=("seg_mean_1", "std", "layer_rms")), 128),
    ],
)
def test_ablation_configs_match_naive_reference(config, width):
    trajectory = random_trajectory(30, 13, width=width, seed=width)
    got = build_map(trajectory, config)
    assert tuple(got.shape) == map_shape(config)
    np.testing.assert_allclose(got.numpy(), naive_map(trajectory, config), rtol=1e-4, atol=1e-4)


def test_global_normalization_is_one_standardisation_of_all_channels():
    trajectory = random_trajectory(18, 9, seed=3)
    pooled = naive_adaptive_pool(naive_statistics(trajectory), 32, axis=1)  # D' = 128 kept
    expected = (pooled - pooled.mean()) / pooled.std()  # one mean/std over 12 * 32 * 128 entries
    got = build_map(trajectory, MapConfig(normalization="global")).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert abs(got.mean()) < 1e-5 and abs(got.std() - 1) < 1e-4
    per_channel_std = got.reshape(12, -1).std(axis=1)
    assert per_channel_std.max() - per_channel_std.min() > 0.1  # channels keep their own scales


# ------------------------------------------------------------------ hand-computed values


def test_segment_bounds_by_hand():
    assert segment_bounds(5) == [(0, 1), (1, 2), (2, 3), (3, 5)]  # boundaries 0,1,2,3,5
    assert segment_bounds(2) == [(0, 1), (0, 1), (1, 2), (1, 2)]  # boundaries 0,0,1,1,2
    assert segment_bounds(3) == [(0, 1), (0, 1), (1, 2), (2, 3)]  # boundaries 0,0,1,2,3
    assert segment_bounds(1) == [(0, 1)] * 4
    assert segment_bounds(8) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert segment_bounds(7, n_segments=1) == [(0, 7)]


@pytest.mark.parametrize("n_segments", [1, 3, 4, 7, 8])
def test_segment_bounds_follow_numpy_linspace(n_segments):
    for n_tokens in range(1, 400):
        bounds = np.linspace(0, n_tokens, n_segments + 1).astype(int)
        pairs = zip(bounds[:-1], bounds[1:], strict=True)
        expected = [(s, e if e > s else s + 1) for s, e in pairs]
        assert segment_bounds(n_tokens, n_segments) == expected


def test_statistics_five_tokens_by_hand():
    x = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0]).reshape(1, 5, 1)  # (L, T, D') = (1, 5, 1)
    stats = temporal_statistics(x)[:, 0, 0].tolist()
    expected = dict(
        seg_mean_0=10, seg_mean_1=20, seg_mean_2=30, seg_mean_3=45,  # segments [3, 5) -> 45
        final=50, final_window=30, std=math.sqrt(250), max=50, drift=40, slope=10,
        layer_rms=math.sqrt(5500 / 5), mean_abs_diff=10,
    )  # fmt: skip
    assert stats == pytest.approx([expected[c] for c in CHANNELS], rel=1e-6)


def test_statistics_two_tokens_by_hand():
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]]).reshape(1, 2, 2)  # tokens x coordinates
    stats = temporal_statistics(x)[:, 0, :]  # (C, D')
    by_name = dict(zip(CHANNELS, stats.tolist(), strict=True))
    assert by_name["seg_mean_0"] == by_name["seg_mean_1"] == [1.0, -2.0]  # [0,1) twice
    assert by_name["seg_mean_2"] == by_name["seg_mean_3"] == [3.0, 4.0]  # [1,2) twice
    assert by_name["final"] == [3.0, 4.0]
    assert by_name["final_window"] == [2.0, 1.0]
    assert by_name["std"] == pytest.approx([math.sqrt(2), math.sqrt(18)])
    assert by_name["max"] == [3.0, 4.0]
    assert by_name["drift"] == [2.0, 6.0]
    assert by_name["slope"] == pytest.approx([2.0, 6.0])
    assert by_name["layer_rms"] == pytest.approx([math.sqrt(30 / 4)] * 2)
    assert by_name["mean_abs_diff"] == [2.0, 6.0]


def test_final_window_covers_last_eight_tokens():
    x = torch.arange(20.0).reshape(1, 20, 1)
    stats = dict(zip(CHANNELS, temporal_statistics(x)[:, 0, 0].tolist(), strict=True))
    assert stats["final_window"] == pytest.approx(np.arange(12, 20).mean())
    assert stats["slope"] == pytest.approx(1.0)


def test_single_token_channels_are_exactly_zero():
    trajectory = random_trajectory(6, 1, width=16, seed=1)
    stats = dict(zip(CHANNELS, temporal_statistics(trajectory), strict=True))
    for name in ("std", "slope", "mean_abs_diff", "drift"):
        assert torch.count_nonzero(stats[name]) == 0, name
    for name in ("seg_mean_0", "seg_mean_3", "final", "final_window", "max"):
        torch.testing.assert_close(stats[name], trajectory[:, 0, :], rtol=0, atol=0)
    # after standardisation a constant channel stays exactly 0 (std floored at 1e-6)
    built = dict(zip(CHANNELS, build_map(random_trajectory(30, 1, seed=2)), strict=True))
    for name in ("std", "slope", "mean_abs_diff", "drift"):
        assert torch.count_nonzero(built[name]) == 0, name


@pytest.mark.parametrize("value", [0.75, 1 / 3, 0.1, -2.7, 1000.1])
def test_constant_trajectory_gives_all_zero_map(value):
    # every channel is exactly constant; a float32 mean of 4096 equal entries need not be exact
    built = build_map(torch.full((30, 7, 128), value))
    assert torch.count_nonzero(built) == 0


def test_channels_are_standardised():
    built = build_map(random_trajectory(30, 12, seed=4))
    flat = built.reshape(12, -1).double()
    assert flat.mean(1).abs().max() < 1e-5
    assert (flat.std(1, unbiased=False) - 1).abs().max() < 1e-4


# ------------------------------------------------------------------ batching


@pytest.mark.parametrize("chunk_bytes", [1 << 22, 300_000])
def test_batched_equals_single_with_garbage_padding(monkeypatch, chunk_bytes):
    # small chunks split the batch into several groups of answers
    monkeypatch.setattr(maps_module, "_CHUNK_BYTES", chunk_bytes)
    lengths = [1, 2, 5, 40, 33, 8, 3, 40]
    singles = [random_trajectory(18, n, seed=i) for i, n in enumerate(lengths)]
    batch = 1e4 * torch.randn(len(lengths), 18, 40, 128)  # garbage everywhere
    batch[1, :, 2:5] = float("nan")  # even NaN and inf padding must not leak in
    batch[2, :, 5:] = float("inf")
    for i, trajectory in enumerate(singles):
        batch[i, :, : lengths[i]] = trajectory
    before = batch.clone()
    got = build_maps(batch, torch.tensor(lengths))
    torch.testing.assert_close(batch, before, rtol=0, atol=0, equal_nan=True)  # input untouched
    assert got.shape == (len(lengths), *MAP_SHAPE)
    for i, trajectory in enumerate(singles):
        torch.testing.assert_close(got[i], build_map(trajectory), rtol=0, atol=1e-5)
    torch.testing.assert_close(build_maps_from_list(singles), got, rtol=0, atol=1e-5)


def test_batched_config_and_lengths_list():
    singles = [random_trajectory(30, n, seed=n) for n in (4, 9)]
    config = MapConfig(n_segments=8, layers_out=16, coords_out=64)
    got = build_maps_from_list(singles, config)
    assert got.shape == (2, 16, 16, 64)
    for i, trajectory in enumerate(singles):
        torch.testing.assert_close(got[i], build_map(trajectory, config), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_any_float_dtype_is_computed_in_float32(dtype):
    trajectory = random_trajectory(18, 6, seed=5).to(dtype)
    got = build_map(trajectory)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, build_map(trajectory.float()), rtol=0, atol=1e-5)


# ------------------------------------------------------------------ errors


def test_empty_answer_raises():
    with pytest.raises(ValueError, match="empty answer"):
        build_map(torch.zeros(30, 0, 128))
    with pytest.raises(ValueError, match=r"empty answer.*rows \[1\]"):
        build_maps(torch.zeros(2, 30, 4, 128), torch.tensor([4, 0]))


def test_non_finite_input_raises_with_count():
    trajectory = random_trajectory(4, 6, width=8)
    trajectory[1, 2, 3] = float("nan")
    trajectory[0, 0, 0] = float("inf")
    trajectory[3, 5, 7] = -float("inf")
    with pytest.raises(ValueError, match=r"3 non-finite values \(1 NaN, 2 inf\)"):
        build_map(trajectory, MapConfig(coords_out=8))
    with pytest.raises(ValueError, match="non-finite"):
        temporal_statistics(trajectory)
    early = random_trajectory(30, 20)
    early[5, 0, 9] = float("nan")  # outside the last-token channels' window, still an error
    with pytest.raises(ValueError, match=r"1 non-finite values \(1 NaN, 0 inf\)"):
        last_token_map(early)


def test_wrong_shapes_raise():
    with pytest.raises(ValueError, match=r"\(L, T, D'\).*\(30, 128\)"):
        build_map(torch.zeros(30, 128))
    with pytest.raises(ValueError, match=r"\(B, L, T, D'\).*\(30, 4, 128\)"):
        build_maps(torch.zeros(30, 4, 128), torch.tensor([4]))
    with pytest.raises(ValueError, match="lengths must have shape"):
        build_maps(torch.zeros(2, 30, 4, 128), torch.tensor([4]))
    with pytest.raises(ValueError, match="exceed the padded token axis"):
        build_maps(torch.zeros(1, 30, 4, 128), torch.tensor([5]))
    with pytest.raises(ValueError, match="floating point"):
        build_map(torch.zeros(30, 4, 128, dtype=torch.int64))
    with pytest.raises(ValueError, match="coords_out=128 exceeds the trajectory width D'=64"):
        build_map(torch.zeros(30, 4, 64))
    with pytest.raises(ValueError, match="share L"):
        build_maps_from_list([torch.zeros(30, 4, 128), torch.zeros(18, 4, 128)])


def test_config_validation():
    with pytest.raises(ValueError, match="unknown names"):
        MapConfig(channels=("final", "median"))
    with pytest.raises(ValueError, match="canonical order"):
        MapConfig(channels=("max", "final"))
    with pytest.raises(ValueError, match="n_segments"):
        MapConfig(n_segments=0)
    with pytest.raises(ValueError, match="normalization"):
        MapConfig(normalization="layer")
    with pytest.raises(ValueError, match="unknown names"):
        MapConfig(n_segments=1, channels=("seg_mean_1",))


# ------------------------------------------------------------------ channels, shapes, storage


def test_channel_names_and_groups():
    assert CHANNELS == (
        "seg_mean_0", "seg_mean_1", "seg_mean_2", "seg_mean_3", "final", "final_window",
        "std", "max", "drift", "slope", "layer_rms", "mean_abs_diff",
    )  # fmt: skip
    for n_segments in (1, 4, 8):
        groups = channel_groups(n_segments)
        assert tuple(groups) == GROUP_NAMES
        members = [c for group in groups.values() for c in group]
        assert sorted(members) == sorted(all_channel_names(n_segments))  # a partition
    assert channel_groups(4)["final_states"] == ("final", "final_window")
    assert channel_groups(4)["magnitude_dynamics"] == ("layer_rms", "mean_abs_diff")


@pytest.mark.parametrize("group", GROUP_NAMES)
def test_each_group_removed(group):
    config = without_group(MapConfig(), group)
    removed = channel_groups(4)[group]
    assert channel_names(config) == tuple(c for c in CHANNELS if c not in removed)
    trajectory = random_trajectory(30, 6, seed=6)
    full = build_map(trajectory)
    got = build_map(trajectory, config)
    assert got.shape == (12 - len(removed), 32, 128)
    kept = [CHANNELS.index(c) for c in channel_names(config)]
    torch.testing.assert_close(got, full[kept])  # per-channel normalisation: same channels


def test_ablation_shapes():
    trajectory = random_trajectory(30, 10, seed=7)
    assert build_map(trajectory, MapConfig(n_segments=1)).shape == (9, 32, 128)
    assert build_map(trajectory, MapConfig(n_segments=8)).shape == (16, 32, 128)
    assert build_map(trajectory, MapConfig(layers_out=16, coords_out=64)).shape == (12, 16, 64)
    wide = random_trajectory(30, 10, width=256, seed=7)
    assert build_map(wide, MapConfig(layers_out=64, coords_out=256)).shape == (12, 64, 256)
    assert last_token_map(trajectory).shape == (2, 32, 128)


def test_last_token_map_is_final_channels():
    trajectory = random_trajectory(30, 10, seed=8)
    torch.testing.assert_close(last_token_map(trajectory), build_map(trajectory)[4:6])
    expected = naive_map(trajectory, MapConfig(channels=("final", "final_window")))
    np.testing.assert_allclose(last_token_map(trajectory).numpy(), expected, atol=1e-4)


def test_float16_storage_size():
    stored = stored_form(build_map(random_trajectory(30, 5)))
    assert stored.dtype == np.float16 and tuple(stored.shape) == MAP_SHAPE
    assert stored.nbytes == MAP_BYTES == 98_304
    with pytest.raises(ValueError, match="float16"):
        stored_form(torch.full((2,), 1e6))


@pytest.mark.parametrize("array", [torch.tensor, np.array])
def test_stored_form_checks_after_the_cast(array):
    """70000 is finite in float32 but beyond float16's largest value (65504): the cast makes
    it inf, so a check made before the cast would let it through to disk."""
    assert np.isfinite(np.float32(70000.0)) and float(np.finfo(np.float16).max) == 65504.0
    with pytest.raises(ValueError, match="does not fit float16"):
        stored_form(array([[1.0, 70000.0]]))
    edge = stored_form(array([65504.0, -65504.0]))  # the largest float16 values still fit
    np.testing.assert_array_equal(edge, np.array([65504.0, -65504.0], dtype=np.float16))


def test_mean_pooled_final_layer():
    trajectory = random_trajectory(5, 7, width=16)
    expected = trajectory.double().numpy()[4].mean(axis=0)
    np.testing.assert_allclose(mean_pooled_final_layer(trajectory).numpy(), expected, rtol=1e-6)


# ------------------------------------------------------------------ pooling-structure helpers


@pytest.mark.parametrize("width", [64, 128, 576, 896, 4096])
def test_pool_hidden_matches_adaptive_windows(width):
    hidden = torch.randn(3, 2, width)
    expected = naive_adaptive_pool(hidden.double().numpy(), 128, axis=2)
    got = pool_hidden(hidden)
    assert got.shape == (3, 2, 128) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool_hidden(hidden[0]), got[0])  # (B, D) form
    torch.testing.assert_close(pool_hidden(hidden[0, 0]), got[0, 0])  # (D,) form
    assert pool_hidden(hidden.to(torch.bfloat16)).dtype == torch.float32


def test_permute_coordinates_is_a_fixed_permutation():
    hidden = torch.arange(2 * 3 * 100, dtype=torch.float32).reshape(2, 3, 100)
    permuted = permute_coordinates(hidden, seed=1)
    assert not torch.equal(permuted, hidden)
    torch.testing.assert_close(permuted.sort(dim=-1).values, hidden)  # same values
    order = permuted[0, 0].long()  # the permutation itself (row 0 holds 0..99)
    torch.testing.assert_close(permuted, hidden[..., order])  # same for every row
    torch.testing.assert_close(permute_coordinates(hidden, seed=1), permuted)  # reproducible
    assert not torch.equal(permute_coordinates(hidden, seed=2), permuted)


def test_gaussian_projection():
    width = 1024
    matrix = gaussian_projection(torch.eye(width), out_dim=128, seed=3)  # rows of the matrix
    assert matrix.shape == (width, 128)
    standard_error = (1 / 128) ** 0.5 / (width * 128) ** 0.5  # of the mean of N(0, 1/128) entries
    assert abs(matrix.mean().item()) < 5 * standard_error
    assert matrix.var().item() == pytest.approx(1 / 128, rel=0.02)
    hidden = torch.randn(4, 5, width)
    got = gaussian_projection(hidden, seed=3)
    torch.testing.assert_close(got, hidden @ matrix)  # linear, same matrix for every row
    assert not torch.equal(gaussian_projection(hidden, seed=4), got)
    assert gaussian_projection(hidden, out_dim=64, seed=3).shape == (4, 5, 64)


def test_config_is_frozen():
    config = MapConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.n_segments = 8  # type: ignore[misc]


# ------------------------------------------------------------------ the previous operator


def _previous_operator():
    """The operator as it was before the fused version (a frozen copy in benchmarks/)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "previous_maps.py"
    spec = importlib.util.spec_from_file_location("previous_maps", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "config",
    [
        MapConfig(),
        MapConfig(n_segments=8, layers_out=16, coords_out=64),
        MapConfig(channels=("std", "max")),
    ],
)
def test_fused_operator_equals_the_previous_one(monkeypatch, config):
    previous = _previous_operator()
    monkeypatch.setattr(maps_module, "_CHUNK_BYTES", 200_000)  # several chunks
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([1, 2, 7, 31, 32, 16, 5, 32, 9])
    batch = 3.0 * torch.randn(len(lengths), 30, 32, 128, generator=generator) + 1.5
    batch[0, :, 1:] = float("nan")  # padding garbage
    prev_config = previous.MapConfig(**dataclasses.asdict(config))
    expected = previous.build_maps(batch, lengths, prev_config)
    got = build_maps(batch, lengths, config)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    # into a reused output buffer: the same maps, the buffer is the result
    out = torch.full_like(got, 7.0)
    assert build_maps(batch, lengths, config, out=out) is out
    torch.testing.assert_close(out, got, rtol=0, atol=0)


def test_out_buffer_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"out must be a float32 \(1, 12, 32, 128\) tensor"):
        build_maps(torch.randn(1, 4, 3, 128), [3], out=torch.empty(1, 12, 32, 64))


def test_reused_work_buffers_give_the_same_maps_after_other_shapes():
    # build_maps keeps one work buffer per thread; a call with other shapes in
    # between (longer answers, other layer counts) must not change a batch's maps
    first = [random_trajectory(30, n, seed=n) for n in (3, 7)]
    expected = build_maps_from_list(first)
    build_maps_from_list([random_trajectory(18, 50, seed=1), random_trajectory(18, 2, seed=2)])
    build_maps(torch.randn(3, 64, 9, 128), torch.tensor([9, 1, 4]))
    torch.testing.assert_close(build_maps_from_list(first), expected, rtol=0, atol=0)
    for i, trajectory in enumerate(first):  # and each map is still the single-answer map
        torch.testing.assert_close(expected[i], build_map(trajectory), rtol=0, atol=1e-5)


def test_work_buffer_made_under_inference_mode_serves_later_calls_outside_it():
    # a server builds maps inside inference_mode, training code outside it, one thread
    trajectory = random_trajectory(30, 6, seed=3)
    expected = build_map(trajectory)
    threading = pytest.importorskip("threading")
    results = {}

    def fresh_thread():  # a new thread: its buffer is first made under inference_mode
        with torch.inference_mode():
            results["inside"] = build_map(random_trajectory(30, 40, seed=4)).clone()
        results["outside"] = build_map(trajectory)

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    torch.testing.assert_close(results["outside"], expected, rtol=0, atol=0)
    torch.testing.assert_close(
        results["inside"], build_map(random_trajectory(30, 40, seed=4)), rtol=0, atol=0
    )


def test_a_strided_batch_gives_the_same_maps():
    # a running prefix (the first t tokens of a longer buffer) is not contiguous
    long = torch.stack([random_trajectory(18, 12, seed=s) for s in (5, 6)])  # (2, L, 12, D')
    prefix = long[:, :, :7]
    assert not prefix.is_contiguous()
    expected = build_maps(prefix.contiguous(), torch.tensor([7, 7]))
    torch.testing.assert_close(build_maps(prefix, torch.tensor([7, 7])), expected, rtol=0, atol=0)
    torch.testing.assert_close(build_maps(prefix, torch.tensor([7, 3]))[0], expected[0])
