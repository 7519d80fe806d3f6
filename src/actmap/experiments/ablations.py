"""Ablations and controls (paper section "Ablations"): what each part of the map and the
detector buys, on one store's balanced rows, every variant with the same seeds on the same rows.

    run_ablations(store, AblationConfig()) -> AblationResult (to_json, to_markdown)

Map variants are rebuilt from the store's pooled trajectories (`actmap.maps.MapConfig`:
channels, segments, resolution, normalization) and compared with the store's own maps.
The pooling-structure controls (coordinate permutation before pooling, a Gaussian random
projection instead of pooling) and the 256-coordinate resolution need the hidden states
before pooling. Given ``hidden`` (`recapture_hidden`: one teacher-forced pass over each
stored answer at full width, every layer) they are built from those; otherwise from the
stored dense states (ACT-ViT's input: the layer axis max-pooled to 8 groups, the first 100
tokens). Either way they are compared with contiguous pooling of the same states
(``contiguous_pooling``), so only the pooling differs. Classifier
variants read the store's maps; the permuted-label control fits the ActMap detector itself
on shuffled train and validation labels (`PermutedLabelControl`); answer length is the
length-only logistic regression. A variant whose input is missing (no trajectories, no
dense states, a resolution wider than the captured width) is reported unavailable with
the reason, and the others still run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from actmap.baselines.controls import AnswerLengthPredictor, PermutedLabelControl
from actmap.capture import CaptureConfig, capture_answers
from actmap.capture.from_store import read_generations
from actmap.detectors import CorrectnessDetector
from actmap.experiments.common import AurocSummary, SeedScores, auroc_summary, train_seeds
from actmap.experiments.seeds import recipe_config
from actmap.maps import (
    MapConfig,
    build_maps_from_list,
    map_shape,
    pool_hidden,
    saturated_float16,
    stored_form,
)
from actmap.maps.ablations import (
    GROUP_NAMES,
    LAST_TOKEN_CHANNELS,
    gaussian_projection,
    mean_pooled_final_layer,
    permute_coordinates,
    without_group,
)
from actmap.scoring.intervals import N_RESAMPLES
from actmap.store.rows import Rows, balanced_splits

log = logging.getLogger(__name__)

REFERENCE = "full"  # the store's maps with the configured detector
POOLING_REFERENCE = "contiguous_pooling"  # the reference of the pooling-structure controls
CLASSIFIERS = ("logreg", "mlp", "mlp4x", "vit")

# name -> (group, what it changes)
VARIANTS: dict[str, tuple[str, str]] = {
    REFERENCE: ("reference", "the store's 12x32x128 maps"),
    "last_token_channels": ("map", "final and final-window channels only"),
    "mean_pooled_final_layer": ("map", "the mean-pooled final-layer state (128 values)"),
    **{f"without_{g}": ("map", f"channel group '{g}' removed") for g in GROUP_NAMES},
    "segments_1": ("map", "1 segment mean (9 channels)"),
    "segments_8": ("map", "8 segment means (16 channels)"),
    "resolution_16x64": ("map", "16 layer rows x 64 coordinates"),
    "resolution_64x256": ("map", "64 layer rows x 256 coordinates"),
    "global_normalization": ("map", "one mean/std over all channels"),
    POOLING_REFERENCE: ("pooling", "unpooled states, contiguous pooling to 128 (reference)"),
    "coordinate_permutation": ("pooling", "unpooled states, coordinates permuted, then pooled"),
    "gaussian_projection": ("pooling", "unpooled states, Gaussian projection to 128"),
    **{f"classifier_{c}": ("classifier", f"{c} on the store's maps") for c in CLASSIFIERS},
    "permuted_labels": ("control", "the detector fit on permuted train/validation labels"),
    "answer_length": ("control", "logistic regression on the answer's token count"),
}
DEFAULT_VARIANTS = tuple(VARIANTS)

# map variants rebuilt from the pooled trajectories
MAP_CONFIGS: dict[str, MapConfig] = {
    "last_token_channels": MapConfig(channels=LAST_TOKEN_CHANNELS),
    **{f"without_{g}": without_group(MapConfig(), g) for g in GROUP_NAMES},
    "segments_1": MapConfig(n_segments=1),
    "segments_8": MapConfig(n_segments=8),
    "resolution_16x64": MapConfig(layers_out=16, coords_out=64),
    "global_normalization": MapConfig(normalization="global"),
}


@dataclass(frozen=True)
class AblationConfig:
    """The ablation grid; the defaults are the paper's (three seeds, the matched MLP)."""

    detector: str = "mlp"  # trained on every map variant; "vit" is the paper's main detector
    seeds: tuple[int, ...] = (42, 123, 456)  # every variant trains these seeds on the same rows
    max_epochs: int | None = None  # recipe epoch cap (CPU budgets); None = the paper's 80
    vit_max_epochs: int | None = None  # a separate cap for ViT variants; None = max_epochs
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    projection_seed: int = 0  # the fixed coordinate permutation / Gaussian matrix
    n_resamples: int = N_RESAMPLES

    def __post_init__(self) -> None:
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown ablation variants {unknown}; known: {tuple(VARIANTS)}")
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))

    def recipe(self, detector: str):
        cap = self.vit_max_epochs if detector == "vit" and self.vit_max_epochs else self.max_epochs
        return recipe_config(cap)


@dataclass(frozen=True)
class VariantResult:
    """One ablation row: its seed-mean AUROC, interval and paired difference to its reference."""

    name: str
    group: str
    description: str
    status: str  # "done" | "unavailable"
    reason: str = ""
    detector: str | None = None
    map_shape: tuple[int, ...] | None = None
    summary: AurocSummary | None = None
    scores: SeedScores | None = None

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "group": self.group,
            "description": self.description,
            "status": self.status,
            "reason": self.reason,
            "detector": self.detector,
            "map_shape": None if self.map_shape is None else list(self.map_shape),
            "summary": None if self.summary is None else self.summary.to_json(),
            "scores": None if self.scores is None else self.scores.to_json(),
        }


@dataclass(frozen=True)
class AblationResult:
    store: str
    config: AblationConfig
    rows: dict[str, int]  # balanced rows per split
    variants: list[VariantResult] = field(default_factory=list)
    pooling_source: str = "dense"  # "hidden" (teacher-forced, every layer) or "dense" (8 groups)

    def variant(self, name: str) -> VariantResult:
        return next(v for v in self.variants if v.name == name)

    def most_damaging(self) -> VariantResult | None:
        """The map or pooling variant whose paired AUROC difference to its reference is the
        most negative (the claims section reads it with its interval)."""
        ranked = [
            v
            for v in self.variants
            if v.group in ("map", "pooling") and v.summary and v.summary.difference is not None
        ]
        return min(ranked, key=lambda v: v.summary.difference.estimate, default=None)

    def classifier_spread(self) -> dict | None:
        """{classifier: seed-mean AUROC} on the identical maps, and their max - min."""
        found = {
            v.name.removeprefix("classifier_"): v.summary.auroc.estimate
            for v in self.variants
            if v.group == "classifier" and v.summary is not None
        }
        if not found:
            return None
        return {"auroc": found, "spread": max(found.values()) - min(found.values())}

    def to_json(self) -> dict:
        return {
            "store": self.store,
            "config": {**dataclasses.asdict(self.config), "seeds": list(self.config.seeds)},
            "rows": self.rows,
            "pooling_source": self.pooling_source,
            "variants": [v.to_json() for v in self.variants],
        }

    def to_markdown(self) -> str:
        lines = [
            "| variant | group | detector | map | AUROC per seed | mean [95% CI] | "
            "Δ vs reference [95% CI] | n test |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in self.variants:
            if v.summary is None:
                lines.append(
                    f"| {v.name} | {v.group} | {v.detector or ''} | | unavailable: {v.reason} "
                    "| | | |"
                )
                continue
            s = v.summary
            seeds = ", ".join(f"{a:.3f}" for a in s.per_seed)
            shape = "x".join(map(str, v.map_shape)) if v.map_shape else ""
            delta = f"{s.difference} vs {s.reference}" if s.difference is not None else ""
            name = f"{v.name} ({v.reason})" if v.reason else v.name
            lines.append(
                f"| {name} | {v.group} | {v.detector or 'length'} | {shape} | {seeds} | {s.auroc} | "
                f"{delta} | {s.auroc.n} |"
            )
        return "\n".join(lines) + "\n"


class Unavailable(Exception):
    """A variant's input is missing; its message says what to capture."""


# --- inputs ------------------------------------------------------------------------------------


@dataclass
class _Inputs:
    """The balanced rows of one store, read once and shared by every variant."""

    store: object
    ids: dict[str, list[str]]  # split -> balanced ids
    labels: dict[str, np.ndarray]
    n_tokens: dict[str, np.ndarray]
    maps: dict[str, np.ndarray]  # the store's maps
    _arrays: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    hidden_source: str = "dense"  # where the unpooled states come from

    @classmethod
    def read(
        cls, store, hidden: dict[str, np.ndarray] | None = None, splits: dict | None = None
    ) -> _Inputs:

        ids = {s: list(v) for s, v in (splits or balanced_splits(store)).items()}
        empty = [s for s, v in ids.items() if not v]
        if empty:
            raise ValueError(f"{store.root}: the balanced {empty} split(s) are empty")
        labels, n_tokens, maps = {}, {}, {}
        for split, keys in ids.items():
            maps[split], meta = store.load_maps(keys)
            labels[split] = meta["label"].to_numpy(dtype=np.int64)
            n_tokens[split] = meta["n_tokens"].to_numpy(dtype=np.int64)
        inputs = cls(store, ids, labels, n_tokens, maps)
        if hidden is not None:
            missing = [k for keys in ids.values() for k in keys if k not in hidden]
            if missing:
                raise ValueError(f"hidden lacks {len(missing)} balanced rows, e.g. {missing[:2]}")
            inputs._arrays["hidden"] = hidden
            inputs.hidden_source = "hidden"
        return inputs

    def split(self, maps: dict[str, np.ndarray], name: str) -> Rows:
        return Rows(self.ids[name], self.labels[name], maps[name])

    def arrays(self, table: str) -> dict[str, np.ndarray]:
        """{id: array} of a side table (trajectories, dense) for every balanced row."""

        if table not in self._arrays:
            if table == "hidden":
                raise Unavailable("no unpooled states given (see recapture_hidden)")
            if not self.store.has_table(table):
                hint = {"trajectories": "--keep-trajectories", "dense": "--keep-dense"}[table]
                raise Unavailable(f"the store has no {table} (capture with {hint})")
            wanted = [key for keys in self.ids.values() for key in keys]
            self._arrays[table] = self.store.read_arrays(table, wanted)
        return self._arrays[table]

    def rebuilt(self, build: Callable[[list[torch.Tensor]], torch.Tensor], table: str) -> dict:
        """{split: maps} built by ``build`` from the side table's arrays, 128 rows a batch."""
        arrays = self.arrays(table)
        out = {}
        for split, keys in self.ids.items():
            parts = []
            for start in range(0, len(keys), 128):
                batch = [torch.from_numpy(arrays[k].astype(np.float32)) for k in keys[start:][:128]]
                parts.append(stored_form(build(batch)))
            out[split] = np.concatenate(parts)
        return out


# --- the variants ------------------------------------------------------------------------------


def _wide_variant(inputs: _Inputs) -> dict[str, np.ndarray]:
    """64 x 256 maps: the unpooled states pooled to 256 coordinates, then Phi at 64 rows."""
    config = MapConfig(layers_out=64, coords_out=256)
    if inputs.hidden_source != "hidden":
        raise Unavailable(
            "256 coordinates exceed the captured width D'=128 (give recapture_hidden's "
            "states, or re-capture with pooled_dim=256)"
        )
    return inputs.rebuilt(
        lambda batch: build_maps_from_list([pool_hidden(x, 256) for x in batch], config), "hidden"
    )


def _map_variant(inputs: _Inputs, name: str) -> dict[str, np.ndarray]:
    config = MAP_CONFIGS[name]
    arrays = inputs.arrays("trajectories")
    width = next(iter(arrays.values())).shape[-1]
    if config.coords_out > width:
        raise Unavailable(
            f"{config.coords_out} coordinates exceed the captured width D'={width} "
            f"(re-capture with pooled_dim={config.coords_out})"
        )
    return inputs.rebuilt(lambda batch: build_maps_from_list(batch, config), "trajectories")


def _final_layer_variant(inputs: _Inputs) -> dict[str, np.ndarray]:
    """(N, 1, 1, D') vectors, each coordinate standardised with the train rows' mean and std."""

    def build(batch):
        return torch.stack([mean_pooled_final_layer(t) for t in batch])[:, None, None, :]

    vectors = inputs.rebuilt(build, "trajectories")
    train = vectors["train"].astype(np.float32)
    mean, std = train.mean(axis=0), np.maximum(train.std(axis=0), 1e-6)
    return {s: ((v.astype(np.float32) - mean) / std).astype(np.float16) for s, v in vectors.items()}


def pooling_transform(name: str, seed: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """Dense states (..., D) -> (..., 128): contiguous pooling, pooling after a fixed coordinate
    permutation, or a fixed Gaussian projection."""
    if name == POOLING_REFERENCE:
        return lambda x: pool_hidden(x, 128)
    if name == "coordinate_permutation":
        return lambda x: pool_hidden(permute_coordinates(x, seed), 128)
    if name == "gaussian_projection":
        return lambda x: gaussian_projection(x, 128, seed)
    raise ValueError(f"unknown pooling control {name!r}")


def _pooling_variant(inputs: _Inputs, name: str, seed: int) -> dict[str, np.ndarray]:
    transform = pooling_transform(name, seed)
    return inputs.rebuilt(
        lambda batch: build_maps_from_list([transform(x) for x in batch]), inputs.hidden_source
    )


def _permuted_labels(inputs: _Inputs, config: AblationConfig) -> SeedScores:

    maps = inputs.maps
    confidence, logits = [], []
    for seed in config.seeds:
        detector = CorrectnessDetector(
            config.detector, config=config.recipe(config.detector), seed=seed
        )
        control = PermutedLabelControl(detector, seed=seed).fit(
            maps["train"], inputs.labels["train"], maps["validation"], inputs.labels["validation"]
        )
        result = control.score(maps["test"])
        confidence.append(result.confidence)
        logits.append(result.raw)
    return SeedScores(
        "permuted_labels",
        inputs.labels["test"],
        np.stack(confidence),
        config.seeds,
        True,
        np.stack(logits),
    )


def _answer_length(inputs: _Inputs) -> SeedScores:

    def rows(split):
        return [SimpleNamespace(n_tokens=int(n)) for n in inputs.n_tokens[split]]

    scorer = AnswerLengthPredictor().fit(rows("train"), inputs.labels["train"])
    p = scorer.score(rows("test")).confidence
    return SeedScores("answer_length", inputs.labels["test"], p[None], (0,), True)


def _variant_maps(inputs: _Inputs, name: str, config: AblationConfig) -> dict[str, np.ndarray]:
    if name in MAP_CONFIGS:
        return _map_variant(inputs, name)
    if name == "resolution_64x256":
        return _wide_variant(inputs)
    if name == "mean_pooled_final_layer":
        return _final_layer_variant(inputs)
    if VARIANTS[name][0] == "pooling":
        return _pooling_variant(inputs, name, config.projection_seed)
    return inputs.maps  # the reference and the classifiers read the store's maps


def _detector_of(name: str, config: AblationConfig) -> str | None:
    if name.startswith("classifier_"):
        return name.removeprefix("classifier_")
    return None if name == "answer_length" else config.detector


def _reference_of(name: str) -> str | None:
    group = VARIANTS[name][0]
    if name in (REFERENCE, POOLING_REFERENCE):
        return None
    return POOLING_REFERENCE if group == "pooling" else REFERENCE


def _scores(
    inputs: _Inputs, name: str, config: AblationConfig, done: dict, known: Mapping
) -> SeedScores:
    detector = _detector_of(name, config)
    if name in known:  # the same fits made elsewhere (an `actmap train` run): not retrained
        return dataclasses.replace(known[name], method=name)
    if name == "answer_length":
        return _answer_length(inputs)
    if name == "permuted_labels":
        return _permuted_labels(inputs, config)
    if name == f"classifier_{config.detector}" and REFERENCE in done:
        return dataclasses.replace(done[REFERENCE], method=name)  # the same fits; not retrained
    maps = _variant_maps(inputs, name, config)
    return train_seeds(
        inputs.split(maps, "train"),
        inputs.split(maps, "validation"),
        inputs.split(maps, "test"),
        detector,
        config.seeds,
        config.recipe(detector),
        method=name,
    )


def variant_map_shape(name: str, config: AblationConfig) -> tuple[int, ...] | None:
    if name in MAP_CONFIGS:
        return map_shape(MAP_CONFIGS[name])
    if name == "resolution_64x256":
        return (12, 64, 256)
    if name == "mean_pooled_final_layer":
        return (1, 1, 128)
    return None if name == "answer_length" else map_shape()


def run_ablations(
    store,
    config: AblationConfig = AblationConfig(),
    progress: Callable[[str], None] | None = None,
    hidden: dict[str, np.ndarray] | None = None,
    on_result: Callable[[VariantResult], None] | None = None,
    splits: dict[str, list[str]] | None = None,
    known: Mapping[str, SeedScores] | None = None,
) -> AblationResult:
    """Every variant of ``config`` on ``store``'s balanced rows; references run first.

    ``hidden``: {id: (L, T, D) unpooled states} of every balanced row (`recapture_hidden`)
    for the pooling controls and the 256-coordinate maps; without it they read the dense
    states (or are unavailable). ``on_result`` receives each variant's result as it is done
    (a long run can keep what it finished). ``splits``: the balanced {split: ids} to use
    (default `actmap.store.rows.balanced_splits(store)`, which records them in the store).
    ``known``: {variant: test scores} of variants already trained elsewhere on the same
    rows with the same detector, recipe and seeds (the reference and classifier variants
    are `actmap train` runs on the store's maps); they are used instead of training again.
    """
    inputs = _Inputs.read(store, hidden, splits)
    known = known or {}
    order = sorted(config.variants, key=lambda v: v not in (REFERENCE, POOLING_REFERENCE))
    done: dict[str, SeedScores] = {}
    results = {}
    for name in order:
        group, description = VARIANTS[name]
        detector = _detector_of(name, config)
        if progress is not None:
            progress(name)
        try:
            scores = _scores(inputs, name, config, done, known)
        except Unavailable as reason:
            log.info("ablation %s unavailable: %s", name, reason)
            results[name] = VariantResult(name, group, description, "unavailable", str(reason))
            if on_result is not None:
                on_result(results[name])
            continue
        done[name] = scores
        reference = done.get(_reference_of(name)) if _reference_of(name) else None
        summary = auroc_summary(scores, reference, config.n_resamples)
        results[name] = VariantResult(
            name,
            group,
            description,
            "done",
            _note(name, reference, known),
            detector,
            variant_map_shape(name, config),
            summary,
            scores,
        )
        log.info("ablation %s: AUROC %s", name, summary.auroc)
        if on_result is not None:
            on_result(results[name])
    rows = {s: len(v) for s, v in inputs.ids.items()}
    return AblationResult(
        str(store.root),
        config,
        rows,
        [results[n] for n in config.variants if n in results],
        inputs.hidden_source,
    )


READ_NOTE = "read: the same fit made elsewhere (not retrained)"


def _note(name: str, reference, known: Mapping) -> str:
    notes = [READ_NOTE] if name in known else []
    if reference is None and _reference_of(name) is not None:
        notes.append("reference missing")
    return "; ".join(notes)


def seed_means(result: AblationResult, names: Sequence[str] | None = None) -> dict[str, float]:
    """{variant: seed-mean AUROC} of the variants that ran (for plots and claims)."""
    return {
        v.name: v.summary.auroc.estimate
        for v in result.variants
        if v.summary is not None and (names is None or v.name in names)
    }


def recapture_hidden(
    store, ids: Sequence[str], model, tokenizer, batch_size: int = 16, progress=None
) -> dict[str, np.ndarray]:
    """{id: (L, T, D) float16} unpooled states of the stored answers ``ids``: one
    teacher-forced pass each (`actmap.capture.capture_answers`, the capture's alignment)
    with the pooled width set to the hidden size D, where pooling is the identity.

    ``model`` must be the store's generator; contiguous pooling of these states to 128
    gives the store's trajectories again (to float rounding).
    """
    import dataclasses as dc

    generations = read_generations(store, list(ids))
    text_config = getattr(model.config, "text_config", model.config)
    stored = store.manifest.get("config", {}).get("capture", {})
    known = {f.name for f in dc.fields(CaptureConfig)}
    config = dc.replace(
        CaptureConfig(**{k: v for k, v in stored.items() if k in known}),
        pooled_dim=int(text_config.hidden_size),
        greybox=False,
        attention_keys=0,
        keep_dense=False,
        batch_size=batch_size,
    )
    records = capture_answers(
        model,
        tokenizer,
        [g.prompt for g in generations],
        [g.token_ids for g in generations],
        config,
        progress=progress,
    )
    return {
        key: saturated_float16(r.trajectory).numpy() for key, r in zip(ids, records, strict=True)
    }


def with_scores(
    result: AblationResult, name: str, scores: SeedScores, note: str = ""
) -> AblationResult:
    """``result`` with the variant ``name`` taken from scores computed elsewhere on the same
    test rows (e.g. the ViT of an `actmap train` run), compared with its reference."""
    group, description = VARIANTS[name]
    reference = next(
        (v.scores for v in result.variants if v.name == _reference_of(name) and v.scores), None
    )
    summary = auroc_summary(scores, reference, result.config.n_resamples)
    variant = VariantResult(
        name,
        group,
        description,
        "done",
        note,
        _detector_of(name, result.config),
        variant_map_shape(name, result.config),
        summary,
        scores,
    )
    kept = [v for v in result.variants if v.name != name]
    return dataclasses.replace(result, variants=[*kept, variant])
