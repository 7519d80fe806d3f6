"""From captured trajectories to p(correct) the way a map store would: one detector, float16 maps.

A served answer is scored from its map rounded to float16, the form the store
keeps and detectors are trained on, so re-scoring an audit store with the same
detector reproduces the served raw score. `load_detector_run` opens a run folder
written by ``actmap train`` (or one of its ``seed-<s>/`` folders): a paper
detector (`vit`, `mlp`, `mlp4x`, `logreg`, maps only) or ``actmap-plus``, the one
to deploy, which also reads the six per-answer scalars of the same pass
(`actmap.capture.answer_scalars`). ``LoadedDetector.requires`` says which: the server
captures the grey-box statistics exactly when the detector reads them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from actmap.detectors import DetectorInputs, live_inputs, load_detector
from actmap.detectors.inputs import SIDE_TABLES
from actmap.errors import ActmapUserError
from actmap.llm.models import ModelSource, file_digest
from actmap.maps import MapConfig, build_maps, build_maps_from_list, stored_form
from actmap.training.run_folder import seed_folders

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedDetector:
    """A trained detector, the id answers record it under, and the map settings it reads."""

    detector: object  # a fitted detector (`actmap.detectors.Detector`)
    id: str  # "<name>:<run>/seed-<s>:<weights sha256 prefix>"
    map_config: MapConfig
    path: Path
    dtype: str = "float32"  # the generator's dtype when the detector's training maps were captured
    # the generator its training maps came from (a store config's ``model``: name, revision,
    # gguf_file); None when the run does not record it
    generator: dict | None = None

    @property
    def requires(self) -> tuple[str, ...]:
        """What the detector reads per answer: "maps", and "scalars", "positions", "attention"
        (`actmap.detectors.inputs.INPUT_NAMES`)."""
        return tuple(self.detector.requires)

    @property
    def needs_scalars(self) -> bool:
        return "scalars" in self.requires

    @property
    def needs_generations(self) -> bool:
        """True when scoring reads more than maps and scalars (positions, attention): the
        whole answer's `Generation` records; no running scores over answer prefixes then."""
        return bool(set(SIDE_TABLES) & set(self.requires))  # the parts a store keeps aside

    def capture_settings(self) -> dict:
        """`CaptureConfig` fields the generation pass needs for this detector: what the
        detector itself declares (``capture_needs()``, `actmap.capture.needs.needs_of`)."""
        return self.detector.capture_needs()

    def predict_proba(
        self, maps: np.ndarray | DetectorInputs, scalars: np.ndarray | None = None, generations=None
    ) -> np.ndarray:
        """(N, C, H, W) float16 maps (+ (N, 6) scalars when required, + the `Generation`
        records when it reads positions or attention) -> (N,) raw p(correct). A
        `DetectorInputs` bundle (`actmap.detectors.read_inputs` of a store) is scored as it is."""
        if isinstance(maps, DetectorInputs):
            return self.detector.predict_proba(maps).astype(np.float64)
        if generations is None and self.needs_generations:
            raise ValueError(
                f"{self.id} reads {', '.join(self.requires)}: score it from the generations "
                "of a capture pass (the server does) or from a store "
                "(actmap.serve.fit.store_p_raw), not maps alone"
            )
        inputs = (
            live_inputs(maps, scalars, generations)
            if self.needs_generations
            else DetectorInputs(maps, scalars)
        )
        return self.detector.predict_proba(inputs).astype(np.float64)


def _seed_folder(run: Path, seed: int | None) -> Path:
    if (run / "config.json").is_file() and (run / "model.safetensors").is_file():
        return run
    seeds = seed_folders(run)
    folders = list(seeds.values())
    if not folders:
        raise FileNotFoundError(
            f"{run} is neither a detector folder (config.json + model.safetensors) nor a run "
            "folder with seed-*/ folders written by `actmap train`"
        )
    if seed is not None:
        if seed not in seeds:
            raise FileNotFoundError(
                f"{run} has no seed-{seed}/; seeds there: " + ", ".join(map(str, seeds))
            )
        return seeds[seed]

    def val_auroc(folder: Path) -> float:
        config = json.loads((folder / "config.json").read_text())
        value = config.get("best_val_auroc", config.get("metadata", {}).get("validation_auroc"))
        return float("-inf") if value is None else float(value)

    return max(folders, key=val_auroc)  # the seed selected on validation, never on test


def load_detector_run(
    run: str | Path, seed: int | None = None, device: str | None = "cpu"
) -> LoadedDetector:
    """The detector of a run folder: ``seed`` when given, else the best validation AUROC."""
    from actmap.llm.models import stored_dtype

    run = Path(run)
    if not run.exists():
        raise FileNotFoundError(f"detector run {run} does not exist")
    folder = _seed_folder(run, seed)
    detector = load_detector(folder, device=device)
    kind = detector.kind
    store_config = detector.metadata_.get("inputs", {}).get("store_config") or {}
    map_config = MapConfig(**store_config.get("map", {}))
    dtype = stored_dtype(store_config)
    name = f"{run.name}/{folder.name}" if folder != run else folder.name
    ident = f"{kind}:{name}:{file_digest(folder / 'model.safetensors')[:12]}"
    log.info("detector %s from %s", ident, folder)
    return LoadedDetector(detector, ident, map_config, folder, dtype, store_config.get("model"))


def refuse_what_vllm_cannot_read(
    detector: LoadedDetector, instead: str, model_type: str | None = None
) -> None:
    """vLLM's capture (the in-process engine and the plugin) gives maps, scalars, position
    states and, for the families `actmap.capture.vllm_attention` reads, the lookback attention
    weights: a run that reads attention on another family (``model_type``: the served model's,
    when known before it loads) is refused by name. ``instead``: what the user can do in that
    mode. Where the family is not known yet, the engine refuses it once it has loaded."""
    from actmap.capture.vllm_attention import VLLM_ATTENTION_FAMILIES

    if "attention" in detector.requires and model_type is not None:
        if model_type not in VLLM_ATTENTION_FAMILIES:
            raise ActmapUserError(
                f"{detector.id} reads attention weights (actmap-plus:full), which vLLM's "
                f"capture reads for {', '.join(sorted(VLLM_ATTENTION_FAMILIES))} models, not "
                f"{model_type!r}: {instead}"
            )


def generator_problem(detector: LoadedDetector, served: ModelSource) -> str | None:
    """Why ``detector`` should not score answers of ``served`` (None: the same generator, or a
    run that does not say which generator it was trained on).

    A GGUF generator matches the file itself or the safetensors folder actmap de-quantizes it
    into (``<stem>-<digest>``, what vLLM loads); a local folder matches the same folder; a hub
    id matches the same id and revision."""
    recorded = detector.generator
    if not recorded or not recorded.get("name"):
        return None
    name, revision, gguf = recorded.get("name"), recorded.get("revision"), recorded.get("gguf_file")
    folder = Path(served.path).expanduser()
    if gguf:
        if served.gguf_file is not None:
            same = served.gguf_file == gguf and served.revision == revision
        else:
            same = folder.name == f"{Path(gguf).stem}-{revision}"
        what = f"{gguf} ({revision})"
    elif revision == "local":
        same = Path(str(name)).expanduser().resolve() == folder.resolve()
        what = f"the folder {name}"
    else:
        same = name == served.name and revision in (served.revision, None)
        what = f"{name} ({revision})"
    if same:
        return None
    served_as = served.gguf_file or served.path
    return (
        f"detector {detector.id} was trained on maps of {what}, but this server generates "
        f"with {served_as}: serve that model, or use a detector trained on this one"
    )


def answer_maps(trajectories: Sequence[torch.Tensor], config: MapConfig) -> np.ndarray:
    """Ragged (L, T_i, D') trajectories -> their maps in stored (float16) form."""
    return stored_form(build_maps_from_list(list(trajectories), config))


def prefix_maps(
    trajectory: torch.Tensor, positions: Sequence[int], config: MapConfig
) -> np.ndarray:
    """Maps of the answer's first k tokens for every k in ``positions`` (float16).

    ``trajectory`` is (L, T, D'); positions beyond T are clamped to T (the answer had
    ended). The map of a prefix is exactly what `build_map` gives on ``trajectory[:, :k]``.
    """
    if trajectory.ndim != 3 or trajectory.shape[1] == 0:
        raise ValueError(f"trajectory must be (L, T>0, D'), got {tuple(trajectory.shape)}")
    lengths = torch.tensor([min(max(int(k), 1), trajectory.shape[1]) for k in positions])
    batch = trajectory[None].expand(len(lengths), -1, -1, -1)  # (P, L, T, D'), no copy
    return stored_form(build_maps(batch, lengths, config))
