"""The judge check: how far to trust the labels of judge-labelled (CNN/DailyMail) stores.

Every figure of such a store is read next to its judge's check; this section lists the
checks given to the report (``actmap judge check``) and which judge labelled which store.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actmap.labelling.judge_pass import JudgeCheck
from actmap.report.sections import ReportContext, Section, Skipped, skipped_markdown


@dataclass(frozen=True)
class JudgeChecks:
    checks: list[JudgeCheck]  # best AUROC first
    stores: dict[str, str]  # judge-labelled store -> its judge's check (or that none was given)

    def to_json(self) -> dict:
        return {"checks": [c.to_json() for c in self.checks], "stores": self.stores}


def compute(context: ReportContext) -> JudgeChecks | Skipped:
    stores = context.judge_notes()
    if not context.judge_checks and not stores:
        return Skipped("no judge check given and no store labelled by a judge")
    checks = sorted(context.judge_checks.values(), key=lambda c: -c.auroc.estimate)
    return JudgeChecks(checks, stores)


def render(result: JudgeChecks | Skipped, figure_dir: Path) -> str:
    if isinstance(result, Skipped):
        return skipped_markdown(result)
    lines = [
        "Per CNN/DailyMail validation article, the judge scores the article's own first "
        "highlight sentence (supported) and another article's (not supported). Accuracy "
        "counts both claims at the judge's support threshold; AUROC [95% bootstrap interval] "
        "ranks the support probabilities; seconds per claim is the judge's wall time.\n",
    ]
    if result.checks:
        lines += [
            "| judge | pairs | accuracy | threshold | AUROC [95% CI] | s per claim |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {c.judge} | {c.pairs} | {c.accuracy:.3f} | {c.threshold:g} | {c.auroc} "
            f"| {c.seconds_per_claim:.2f} |"
            for c in result.checks
        ]
        lines.append("")
    for store, note in result.stores.items():
        lines.append(f"- Labels of {store}: {note}")
    return "\n".join(lines) + "\n"


SECTION = Section("judge_check", "The judge check (labels of long-form stores)", compute, render)
