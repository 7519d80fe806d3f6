"""How early does the running p(correct) separate correct from incorrect answers?

While streaming, the server scores the answer so far: the map of the first k
tokens' trajectory (`actmap.serve.loaded_run.prefix_maps`), read by the same
detector (with the prefix's per-answer scalars when the detector reads them).
`running_auroc` replays that on a store kept with trajectories
(``actmap capture --keep-trajectories``): for each answer position k it scores
every labelled answer of a split at ``min(k, T)`` tokens (an answer that has
ended is scored whole, as a stream would have been) and reports the AUROC, plus
the AUROC over the answers still running at k (``T >= k``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from actmap.capture.answer_scalars import answer_scalars
from actmap.errors import ActmapUserError
from actmap.scoring.metrics import auroc
from actmap.store import MapStore
from actmap.store.rows import row_metadata


@dataclass(frozen=True)
class PositionAUROC:
    position: int  # answer tokens the running score has seen (k)
    auroc: float  # all answers, each at min(k, T) tokens
    n: int
    auroc_running: float | None  # answers with T >= k only (None: one class or none left)
    n_running: int
    n_running_correct: int


@dataclass(frozen=True)
class RunningAUROC:
    split: str
    n: int
    n_correct: int
    final_auroc: float  # every answer scored whole (its stored-map score, from the trajectory)
    positions: list[PositionAUROC]

    def to_json(self) -> dict:
        return asdict(self)


def default_positions(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, ... up to the longest answer."""
    out, k = [], 1
    while k < max_tokens:
        out.append(k)
        k *= 2
    return [*out, max_tokens]


def running_scores(
    detector,
    trajectories: Sequence[torch.Tensor],
    positions: Sequence[int],
    map_config,
    statistics: Sequence[tuple[Sequence[float], Sequence[float]]] | None = None,
) -> np.ndarray:
    """(N, P) running p(correct) of each trajectory at each position (clamped to its length).

    ``statistics``: per answer, its (log-probs, entropies), for a detector that reads the
    per-answer scalars; each position's scalars are those of the prefix.
    """
    from actmap.serve.loaded_run import prefix_maps

    out = []
    for i, t in enumerate(trajectories):
        scalars = None
        if statistics is not None:
            lp, h = statistics[i]
            ends = [min(max(int(k), 1), t.shape[1]) for k in positions]
            scalars = np.stack([answer_scalars(lp[:k], h[:k]) for k in ends])
        out.append(detector.predict_proba(prefix_maps(t, positions, map_config), scalars))
    return np.stack(out)


def running_auroc(
    store: MapStore,
    detector,
    split: str = "test",
    positions: Sequence[int] | None = None,
) -> RunningAUROC:
    """AUROC of the running score at each answer position, on a split's labelled answers."""
    if not store.has_table("trajectories"):
        raise ActmapUserError(
            f"{store.root} keeps no trajectories; capture with --keep-trajectories"
        )
    meta = row_metadata(store)  # an id written twice counts once, with its last row
    rows = meta[(meta["split"] == split) & meta["label"].notna()]
    if rows.empty:
        raise ActmapUserError(f"{store.root} has no labelled rows in split '{split}'")
    ids = rows["id"].tolist()
    arrays = store.read_arrays("trajectories", ids)
    trajectories = [torch.from_numpy(arrays[key].astype(np.float32)) for key in ids]
    lengths = np.array([t.shape[1] for t in trajectories])
    statistics = None
    if getattr(detector, "needs_scalars", False):
        stats = store.read_latest("generations", ["logprobs", "entropies"])
        at = {key: i for i, key in enumerate(stats.column("id").to_pylist())}
        lp, h = stats.column("logprobs"), stats.column("entropies")
        statistics = [(lp[at[key]].as_py(), h[at[key]].as_py()) for key in rows["id"]]
    labels = rows["label"].to_numpy().astype(np.int64)
    positions = list(positions or default_positions(int(lengths.max())))
    scores = running_scores(
        detector, trajectories, [*positions, int(lengths.max())], detector.map_config, statistics
    )
    results = []
    for j, k in enumerate(positions):
        alive = lengths >= k
        y_alive = labels[alive]
        both = alive.any() and len(np.unique(y_alive)) == 2
        results.append(
            PositionAUROC(
                position=int(k),
                auroc=auroc(scores[:, j], labels),
                n=len(labels),
                auroc_running=auroc(scores[alive, j], y_alive) if both else None,
                n_running=int(alive.sum()),
                n_running_correct=int(y_alive.sum()),
            )
        )
    return RunningAUROC(
        split, len(labels), int(labels.sum()), auroc(scores[:, -1], labels), results
    )
