"""Computational cost (paper: "Computational Cost"): capture overhead, bytes, scoring, training.

    time_scoring(model, inputs, repeats)     -> ScoringCost   (median latency, peak memory)
    detector_scoring_costs(...)              -> ActMap detectors and ACT-ViT at one batch size
    storage_costs(store)                     -> bytes per map / pooled trajectory / ACT-ViT tensor
    training_costs(runs)                     -> training seconds per seed, from run histories
    capture_overhead(model, tokenizer, ...)  -> `actmap.capture.overhead.Overhead` (hooked/plain)

`benchmarks/bench_scoring.py` prints the same timings beside their references.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actmap.baselines.actvit import LAYER_GROUPS, N_MAX, ACTViT, ACTViTConfig, tensor_nbytes
from actmap.capture.overhead import measure_overhead
from actmap.capture.records import CaptureConfig
from actmap.detectors import create_detector
from actmap.maps import MAP_BYTES, MAP_SHAPE
from actmap.training.run_folder import method_name, read_run


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class ScoringCost:
    name: str
    batch: int
    repeats: int
    ms_per_map: float  # median over repeats of one batch's time, per map
    maps_per_s: float
    peak_mib: float | None  # CUDA peak allocated during scoring; None on CPU (not tracked)
    device: str
    budget_s: float | None = None  # the repeats stopped once timing had taken this long

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def time_calls(
    calls: Mapping[str, Callable[[], Any]],
    device: torch.device,
    repeats: int,
    warmup: int,
    budget_s: float | None = None,
    min_repeats: int = 5,
) -> tuple[dict[str, list[float]], dict[str, float | None]]:
    """Seconds of every repeat of each call (repeats interleaved across the calls, so a slow
    moment of a shared machine touches all of them) and each call's CUDA peak MiB.

    ``budget_s``: stop after the round of repeats that brings the timed seconds (all calls)
    past it, once ``min_repeats`` rounds are done (300 repeats of a ViT at batch 256 take an
    hour on a CPU); every call then has the same number of repeats, which the caller reports."""
    peak: dict[str, float | None] = {}
    for label, fn in calls.items():  # warm-up, excluded; peak memory
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        for _ in range(warmup):
            fn()
        synchronize(device)
        peak[label] = (
            (torch.cuda.max_memory_allocated(device) - base) / 2**20
            if device.type == "cuda"
            else None
        )
    times: dict[str, list[float]] = {label: [] for label in calls}
    spent = 0.0
    for done in range(1, repeats + 1):
        for label, fn in calls.items():
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[label].append(time.perf_counter() - start)
            spent += times[label][-1]
        if budget_s is not None and spent >= budget_s and done >= min_repeats:
            break
    return times, peak


def time_scoring(
    models: Mapping[str, tuple[torch.nn.Module, torch.Tensor]],
    repeats: int = 300,
    warmup: int = 3,
    device: str | torch.device = "cpu",
    budget_s: float | None = None,
) -> list[ScoringCost]:
    """Median latency of one batch per model (``{name: (model, batch of inputs)}``) over
    ``repeats`` timed repeats, fewer when they exceed ``budget_s`` (`time_calls`)."""
    device = torch.device(device)
    calls = {}
    for name, (model, inputs) in models.items():
        model = model.to(device).eval()
        x = inputs.to(device)
        calls[name] = torch.inference_mode()(lambda m=model, x=x: m(x))
    times, peak = time_calls(calls, device, repeats, warmup, budget_s)
    out = []
    for name, (_, inputs) in models.items():
        median = statistics.median(times[name])
        batch, timed = len(inputs), len(times[name])
        out.append(
            ScoringCost(
                name,
                batch,
                timed,
                1e3 * median / batch,
                batch / median,
                peak[name],
                str(device),
                budget_s if timed < repeats else None,
            )
        )
    return out


def detector_scoring_costs(
    detectors: Sequence[str] = ("vit", "mlp"),
    d_model: int | None = 576,
    batch: int = 256,
    repeats: int = 300,
    warmup: int = 3,
    device: str = "cpu",
    budget_s: float | None = None,
) -> list[ScoringCost]:
    """ActMap detectors on float32 maps and (with ``d_model``) ACT-ViT on its padded tensor of a
    generator of that hidden size, untrained weights (latency does not depend on them)."""

    torch.manual_seed(0)
    models = {
        method_name(name): (create_detector(name), torch.randn(batch, *MAP_SHAPE))
        for name in detectors
    }
    if d_model is not None:
        models["actvit"] = (
            ACTViT.from_config(ACTViTConfig(), d_model),
            torch.randn(batch, LAYER_GROUPS, N_MAX, d_model),
        )
    return time_scoring(models, repeats, warmup, device, budget_s)


@dataclass(frozen=True)
class StorageCost:
    store: str
    map_bytes: int  # one stored map (float16)
    trajectory_bytes: float | None  # mean pooled L x T x 128 trajectory (float16), if stored
    actvit_bytes: int | None  # ACT-ViT's padded (8, 100, D) tensor (float16) of this generator
    d_model: int | None
    n_trajectories: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def storage_costs(store, name: str) -> StorageCost:
    """Bytes per generation of each representation, read from the store's tables."""

    trajectory, n_traj = None, 0
    if store.has_table("trajectories"):
        shapes = store.read_table("trajectories", ["shape"]).column("shape").to_pylist()
        n_traj = len(shapes)
        trajectory = float(np.mean([2 * int(np.prod(s)) for s in shapes]))
    d_model = None
    if store.has_table("dense"):
        first = store.read_table("dense", ["shape"]).column("shape")[0].as_py()
        d_model = int(first[-1])
    return StorageCost(
        name,
        int(np.prod(store.map_shape)) * 2 if store.map_shape else MAP_BYTES,
        trajectory,
        None if d_model is None else tensor_nbytes(d_model),
        d_model,
        n_traj,
    )


@dataclass(frozen=True)
class TrainingCost:
    store: str
    detector: str
    seconds_per_seed: list[float]  # sum of the epochs' wall times, one per seed
    epochs_per_seed: list[int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def training_costs(run: Path, store: str, detector: str) -> TrainingCost:
    """Training seconds per seed, summed from each seed's recorded epoch times."""

    seconds, epochs = [], []
    for folder in read_run(run).seed_dirs.values():
        history = json.loads((folder / "history.json").read_text())
        seconds.append(float(sum(h["epoch_time_s"] for h in history)))
        epochs.append(len(history))
    return TrainingCost(store, detector, seconds, epochs)


@dataclass(frozen=True)
class CaptureCost:
    model: str
    batch: int
    new_tokens: int
    plain_s: list[float]
    hooked_s: list[float]
    median_ratio: float  # hooked / plain, median over repeats
    identical_tokens: bool
    plain_ms_per_answer: float  # median plain time per answer
    # capture variant -> median hooked/plain ratio, beyond map-only (`median_ratio`):
    # "greybox" (per-step log-probs and entropies), "attention" (+ K attention weights per
    # head), "dense" (+ ACT-ViT's dense states); what the baselines' capture costs
    variants: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def added_ms(self, variant: str) -> float | None:
        """Capture time added per answer by ``variant`` over plain generation (>= 0); None
        when that variant was not measured."""
        ratio = self.median_ratio if variant == "map-only" else self.variants.get(variant)
        return None if ratio is None else max(0.0, (ratio - 1.0) * self.plain_ms_per_answer)


# What each capture variant keeps (`CaptureConfig` fields, beyond map-only capture)
CAPTURE_VARIANTS = {
    "greybox": dict(greybox=True),
    "attention": dict(greybox=True, attention_keys=10, lookback_attention=True),
    "dense": dict(greybox=True, keep_dense=True),
}


def capture_variant(method: str) -> str:
    """The capture a method's scores need: map-only for ActMap's detectors, else what the
    baseline reads (attention weights, dense states, or the grey-box statistics)."""
    if method.startswith("actmap-"):
        return "map-only"
    try:
        from actmap.baselines.registry import create_baseline

        requires = set(getattr(create_baseline(method), "requires", ()))
    except Exception:  # not a registered baseline: its recorded latency is all we know
        return "greybox"
    if "dense" in requires:
        return "dense"
    if "attention" in requires:
        return "attention"
    return "greybox"


def capture_overhead(
    model,
    tokenizer,
    name: str,
    prompts: Sequence[str],
    new_tokens: int = 32,
    repeats: int = 3,
    variants: Sequence[str] = (),
) -> CaptureCost:
    """Hooked (map-only: what ActMap needs) vs plain generation of one batch, interleaved;
    and each of ``variants`` (`CAPTURE_VARIANTS`) the same way."""

    config = CaptureConfig(max_new_tokens=new_tokens, batch_size=len(prompts), greybox=False)
    measured = measure_overhead(model, tokenizer, prompts, config, repeats)
    ratios = {
        v: measure_overhead(
            model, tokenizer, prompts, replace(config, **CAPTURE_VARIANTS[v]), repeats
        ).median_ratio
        for v in variants
    }
    return CaptureCost(
        name,
        len(prompts),
        new_tokens,
        measured.plain_s,
        measured.hooked_s,
        measured.median_ratio,
        measured.identical_tokens,
        1e3 * statistics.median(measured.plain_s) / len(prompts),
        ratios,
    )


@dataclass(frozen=True)
class CostResult:
    scoring: list[ScoringCost]
    storage: list[StorageCost]
    training: list[TrainingCost]
    capture: CaptureCost | None
    # method -> (added ms per answer, mean AUROC over the stores, n stores); the plot's points
    cost_quality: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load_average: tuple[float, float, float] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "scoring": [s.to_json() for s in self.scoring],
            "storage": [s.to_json() for s in self.storage],
            "training": [t.to_json() for t in self.training],
            "capture": None if self.capture is None else self.capture.to_json(),
            "cost_quality": {
                k: {"ms_per_answer": v[0], "mean_auroc": v[1], "n_stores": v[2]}
                for k, v in self.cost_quality.items()
            },
            "notes": self.notes,
            "load_average": self.load_average,
        }


def cost_quality_points(
    mean_auroc: Mapping[str, tuple[float, int]],
    baseline_latency: Mapping[str, float],
    scoring: Sequence[ScoringCost],
    capture: CaptureCost | None,
) -> dict[str, tuple[float, float, int]]:
    """Added latency per answer and mean AUROC per method: the capture its scores need
    (`capture_variant`: hooked minus plain time per answer, at least 0; map-only for ActMap,
    attention weights for RAUQ/TAD, dense states for ACT-ViT, the grey-box statistics for the
    others) plus ActMap's detector scoring time, or what a baseline's run recorded (its own
    passes, samples included, and scoring). A capture variant not measured adds 0."""
    per_map = {s.name: s.ms_per_map for s in scoring}

    def capture_ms(method: str) -> float:
        added = None if capture is None else capture.added_ms(capture_variant(method))
        return 0.0 if added is None else added

    points = {}
    for method, (auroc, n) in mean_auroc.items():
        if method.startswith("actmap-") and method in per_map:
            points[method] = (capture_ms(method) + per_map[method], auroc, n)
        elif method in baseline_latency:
            points[method] = (capture_ms(method) + baseline_latency[method], auroc, n)
    return points
