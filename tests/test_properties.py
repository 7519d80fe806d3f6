"""Property tests (Hypothesis) for the invariants everything else leans on.

The map operator (shape, float16 round trip, per-channel standardisation, shift
invariance), the label normalisers, the splits and the store's write-then-read.
"""

from __future__ import annotations

import string
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actmap.data.labels import normalize_answer, qa_correct
from actmap.data.splits import SPLITS, assign_splits
from actmap.maps import MapConfig, all_channel_names, build_map, map_shape, stored_form
from actmap.store import MapRecord, MapStore, decode_array, encode_array

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Every channel but the layer RMS is unchanged by adding a constant to the whole
# trajectory once standardised per channel: the means, final states and max move
# by the constant (removed by the standardisation), and std, drift, slope and mean
# |diff| do not move at all. The RMS of a layer is not a difference of values.
SHIFT_INVARIANT = tuple(c for c in all_channel_names(4) if c != "layer_rms")


@st.composite
def trajectories(draw, width: int = 128) -> torch.Tensor:
    n_layers = draw(st.integers(2, 40))
    n_tokens = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.floats(0.1, 10.0))
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n_layers, n_tokens, width, generator=generator) * scale  # (L, T, D')


configs = st.builds(
    MapConfig,
    n_segments=st.sampled_from([1, 4, 8]),
    layers_out=st.sampled_from([4, 16, 32]),
    coords_out=st.sampled_from([16, 64, 128]),
    normalization=st.sampled_from(["channel", "global"]),
)


@PROPERTY
@given(trajectories(), configs)
def test_map_shape_and_finiteness(trajectory, config):
    result = build_map(trajectory, config)
    assert tuple(result.shape) == map_shape(config) == (config.n_segments + 8, *result.shape[1:])
    assert result.shape[1:] == (config.layers_out, config.coords_out)
    assert torch.isfinite(result).all()


@PROPERTY
@given(trajectories())
def test_channels_are_standardised_one_by_one(trajectory):
    result = build_map(trajectory).double()  # (12, 32, 128)
    flat = result.reshape(result.shape[0], -1)
    for channel in flat:
        # a constant channel (e.g. std of a one-token answer) maps to exactly 0
        if torch.all(channel == 0):
            continue
        assert abs(channel.mean().item()) < 1e-4
        assert abs(channel.std(unbiased=False).item() - 1.0) < 1e-3


@PROPERTY
@given(trajectories())
def test_float16_round_trip_is_exact_after_the_first_cast(trajectory):
    result = build_map(trajectory)
    half = stored_form(result)
    stored = decode_array(encode_array(result.numpy()), result.shape)
    np.testing.assert_array_equal(stored, half)  # the store keeps exactly these bytes
    again = decode_array(encode_array(stored), result.shape)
    np.testing.assert_array_equal(again, stored)  # and a second trip changes nothing
    # float16 keeps 11 significant bits: relative error <= 2^-11 (+ subnormal floor)
    error = (torch.from_numpy(half).float() - result).abs()
    assert torch.all(error <= result.abs() * 2.0**-11 + 2.0**-24)


@PROPERTY
@given(trajectories(), st.floats(-20.0, 20.0))
def test_shift_invariant_channels_ignore_a_constant_shift(trajectory, shift):
    config = MapConfig(channels=SHIFT_INVARIANT)
    plain = build_map(trajectory, config)
    shifted = build_map(trajectory + shift, config)
    torch.testing.assert_close(shifted, plain, atol=2e-3, rtol=0)


ascii_text = st.text(alphabet=string.ascii_letters + string.digits + string.punctuation + " ")


@PROPERTY
@given(ascii_text)
def test_answer_normalisation_is_idempotent_and_ignores_case_and_punctuation(text):
    once = normalize_answer(text)
    assert normalize_answer(once) == once
    assert normalize_answer(text.upper()) == once == normalize_answer(text.lower())
    stripped = "".join(ch for ch in text if ch not in string.punctuation)
    assert normalize_answer(stripped) == once


@PROPERTY
@given(ascii_text, st.lists(ascii_text, min_size=1, max_size=3), st.sampled_from(",.!?;:'\""))
def test_qa_labels_ignore_case_and_punctuation(answer, aliases, mark):
    label = qa_correct(answer, aliases)
    assert qa_correct(answer.swapcase(), aliases) == label
    assert qa_correct(f"{mark}{answer}{mark}", aliases) == label
    assert qa_correct(answer, [a.upper() for a in aliases]) == label


keys = st.lists(st.text(string.ascii_lowercase, min_size=1, max_size=4), min_size=1, max_size=40)


@PROPERTY
@given(keys, keys, st.integers(0, 3))
def test_splits_are_disjoint_by_key_and_stable_when_rows_are_added(rows, added, seed):
    first = assign_splits(rows, seed=seed)
    by_key: dict[str, set[str]] = {}
    for key, split in zip(rows, first, strict=True):
        by_key.setdefault(key, set()).add(split)
    assert all(len(splits) == 1 for splits in by_key.values())  # a key lives in one split
    assert set(first) <= set(SPLITS)
    grown = assign_splits(rows + added, seed=seed)
    assert grown[: len(rows)] == first  # adding rows never moves old ones
    assert assign_splits(rows[::-1], seed=seed) == first[::-1]  # nor does their order


text = st.text(max_size=30)
records = st.lists(
    st.tuples(
        text,  # source_key
        st.sampled_from(SPLITS),
        text,  # prompt
        text,  # answer
        st.integers(1, 500),
        st.sampled_from([None, 0, 1]),
        st.integers(0, 2**31 - 1),
    ),
    min_size=1,
    max_size=8,
)


@PROPERTY
@given(records, st.integers(1, 8))
def test_store_write_then_read_gives_identical_rows(rows, shard_size):
    written = [
        MapRecord(
            id=f"d:{i}:{key}",
            source_key=key,
            dataset="d",
            split=split,
            model_name="m",
            model_revision="r",
            prompt=prompt,
            answer=answer,
            n_tokens=n_tokens,
            label=label,
            map=np.random.default_rng(seed).standard_normal((12, 32, 128)).astype(np.float32),
        )
        for i, (key, split, prompt, answer, n_tokens, label, seed) in enumerate(rows)
    ]
    with tempfile.TemporaryDirectory() as folder:
        store = MapStore.create(Path(folder) / "s", {})
        for start in range(0, len(written), shard_size):
            store.write_maps(written[start : start + shard_size])
        store.close()
        maps, meta = MapStore.open(Path(folder) / "s").load_maps([r.id for r in written])
    for row, record in enumerate(written):
        np.testing.assert_array_equal(maps[row], record.map.astype(np.float16))
        got = meta.iloc[row]
        for name in ("id", "source_key", "split", "prompt", "answer", "n_tokens"):
            assert got[name] == getattr(record, name)
        assert (None if np.isnan(got["label"]) else int(got["label"])) == record.label


def test_the_rms_channel_is_the_one_that_moves_with_a_shift():
    """The exception above is real: the layer RMS of a shifted trajectory differs."""
    trajectory = torch.randn(8, 5, 128, generator=torch.Generator().manual_seed(0))
    config = MapConfig(channels=("layer_rms",))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(
            build_map(trajectory + 3.0, config), build_map(trajectory, config)
        )
