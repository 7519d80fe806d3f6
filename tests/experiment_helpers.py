"""A tiny synthetic map store for the experiment tests: pooled trajectories whose mid layers
carry the label, the dense states they pool from, and the maps built from them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from actmap.maps import build_map, pool_hidden
from actmap.store import MapRecord, MapStore, encode_array

N_LAYERS, HIDDEN = 6, 256  # pooled width 128 = the map's, so the default MapConfig applies


def _array_table(ids, arrays, column) -> pa.Table:
    return pa.table(
        {
            "id": ids,
            "shape": pa.array([list(a.shape) for a in arrays], pa.list_(pa.int32())),
            column: [encode_array(a) for a in arrays],
        }
    )


def synthetic_store(root, n: int = 80, seed: int = 0, signal: float = 1.5, dense: bool = True):
    """``n`` rows (60/20/20% train/validation/test, half correct in each): correct answers
    shift hidden units 0-63 of layers 2-3 by ``signal``; answer lengths are random."""
    rng = np.random.default_rng(seed)
    store = MapStore.create(root, {"synthetic": seed})
    splits = ["train"] * (n * 6 // 10) + ["validation"] * (n // 5)
    splits += ["test"] * (n - len(splits))
    records, trajectories, denses, ids = [], [], [], []
    for i, split in enumerate(splits):
        label = i % 2
        t = int(rng.integers(2, 7))
        hidden = rng.standard_normal((N_LAYERS, t, HIDDEN)).astype(np.float32)
        hidden[2:4, :, :64] += signal * label
        trajectory = pool_hidden(torch.from_numpy(hidden), 128)  # (L, T, 128)
        key = f"s:{i}"
        ids.append(key)
        trajectories.append(trajectory.numpy())
        denses.append(hidden[:, :, :])  # stand-in for the 8 layer groups: L=6 layers
        records.append(
            MapRecord(
                id=key,
                source_key=str(i),
                dataset="synthetic",
                split=split,
                model_name="m",
                model_revision="r",
                prompt=f"q{i}",
                answer=f"a{i}",
                n_tokens=t,
                label=label,
                map=build_map(trajectory).numpy(),
            )
        )
    store.write_table("trajectories", _array_table(ids, trajectories, "trajectory"))
    if dense:
        store.write_table("dense", _array_table(ids, denses, "dense"))
    store.write_maps(records)
    return store
