"""One estimator contract for every detector: fit / predict_proba / save / load.

`CorrectnessDetector(detector="vit")` stores its arguments; `fit` builds the
registered module for the maps' shape and trains it with the paper's recipe;
`predict_proba` returns p(correct) (higher = more likely correct). Saved as
`model.safetensors` + `config.json`, never pickle.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from sklearn.exceptions import NotFittedError

from actmap.artifacts import package_version, write_json
from actmap.atomic import atomic_path
from actmap.capture.needs import needs_of
from actmap.detectors.inputs import as_inputs
from actmap.detectors.registry import create_detector
from actmap.device import resolve_device
from actmap.errors import ActmapUserError
from actmap.scoring.contract import ScoreResult
from actmap.training.recipe import (
    EpochRecord,
    ProgressCallback,
    TrainConfig,
    amx_bf16_cpu,
    predict_logits,
    seed_everything,
    train_detector,
)

SCHEMA_VERSION = 1  # of config.json next to a saved detector
SHAPE_KWARGS = ("in_channels", "map_height", "map_width")  # every registered detector takes these


def as_maps(maps: Any, name: str = "maps") -> torch.Tensor:
    """(N, C, H, W) maps -> CPU float tensor (float16 kept until batching).

    Takes what `build_map` / `build_maps` and the store return: a numpy array, a
    tensor, or a list of (C, H, W) maps (stacked here).
    """
    if isinstance(maps, list | tuple):
        if not maps:
            raise ActmapUserError(f"{name} is empty")
        maps = torch.stack([as_maps(m[None], name)[0] for m in maps])
    if isinstance(maps, np.ndarray):
        if not np.issubdtype(maps.dtype, np.floating):
            raise ActmapUserError(f"{name} must be floating point, got dtype {maps.dtype}")
        maps = np.ascontiguousarray(maps)
        maps = torch.from_numpy(maps if maps.flags.writeable else maps.copy())
    if not isinstance(maps, torch.Tensor):
        raise TypeError(
            f"{name} must be a list of maps, a numpy array or a torch tensor, "
            f"got {type(maps).__name__}"
        )
    if maps.ndim != 4:
        raise ActmapUserError(f"{name} must have shape (N, C, H, W), got {tuple(maps.shape)}")
    if len(maps) == 0:
        raise ActmapUserError(f"{name} is empty")
    if not maps.is_floating_point():
        raise ActmapUserError(f"{name} must be floating point, got dtype {maps.dtype}")
    if maps.dtype not in (torch.float16, torch.float32):
        maps = maps.float()
    maps = maps.cpu()
    for start in range(0, len(maps), 1024):  # chunked, so the check allocates little
        finite = torch.isfinite(maps[start : start + 1024]).flatten(1).all(1)
        if not finite.all():
            rows = (start + torch.nonzero(~finite).flatten()).tolist()
            raise ActmapUserError(
                f"{name} contain NaN or infinite values (row {rows[0]}"
                + (
                    f" and {len(rows) - 1} more in rows {start}-{start + len(finite) - 1})"
                    if len(rows) > 1
                    else ")"
                )
            )
    return maps


def as_labels(labels: Any, n_rows: int, name: str = "labels") -> torch.Tensor:
    """(N,) 0/1 labels (bool, int or float) with both classes -> int64 tensor."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    y = torch.as_tensor(np.array(labels))  # a copy: a pandas column read from Parquet is read-only
    if y.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(y.shape)}")
    if len(y) != n_rows:
        raise ValueError(f"{name} has {len(y)} rows but the maps have {n_rows}")
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError(f"{name} must be 0 or 1, got values {torch.unique(y)[:10].tolist()}")
    y = y.long()
    if len(torch.unique(y)) < 2:
        raise ValueError(f"{name} contain a single class; need both correct (1) and incorrect (0)")
    return y


class CorrectnessDetector:
    """p(correct) from activation maps, with the paper's training recipe.

    Honours the scoring contract of `actmap.scoring.contract` (reads ``maps``; its
    confidence is a probability).

    Learned state (after `fit` or `load`): `model_`, `detector_kwargs_` (resolved
    constructor arguments), `config_`, `history_`, `best_epoch_`, `best_val_auroc_`,
    `wall_time_s_`, `trained_on_` (device name), `device_` (where it scores now),
    `metadata_`.
    """

    name: ClassVar[str] = "actmap"
    supervised: ClassVar[bool] = True
    requires: ClassVar[tuple[str, ...]] = ("maps",)
    probability: ClassVar[bool] = True

    def __init__(
        self,
        detector: str = "vit",
        detector_kwargs: dict[str, Any] | None = None,
        config: TrainConfig | None = None,
        seed: int = 42,
        device: str | None = None,
        precision: str = "float32",  # scoring: "bfloat16" = bf16 autocast (see bf16_supported)
        compile: bool | str = False,  # scoring through torch.compile (a mode: `predict_logits`)
    ) -> None:
        self.detector = detector
        self.detector_kwargs = detector_kwargs
        self.config = config
        self.seed = seed
        self.device = device
        self.precision = precision
        self.compile = compile

    @property
    def kind(self) -> str:
        """The name its artifact and served answers record (``detector`` in config.json)."""
        return self.detector

    def capture_needs(self) -> dict:
        """`CaptureConfig` fields a capture pass needs for it: the map only."""
        return needs_of(self.requires)

    # --- fitting -------------------------------------------------------------

    def _resolve_kwargs(self, map_shape: tuple[int, int, int]) -> dict[str, Any]:
        kwargs = dict(self.detector_kwargs or {})
        for key, value in zip(SHAPE_KWARGS, map_shape, strict=True):
            if key in kwargs and kwargs[key] != value:
                raise ValueError(f"detector_kwargs {key}={kwargs[key]} but the maps have {value}")
            kwargs[key] = value
        return kwargs

    def fit(
        self,
        inputs: Any,
        y: Any,
        val_inputs: Any,
        y_val: Any,
        progress: ProgressCallback | None = None,
        checkpoint: str | Path | None = None,
    ) -> CorrectnessDetector:
        """Train on (inputs, y), select the epoch on validation AUROC; returns self. ``inputs``
        and ``val_inputs``: `DetectorInputs` or bare maps (only the maps are read).

        ``checkpoint``: a file where training saves its state as it goes and from which a
        killed fit of the same seed and data resumes (`actmap.training.recipe.train_detector`).
        """
        x = as_maps(as_inputs(inputs).maps)
        y = as_labels(y, len(x))
        vx = as_maps(as_inputs(val_inputs).maps, "val_maps")
        vy = as_labels(y_val, len(vx), "val_labels")
        if vx.shape[1:] != x.shape[1:]:
            raise ValueError(
                f"val_maps have map shape {tuple(vx.shape[1:])}, maps {tuple(x.shape[1:])}"
            )
        cfg = self.config or TrainConfig()
        kwargs = self._resolve_kwargs(tuple(x.shape[1:]))
        device = resolve_device(self.device if self.device is not None else cfg.device)
        seed_everything(self.seed)  # the initial weights depend on the seed too
        model = create_detector(self.detector, **kwargs)
        result = train_detector(model, x, y, vx, vy, cfg, self.seed, device, progress, checkpoint)
        self.model_ = model.eval()
        self.detector_kwargs_ = kwargs
        self.config_ = cfg
        self.history_: list[EpochRecord] = result.history
        self.best_epoch_ = result.best_epoch
        self.best_val_auroc_ = result.best_val_auroc
        self.wall_time_s_ = result.wall_time_s
        self.device_ = device
        self.trained_on_ = str(device)
        self.metadata_: dict[str, Any] = {}
        return self

    # --- scoring -------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not hasattr(self, "model_"):
            raise NotFittedError("this CorrectnessDetector is not fitted; call fit() or load()")

    def decision_function(self, inputs: Any, scalars: Any = None) -> np.ndarray:
        """(N,) float32 logits; higher = more likely correct. ``inputs``: a `DetectorInputs`
        or bare maps; only the maps are read (``scalars`` is accepted so every detector scores
        alike)."""
        self._check_fitted()
        x = as_maps(as_inputs(inputs, scalars).maps)
        expected = tuple(self.detector_kwargs_[k] for k in SHAPE_KWARGS)
        if tuple(x.shape[1:]) != expected:
            raise ValueError(f"maps have shape {tuple(x.shape[1:])}, detector expects {expected}")
        batch = self.config_.eval_batch_size
        if self.precision == "bfloat16" and self.detector == "vit" and self.device_.type == "cpu":
            if amx_bf16_cpu():
                warnings.warn(
                    "bfloat16 ViT scoring on a CPU with AMX: oneDNN's AMX bf16 kernels moved a "
                    "ViT's test AUROC from .793 to .429 on a real store (docs/performance.md); "
                    "score in float32, or start the process with "
                    "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16",
                    stacklevel=2,
                )
        return predict_logits(
            self.model_, x, batch, self.device_, self.precision, self.compile
        ).numpy()

    def predict_proba(self, inputs: Any, scalars: Any = None) -> np.ndarray:
        """(N,) float32 p(correct) in [0, 1] (only the maps are read)."""
        return torch.sigmoid(torch.from_numpy(self.decision_function(inputs, scalars))).numpy()

    # --- persistence ---------------------------------------------------------

    def score(self, inputs: Any) -> ScoreResult:
        """The scorer contract (`actmap.scoring.contract`): confidence = p(correct), raw = the logit."""
        logits = self.decision_function(inputs).astype(np.float64)
        return ScoreResult(
            confidence=1.0 / (1.0 + np.exp(-logits)),
            raw=logits,
            raw_name="logit",
            details={"detector": self.detector, "seed": self.seed},
        )

    def save(self, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """Write model.safetensors and config.json into `directory`; returns it."""
        self._check_fitted()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model_.state_dict().items()}
        with atomic_path(out / "model.safetensors") as tmp:
            save_file(state, tmp)
        write_json(
            out / "config.json",
            {
                "schema_version": SCHEMA_VERSION,
                "actmap_version": package_version(),
                "detector": self.detector,
                "detector_kwargs": self.detector_kwargs_,
                "train_config": self.config_.to_dict(),
                "seed": self.seed,
                "best_epoch": self.best_epoch_,
                "best_val_auroc": self.best_val_auroc_,
                "wall_time_s": self.wall_time_s_,
                "trained_on": self.trained_on_,
                "history": [vars(r) for r in self.history_],
                "metadata": {**self.metadata_, **(metadata or {})},
            },
        )
        return out

    @classmethod
    def load(
        cls,
        directory: str | Path,
        device: str | None = None,
        precision: str = "float32",
        compile: bool | str = False,
    ) -> CorrectnessDetector:
        """Restore a saved detector; it predicts exactly as the one saved (``precision``
        "bfloat16" scores under bf16 autocast instead; ``compile`` through torch.compile, e.g.
        "reduce-overhead" on a GPU: CUDA graphs).

        A damaged folder (missing or garbled file, a field missing from config.json,
        weights of another shape) raises `ActmapUserError` naming the file.
        """
        src = Path(directory)
        for name in ("config.json", "model.safetensors"):
            if not (src / name).is_file():
                raise FileNotFoundError(f"{src / name} does not exist; is {src} a saved detector?")
        cfg = _read_config(src / "config.json")
        kwargs = {
            k: tuple(v) if isinstance(v, list) else v for k, v in cfg["detector_kwargs"].items()
        }  # JSON turns tuples into lists
        train_config = TrainConfig.from_dict(cfg["train_config"])
        est = cls(cfg["detector"], kwargs, train_config, cfg["seed"], device, precision, compile)
        est.device_ = _scoring_device(device, train_config.device)
        model = create_detector(cfg["detector"], **kwargs)
        model.load_state_dict(_read_weights(src / "model.safetensors", model), strict=True)
        est.model_ = model.to(est.device_).eval()
        est.detector_kwargs_ = kwargs
        est.config_ = train_config
        est.history_ = [
            EpochRecord(**{k: (float("nan") if v is None else v) for k, v in r.items()})
            for r in cfg["history"]
        ]
        est.best_epoch_ = cfg["best_epoch"]
        est.best_val_auroc_ = cfg["best_val_auroc"]
        est.wall_time_s_ = cfg["wall_time_s"]
        est.trained_on_ = cfg["trained_on"]
        est.metadata_ = cfg.get("metadata", {})
        return est


CONFIG_FIELDS = (
    "schema_version",
    "detector",
    "detector_kwargs",
    "train_config",
    "seed",
    "best_epoch",
    "best_val_auroc",
    "wall_time_s",
    "trained_on",
    "history",
)


def _read_config(path: Path) -> dict[str, Any]:
    """A saved detector's config.json, checked for every field `load` reads."""
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ActmapUserError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(cfg, dict):
        raise ActmapUserError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    missing = [k for k in CONFIG_FIELDS if k not in cfg]
    if missing:
        raise ActmapUserError(f"{path} lacks the field(s) {', '.join(missing)}")
    if cfg["schema_version"] != SCHEMA_VERSION:
        raise ActmapUserError(
            f"{path} has schema_version {cfg['schema_version']}, this actmap reads {SCHEMA_VERSION}"
        )
    if not isinstance(cfg["history"], list) or not all(isinstance(r, dict) for r in cfg["history"]):
        raise ActmapUserError(f"{path}: field 'history' must be a list of epoch records")
    return cfg


def _read_weights(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors, checked against the module config.json describes."""
    from safetensors import SafetensorError

    try:
        state = load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise ActmapUserError(f"{path} is not a readable safetensors file ({reason})") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ActmapUserError(
            f"{path} does not hold the weights config.json describes "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ActmapUserError(
                f"{path}: tensor '{key}' has shape {tuple(tensor.shape)}, "
                f"config.json's detector needs {tuple(expected[key].shape)}"
            )
    return state


def _scoring_device(asked: str | None, trained: str) -> torch.device:
    """Where a loaded detector scores: the asked device, else the saved one when it exists here."""
    if asked is None and str(trained).startswith("cuda") and not torch.cuda.is_available():
        return torch.device("cpu")  # trained with --device cuda, scored on a CPU machine
    return resolve_device(asked if asked is not None else trained)
