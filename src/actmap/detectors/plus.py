"""actmap-plus: the detector to deploy. PCA of the map + the pass's scalars -> logistic regression.

The paper's detectors (`vit`, `mlp`, `mlp4x`, `logreg`) reproduce the paper;
this one is what an operator runs. It reads only what the one capture pass
records: the (C, H, W) map, flattened and projected on its first principal
components, and optionally the six per-answer scalars of
`actmap.capture.answer_scalars` (length, log-likelihood, entropy, first-token
probability). A logistic regression with cross-validated L2 strength
(scikit-learn's ``LogisticRegressionCV``, AUROC-scored folds) reads them all
(early fusion). It may train on every labelled row (with class weights or
without), not only on the balanced subset; validation rows choose
(`actmap.experiments.compare_product.plus_scored`). Why this and not the others tried is in
docs/results/log.md ("what was tried").

Calibration: the fitted probabilities hold at ``calibrated_prevalence_``
(0.5 under class weights: the weighted loss sees both classes equally; the
training rows' own fraction correct otherwise). ``predict_proba(maps,
prevalence=pi)`` shifts the logit to the deployment prevalence
(`actmap.scoring.prior`). The artifact is ``model.safetensors`` (every fitted array)
+ ``config.json``; scoring is plain numpy, never pickle.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file
from sklearn.exceptions import NotFittedError

from actmap.atomic import atomic_path
from actmap.capture.answer_scalars import SCALAR_NAMES
from actmap.capture.needs import needs_of
from actmap.detectors.inputs import as_inputs
from actmap.errors import ActmapUserError
from actmap.scoring.contract import ScoreResult
from actmap.scoring.prior import shift_to_prevalence, sigmoid

NAME = "actmap-plus"
SCHEMA_VERSION = 1  # of config.json next to a saved actmap-plus


@dataclass(frozen=True)
class PlusConfig:
    """Settings of one actmap-plus fit; selected on validation rows by `select_plus`."""

    n_components: int = 64  # principal components of the flattened map; 0 = scalars only
    use_scalars: bool = True  # read the six per-answer scalars beside the map
    class_weight: str | None = "balanced"  # "balanced" = weight classes equally; None = as found
    n_strengths: int = 10  # LogisticRegressionCV's Cs: L2 strengths on a log grid 1e-4..1e4
    cv_folds: int = 5  # stratified folds that choose the strength (AUROC)
    seed: int = 0  # PCA's randomized SVD and the fold shuffle
    C: float | None = None  # a fixed inverse L2 strength; None = chosen by the folds
    # rescale the logit (Platt: p = sigmoid(a * logit + b)) fit on out-of-fold training logits;
    # the strength chosen for AUROC leaves probabilities too flat, and rescaling keeps the ranking
    calibrate: bool = True

    def __post_init__(self) -> None:
        if self.n_components < 0:
            raise ValueError(f"n_components must be >= 0, got {self.n_components}")
        if self.n_components == 0 and not self.use_scalars:
            raise ValueError("actmap-plus needs the map (n_components > 0) or the scalars")
        if self.class_weight not in (None, "balanced"):
            raise ValueError(f"class_weight must be 'balanced' or None, got {self.class_weight!r}")
        if self.n_strengths < 1 or self.cv_folds < 2:
            raise ValueError("n_strengths must be >= 1 and cv_folds >= 2")


def flatten_maps(maps: Any) -> np.ndarray:
    """(N, C, H, W) maps (numpy or torch, any float dtype) -> (N, C*H*W) float32."""
    if hasattr(maps, "detach"):
        maps = maps.detach().cpu().numpy()
    x = np.asarray(maps)
    if x.ndim != 4:
        raise ValueError(f"maps must have shape (N, C, H, W), got {x.shape}")
    if len(x) == 0:
        raise ValueError("maps are empty")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"maps must be floating point, got dtype {x.dtype}")
    x = x.reshape(len(x), -1).astype(np.float32)
    if not np.isfinite(x).all():
        raise ValueError("maps contain NaN or infinite values")
    return x


def check_scalars(scalars: Any, n_rows: int) -> np.ndarray:
    s = np.asarray(scalars, dtype=np.float64)
    if s.shape != (n_rows, len(SCALAR_NAMES)):
        raise ValueError(
            f"scalars must have shape ({n_rows}, {len(SCALAR_NAMES)}) "
            f"({', '.join(SCALAR_NAMES)}), got {s.shape}"
        )
    if not np.isfinite(s).all():
        raise ValueError("scalars contain NaN or infinite values")
    return s


def platt_on_out_of_fold(features, y, C, class_weight, folds) -> tuple[float, float]:
    """(a, b) of sigmoid(a * z + b) fit to out-of-fold logits z of the L2 logistic regression."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_predict

    inner = LogisticRegression(C=C, class_weight=class_weight, max_iter=5000)
    z = cross_val_predict(inner, features, y, cv=folds, method="decision_function")
    outer = LogisticRegression(C=1e6, class_weight=class_weight, max_iter=5000)
    outer.fit(z.reshape(-1, 1), y)
    return float(outer.coef_[0, 0]), float(outer.intercept_[0])


class PriorShifted:
    """``predict_proba`` of a logistic detector whose probabilities hold at its
    ``calibrated_prevalence_`` (actmap-plus v1 and the stacked presets)."""

    def predict_proba(
        self, inputs: Any, scalars: Any = None, prevalence: float | None = None
    ) -> np.ndarray:
        """(N,) p(correct); with ``prevalence``, prior-corrected to that deployment accuracy."""
        p = sigmoid(self.decision_function(inputs, scalars))
        if prevalence is None:
            return p
        return shift_to_prevalence(p, prevalence, self.calibrated_prevalence_)

    def score(self, inputs: Any) -> ScoreResult:
        """The scorer contract every baseline honours (`actmap.scoring.contract`): confidence =
        p(correct) at ``calibrated_prevalence_``, raw = the logit."""
        logits = np.asarray(self.decision_function(inputs), dtype=np.float64)
        return ScoreResult(sigmoid(logits), logits, "logit", {"detector": self.kind})

    def _write(
        self, directory: str | Path, arrays: dict, schema: int, fields: dict, metadata
    ) -> Path:
        """``arrays`` -> model.safetensors and config.json (``schema``, ``fields``, the training
        rows and the prior, ``metadata`` added) in ``directory``; returns it."""
        from actmap.artifacts import package_version, write_json

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        with atomic_path(out / "model.safetensors") as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, tmp)
        write_json(
            out / "config.json",
            {
                "schema_version": schema,
                "actmap_version": package_version(),
                "detector": NAME,
                **fields,
                "n_train": self.n_train_,
                "train_prevalence": self.train_prevalence_,
                "calibrated_prevalence": self.calibrated_prevalence_,
                "metadata": {**self.metadata_, **(metadata or {})},
            },
        )
        return out

    def _restore_fit_record(self, cfg: dict[str, Any]) -> None:
        self.n_train_, self.train_prevalence_ = cfg["n_train"], cfg["train_prevalence"]
        self.calibrated_prevalence_ = cfg["calibrated_prevalence"]
        self.metadata_ = cfg.get("metadata", {})


class ActMapPlus(PriorShifted):
    """p(correct) from the map's principal components and the pass's scalars.

    Learned state: ``map_shape_``, ``map_mean_`` (F,), ``components_`` (k, F),
    ``feature_mean_`` / ``feature_scale_`` (k + s,), ``coef_`` (k + s,),
    ``intercept_``, ``C_`` (the chosen inverse strength), ``train_prevalence_``
    (fraction correct of the training rows), ``calibrated_prevalence_``,
    ``n_train_``, ``metadata_``.
    """

    name = NAME

    def __init__(self, config: PlusConfig | None = None) -> None:
        self.config = config

    @property
    def requires(self) -> tuple[str, ...]:
        """What it reads per answer: the map, and the scalars when its settings use them."""
        config = getattr(self, "config_", None) or self.config or PlusConfig()
        return ("maps", "scalars") if config.use_scalars else ("maps",)

    @property
    def kind(self) -> str:
        """The name its artifact and served answers record (``detector`` in config.json)."""
        return NAME

    def capture_needs(self) -> dict:
        """`CaptureConfig` fields a capture pass needs for it (`actmap.capture.needs.needs_of`)."""
        return needs_of(self.requires)

    # --- fitting -------------------------------------------------------------

    def _features(self, maps: Any, scalars: Any) -> np.ndarray:
        """(N, k + s) standardised inputs of the logistic regression."""
        x = flatten_maps(maps)
        if x.shape[1] != self.components_.shape[1]:
            raise ValueError(
                f"maps have {x.shape[1]} values per row, actmap-plus was fit on "
                f"{self.components_.shape[1]} (map shape {tuple(self.map_shape_)})"
            )
        return (self._raw_features(x, scalars) - self.feature_mean_) / self.feature_scale_

    def _raw_features(self, x: np.ndarray, scalars: Any) -> np.ndarray:
        """(N, F) flat maps -> (N, k + s): principal components, then the scalars."""
        parts = [(x - self.map_mean_) @ self.components_.T] if len(self.components_) else []
        if self.config_.use_scalars:
            if scalars is None:
                raise ValueError(
                    "this actmap-plus reads the per-answer scalars; pass them in its inputs "
                    "(DetectorInputs(maps, scalars); actmap.detectors.inputs.read_inputs reads "
                    "them from a store)"
                )
            parts.append(check_scalars(scalars, len(x)))
        return np.hstack(parts).astype(np.float64)

    def fit(self, inputs: Any, y: Any, val_inputs: Any = None, y_val: Any = None) -> ActMapPlus:
        """Fit PCA, the standardisation and the logistic regression on ``inputs`` (a
        `DetectorInputs`, or bare maps when ``use_scalars`` is off); returns self. The
        strength and calibration are chosen by folds of the training rows: validation rows are
        not read (`actmap.experiments.compare_product.select_plus` chooses among settings on
        them)."""
        from sklearn.decomposition import PCA
        from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
        from sklearn.model_selection import StratifiedKFold

        cfg = self.config or PlusConfig()
        rows = as_inputs(inputs)
        maps, scalars = rows.maps, rows.scalars
        x = flatten_maps(maps)
        y = np.asarray(y)
        if y.shape != (len(x),) or not np.isin(y, (0, 1)).all() or len(np.unique(y)) < 2:
            raise ValueError(f"labels must be {len(x)} values of 0/1 holding both classes")
        y = y.astype(np.int64)
        counts = np.bincount(y, minlength=2)
        if counts.min() < cfg.cv_folds:
            raise ActmapUserError(
                f"actmap-plus v1 chooses its strength and calibration over {cfg.cv_folds} "
                f"stratified folds and needs at least {cfg.cv_folds} rows of each class; got "
                f"{counts[1]} correct and {counts[0]} incorrect"
            )
        k = min(cfg.n_components, len(x) - 1, x.shape[1])
        self.map_shape_ = np.asarray(np.shape(maps)[1:], dtype=np.int64)
        if k > 0:
            pca = PCA(n_components=k, svd_solver="randomized", random_state=cfg.seed).fit(x)
            self.map_mean_ = pca.mean_.astype(np.float32)
            self.components_ = pca.components_.astype(np.float32)
        else:
            self.map_mean_ = np.zeros(x.shape[1], np.float32)
            self.components_ = np.zeros((0, x.shape[1]), np.float32)
        self.config_ = cfg
        raw = self._raw_features(x, scalars)
        self.feature_mean_ = raw.mean(axis=0)
        self.feature_scale_ = np.where(raw.std(axis=0) > 0, raw.std(axis=0), 1.0)
        folds = StratifiedKFold(cfg.cv_folds, shuffle=True, random_state=cfg.seed)
        if cfg.C is not None:
            model = LogisticRegression(C=cfg.C, class_weight=cfg.class_weight, max_iter=5000)
        else:
            model = LogisticRegressionCV(
                Cs=cfg.n_strengths,
                cv=folds,
                scoring="roc_auc",
                class_weight=cfg.class_weight,
                max_iter=5000,
            )
        with warnings.catch_warnings():  # scikit-learn 1.9 announces new defaults; L2 either way
            warnings.simplefilter("ignore", FutureWarning)
            model.fit((raw - self.feature_mean_) / self.feature_scale_, y)
        self.coef_ = np.ravel(model.coef_).astype(np.float64)
        self.intercept_ = float(np.ravel(model.intercept_)[0])
        self.C_ = float(cfg.C if cfg.C is not None else np.ravel(model.C_)[0])
        self.platt_ = (1.0, 0.0)
        if cfg.calibrate:
            features = (raw - self.feature_mean_) / self.feature_scale_
            a, b = platt_on_out_of_fold(features, y, self.C_, cfg.class_weight, folds)
            self.coef_, self.intercept_ = a * self.coef_, a * self.intercept_ + b
            self.platt_ = (a, b)
        self.n_train_ = len(y)
        self.train_prevalence_ = float(y.mean())
        self.calibrated_prevalence_ = 0.5 if cfg.class_weight == "balanced" else float(y.mean())
        self.metadata_: dict[str, Any] = {}
        return self

    # --- scoring -------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not hasattr(self, "coef_"):
            raise NotFittedError("this ActMapPlus is not fitted; call fit() or load()")

    def decision_function(self, inputs: Any, scalars: Any = None) -> np.ndarray:
        """(N,) logits of p(correct) at ``calibrated_prevalence_``; higher = more likely correct.
        ``inputs``: a `DetectorInputs`, or bare maps with ``scalars``."""
        self._check_fitted()
        rows = as_inputs(inputs, scalars)
        return self._features(rows.maps, rows.scalars) @ self.coef_ + self.intercept_

    # --- persistence ---------------------------------------------------------

    def save(self, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """Write model.safetensors (every fitted array) and config.json into ``directory``."""
        self._check_fitted()
        arrays = {
            "map_shape": self.map_shape_,
            "map_mean": self.map_mean_,
            "components": self.components_,
            "feature_mean": self.feature_mean_,
            "feature_scale": self.feature_scale_,
            "coef": self.coef_,
            "intercept": np.array([self.intercept_]),
        }
        fields = {
            "plus_config": asdict(self.config_),
            "scalar_names": list(SCALAR_NAMES) if self.config_.use_scalars else [],
            "C": self.C_,
            "platt": list(self.platt_),
        }
        return self._write(directory, arrays, SCHEMA_VERSION, fields, metadata)

    @classmethod
    def load(cls, directory: str | Path, device: str | None = None) -> ActMapPlus:
        """Restore a saved actmap-plus; it predicts exactly as the one saved (numpy: ``device``
        is not read)."""
        src = Path(directory)
        for name in ("config.json", "model.safetensors"):
            if not (src / name).is_file():
                raise FileNotFoundError(f"{src / name} does not exist")
        cfg = json.loads((src / "config.json").read_text())
        if cfg.get("detector") == NAME and cfg.get("schema_version") == 2:
            raise ValueError(
                f"{src} holds a stacked {NAME} (schema 2): load it with "
                "actmap.detectors.load_detector (every caller in actmap does)"
            )
        if cfg.get("detector") != NAME or cfg.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(
                f"{src / 'config.json'} is not an {NAME} artifact of schema {SCHEMA_VERSION} "
                f"(detector {cfg.get('detector')!r}, schema {cfg.get('schema_version')})"
            )
        arrays = load_file(src / "model.safetensors")
        est = cls(PlusConfig(**cfg["plus_config"]))
        est.config_ = est.config
        est.map_shape_ = arrays["map_shape"]
        est.map_mean_, est.components_ = arrays["map_mean"], arrays["components"]
        est.feature_mean_, est.feature_scale_ = arrays["feature_mean"], arrays["feature_scale"]
        est.coef_, est.intercept_ = arrays["coef"], float(arrays["intercept"][0])
        est.C_, est.platt_ = cfg["C"], tuple(cfg["platt"])
        est._restore_fit_record(cfg)
        return est
