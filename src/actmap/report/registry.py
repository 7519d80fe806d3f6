"""The report's sections, in the paper's order. A section lands by adding its line here."""

from __future__ import annotations

from collections.abc import Sequence

from actmap.errors import ActmapUserError
from actmap.report.parts import (
    ablations,
    calibration,
    claims,
    cost,
    in_domain,
    judge_check,
    learning_curve,
    localization,
    map_channels,
    method_runs,
    out_of_domain,
    transfer,
)
from actmap.report.sections import Section


def report_sections() -> list[Section]:
    """Every section of the report, in report order (the claims section last: it reads
    the results of the others)."""

    return [
        map_channels.SECTION,
        judge_check.SECTION,
        in_domain.SECTION,
        method_runs.SECTION,
        transfer.SECTION,
        out_of_domain.SECTION,
        ablations.SECTION,
        learning_curve.SECTION,
        localization.SECTION,
        calibration.SECTION,
        cost.SECTION,
        claims.SECTION,
    ]


def select_sections(names: Sequence[str] | None = None) -> list[Section]:
    """The sections named (in report order), or all of them."""
    sections = report_sections()
    if not names:
        return sections
    known = {s.name for s in sections}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ActmapUserError(f"unknown report section(s) {unknown}; known: {sorted(known)}")
    return [s for s in sections if s.name in names]
