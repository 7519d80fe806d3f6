"""Tiny synthetic map stores for the report's experiments: signal where we put it.

``synthetic_store`` writes maps of shape (C, H, W) whose correct rows carry ``+signal``
in the depth rows ``signal_rows`` (all channels, all coordinates) and noise elsewhere,
so an experiment's answer is known in advance (e.g. occluding those rows removes the
signal; a store with ``signal=0`` is chance).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from actmap.store import MapRecord, MapStore

SPLIT_SIZES = {"train": 40, "validation": 16, "test": 24}
SHAPE = (12, 8, 16)


def synthetic_store(
    root: Path,
    *,
    generator: str = "gen-a",
    task: str = "task-a",
    signal: float = 1.0,
    signal_rows: tuple[int, int] = (2, 5),
    sizes: dict[str, int] | None = None,
    shape: tuple[int, int, int] = SHAPE,
    prevalence: float = 0.5,
    seed: int = 0,
    judge: str | None = None,
    dtype: str | None = None,
) -> Path:
    """A committed store at ``root``; row ``k`` of a split is correct with probability
    ``prevalence``; its answer length is noise (so the length control is chance)."""
    rng = np.random.default_rng(seed)
    config = {
        "model": {"name": generator, "revision": "0"} | ({"dtype": dtype} if dtype else {}),
        "task": {"task": task} if judge is None else {"task": task, "judge": judge},
        "map": {"n_segments": 4, "layers_out": shape[1], "coords_out": shape[2]},
    }
    store = MapStore.create(root, config, map_shape=shape)
    records = []
    for split, n in (sizes or SPLIT_SIZES).items():
        for k in range(n):
            label = int(rng.random() < prevalence)
            m = rng.standard_normal(shape).astype(np.float32)
            m[:, signal_rows[0] : signal_rows[1], :] += signal * (2 * label - 1) / 2
            records.append(
                MapRecord(
                    id=f"{split}-{k}",
                    source_key=f"{split}-{k}",
                    dataset=task,
                    split=split,
                    model_name=generator,
                    model_revision="0",
                    prompt=f"question {split} {k}",
                    answer=f"answer {k}",
                    n_tokens=int(rng.integers(1, 20)),
                    label=label,
                    map=m,
                )
            )
    store.write_maps(records)
    store.close()
    return root
