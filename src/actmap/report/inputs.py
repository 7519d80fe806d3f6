"""What a report reads: store references and the `actmap train` runs laid out beside them.

Runs live as ``<runs>/<store name>/<detector>/seed-<s>/`` (what `actmap reproduce` writes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from actmap.errors import ActmapUserError
from actmap.labelling.judge_pass import read_judge_check
from actmap.llm.models import stored_dtype
from actmap.report.sections import StoreRef
from actmap.store import read_manifest

if TYPE_CHECKING:
    from actmap.labelling.judge_pass import JudgeCheck

T = TypeVar("T")


def store_ref(path: str | Path, name: str | None = None) -> StoreRef:
    """A store's name (its folder's name unless given), generator and task, from its manifest."""

    path = Path(path)
    config = read_manifest(path).get("config", {})
    generator = str(config.get("model", {}).get("name") or "unknown")
    task = str(config.get("task", {}).get("task") or "unknown")
    judge = config.get("task", {}).get("judge")
    judge = None if judge is None else str(judge)
    return StoreRef(name or path.name, path, generator, task, judge, stored_dtype(config))


def _one_each(
    paths: Iterable[str | Path],
    read: Callable[[str | Path], T],
    key: Callable[[T], str],
    clash: Callable[[T, str | Path], str],
) -> dict[str, T]:
    """``{key: item}`` of the item read from each path; two with one key are an error."""
    found: dict[str, T] = {}
    for path in paths:
        item = read(path)
        if key(item) in found:
            raise ActmapUserError(clash(found[key(item)], path))
        found[key(item)] = item
    return found


def store_refs(paths: Iterable[str | Path]) -> dict[str, StoreRef]:
    return _one_each(
        paths,
        store_ref,
        lambda ref: ref.name,
        lambda ref, path: f"two stores are named '{ref.name}': {ref.path}, {path}",
    )


def find_runs(runs_dir: str | Path | None, stores: Iterable[str]) -> dict[str, dict[str, Path]]:
    """``{store name: {detector: run folder}}`` for every ``<runs>/<store>/<detector>/`` that
    holds at least one ``seed-*`` folder."""
    if runs_dir is None:
        return {}
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise ActmapUserError(f"runs folder {runs_dir} does not exist")
    found: dict[str, dict[str, Path]] = {}
    for name in stores:
        folder = runs_dir / name
        if not folder.is_dir():
            continue
        for run in sorted(p for p in folder.iterdir() if p.is_dir()):
            if any(run.glob("seed-*/config.json")):
                found.setdefault(name, {})[run.name] = run
    return found


def read_judge_checks(paths: Iterable[str | Path]) -> dict[str, JudgeCheck]:
    """``{judge name: check}`` from `actmap judge check` output folders (one check per judge)."""

    return _one_each(
        paths,
        read_judge_check,
        lambda check: check.judge,
        lambda check, path: (
            f"two judge checks of {check.judge}: give one folder per judge ({path})"
        ),
    )
