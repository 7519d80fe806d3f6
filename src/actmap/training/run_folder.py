"""Run folders: one detector and one training recipe per folder, one ``seed-<s>/`` per seed.

Training more seeds of the same detector and recipe into a folder extends it;
anything else refuses (or replaces the folder when asked), so a folder's
mean ± std is always over seeds of one thing. Readers (`evaluate`, `compare`)
check the same and never average across detectors or recipes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actmap.artifacts import write_json
from actmap.errors import ActmapUserError
from actmap.scoring.metrics import SUMMARY_METRICS, seed_summary

# TrainConfig fields that do not change what a seed learns: not part of the recipe
NOT_RECIPE = ("seeds", "device", "eval_batch_size")


def method_name(detector: str) -> str:
    """How tables name a detector's scores: ``actmap-<detector>``, the prefix written once
    (``mlp`` -> ``actmap-mlp``; ``actmap-plus`` stays ``actmap-plus``)."""
    return detector if detector.startswith("actmap-") else f"actmap-{detector}"


def recipe_of(train_config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a saved TrainConfig that define the recipe."""
    return {k: v for k, v in sorted(train_config.items()) if k not in NOT_RECIPE}


@dataclass(frozen=True)
class RunFolder:
    """A checked run folder: its detector, its recipe and its seed folders, by seed."""

    path: Path
    detector: str
    recipe: dict[str, Any]
    seed_dirs: dict[int, Path]


ONE_FIT_SEED = 0  # a detector fit once, with no training seed (actmap-plus), is seed-0/


def seed_folder(run: str | Path, seed: int) -> Path:
    """The ``seed-<s>/`` folder of seed ``seed`` in a run folder (written or not)."""
    return Path(run) / f"seed-{seed}"


def seed_folders(run: str | Path) -> dict[int, Path]:
    """{seed: its ``seed-<s>/`` folder} of a run folder, in seed order (none: empty)."""
    run = Path(run)
    found = {}
    for folder in sorted(run.glob("seed-*")):
        try:
            found[int(folder.name.split("-", 1)[1])] = folder
        except ValueError:
            continue
    return dict(sorted(found.items()))


def _seed_identity(folder: Path) -> tuple[str, dict[str, Any]]:
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
        # the paper's detectors save their TrainConfig; actmap-plus its PlusConfig (v1) or
        # StackConfig (v2, the stacked one)
        recipe = cfg.get("train_config") or cfg.get("plus_config") or cfg["stack_config"]
        return str(cfg["detector"]), recipe_of(recipe)
    except FileNotFoundError:
        raise ActmapUserError(f"{path} does not exist; {folder} is not a finished seed") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ActmapUserError(f"{path} is damaged ({type(error).__name__}: {error})") from None


def _differences(a: dict[str, Any], b: dict[str, Any]) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in keys)


def read_run(run: str | Path) -> RunFolder:
    """The run folder's seeds, refusing a folder whose seeds differ in detector or recipe."""
    path = Path(run)
    seeds = seed_folders(path)
    if not seeds:
        raise ActmapUserError(
            f"{path} has no seed-*/ folders; is it a run written by `actmap train`?"
        )
    identities = {seed: _seed_identity(folder) for seed, folder in seeds.items()}
    first_seed, (detector, recipe) = next(iter(identities.items()))
    for seed, (other_detector, other_recipe) in identities.items():
        if other_detector != detector:
            raise ActmapUserError(
                f"{path} mixes detectors ({detector} in seed {first_seed}, {other_detector} in "
                f"seed {seed}); its seeds cannot be averaged: train each detector into its own --out"
            )
        if other_recipe != recipe:
            raise ActmapUserError(
                f"{path} mixes training recipes (seed {first_seed} vs seed {seed}: "
                f"{_differences(recipe, other_recipe)}); its seeds cannot be averaged"
            )
    return RunFolder(path, detector, recipe, seeds)


def prepare_run_folder(
    out: str | Path, detector: str, train_config: dict[str, Any] | None, overwrite: bool = False
) -> None:
    """Make ``out`` ready for seeds of ``detector`` trained with ``train_config``.

    An empty or missing folder is fine, and so is a run of the same detector and recipe
    (its seeds are extended; ``train_config`` None checks the detector only). A run of anything else, or a folder that is not a run,
    refuses unless ``overwrite``, which deletes the folder first.
    """
    path = Path(out)
    if not path.exists():
        return
    if not path.is_dir():
        raise ActmapUserError(f"--out {path} is a file, not a run folder")
    if overwrite:
        shutil.rmtree(path)
        return
    if not any(not p.name.startswith(".") for p in path.iterdir()):
        return  # empty, or only a killed run's checkpoint or temporary files
    if not seed_folders(path):
        raise ActmapUserError(
            f"{path} is not empty and holds no run; choose another --out or pass --overwrite"
        )
    existing = read_run(path)
    # None: the recipe is chosen while fitting (actmap-plus), so only the detector must match
    recipe = existing.recipe if train_config is None else recipe_of(train_config)
    if existing.detector != detector:
        raise ActmapUserError(
            f"{path} holds a run of detector {existing.detector}, not {detector}; "
            "choose another --out, or pass --overwrite to replace it"
        )
    if existing.recipe != recipe:
        raise ActmapUserError(
            f"{path} holds a run of {detector} with another recipe "
            f"({_differences(existing.recipe, recipe)}); choose another --out, "
            "or pass --overwrite to replace it"
        )


def checkpoint_path(run: str | Path, seed: int) -> Path:
    """Where seed ``seed`` of a run folder keeps its epoch checkpoint while it trains (a
    hidden file, removed once the seed's folder is written)."""
    return Path(run) / f".checkpoint-seed-{seed}.safetensors"


def seed_finished(run: str | Path, seed: int) -> bool:
    """Seed ``seed`` of a run folder finished: its ``metrics.json``, the last file a seed
    writes, is there."""
    return (seed_folder(run, seed) / "metrics.json").is_file()


def folder_summary(run: str | Path) -> dict[str, Any]:
    """Per-seed test metrics of every seed in the folder and their mean and std (ddof=1)."""

    folder = read_run(run)
    per_seed = {}
    for seed, seed_dir in folder.seed_dirs.items():
        path = seed_dir / "metrics.json"
        try:
            per_seed[str(seed)] = json.loads(path.read_text())
        except (FileNotFoundError, ValueError) as error:
            raise ActmapUserError(f"{path} is missing or damaged ({error})") from None
    mean, std = {}, {}
    for name in SUMMARY_METRICS:
        values = [m[name] for m in per_seed.values() if m.get(name) is not None]
        if values:
            mean[name], std[name] = seed_summary(values)
    return {
        "detector": folder.detector,
        "seeds": list(folder.seed_dirs),
        "per_seed": per_seed,
        "mean": mean,
        "std": std,
        "std_ddof": 1,
    }


def extend_run_record(run: str | Path) -> dict[str, Any]:
    """After new seeds: summary.json and manifest.json's seeds cover every seed of the folder."""

    path = Path(run)
    summary = folder_summary(path)
    write_json(path / "summary.json", summary)
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    write_json(manifest_path, {**manifest, "seeds": summary["seeds"]})
    return summary
