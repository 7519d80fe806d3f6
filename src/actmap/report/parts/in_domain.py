"""Main results: the in-domain matrix (methods by black/grey/white box, one column per store)."""

from __future__ import annotations

from pathlib import Path

from actmap.experiments.in_domain import FAMILY_ORDER, InDomainColumn, InDomainMatrix, store_column
from actmap.report.sections import ReportContext, Section, judge_footnote, judged_name

FAMILY_TITLE = {
    "black": "black box",
    "grey": "grey box",
    "white": "white box",
    "actmap": "ActMap (white box)",
    "control": "control",
}


def compute(context: ReportContext) -> InDomainMatrix:

    columns, skipped = [], {}
    for ref in context.stores.values():
        runs = context.runs.get(ref.name, {})
        try:
            with context.timings.measure(f"in_domain/{ref.name}"):
                column = store_column(
                    ref.path, runs, ref.name, ref.generator, ref.task, context.n_resamples
                )
        except ValueError as error:  # e.g. a balanced test split with one class
            skipped[ref.name] = str(error)
            continue
        if len(column.cells) == 0:
            skipped[ref.name] = "no method scored its balanced test rows"
            continue
        columns.append(column)
    return InDomainMatrix(columns, skipped, context.judge_notes([c.store for c in columns]))


def _cell_text(column: InDomainColumn, method: str, metric: str) -> str:
    cell = column.cell(method)
    if cell is None:
        return "--"
    value = getattr(cell, metric)
    if value is None:
        return "n/a"
    text = f"{value.estimate:.3f} [{value.low:.3f}, {value.high:.3f}] n={cell.n}"
    return f"**{text}**" if metric == "auroc" and column.best == method else text


def matrix_table(matrix: InDomainMatrix, metric: str) -> str:
    """Rows: methods grouped black/grey/white box, then ActMap, then controls; columns: stores."""
    methods = {(c.family, c.method) for col in matrix.columns for c in col.cells}
    ordered = sorted(methods, key=lambda fm: (FAMILY_ORDER.index(fm[0]), fm[1]))
    names = [judged_name(c.store, matrix.judge_notes) for c in matrix.columns]
    head = "| family | method | " + " | ".join(names) + " |"
    lines = [head, "|---|---|" + "---|" * len(matrix.columns)]
    for family, method in ordered:
        cells = " | ".join(_cell_text(col, method, metric) for col in matrix.columns)
        lines.append(f"| {FAMILY_TITLE[family]} | {method} | {cells} |")
    return "\n".join(lines) + "\n" + judge_footnote(matrix.judge_notes)


def paired_table(matrix: InDomainMatrix) -> str:
    lines = [
        "| store | ActMap detector | vs | AUROC difference [95% paired CI] | n | excludes 0 |",
        "|---|---|---|---|---|---|",
    ]
    for col in matrix.columns:
        for p in col.paired:
            d = p.difference
            lines.append(
                f"| {judged_name(col.store, matrix.judge_notes)} | {p.a} | {p.b} | {d.estimate:+.3f} [{d.low:+.3f}, {d.high:+.3f}] "
                f"| {d.n} | {'yes' if p.excludes_zero else 'no'} |"
            )
    return "\n".join(lines) + "\n" + judge_footnote(matrix.judge_notes)


def render(matrix: InDomainMatrix, figure_dir: Path) -> str:
    if not matrix.columns:
        reasons = "; ".join(f"{k}: {v}" for k, v in matrix.skipped.items()) or "no store"
        return f"_No store could be scored ({reasons})._\n"
    parts = [
        "Every method on each store's identical balanced test rows. Cells: estimate "
        "[95% bootstrap interval over test rows] and the rows scored (n). ActMap detectors "
        "score a row with the mean p(correct) of their seeds. **Bold**: the best AUROC of a "
        "column, marked only where its paired interval against every other method excludes 0.\n",
        "### AUROC\n",
        matrix_table(matrix, "auroc"),
        "### AUPRC (correct = positive class)\n",
        matrix_table(matrix, "auprc"),
        "### ECE (10 bins; only for confidences that are probabilities)\n",
        matrix_table(matrix, "ece"),
        "### ActMap against each method (paired bootstrap of the AUROC difference)\n",
        paired_table(matrix),
    ]
    best = [f"{c.store}: {c.best or 'none clear'}" for c in matrix.columns]
    parts.append("Best per column (paired intervals all exclude 0): " + "; ".join(best) + "\n")
    if matrix.skipped:
        parts.append(
            "Skipped: " + "; ".join(f"{k} ({v})" for k, v in matrix.skipped.items()) + "\n"
        )
    return "\n".join(parts)


SECTION = Section("in_domain", "Main results: the in-domain matrix", compute, render)
