"""Computational cost: capture overhead, bytes per representation, scoring and training time."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from actmap.data.builtin import BuiltinArithmeticTask
from actmap.experiments.cost import (
    CostResult,
    capture_overhead,
    cost_quality_points,
    detector_scoring_costs,
    storage_costs,
    training_costs,
)
from actmap.experiments.in_domain import family_of
from actmap.llm.models import load_model
from actmap.report.plots import save_figure
from actmap.report.plots.cost import plot_cost_quality
from actmap.report.sections import ReportContext, Section, figure_markdown
from actmap.store import MapStore

log = logging.getLogger(__name__)

# on a CPU, 300 repeats of the ViT and ACT-ViT at batch 256 take about an hour: time for at
# most this long (the medians settle within a few repeats; the count is reported)
CPU_BUDGET_S = 120.0


def _capture(context: ReportContext, notes: list[str]):

    model_name = context.option("cost", "capture_model")
    if model_name is None:
        generators = [s.generator for s in context.stores.values()]
        model_name = generators[0] if generators else None
    if model_name is None or not context.option("cost", "capture", True):
        notes.append("capture overhead not measured (no generator, or switched off)")
        return None
    try:
        model, tokenizer, source = load_model(model_name, device=context.device or "cpu")
    except Exception as error:  # noqa: BLE001 -- an unloadable generator is stated, not fatal
        notes.append(f"capture overhead not measured: cannot load {model_name} ({error})")
        return None
    batch = int(context.option("cost", "capture_batch", 16))
    task = BuiltinArithmeticTask(n_questions=batch)
    prompts = [task.prompt(e, tokenizer) for e in task.load_all()][:batch]
    return capture_overhead(
        model,
        tokenizer,
        source.name,
        prompts,
        int(context.option("cost", "capture_new_tokens", 32)),
        int(context.option("cost", "capture_repeats", 3)),
        tuple(context.option("cost", "capture_variants", ("greybox", "attention", "dense"))),
    )


def compute(context: ReportContext) -> CostResult:

    notes: list[str] = []
    storage, latency = [], {}
    for ref in context.stores.values():
        store = MapStore.open(ref.path)
        storage.append(storage_costs(store, ref.name))
        for method, record in store.manifest.get("results", {}).items():
            if record.get("latency_ms_per_answer") is not None:
                latency.setdefault(method, []).append(float(record["latency_ms_per_answer"]))
    d_model = next((s.d_model for s in storage if s.d_model), None)
    if d_model is None:
        notes.append("no store keeps dense states: ACT-ViT timed at d_model 576 (SmolLM2)")
    device = context.device or "cpu"
    budget = context.option("cost", "budget_s", CPU_BUDGET_S if device == "cpu" else None)
    with context.timings.measure("cost/scoring"):
        scoring = detector_scoring_costs(
            tuple(context.option("cost", "detectors", ("vit", "mlp", "logreg"))),
            d_model or 576,
            int(context.option("cost", "batch", 256)),
            int(context.option("cost", "repeats", 300)),
            device=device,
            budget_s=None if budget is None else float(budget),
        )
    if any(s.budget_s is not None for s in scoring):
        notes.append(
            f"scoring latency: timing stopped after {float(budget):g} s of timed repeats "
            "(`[report.cost] budget_s`); the repeats column says how many were timed"
        )
    training = [
        training_costs(Path(run), store, detector)
        for store, runs in context.runs.items()
        for detector, run in runs.items()
    ]
    with context.timings.measure("cost/capture"):
        capture = _capture(context, notes)
    mean_auroc = {}
    in_domain = context.results.get("in_domain")
    if in_domain is not None and hasattr(in_domain, "columns"):
        values: dict[str, list[float]] = {}
        for column in in_domain.columns:
            for cell in column.cells:
                values.setdefault(cell.method, []).append(cell.auroc.estimate)
        mean_auroc = {m: (float(np.mean(v)), len(v)) for m, v in values.items()}
    else:
        notes.append("no in-domain results: no cost-quality points")
    points = cost_quality_points(
        mean_auroc, {m: float(np.mean(v)) for m, v in latency.items()}, scoring, capture
    )
    return CostResult(scoring, storage, training, capture, points, notes, os.getloadavg())


def render(result: CostResult, figure_dir: Path) -> str:

    load = result.load_average
    lines = [f"Machine load average while measuring: {load}.\n"]
    if result.capture is not None:
        c = result.capture
        lines.append(
            f"**Capture overhead** ({c.model}, batch {c.batch}, {c.new_tokens} new tokens, "
            f"map-only capture, {len(c.plain_s)} interleaved repeats): median hooked/plain "
            f"{c.median_ratio:.3f} ({100 * (c.median_ratio - 1):+.1f}%); per repeat plain "
            f"{', '.join(f'{t:.2f}' for t in c.plain_s)} s, hooked "
            f"{', '.join(f'{t:.2f}' for t in c.hooked_s)} s; identical tokens "
            f"{c.identical_tokens}.\n"
        )
        if c.variants:
            each = "; ".join(
                f"{v} {r:.3f} ({c.added_ms(v):.2f} ms/answer)" for v, r in c.variants.items()
            )
            lines.append(
                f"Capture a baseline needs, hooked/plain (added ms per answer): {each}. The "
                "cost-quality figure adds each method's capture to its scoring time (map-only for "
                "ActMap, attention for RAUQ/TAD, dense states for ACT-ViT, grey-box for the "
                "others).\n"
            )
    lines += [
        "**Bytes per generation** (float16)\n",
        "| store | map | pooled trajectory (mean) | ACT-ViT tensor | d_model |",
        "|---|---|---|---|---|",
    ]
    for s in result.storage:
        traj = (
            "--"
            if s.trajectory_bytes is None
            else f"{s.trajectory_bytes:,.0f} (n={s.n_trajectories})"
        )
        act = "--" if s.actvit_bytes is None else f"{s.actvit_bytes:,}"
        lines.append(f"| {s.store} | {s.map_bytes:,} | {traj} | {act} | {s.d_model or '--'} |")
    lines += [
        "",
        "**Scoring latency** (untrained weights, float32 input)\n",
        "| detector | batch | repeats | ms/map (median) | maps/s | peak MiB | device |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in result.scoring:
        peak = "n/a (CPU)" if s.peak_mib is None else f"{s.peak_mib:.1f}"
        lines.append(
            f"| {s.name} | {s.batch} | {s.repeats} | {s.ms_per_map:.4f} "
            f"| {s.maps_per_s:,.0f} | {peak} | {s.device} |"
        )
    if result.training:
        lines += [
            "",
            "**Training time per seed** (sum of recorded epoch times)\n",
            "| store | detector | seconds per seed | epochs |",
            "|---|---|---|---|",
        ]
        for t in result.training:
            lines.append(
                f"| {t.store} | {t.detector} | "
                f"{', '.join(f'{s:.1f}' for s in t.seconds_per_seed)} "
                f"| {', '.join(map(str, t.epochs_per_seed))} |"
            )
    if result.cost_quality:
        families = {m: family_of(m) for m in result.cost_quality}
        path = save_figure(
            plot_cost_quality(result.cost_quality, families), figure_dir / "cost_quality.png"
        )
        lines += [
            "",
            figure_markdown(
                path,
                "Added latency per answer (log scale) against mean "
                "AUROC over the stores each method ran on",
            ),
        ]
    if result.notes:
        lines += ["", "Notes: " + "; ".join(result.notes)]
    return "\n".join(lines) + "\n"


SECTION = Section("cost", "Computational cost", compute, render)
