"""Epoch checkpoints of one training seed, so that a killed run resumes where it stopped.

`actmap.training.recipe.train_detector(..., checkpoint=path)` writes one safetensors file at
the end of an epoch (at most every ``every_s`` seconds, and after the last epoch). It
holds everything the next epoch depends on: the weights, AdamW's moments, the kept
best weights, the state of every random generator, the learning-rate schedule, early
stopping and the history so far. Resuming from it gives the same weights, bit for bit,
as a run that was never stopped (same device, torch and thread count).

The file also says what it was written for (seed, recipe, device, the module's tensor
shapes, a hash of the training and validation maps and labels). A checkpoint of
anything else, or one that cannot be read, is ignored with a warning, and the seed
trains from its first epoch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from actmap.atomic import atomic_path
from actmap.training.run_folder import recipe_of

log = logging.getLogger(__name__)

FORMAT = "actmap-train-checkpoint/1"


@dataclass
class TrainState:
    """Where one seed's training stands after ``epochs`` finished epochs."""

    epochs: int
    model: dict[str, torch.Tensor]  # the module's current weights and buffers
    best: dict[str, torch.Tensor] | None  # the kept checkpoint; None before any improvement
    optimizer: dict[str, Any]  # torch.optim state_dict()
    schedule: dict[str, Any]  # the lr scheduler's state_dict()
    stopper: dict[str, Any]  # EarlyStopping's fields
    generators: dict[str, torch.Tensor]  # torch generator states (uint8), by name
    numpy_generator: dict[str, Any]  # the mixup generator's bit_generator.state
    history: list[dict[str, Any]]  # EpochRecords as dicts
    elapsed_s: float  # training seconds before this checkpoint


def identity(
    seed: int,
    recipe: dict[str, Any],
    device: torch.device,
    model: nn.Module,
    tensors: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """What a checkpoint is valid for: the same seed, recipe, device and module, trained on
    the same maps and labels (``tensors``, hashed byte for byte)."""
    data = {}
    for name, tensor in tensors.items():
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        data[name] = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype),
            "sha256": hashlib.sha256(memoryview(raw)).hexdigest(),
        }
    return {
        "format": FORMAT,
        "seed": int(seed),
        "recipe": recipe_of(recipe),
        "device": device.type,
        "module": type(model).__name__,
        "tensors": {k: list(v.shape) for k, v in model.state_dict().items()},
        "data": data,
    }


def _flat(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v.detach().cpu().contiguous().clone() for k, v in tensors.items()}


def _unflat(prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    start = f"{prefix}."
    return {k[len(start) :]: v for k, v in tensors.items() if k.startswith(start)}


def save(path: str | Path, state: TrainState, ident: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (the previous checkpoint stays until then)."""
    from safetensors.torch import save_file

    tensors = {**_flat("model", state.model), **_flat("generator", state.generators)}
    if state.best is not None:
        tensors.update(_flat("best", state.best))
    optimizer_values: dict[str, dict[str, Any]] = {}
    for index, values in state.optimizer["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().cpu().contiguous().clone()
            else:
                optimizer_values.setdefault(str(index), {})[key] = value
    meta = {
        "epochs": state.epochs,
        "has_best": state.best is not None,
        "optimizer_groups": state.optimizer["param_groups"],
        "optimizer_values": optimizer_values,
        "schedule": state.schedule,
        "stopper": state.stopper,
        "numpy_generator": state.numpy_generator,
        "history": state.history,
        "elapsed_s": state.elapsed_s,
    }
    metadata = {"format": FORMAT, "identity": json.dumps(ident), "state": json.dumps(meta)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def _differing(saved: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))


def load(path: str | Path, ident: dict[str, Any]) -> TrainState | None:
    """The state saved at ``path`` if it was written for ``ident``; None (with a warning
    saying why) for a missing, unreadable or foreign checkpoint."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
        saved, meta = json.loads(metadata["identity"]), json.loads(metadata["state"])
    except (OSError, SafetensorError, ValueError, KeyError) as error:
        log.warning("%s is not a readable checkpoint (%s); training from epoch 0", path, error)
        return None
    if saved != ident:
        log.warning(
            "%s was written for another run (differs in: %s); training from epoch 0",
            path,
            ", ".join(_differing(saved, ident)),
        )
        return None
    optimizer_state: dict[int, dict[str, Any]] = {}
    for key, value in _unflat("optimizer", tensors).items():
        index, name = key.split(".", 1)
        optimizer_state.setdefault(int(index), {})[name] = value
    for index, values in meta["optimizer_values"].items():
        optimizer_state.setdefault(int(index), {}).update(values)
    return TrainState(
        epochs=int(meta["epochs"]),
        model=_unflat("model", tensors),
        best=_unflat("best", tensors) if meta["has_best"] else None,
        optimizer={"state": optimizer_state, "param_groups": meta["optimizer_groups"]},
        schedule=meta["schedule"],
        stopper=meta["stopper"],
        generators=_unflat("generator", tensors),
        numpy_generator=meta["numpy_generator"],
        history=meta["history"],
        elapsed_s=float(meta["elapsed_s"]),
    )
