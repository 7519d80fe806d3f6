"""Transfer and generalization: frozen detectors on stores they never saw."""

from __future__ import annotations

from pathlib import Path

from actmap.experiments.transfer import (
    StoreInfo,
    TransferResult,
    detectors_from_runs,
    transfer_rows,
)
from actmap.report.sections import ReportContext, Section, judge_footnote, judged_name


def compute(context: ReportContext) -> TransferResult:

    detector = context.option("transfer", "detector", "mlp")
    rows = context.option("transfer", "rows", "all")
    stores = [
        StoreInfo(s.name, s.path, s.generator, s.task, s.dtype) for s in context.stores.values()
    ]
    detector_for = detectors_from_runs(
        context.runs,
        detector,
        context.scratch / "transfer",
        context.seeds,
        context.max_epochs,
        context.device,
    )

    def own_run(target: StoreInfo):
        run = context.runs.get(target.name, {}).get(detector)
        return None if run is None else Path(run)

    result = transfer_rows(stores, detector_for, own_run, detector, rows, context.n_resamples)
    named = {n for r in result.rows for n in (*r.source.split("+"), r.target) if n}
    result.judge_notes.update(context.judge_notes(sorted(named & set(context.stores))))
    return result


def _interval(value) -> str:
    if value is None:
        return "--"
    return f"{value.estimate:.3f} [{value.low:.3f}, {value.high:.3f}] n={value.n}"


def _note(row, target_rows: str) -> str:
    if row.skipped or not row.rows or row.rows == target_rows:
        return row.skipped
    return f"the target's {row.rows} rows (source and target share their questions)"


def render(result: TransferResult, figure_dir: Path) -> str:
    lines = [
        f"Detector: actmap-{result.detector}, fit on the source and frozen; scored on the "
        f"target's '{result.target_rows}' rows (natural prevalence; empty answers count as "
        "incorrect, scored 0). AUROC of the seed-mean p(correct) [95% bootstrap interval] "
        "and n; beside it the target's own detector on its balanced test rows.\n",
        "| kind | source | target | transfer AUROC | target in-domain AUROC | empty | note |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = result.judge_notes
    for r in result.rows:
        source = "+".join(judged_name(s, notes) for s in r.source.split("+")) if r.source else "--"
        target = judged_name(r.target, notes) if r.target else "--"
        lines.append(
            f"| {r.kind} | {source} | {target} | {_interval(r.auroc)} "
            f"| {_interval(r.in_domain)} | {r.n_empty} | {_note(r, result.target_rows)} |"
        )
    return "\n".join(lines) + "\n" + judge_footnote(notes)


SECTION = Section("transfer", "Transfer and generalization (frozen detectors)", compute, render)
