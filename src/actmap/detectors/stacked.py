"""actmap-plus, version 2: one stacked detector over every signal of the single pass.

Candidate blocks, each a standardised L2 logistic regression on one kind of input:

    map                 the map's first principal components (actmap-plus v1's input)
    scalars             the six per-answer scalars (`actmap.capture.answer_scalars`)
    probe:<position>    the full-width state at one named position (`actmap.capture.positions`),
                        at the layer chosen on validation
    lookback            per head, the mean attention to the previous answer token and to the
                        K previous answer tokens (Lookback-Lens-like; needs attention weights)
    rauq                RAUQ's confidence (needs attention weights)
    tad                 TAD's confidence (needs attention weights; TAD is trained itself)

Each block is fit on the training rows; its out-of-fold logits on those rows (stratified
folds, `out_of_fold_logits`) train a logistic regression that stacks them. Every choice is made
on validation rows only: each probe's layer, each block's L2 strength, and which blocks enter
the stack (greedy forward selection by validation AUROC).

With few correct training answers (GSM8K on the small generators: 17-33) a stack of 576- to
1,536-wide probes is noise, and one logistic regression on the map's components and the
scalars together (``map+scalars``, actmap-plus v1's early fusion) ranks better. So that block
is fit as well, outside the stack, and replaces the stack when its validation AUROC is higher
(``StackConfig.fallback``; the choice is in ``validation_["fallback"]``). Two presets:

    deployable   map, scalars, probes: what any engine gives (vLLM included), no attention
    full         everything, attention weights included

The artifact is actmap-plus's: ``model.safetensors`` (every fitted array) + ``config.json``
(``detector: actmap-plus``, ``schema_version: 2``), loaded by `StackedPlus.load` (and by
`actmap.detectors.load_detector`, which opens every kind). RAUQ's and TAD's formulas come from
`actmap.signals`, the low room the baselines read them from too. Registered as
``actmap-plus:deployable`` and ``actmap-plus:full`` (`actmap.detectors.catalog`).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from actmap.capture.needs import needs_of
from actmap.capture.positions import POSITION_NAMES
from actmap.detectors.inputs import DetectorInputs, as_inputs
from actmap.detectors.plus import PriorShifted
from actmap.scoring import metrics
from actmap.signals.rauq import RAUQ
from actmap.signals.tad import TAD

log = logging.getLogger(__name__)

NAME = "actmap-plus"
SCHEMA_VERSION = 2
ATTENTION_BLOCKS = ("lookback", "rauq", "tad")
PROBES = tuple(f"probe:{p}" for p in POSITION_NAMES)
FALLBACK = "map+scalars"  # one regression on the map's components and the scalars (v1's input)
PRESETS = {
    "deployable": ("map", "scalars", *PROBES),
    "full": ("map", "scalars", *PROBES, *ATTENTION_BLOCKS),
}
STRENGTHS = (1e-3, 1e-2, 1e-1, 1.0)  # inverse L2 strengths tried per block on validation
LAYER_SEARCH_C = 1e-2  # a probe's layer is chosen at this strength, then its C


@dataclass(frozen=True)
class StackConfig:
    """Settings of one stacked fit."""

    preset: str = "full"  # "deployable" (no attention weights) | "full"
    map_components: int = 64  # principal components of the map block
    folds: int = 5  # stratified folds of the out-of-fold logits
    seed: int = 0
    class_weight: str | None = "balanced"  # every logistic regression; "balanced" -> p at 0.5
    # "all": every block of the preset enters the stack (its weights are fit on the training
    # rows' out-of-fold logits); "greedy": forward selection by validation AUROC
    selection: str = "all"
    min_gain: float = 0.002  # greedy: validation AUROC a block must add to enter the stack
    tad_previous: int = 10  # K of TAD and of the lookback block
    # fit the map+scalars block beside the stack; it replaces the stack when its validation
    # AUROC is higher (few correct training answers)
    fallback: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.selection not in ("all", "greedy"):
            raise ValueError(f"selection must be 'all' or 'greedy', got {self.selection!r}")


# --- features of each block ---------------------------------------------------------------------


def lookback_features(generations: Sequence, keys: int) -> np.ndarray:
    """(N, 2 * L * H): per head, the mean over answer steps t >= 1 of the attention to the
    previous answer token, then of the summed attention to the ``keys`` previous ones."""
    rows = []
    for g in generations:
        if g.attention is None:
            raise ValueError(
                "the lookback block needs attention weights (capture --attention-keys)"
            )
        a = np.asarray(g.attention, dtype=np.float64)  # (T, L, H, K)
        steps = a[1:] if len(a) > 1 else np.zeros((1, *a.shape[1:]))
        rows.append(
            np.concatenate(
                [steps[..., 0].mean(0).ravel(), steps[..., :keys].sum(-1).mean(0).ravel()]
            )
        )
    return np.stack(rows)


def rauq_confidences(generations: Sequence) -> np.ndarray:
    return np.asarray(RAUQ().score(generations).confidence, dtype=np.float64).reshape(-1, 1)


def _tad(keys: int, **choices):
    return TAD(n_previous=keys, **choices)


def tad_confidences(tad, generations: Sequence) -> np.ndarray:
    return np.asarray(tad.score(generations).confidence, dtype=np.float64).reshape(-1, 1)


def flat_maps(maps: np.ndarray) -> np.ndarray:
    x = np.asarray(maps, dtype=np.float32)
    return x.reshape(len(x), -1)


def position_slice(rows: DetectorInputs, position: str, layer: int) -> np.ndarray:
    if rows.positions is None:
        raise ValueError(
            "the probe blocks read position states; capture with --keep-positions "
            "(or add them with scripts/add_positions.py)"
        )
    return np.asarray(rows.positions[:, POSITION_NAMES.index(position), layer], dtype=np.float64)


# --- one block: standardised L2 logistic regression ----------------------------------------------


def _logreg(C: float, class_weight):
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=C, class_weight=class_weight, max_iter=5000)


def out_of_fold_logits(
    x: np.ndarray, y: np.ndarray, C: float, class_weight, folds, sample_weight=None
) -> np.ndarray:
    """(N,) logits of a standardised L2 logistic regression, each row scored by the model fit
    on the folds without it (sklearn's cross_val_predict over ``folds``; ``sample_weight``,
    when given, weighs each fold's fit)."""
    from sklearn.model_selection import cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    model = make_pipeline(StandardScaler(), _logreg(C, class_weight))
    params = {} if sample_weight is None else {"logisticregression__sample_weight": sample_weight}
    return cross_val_predict(model, x, y, cv=folds, method="decision_function", params=params)


@dataclass
class LinearBlock:
    """Learned state of one block: standardisation, coefficients, its choices."""

    name: str
    C: float
    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    intercept: float
    choices: dict[str, Any] = field(default_factory=dict)  # layer, position, PCA size ...

    @classmethod
    def fit(
        cls, name: str, x: np.ndarray, y: np.ndarray, C: float, class_weight,
        sample_weight=None, **choices,
    ):  # fmt: skip
        mean, scale = x.mean(0), x.std(0)
        scale = np.where(scale > 0, scale, 1.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = _logreg(C, class_weight).fit((x - mean) / scale, y, sample_weight)
        return cls(
            name, C, mean, scale, model.coef_.ravel().copy(), float(model.intercept_[0]), choices
        )

    def logits(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.mean) / self.scale) @ self.coef + self.intercept


class StackedPlus(PriorShifted):
    """actmap-plus v2: blocks fit on training rows, stacked on their out-of-fold logits.

    Learned state: ``blocks_`` (name -> `LinearBlock`), ``pca_`` (map mean and components),
    ``tad_`` (the fitted TAD, full preset), ``selected_`` (blocks in the stack, in order),
    ``meta_`` (the stacking `LinearBlock`), ``validation_`` (every choice's validation AUROC),
    ``calibrated_prevalence_``, ``n_train_``, ``metadata_``.
    """

    name = NAME
    schema_version = SCHEMA_VERSION

    def __init__(self, config: StackConfig | None = None) -> None:
        self.config = config or StackConfig()

    # --- which inputs ----------------------------------------------------------------------

    @property
    def requires(self) -> tuple[str, ...]:
        """What a row must carry: "maps", "scalars", "positions", "attention"."""
        used = getattr(self, "selected_", PRESETS[self.config.preset])
        need = ["maps"]
        if "scalars" in used or FALLBACK in used:
            need.append("scalars")
        if any(b.startswith("probe:") for b in used):
            need.append("positions")
        if any(b in ATTENTION_BLOCKS for b in used):
            need.append("attention")
        return tuple(need)

    @property
    def kind(self) -> str:
        """The name its artifact and served answers record (``detector`` in config.json)."""
        return NAME

    def capture_needs(self) -> dict:
        """`CaptureConfig` fields a capture pass needs for it (`actmap.capture.needs.needs_of`)."""
        return needs_of(self.requires, self.config.tad_previous, lookback=True)

    def _features(self, block: str, rows: DetectorInputs, layer: int | None = None) -> np.ndarray:
        if block == "map":
            return (flat_maps(rows.maps) - self.pca_[0]) @ self.pca_[1].T
        if block in ("scalars", FALLBACK):
            if rows.scalars is None:
                raise ValueError(
                    f"the {block} block needs the per-answer scalars (grey-box capture)"
                )
            scalars = np.asarray(rows.scalars, dtype=np.float64)
            if block == FALLBACK:
                return np.hstack([self._features("map", rows), scalars])
            return scalars
        if block.startswith("probe:"):
            if layer is None:
                layer = self.blocks_[block].choices["layer"]
            return position_slice(rows, block.split(":", 1)[1], layer)
        if rows.generations is None:
            raise ValueError(f"the {block} block needs the generations with attention weights")
        if block == "lookback":
            return lookback_features(rows.generations, self.config.tad_previous)
        if block == "rauq":
            return rauq_confidences(rows.generations)
        if block == "tad":
            return tad_confidences(self.tad_, rows.generations)
        raise ValueError(f"unknown block {block!r}")

    # --- fitting ---------------------------------------------------------------------------

    def fit(
        self, inputs: Any, y: Any, val_inputs: Any, y_val: Any, sample_weight: Any = None
    ) -> StackedPlus:
        """Fit every block of the preset on ``train``, choose on ``val``, stack; returns self.

        ``sample_weight`` (N,) weighs the training rows in every logistic regression (the
        blocks, their out-of-fold logits and the stack; not the map's PCA or TAD's Ridge): a
        generalist over several tasks gives each task the same total weight
        (`actmap.experiments.generalist`)."""
        from sklearn.decomposition import PCA
        from sklearn.model_selection import StratifiedKFold

        train, val = as_inputs(inputs), as_inputs(val_inputs)
        cfg = self.config
        if train.generations and train.generations[0].attention is not None:
            stored = int(train.generations[0].attention.shape[-1])  # K the capture kept
            if stored < cfg.tad_previous:
                log.warning("TAD and lookback read K=%d previous tokens (stored)", stored)
                cfg = self.config = replace(cfg, tad_previous=stored)
        y, y_val = _labels(y, len(train)), _labels(y_val, len(val))
        w = self.w_ = _weights(sample_weight, len(y))
        # fewer folds when a class has fewer training rows than folds (a small task)
        n_folds = int(min(cfg.folds, np.bincount(y, minlength=2).min()))
        if n_folds < 2:
            raise ValueError("the stack's out-of-fold logits need 2 training rows of each class")
        folds = StratifiedKFold(n_folds, shuffle=True, random_state=cfg.seed)
        weight = cfg.class_weight
        x_map = flat_maps(train.maps)
        k = min(cfg.map_components, len(x_map) - 1, x_map.shape[1])
        pca = PCA(n_components=k, svd_solver="randomized", random_state=cfg.seed).fit(x_map)
        self.pca_ = (pca.mean_.astype(np.float32), pca.components_.astype(np.float32))
        self.blocks_, self.validation_, self.tad_ = {}, {}, None
        oof, val_logits = {}, {}
        available = [b for b in PRESETS[cfg.preset] if self._has_inputs(b, train)]
        if cfg.fallback and self._has_inputs(FALLBACK, train):
            available.append(FALLBACK)
        for block in available:
            if block == "tad":
                self._fit_tad(train, y, val, y_val, folds)
            layer = (
                self._choose_layer(block, train, y, val, y_val)
                if block.startswith("probe:")
                else None
            )
            x = self.tad_oof_ if block == "tad" else self._features(block, train, layer)
            xv = self._features(block, val, layer)
            best = max(
                STRENGTHS,
                key=lambda C: metrics.auroc(
                    LinearBlock.fit(block, x, y, C, weight, w).logits(xv), y_val
                ),
            )
            fitted = LinearBlock.fit(block, x, y, best, weight, w)
            if layer is not None:
                fitted.choices.update(layer=layer, position=block.split(":", 1)[1])
            self.blocks_[block] = fitted
            val_logits[block] = fitted.logits(xv)
            oof[block] = out_of_fold_logits(x, y, best, weight, folds, w)
            self.validation_[block] = metrics.auroc(val_logits[block], y_val)
            log.info("block %s: validation AUROC %.4f (C=%g)", block, self.validation_[block], best)
        # kept in memory (not saved): `restricted` re-stacks a subset without refitting blocks
        self.oof_, self.val_logits_, self.y_, self.y_val_ = oof, val_logits, y, y_val
        self.all_blocks_, self.all_tad_ = dict(self.blocks_), self.tad_
        self._finish([b for b in oof if b != FALLBACK])
        self.n_train_ = len(y)
        self.train_prevalence_ = float(np.average(y, weights=w))
        self.calibrated_prevalence_ = 0.5 if weight == "balanced" else self.train_prevalence_
        self.metadata_: dict[str, Any] = {}
        return self

    def _has_inputs(self, block: str, rows: DetectorInputs) -> bool:
        if block in ("scalars", FALLBACK):
            return rows.scalars is not None
        if block.startswith("probe:"):
            return rows.positions is not None
        if block in ATTENTION_BLOCKS:
            gens = rows.generations
            return gens is not None and all(g.attention is not None for g in gens)
        return True

    def _choose_layer(self, block, train, y, val, y_val) -> int:
        n_layers = train.positions.shape[2]
        aucs = [
            metrics.auroc(
                LinearBlock.fit(block, self._features(block, train, layer), y, LAYER_SEARCH_C,
                                self.config.class_weight, self.w_,
                                ).logits(self._features(block, val, layer)),
                y_val,
            )
            for layer in range(n_layers)
        ]  # fmt: skip
        self.validation_[f"{block} layers"] = [round(a, 4) for a in aucs]
        return int(np.argmax(aucs))

    def _fit_tad(self, train, y, val, y_val, folds) -> None:
        """TAD with its choices made on validation; its out-of-fold confidences on training rows
        come from refits (same choices) on the folds without each row."""
        gens = train.generations
        tad = _tad(self.config.tad_previous).fit(gens, y, val.generations, y_val)
        self.tad_ = tad
        oof = np.zeros((len(gens), 1))
        for fit_idx, held in folds.split(np.zeros(len(y)), y):
            part = tad.fixed_choices().fit([gens[i] for i in fit_idx], y[fit_idx])
            oof[held] = tad_confidences(part, [gens[i] for i in held])
        self.tad_oof_ = oof

    def _stack(self, logits: dict[str, np.ndarray], blocks: Sequence[str]) -> np.ndarray:
        return np.column_stack([logits[b] for b in blocks])

    def _finish(self, candidates: list[str]) -> None:
        """Choose the stacked blocks among ``candidates`` and fit the stack; the map+scalars
        block alone takes the stack's place when its validation AUROC is higher."""
        oof = {b: self.oof_[b] for b in candidates}
        val = {b: self.val_logits_[b] for b in candidates}
        if self.config.selection == "greedy":
            self.selected_ = self._select(oof, val, self.y_, self.y_val_)
        else:
            self.selected_ = list(candidates)
        self.meta_ = self._meta(oof, self.y_)
        self.validation_["stack"] = metrics.auroc(
            self.meta_.logits(self._stack(val, self.selected_)), self.y_val_
        )
        fallback = self.validation_.get(FALLBACK, -np.inf)
        self.validation_["fallback"] = bool(fallback > self.validation_["stack"])
        if self.validation_["fallback"]:
            log.info(
                "the %s block (validation AUROC %.4f) replaces the stack (%.4f)",
                FALLBACK, fallback, self.validation_["stack"],
            )  # fmt: skip
            self.selected_ = [FALLBACK]
            self.meta_ = self._meta(self.oof_, self.y_)
        self.blocks_ = {b: self.blocks_[b] for b in self.selected_}
        if "tad" not in self.selected_:
            self.tad_ = None

    def restricted(self, preset: str) -> StackedPlus:
        """This fit re-stacked on ``preset``'s blocks only (no block is refit): the deployable
        preset of a full fit, the same as fitting it alone."""
        import copy

        if not hasattr(self, "oof_"):
            raise ValueError("restricted() needs a fit of this session (out-of-fold logits)")
        other = copy.copy(self)
        other.config = replace(self.config, preset=preset)
        other.validation_ = {k: v for k, v in self.validation_.items() if not k.startswith("stack")}
        other.blocks_, other.tad_ = dict(self.all_blocks_), self.all_tad_
        other._finish([b for b in self.oof_ if b in PRESETS[preset]])
        return other

    def _meta(self, oof: dict[str, np.ndarray], y: np.ndarray, blocks=None) -> LinearBlock:
        blocks = list(self.selected_ if blocks is None else blocks)
        return LinearBlock.fit(
            "stack", self._stack(oof, blocks), y, 1.0, self.config.class_weight, self.w_
        )

    def _select(self, oof, val_logits, y, y_val) -> list[str]:
        """Greedy forward selection: add the block that most raises the stack's validation
        AUROC, while it adds at least ``min_gain``."""
        chosen: list[str] = []
        best = -np.inf
        while True:
            trials = {
                b: metrics.auroc(
                    self._meta(oof, y, chosen + [b]).logits(self._stack(val_logits, chosen + [b])),
                    y_val,
                )
                for b in oof
                if b not in chosen
            }
            if not trials:
                break
            block = max(trials, key=trials.get)
            if chosen and trials[block] < best + self.config.min_gain:
                break
            chosen.append(block)
            best = trials[block]
            self.validation_[f"stack+{block}"] = best
        return chosen

    # --- scoring ---------------------------------------------------------------------------

    def decision_function(self, inputs: Any, scalars: Any = None) -> np.ndarray:
        """(N,) logits at ``calibrated_prevalence_``; higher = more likely correct. ``inputs``:
        a `DetectorInputs` holding what ``requires`` names (bare maps with ``scalars`` score
        the map+scalars block alone)."""
        if not hasattr(self, "meta_"):
            from sklearn.exceptions import NotFittedError

            raise NotFittedError("this StackedPlus is not fitted; call fit() or load()")
        rows = as_inputs(inputs, scalars)
        logits = {b: self.blocks_[b].logits(self._features(b, rows)) for b in self.selected_}
        return self.meta_.logits(self._stack(logits, self.selected_))

    # --- persistence -----------------------------------------------------------------------

    def save(self, directory: str | Path, metadata: dict[str, Any] | None = None) -> Path:
        """Write model.safetensors (every fitted array) and config.json into ``directory``."""
        arrays = {"pca.mean": self.pca_[0], "pca.components": self.pca_[1]}
        blocks = {}
        for name, b in [*self.blocks_.items(), ("stack", self.meta_)]:
            arrays.update(
                {f"{name}.mean": b.mean, f"{name}.scale": b.scale, f"{name}.coef": b.coef}
            )
            blocks[name] = {"C": b.C, "intercept": b.intercept, "choices": b.choices}
        tad = None
        if self.tad_ is not None:
            # the Ridge's own dtypes (float32 features): the loaded TAD scores to the bit
            arrays["tad.ridge_coef"] = np.asarray(self.tad_.model_.coef_)
            arrays["tad.ridge_intercept"] = np.atleast_1d(np.asarray(self.tad_.model_.intercept_))
            tad = {
                "n_previous": self.tad_.n_previous,
                "alpha": self.tad_.alpha_,
                "stage1_alpha": self.tad_.stage1_alpha_,
                "aggregation": self.tad_.aggregation_,
                "ridge_intercept": float(self.tad_.model_.intercept_),
                "n_features_in": int(self.tad_.n_features_in_),
            }
        fields = {
            "stack_config": asdict(self.config),
            "requires": list(self.requires),
            "selected": self.selected_,
            "blocks": blocks,
            "tad": tad,
            "validation": self.validation_,
        }
        return self._write(directory, arrays, SCHEMA_VERSION, fields, metadata)

    @classmethod
    def load(cls, directory: str | Path, device: str | None = None) -> StackedPlus:
        """Restore a saved stacked actmap-plus; it scores exactly as the one saved (numpy:
        ``device`` is not read)."""
        from safetensors.numpy import load_file

        src = Path(directory)
        cfg = _read_config(src)
        if cfg.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{src / 'config.json'} is not a stacked {NAME} (schema 2)")
        arrays = load_file(src / "model.safetensors")
        est = cls(StackConfig(**cfg["stack_config"]))
        est.pca_ = (arrays["pca.mean"], arrays["pca.components"])

        def block(name: str) -> LinearBlock:
            b = cfg["blocks"][name]
            return LinearBlock(
                name, b["C"], arrays[f"{name}.mean"], arrays[f"{name}.scale"],
                arrays[f"{name}.coef"], b["intercept"], b["choices"],
            )  # fmt: skip

        est.selected_ = list(cfg["selected"])
        est.blocks_ = {name: block(name) for name in est.selected_}
        est.meta_ = block("stack")
        est.tad_ = None
        if cfg.get("tad"):
            t = cfg["tad"]
            est.tad_ = _tad(t["n_previous"], alpha=t["alpha"], aggregation=t["aggregation"],
                            stage1_alpha=t["stage1_alpha"])  # fmt: skip
            est.tad_.model_ = SimpleNamespace(
                coef_=arrays["tad.ridge_coef"], intercept_=arrays["tad.ridge_intercept"][0]
            )
            est.tad_.alpha_, est.tad_.aggregation_ = t["alpha"], t["aggregation"]
            est.tad_.stage1_alpha_, est.tad_.n_features_in_ = t["stage1_alpha"], t["n_features_in"]
        est.validation_ = cfg.get("validation", {})
        est._restore_fit_record(cfg)
        return est


def _labels(y: Any, n: int) -> np.ndarray:
    y = np.asarray(y)
    if y.shape != (n,) or not np.isin(y, (0, 1)).all() or len(np.unique(y)) < 2:
        raise ValueError(f"labels must be {n} values of 0/1 holding both classes")
    return y.astype(np.int64)


def _weights(sample_weight: Any, n: int) -> np.ndarray | None:
    if sample_weight is None:
        return None
    w = np.asarray(sample_weight, dtype=np.float64)
    if w.shape != (n,) or not np.isfinite(w).all() or (w <= 0).any():
        raise ValueError(f"sample_weight must be {n} finite positive values")
    return w


def _read_config(src: Path) -> dict:
    for name in ("config.json", "model.safetensors"):
        if not (src / name).is_file():
            raise FileNotFoundError(f"{src / name} does not exist")
    return json.loads((src / "config.json").read_text())
