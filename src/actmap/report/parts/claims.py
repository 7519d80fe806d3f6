"""The paper's claims, checked: the last section, read from the results of the others."""

from __future__ import annotations

from pathlib import Path

from actmap.experiments.claims import ClaimsResult, check_claims
from actmap.report.sections import ReportContext, Section, judge_footnote


def compute(context: ReportContext) -> ClaimsResult:

    tasks = {s.name: s.task for s in context.stores.values()}
    result = check_claims(context.results, tasks)
    result.judge_notes.update(
        (store, note)
        for store, note in context.judge_notes().items()
        if any(store in c.ours for c in result.claims)  # the stores a claim cites
    )
    return result


def render(result: ClaimsResult, figure_dir: Path) -> str:
    lines = [
        "Each headline claim of the paper, its figure, ours with its 95% interval and n, and a "
        "verdict: holds / does not hold / inconclusive at this sample size (the rule is in the "
        "last column; `actmap.experiments.claims` documents them).\n",
        "| claim | paper | ours | verdict | rule |",
        "|---|---|---|---|---|",
    ]
    for c in result.claims:
        cells = [cell.replace("|", "\\|") for cell in (c.claim, c.paper, c.ours)]
        rule = c.rule.replace("|", "\\|")
        lines.append(f"| {' | '.join(cells)} | **{c.verdict}** | {rule} |")
    return "\n".join(lines) + "\n" + judge_footnote(result.judge_notes)


SECTION = Section("claims", "The paper's claims, checked", compute, render)
