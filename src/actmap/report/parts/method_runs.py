"""How each baseline was run: the settings that vary between runs, and its run time, per store.

Read from each store's results records (``actmap baselines`` writes them): the rows scored,
the settings a reader checks against the paper's (samples and judge for the sampling methods,
the configuration and the sweep behind ACT-ViT), the fit time of a supervised method, the
method's wall time in all, and its latency per answer (sampling included). Where ACT-ViT
swept more than one configuration, the sweep's own record follows: every configuration's
validation AUROC with the selection seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from actmap.baselines.actvit import ACTViTConfig
from actmap.report.sections import ReportContext, Section, Skipped, skipped_markdown
from actmap.store import MapStore


@dataclass(frozen=True)
class MethodRun:
    store: str
    method: str
    rows: int
    settings: str
    fit_s: float | None
    wall_s: float | None
    latency_ms: float | None


@dataclass(frozen=True)
class SweptConfig:
    store: str
    config: str
    val_auroc: float
    best_epoch: int
    n_params: int
    selected: bool


@dataclass(frozen=True)
class MethodRuns:
    runs: list[MethodRun]
    sweeps: list[SweptConfig]

    def to_json(self) -> dict:
        return {"runs": [asdict(r) for r in self.runs], "sweeps": [asdict(s) for s in self.sweeps]}


def config_label(config: Mapping[str, Any]) -> str:
    """An ACT-ViT configuration record in a few words (``ACTViTConfig.label``; records older
    than the precision field read as float32)."""

    return ACTViTConfig.from_dict(config).label()


def _sampling(details: Mapping[str, Any]) -> str:
    return (
        f"{details['n_samples']} samples, T = {details['temperature']:g}, "
        f"top-p {details['top_p']:g}"
    )


def settings_text(method: str, details: Mapping[str, Any]) -> str:
    """The settings of one results record that a reader compares with the paper's."""
    if method == "actvit" and "config" in details:
        grid = details.get("grid")
        swept = f"selected of {len(grid)}" if grid else "sweep not recorded"
        seeds = len(details.get("seeds", []))
        return (
            f"{config_label(details['config'])} ({swept}); {seeds} seeds; "
            f"{details.get('n_params', 0):,} parameters"
        )
    if method == "semantic_entropy" and "n_samples" in details:
        return f"{_sampling(details)}; judge {details.get('judge')}"
    if method == "eigenscore" and "n_samples" in details:
        return _sampling(details)
    if method == "tad" and "n_previous" in details:
        return f"K = {details['n_previous']}"
    return ""


def _number(record: Mapping[str, Any], key: str) -> float | None:
    value = record.get(key)
    return None if value is None else float(value)


def compute(context: ReportContext) -> MethodRuns | Skipped:

    runs, sweeps = [], []
    for ref in context.stores.values():
        results = MapStore.open(ref.path).manifest.get("results", {})
        for method, record in sorted(results.items()):
            details = record.get("details") or {}
            runs.append(
                MethodRun(
                    store=ref.name,
                    method=method,
                    rows=int(record.get("rows", 0)),
                    settings=settings_text(method, details),
                    fit_s=_number(record, "fit_time_s"),
                    wall_s=_number(record, "wall_time_s"),
                    latency_ms=_number(record, "latency_ms_per_answer"),
                )
            )
            grid = details.get("grid") if method == "actvit" else None
            if grid and len(grid) > 1:
                for entry in grid:
                    sweeps.append(
                        SweptConfig(
                            ref.name,
                            config_label(entry["config"]),
                            float(entry["val_auroc"]),
                            int(entry["best_epoch"]),
                            int(entry["n_params"]),
                            entry["config"] == details["config"],
                        )
                    )
    if not runs:
        return Skipped("no store holds baseline results")
    return MethodRuns(runs, sweeps)


def _seconds(value: float | None) -> str:
    """Thousands separated from 10 up, three significant digits below (0.0134, 2.46)."""
    if value is None:
        return "--"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"


def render(result: MethodRuns | Skipped, figure_dir: Path) -> str:
    if isinstance(result, Skipped):
        return skipped_markdown(result)
    lines = [
        "Each baseline's results record: the rows it scored, the settings that vary between "
        "runs, the fit time of a supervised method, its wall time in all (fit, sampling and "
        "scoring) and its latency per answer (sampling included), on the machine and load of "
        "its run.\n",
        "| store | method | rows | settings | fit (s) | wall (s) | ms per answer |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.store} | {r.method} | {r.rows} | {r.settings or '--'} | {_seconds(r.fit_s)} "
        f"| {_seconds(r.wall_s)} | {_seconds(r.latency_ms)} |"
        for r in result.runs
    ]
    if result.sweeps:
        lines += [
            "",
            "ACT-ViT sweeps: every configuration's best validation AUROC with the selection "
            "seed (the test rows are never used to select).\n",
            "| store | configuration | validation AUROC | best epoch | parameters | selected |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {s.store} | {s.config} | {s.val_auroc:.3f} | {s.best_epoch} | {s.n_params:,} "
            f"| {'yes' if s.selected else ''} |"
            for s in result.sweeps
        ]
    return "\n".join(lines) + "\n"


SECTION = Section(
    "method_runs", "How each baseline was run (settings and run time)", compute, render
)
