"""Reading a store's generations back as `Generation` records, for scorers and baselines."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actmap.capture.records import Generation
from actmap.store import MapStore, StoreError, decode_rows


def read_generations(
    store: MapStore,
    ids: Sequence[str],
    with_trajectories: bool = False,
    with_positions: bool = False,
) -> list[Generation]:
    """Rebuild `Generation` records (attention when stored; trajectories when asked) for scorers."""
    maps_meta = store.metadata(latest=True).set_index("id")  # a rewritten id: its last row
    tables = {  # only the rows asked for: a long-form store's attention table holds gigabytes
        name: store.read_latest(name, ids=ids)
        for name in ("generations", "attention")
        + (("trajectories",) if with_trajectories else ())
        + (("positions",) if with_positions else ())
        if store.has_table(name)
    }
    if "generations" not in tables:
        raise StoreError(f"{store.root} has no generations table")
    gens = tables["generations"]
    at = {k: i for i, k in enumerate(gens.column("id").to_pylist())}
    arrays = {
        name: decode_rows(t, name, ids) for name, t in tables.items() if name != "generations"
    }

    def tensor(name: str, key: str) -> torch.Tensor | None:
        array = arrays.get(name, {}).get(key)
        return None if array is None else torch.from_numpy(array.astype(np.float32))

    out = []
    for key in ids:
        if key not in at:
            raise StoreError(
                f"'{key}' has no row in the generations table of {store.root}; "
                f"run `actmap store verify {store.root}`"
            )
        row = at[key]

        def get(column: str, row: int = row):
            return gens.column(column)[row].as_py()

        extras = {k: v for k in ("eos_logprob", "eos_entropy") if (v := get(k)) is not None}
        steps = {c: get(c) for c in ("logprobs", "entropies")}  # null in map-only capture
        trajectory = tensor("trajectories", key)
        out.append(
            Generation(
                prompt=maps_meta.at[key, "prompt"],
                answer=maps_meta.at[key, "answer"],
                token_ids=get("token_ids"),
                **{
                    c: None if v is None else torch.tensor(v, dtype=torch.float32)
                    for c, v in steps.items()
                },
                trajectory=trajectory if trajectory is not None else torch.empty(0),
                stopped=get("stopped"),
                prompt_tokens=get("prompt_tokens"),
                attention=tensor("attention", key),
                positions=tensor("positions", key),
                extras=extras,
            )
        )
    return out
