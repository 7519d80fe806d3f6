"""The shift monitor: is this window of maps from the domain the detector was trained on?

`ShiftMonitor(config).fit(maps)` learns the in-domain distribution of the maps'
layer profiles (`actmap.monitor.features`). The fitting rows are split at random
in two parts:

- the *transform* third fixes the feature space: standardisation, PCA to
  ``n_components`` and the Ledoit-Wolf shrinkage covariance (sklearn) of the
  per-map score;
- the *reference* two thirds, never seen by the transform, is what new maps are
  compared with: up to ``n_reference`` of its rows for the window test
  (`actmap.monitor.mmd`: MMD by permutation, exact false-alarm rate), and all of
  its per-map scores as the calibration set of the per-map p-value.

Per map: the squared Mahalanobis distance of its features to the in-domain mean,
and the conformal p-value (1 + #{reference scores >= d}) / (1 + n), uniform for
an in-domain map because the reference rows are exchangeable with it. Per window:
`test_window` gives MMD^2, its permutation p-value and the alarm (p <= alpha).

Learned state ends in ``_``; `save` writes ``model.safetensors`` (arrays) and
``config.json`` (settings, metadata), `load` restores a monitor that scores
exactly as the saved one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.covariance import LedoitWolf
from sklearn.decomposition import PCA
from sklearn.exceptions import NotFittedError

from actmap.artifacts import package_version, write_json
from actmap.atomic import atomic_path
from actmap.errors import ActmapUserError
from actmap.monitor.features import layer_profiles
from actmap.monitor.mmd import PermutationTest, median_bandwidth, mmd_permutation_test

SCHEMA_VERSION = 1  # of config.json next to a saved monitor
MIN_ROWS = 30  # fewest fitting rows: 10 to fix the feature space, 20 to compare with
ARRAYS = (
    "feature_mean_",
    "feature_scale_",
    "components_",
    "location_",
    "precision_",
    "reference_",
    "calibration_scores_",
)


@dataclass(frozen=True)
class MonitorConfig:
    """How a monitor is fitted and when it alarms."""

    alpha: float = 0.05  # false-alarm rate of one window test (alarm when p <= alpha)
    map_alpha: float = 0.01  # a map is flagged when its conformal p-value <= this
    n_components: int = 32  # PCA components of the standardised layer profiles
    n_reference: int = 1000  # reference rows a window is compared with (more: power, time)
    n_permutations: int = 199  # p-value resolution 1 / (B + 1)
    seed: int = 0  # the split of the fitting rows and the permutations

    def __post_init__(self) -> None:
        for name in ("alpha", "map_alpha"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ActmapUserError(f"{name} must lie in (0, 1), got {value}")
        for name in ("n_components", "n_reference", "n_permutations"):
            if getattr(self, name) < 1:
                raise ActmapUserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if (self.n_permutations + 1) * self.alpha < 1:
            raise ActmapUserError(
                f"{self.n_permutations} permutations cannot reach p <= alpha = {self.alpha}; "
                f"use at least {int(np.ceil(1 / self.alpha)) - 1}"
            )

    @classmethod
    def from_dict(cls, data: dict) -> MonitorConfig:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class MapScores:
    """Per-map out-of-domain scores of N maps."""

    distance: np.ndarray  # (N,) squared Mahalanobis distance in the monitor's feature space
    p_value: np.ndarray  # (N,) conformal p-value against the reference rows' distances
    flagged: np.ndarray  # (N,) bool: p_value <= map_alpha


@dataclass(frozen=True)
class WindowTest:
    """One window's two-sample test against the reference."""

    n_maps: int
    statistic: float  # MMD^2
    p_value: float
    alarm: bool  # p_value <= alpha
    map_flagged: float  # fraction of the window's maps flagged one by one

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ShiftMonitor:
    """Window alarms and per-map scores for maps of one domain (see the module docstring).

    Learned state (after `fit` or `load`): ``feature_mean_``, ``feature_scale_``,
    ``components_`` (PCA), ``location_`` and ``precision_`` (shrinkage covariance),
    ``reference_`` (reference features), ``calibration_scores_``, ``bandwidth_``,
    ``shrinkage_``, ``n_fit_`` and ``metadata_``.
    """

    config: MonitorConfig = field(default_factory=MonitorConfig)

    # --- fitting -------------------------------------------------------------------------
    def fit(self, maps: Any, metadata: dict | None = None) -> ShiftMonitor:
        """Learn the in-domain distribution from (N, C, H, W) maps; returns self."""
        profiles = layer_profiles(_as_array(maps))
        if len(profiles) < MIN_ROWS:
            raise ActmapUserError(f"a monitor needs at least {MIN_ROWS} maps, got {len(profiles)}")
        cfg = self.config
        rng = np.random.default_rng(cfg.seed)
        order = rng.permutation(len(profiles))
        cut = len(order) // 3
        transform_rows, reference_rows = np.sort(order[:cut]), np.sort(order[cut:])
        fit_part = profiles[transform_rows]
        self.feature_mean_ = fit_part.mean(axis=0)
        scale = fit_part.std(axis=0)
        self.feature_scale_ = np.where(scale > 1e-12, scale, 1.0)  # constant columns stay 0
        standard = (fit_part - self.feature_mean_) / self.feature_scale_
        k = min(cfg.n_components, standard.shape[1], len(standard) - 1)
        self.components_ = PCA(n_components=k, random_state=cfg.seed).fit(standard).components_
        fit_features = standard @ self.components_.T  # (n_fit, k)
        covariance = LedoitWolf().fit(fit_features)
        self.location_ = covariance.location_
        self.precision_ = covariance.precision_
        self.shrinkage_ = float(covariance.shrinkage_)
        reference = self._project(profiles[reference_rows])  # (n_ref_rows, k)
        self.calibration_scores_ = np.sort(self._distance(reference))
        kept = rng.permutation(len(reference))[: cfg.n_reference]
        self.reference_ = reference[np.sort(kept)]
        self.bandwidth_ = median_bandwidth(self.reference_)
        self.transform_rows_ = transform_rows  # kept in memory only (tests, provenance)
        self.n_fit_ = len(profiles)
        self.metadata_ = dict(metadata or {})
        return self

    # --- scoring -------------------------------------------------------------------------
    def _check_fitted(self) -> None:
        if not hasattr(self, "reference_"):
            raise NotFittedError("this ShiftMonitor is not fitted; call fit() or load()")

    def _project(self, profiles: np.ndarray) -> np.ndarray:
        if profiles.shape[1] != len(self.feature_mean_):
            raise ActmapUserError(
                f"maps give {profiles.shape[1]} layer-profile features, the monitor was "
                f"fitted on maps giving {len(self.feature_mean_)} (another map shape)"
            )
        return ((profiles - self.feature_mean_) / self.feature_scale_) @ self.components_.T

    def _distance(self, features: np.ndarray) -> np.ndarray:
        centred = features - self.location_
        return np.einsum("ij,jk,ik->i", centred, self.precision_, centred)

    def transform(self, maps: Any) -> np.ndarray:
        """(N, C, H, W) maps -> (N, k) features the tests read."""
        self._check_fitted()
        return self._project(layer_profiles(_as_array(maps)))

    def score_maps(self, maps: Any) -> MapScores:
        """Per-map squared Mahalanobis distance, conformal p-value and flag."""
        return self.score_features(self.transform(maps))

    def score_features(self, features: np.ndarray) -> MapScores:
        """`score_maps` on features already given by `transform`."""
        distance = self._distance(features)
        calibration = self.calibration_scores_  # sorted ascending
        at_least = len(calibration) - np.searchsorted(calibration, distance, side="left")
        p_value = (1.0 + at_least) / (1.0 + len(calibration))
        return MapScores(distance, p_value, p_value <= self.config.map_alpha)

    def test_window(self, maps: Any, seed: int | None = None) -> WindowTest:
        """The permutation MMD test of one window of maps against the reference."""
        rng = np.random.default_rng(self.config.seed if seed is None else seed)
        return self.test_features(self.transform(maps), rng)

    def test_features(self, features: np.ndarray, rng: np.random.Generator) -> WindowTest:
        """`test_window` on features already given by `transform`."""
        if len(features) < 2:
            raise ActmapUserError(f"a window needs at least 2 maps, got {len(features)}")
        test: PermutationTest = mmd_permutation_test(
            features, self.reference_, self.bandwidth_, self.config.n_permutations, rng
        )
        return WindowTest(
            n_maps=len(features),
            statistic=test.statistic,
            p_value=test.p_value,
            alarm=test.p_value <= self.config.alpha,
            map_flagged=float(self.score_features(features).flagged.mean()),
        )

    # --- persistence ---------------------------------------------------------------------
    def save(self, directory: str | Path, metadata: dict | None = None) -> Path:
        """Write model.safetensors and config.json into ``directory``; returns it."""
        from safetensors.numpy import save_file

        self._check_fitted()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        arrays = {name: np.ascontiguousarray(getattr(self, name)) for name in ARRAYS}
        with atomic_path(out / "model.safetensors") as tmp:
            save_file(arrays, str(tmp))
        write_json(
            out / "config.json",
            {
                "schema_version": SCHEMA_VERSION,
                "kind": "shift-monitor",
                "actmap_version": package_version(),
                "config": asdict(self.config),
                "bandwidth": self.bandwidth_,
                "shrinkage": self.shrinkage_,
                "n_fit": self.n_fit_,
                "features": "layer profiles: per channel and layer row, mean and std over coordinates",
                "metadata": {**self.metadata_, **(metadata or {})},
            },
        )
        return out

    @classmethod
    def load(cls, directory: str | Path) -> ShiftMonitor:
        """Restore a saved monitor; a damaged folder raises `ActmapUserError` naming the file."""
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        src = Path(directory)
        config_path, weights_path = src / "config.json", src / "model.safetensors"
        for path in (config_path, weights_path):
            if not path.is_file():
                raise ActmapUserError(
                    f"{path} does not exist; is {src} a monitor (`actmap monitor fit`)?"
                )
        try:
            saved = json.loads(config_path.read_text())
            if saved.get("kind") != "shift-monitor":
                raise ActmapUserError(f"{config_path} does not describe a shift monitor")
            if saved.get("schema_version") != SCHEMA_VERSION:
                raise ActmapUserError(
                    f"{config_path} has schema_version {saved.get('schema_version')}, "
                    f"this actmap reads {SCHEMA_VERSION}"
                )
            monitor = cls(MonitorConfig.from_dict(saved["config"]))
            monitor.bandwidth_ = float(saved["bandwidth"])
            monitor.shrinkage_ = float(saved["shrinkage"])
            monitor.n_fit_ = int(saved["n_fit"])
            monitor.metadata_ = dict(saved.get("metadata") or {})
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ActmapUserError(
                f"{config_path} is damaged ({type(error).__name__}: {error})"
            ) from None
        try:
            arrays = load_file(str(weights_path))
        except (SafetensorError, OSError, ValueError) as error:
            raise ActmapUserError(
                f"{weights_path} is not a readable safetensors file ({error})"
            ) from None
        missing = [name for name in ARRAYS if name not in arrays]
        if missing:
            raise ActmapUserError(f"{weights_path} lacks the array(s) {', '.join(missing)}")
        for name in ARRAYS:
            setattr(monitor, name, arrays[name])
        return monitor


def _as_array(maps: Any) -> np.ndarray:
    if hasattr(maps, "detach"):  # a torch tensor
        maps = maps.detach().cpu().numpy()
    if isinstance(maps, list | tuple):
        maps = np.stack([np.asarray(m) for m in maps])
    array = np.asarray(maps)
    if array.ndim != 4:
        raise ActmapUserError(f"maps must have shape (N, C, H, W), got {array.shape}")
    if not np.issubdtype(array.dtype, np.floating):
        raise ActmapUserError(f"maps must be floating point, got dtype {array.dtype}")
    finite = np.isfinite(array.reshape(len(array), -1)).all(axis=1)
    if not finite.all():
        raise ActmapUserError(f"map {int(np.argmin(finite))} has NaN or infinite values")
    return array
