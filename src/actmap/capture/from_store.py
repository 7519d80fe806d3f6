"""Reading a store's generations back as `Generation` records, for scorers and baselines."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actmap.capture.records import Generation
from actmap.store import MapStore, StoreError, decode_array


def read_generations(
    store: MapStore,
    ids: Sequence[str],
    with_trajectories: bool = False,
    with_positions: bool = False,
) -> list[Generation]:
    """Rebuild `Generation` records (attention when stored; trajectories when asked) for scorers."""
    maps_meta = store.metadata().set_index("id")
    tables = {  # only the rows asked for: a long-form store's attention table holds gigabytes
        name: store.read_latest(name, ids=ids)
        for name in ("generations", "attention")
        + (("trajectories",) if with_trajectories else ())
        + (("positions",) if with_positions else ())
        if store.has_table(name)
    }
    if "generations" not in tables:
        raise StoreError(f"{store.root} has no generations table")
    index = {
        name: {k: i for i, k in enumerate(t.column("id").to_pylist())} for name, t in tables.items()
    }

    def tensor(name: str, column: str, key: str) -> torch.Tensor | None:
        if name not in tables or key not in index[name]:
            return None
        row = index[name][key]
        shape = tables[name].column("shape")[row].as_py()
        return torch.from_numpy(
            decode_array(tables[name].column(column)[row].as_py(), shape).astype(np.float32)
        )

    gens = tables["generations"]
    out = []
    for key in ids:
        if key not in index["generations"]:
            raise StoreError(
                f"'{key}' has no row in the generations table of {store.root}; "
                f"run `actmap store verify {store.root}`"
            )
        row = index["generations"][key]

        def get(column: str, row: int = row):
            return gens.column(column)[row].as_py()

        extras = {k: v for k in ("eos_logprob", "eos_entropy") if (v := get(k)) is not None}
        steps = {c: get(c) for c in ("logprobs", "entropies")}  # null in map-only capture
        trajectory = tensor("trajectories", "trajectory", key)
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
                attention=tensor("attention", "attention", key),
                positions=tensor("positions", "positions", key),
                extras=extras,
            )
        )
    return out
