"""The one input bundle every detector reads: `DetectorInputs`, from a store or from live
generations.

A detector declares what it reads per answer in ``requires`` (`INPUT_NAMES`): the map always,
and the six per-answer scalars, the position states and the attention weights when it reads
them. `read_inputs(store, rows, requires)` reads exactly those from a store (the maps table,
the ``generations``, ``positions`` and ``attention`` side tables); `live_inputs(maps, scalars,
generations)` builds the same bundle from the `Generation` records of a capture pass (the
server's). ``fit(inputs, y, val_inputs, y_val)`` and ``predict_proba(inputs)`` of every detector
take it; a bare maps array stands for ``DetectorInputs(maps)`` (`as_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from actmap.capture.answer_scalars import scalars_from_store
from actmap.capture.from_store import read_generations
from actmap.errors import ActmapUserError
from actmap.maps import saturated_float16

# what a detector may read per answer, in the order a store keeps them
INPUT_NAMES = ("maps", "scalars", "positions", "attention")
# the store's side table of each part beside the map and the per-answer scalars, and how to add it
SIDE_TABLES = {
    "positions": ("positions", "capture with --keep-positions or run scripts/add_positions.py"),
    "attention": ("attention", "capture with --attention-keys and --lookback-attention"),
}


@dataclass
class DetectorInputs:
    """What detectors read for N answers.

    maps (N, C, H, W); scalars (N, 6) or None; positions (N, 4, L, D) float16 or None;
    generations: `Generation` records (with ``attention`` when captured) or None.
    """

    maps: Any
    scalars: np.ndarray | None = None
    positions: np.ndarray | None = None
    generations: list | None = None

    def __len__(self) -> int:
        return len(self.maps)

    def take(self, index) -> DetectorInputs:
        """The rows at ``index`` (a slice or an integer array) of every part held."""
        idx = np.arange(len(self))[index]
        gens = None if self.generations is None else [self.generations[i] for i in idx]
        return DetectorInputs(
            np.asarray(self.maps)[idx],
            None if self.scalars is None else np.asarray(self.scalars)[idx],
            None if self.positions is None else self.positions[idx],
            gens,
        )


def as_inputs(inputs: Any, scalars: Any = None) -> DetectorInputs:
    """``inputs`` as a bundle: a `DetectorInputs` as it is, or bare maps (with ``scalars``)."""
    if isinstance(inputs, DetectorInputs):
        if scalars is not None:
            raise ValueError("pass the scalars inside the DetectorInputs, not beside it")
        return inputs
    return DetectorInputs(inputs, scalars)


def check_requires(requires: Sequence[str]) -> tuple[str, ...]:
    """``requires`` checked against `INPUT_NAMES` (the map first, always)."""
    unknown = [r for r in requires if r not in INPUT_NAMES]
    if unknown or "maps" not in requires:
        raise ValueError(
            f"a detector requires 'maps' and only {', '.join(INPUT_NAMES)}; got {tuple(requires)}"
        )
    return tuple(requires)


def read_positions(store, ids: Sequence[str]) -> np.ndarray:
    """(N, 4, L, D) float16 position states of ``ids`` (only those rows are read)."""
    arrays = store.read_arrays("positions", ids, hint="scripts/add_positions.py adds them")
    states = np.stack([arrays[k] for k in ids])
    nan = np.isnan(states).reshape(len(ids), -1).any(axis=1)
    if nan.any():
        bad = [k for k, b in zip(ids, nan, strict=True) if b]
        raise ValueError(
            f"{store.root}: {len(bad)} rows have NaN position states, e.g. {bad[:3]}: "
            "the probes cannot read them"
        )
    # a store written before capture saturated float16 (`saturated_float16`) holds inf where a
    # state left float16's range: read it as the saturated value capture now stores (in place:
    # the stack is this call's own array, up to a gigabyte for a large store)
    return saturated_float16(states)


def check_stored_inputs(store, ids: Sequence[str], requires: Sequence[str], name=None) -> None:
    """A clear error when ``store`` lacks a side table part ``requires`` names for ``ids``
    (``name``: the detector, in the message)."""
    name = name or "the detector"
    for need, (table, how) in SIDE_TABLES.items():
        if need not in requires:
            continue
        if not store.has_table(table):
            raise ActmapUserError(
                f"{name} reads {need}, but {store.root} has no '{table}' table ({how})"
            )
        have = store.ids(table)
        missing = [k for k in ids if k not in have]
        if missing:
            raise ActmapUserError(
                f"{name} reads {need}, but {len(missing)} of the {len(ids)} rows to score have "
                f"none in {store.root}'s '{table}' table, e.g. {missing[:3]} ({how})"
            )


def read_inputs(store, rows, requires: Sequence[str]) -> DetectorInputs:
    """What ``requires`` names for ``rows`` of ``store``: ``rows`` is a `actmap.store.rows.Rows`
    (its maps and scalars are used when it holds them) or a sequence of ids. The position
    states and the attention-carrying generations are read when required and stored (a
    detector that finds one missing says so when it scores; `check_stored_inputs` says so
    first)."""
    if hasattr(rows, "row_ids"):
        ids, maps, scalars = rows.row_ids(), rows.maps, rows.scalars
    else:
        ids, maps, scalars = list(rows), None, None
    need = check_requires(requires)
    if maps is None:
        maps, _ = store.load_maps(ids)
    if "scalars" in need and scalars is None:
        scalars = scalars_from_store(store, ids)
    positions = None
    if "positions" in need and store.has_table(SIDE_TABLES["positions"][0]):
        positions = read_positions(store, ids)
    gens = None
    if "attention" in need and store.has_table(SIDE_TABLES["attention"][0]):
        gens = read_generations(store, ids)
    return DetectorInputs(maps, scalars if "scalars" in need else None, positions, gens)


def live_inputs(maps: Any, scalars: np.ndarray | None, generations) -> DetectorInputs:
    """The bundle of answers just captured: their maps, scalars, and `Generation` records
    (position states when every record kept them; attention weights inside each)."""
    positions = None
    if generations and all(g.positions is not None for g in generations):
        positions = np.stack([g.positions.numpy() for g in generations])
    return DetectorInputs(
        maps, scalars, positions, None if generations is None else list(generations)
    )
