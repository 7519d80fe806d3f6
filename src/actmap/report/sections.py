"""The report's contract: what a section is, and what every section is given.

A section answers one of the paper's questions::

    compute(context) -> result        # the experiment; result.to_json() -> plain JSON
    render(result, figure_dir) -> str # Markdown; figures drawn by pure functions in
                                      # actmap.report.plots, saved as PNG into figure_dir

``compute`` calls a library function (``actmap.experiments.<name>``) with what the
context holds; ``render`` never recomputes, it only formats the result and draws it.
The assembler (``actmap.report.assemble``) runs the sections in report order
(``actmap.report.registry``), times each, writes ``json/<name>.json`` from
``to_json()`` and stitches the Markdown into ``report.md``. A section whose inputs
are missing returns a result that says so (``Skipped``), never raises for that.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from actmap.errors import ActmapUserError

if TYPE_CHECKING:
    from actmap.labelling.judge_pass import JudgeCheck

Rows = Literal["balanced", "test", "all"]
ROWS_HELP = (
    "balanced: the store's balanced test split (default); test: every labelled test row at "
    "the natural prevalence; all: every labelled row of the store"
)


def check_rows(rows: str) -> Rows:

    if rows not in ("balanced", "test", "all"):
        raise ActmapUserError(f"rows must be balanced, test or all, not '{rows}' ({ROWS_HELP})")
    return rows  # type: ignore[return-value]


class SectionResult(Protocol):
    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Skipped:
    """A section (or a part of one) that could not run here, and why."""

    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"skipped": self.reason}


@dataclass(frozen=True)
class StoreRef:
    """One (generator, task) map store the report reads; ``name`` is e.g. 'smollm2-triviaqa'."""

    name: str
    path: Path
    generator: str
    task: str
    judge: str | None = None  # who labelled it (CNN/DM summaries), from its manifest
    dtype: str = "float32"  # the generator's at capture, from its manifest


@dataclass
class Timings:
    """Seconds per part (``section`` or ``section/part``), in the order they ran."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def measure(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - start

    def to_json(self) -> dict[str, float]:
        return dict(self.seconds)


@dataclass(frozen=True)
class ReportContext:
    """Everything a section may read.

    stores: the map stores, by name. runs: ``{store name: {detector: run folder}}`` of
    `actmap train` runs (three seeds each) on that store's balanced rows. scratch: a
    folder a section may write into (copies of stores, baseline results, fitted
    detectors); sections never write into a store listed in ``stores``.
    options: ``{section name: {option: value}}`` from the config (e.g. small counts for
    tests). results: the results of the sections already computed, by name (the claims
    section reads them). timings: seconds per part, filled by the assembler and by
    sections that time their own parts (``context.timings.measure("cost/latency")``).
    cache: what several sections read, computed once (balanced maps, fitted detectors:
    `actmap.report.parts.choice`).
    """

    stores: Mapping[str, StoreRef]
    runs: Mapping[str, Mapping[str, Path]]
    out: Path
    scratch: Path
    seeds: tuple[int, ...] = (42, 123, 456)
    rows: Rows = "balanced"
    n_resamples: int = 2000
    device: str | None = None
    max_epochs: int | None = None  # None: the paper's recipe
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    results: dict[str, SectionResult] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    cache: dict[Any, Any] = field(default_factory=dict)  # what several sections read, once
    judge_checks: Mapping[str, JudgeCheck] = field(default_factory=dict)  # by judge name

    def option(self, section: str, name: str, default: Any = None) -> Any:
        return self.options.get(section, {}).get(name, default)

    def judge_notes(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """``{store: line}`` for every judge-labelled store among ``names`` (default: all): its
        judge's check, read beside every figure of that store, or that none was given."""
        notes = {}
        for name in self.stores if names is None else names:
            judge = self.stores[name].judge if name in self.stores else None
            if judge is None:
                continue
            check = self.judge_checks.get(judge)
            notes[name] = (
                check.summary()
                if check is not None
                else f"judge {judge}: no judge check given (labels unchecked)"
            )
        return notes

    def stores_of(self, generator: str | None = None, task: str | None = None) -> list[StoreRef]:
        return [
            s
            for s in self.stores.values()
            if (generator is None or s.generator == generator) and (task is None or s.task == task)
        ]


@dataclass(frozen=True)
class Section:
    """One part of the report: ``name`` names its JSON file and its timing entry."""

    name: str
    title: str
    compute: Callable[[ReportContext], SectionResult]
    render: Callable[[Any, Path], str]


def figure_markdown(path: Path, caption: str) -> str:
    """A figure line for report.md (figures live in ``figures/`` beside it) with its caption."""
    return f"![{caption}](figures/{Path(path).name})\n\n*{caption}*\n"


JUDGED = "‡"  # marks a judge-labelled store's name in a table


def judged_name(name: str, notes: Mapping[str, str]) -> str:
    return f"{name} {JUDGED}" if name in notes else name


def judge_footnote(notes: Mapping[str, str]) -> str:
    """Lines under a table that shows judge-labelled stores: each one's judge check."""
    lines = "".join(f"- {JUDGED} labels of {store}: {note}\n" for store, note in notes.items())
    return "\n" + lines if lines else ""  # a blank line ends the table above


def skipped_markdown(result: Skipped) -> str:
    return f"_Skipped: {result.reason}_\n"
