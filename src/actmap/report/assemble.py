"""Assemble the report: run each section, write its JSON, stitch the Markdown.

    build_report(context, sections) -> ReportOutput   (out/report.md, out/json/, out/figures/)

The assembler computes nothing itself: each section's ``compute`` answers its
question, ``render`` formats the answer. It times both, and writes a header with
the package version, the git commit of the code, the stores and runs read (each
store's rows, natural accuracy, balanced rows and capture rate), and the seconds
each part took.
"""

from __future__ import annotations

import datetime as dt
import logging
import subprocess
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from actmap.artifacts import package_version, write_json
from actmap.atomic import atomic_write_text
from actmap.data.splits import SPLITS
from actmap.report.sections import ReportContext, Section, Skipped
from actmap.store import MapStore
from actmap.store.rows import rate_text, store_summary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReportOutput:
    report: Path
    json_dir: Path
    figure_dir: Path
    sections: dict[str, str]  # name -> "done" | "skipped: ..." | "failed: ..."


def git_commit(where: Path | None = None) -> str | None:
    """The commit of the code that made the report (None outside a git checkout)."""
    where = where or Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=where,
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout.strip()
    return done.stdout.strip() + ("-dirty" if dirty else "")


def store_counts(path: Path) -> dict:
    """What the report's store table shows of one store: rows, labels, natural accuracy and
    balanced rows per split, and its capture rate (read, never written)."""

    summary = store_summary(MapStore.open(path)).to_json()
    return {
        "splits": summary["splits"],
        "total": summary["total"],
        "capture_rows_per_s": summary["capture_rows_per_s"],
    }


def header(context: ReportContext, commit: str | None) -> dict:
    return {
        "actmap_version": package_version(),
        "git_commit": commit,
        "created_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "rows": context.rows,
        "seeds": list(context.seeds),
        "n_resamples": context.n_resamples,
        "max_epochs": context.max_epochs,
        "stores": {
            s.name: {
                "path": str(s.path),
                "generator": s.generator,
                "dtype": s.dtype,
                "task": s.task,
                "judge": s.judge,
                "counts": store_counts(s.path),
            }
            for s in context.stores.values()
        },
        "runs": {k: {d: str(p) for d, p in v.items()} for k, v in context.runs.items()},
    }


def _generator_label(generator: str) -> str:
    """A generator loaded from a local file reads as the file's name (the report's json keeps
    the whole path); a hub id or a built-in name reads as it is."""
    path = Path(generator)
    return path.name if path.is_absolute() else generator


def _counts_table(stores: dict[str, dict]) -> list[str]:
    """Per store: rows, natural accuracy (the factual rate of judged summaries), balanced
    train / validation / test rows and the capture rate; stores without counts are left out."""

    counted = {name: s["counts"] for name, s in stores.items() if s.get("counts")}
    if not counted:
        return []
    lines = [
        "",
        "| store | rows | labelled | natural accuracy | balanced train / val / test "
        "| capture rows/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in counted.items():
        total, splits = c["total"], c["splits"]
        accuracy = "-" if total["accuracy"] is None else f"{total['accuracy']:.3f}"
        balanced = " / ".join(str(splits[s]["balanced"]) for s in SPLITS)
        rate = c["capture_rows_per_s"]
        lines.append(
            f"| {name} | {total['rows']:,} | {total['labelled']:,} | {accuracy} | {balanced} "
            f"| {rate_text(rate)} |"
        )
    return lines


def header_markdown(head: dict, timings: dict[str, float]) -> str:
    lines = [
        "# actmap: the paper's evaluation\n",
        f"- actmap {head['actmap_version']}, git commit `{head['git_commit']}`, "
        f"made {head['created_utc']}",
        f"- rows scored: {head['rows']}; seeds {head['seeds']}; "
        f"{head['n_resamples']} bootstrap resamples per interval (95%, percentile)",
        f"- training epochs: {head['max_epochs'] or 'the paper recipe (80, early stopping)'}",
        "",
        "| store | generator | dtype | task | labels | path |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {_generator_label(s['generator'])} | {s.get('dtype', 'float32')} | {s['task']} "
        f"| {'judge ' + s['judge'] if s.get('judge') else 'task rule'} | `{s['path']}` |"
        for name, s in head["stores"].items()
    ]
    lines += _counts_table(head["stores"])
    runs = [(store, det, path) for store, v in head["runs"].items() for det, path in v.items()]
    if runs:
        lines += ["", "| runs of store | detector | run folder |", "|---|---|---|"]
        lines += [f"| {s} | {d} | `{p}` |" for s, d, p in runs]
    lines += ["", "| part | seconds |", "|---|---|"]
    lines += [f"| {part} | {sec:.1f} |" for part, sec in timings.items()]
    return "\n".join(lines) + "\n"


def build_report(
    context: ReportContext,
    sections: Sequence[Section],
    progress: Callable[[str, str], None] | None = None,
) -> ReportOutput:
    """Compute and render every section into ``context.out``.

    A section that raises is recorded as failed (with its error in its JSON and in the
    report) and the others still run: one broken experiment must not hide the rest.
    ``progress(section name, state)`` is called before and after each section.
    """
    out = Path(context.out)
    json_dir, figure_dir = out / "json", out / "figures"
    json_dir.mkdir(parents=True, exist_ok=True)
    figure_dir.mkdir(parents=True, exist_ok=True)
    commit = git_commit()
    bodies, states = [], {}
    for section in sections:
        if progress:
            progress(section.name, "start")
        try:
            with context.timings.measure(section.name):
                result = section.compute(context)
            context.results[section.name] = result
            write_json(json_dir / f"{section.name}.json", result.to_json())
            with context.timings.measure(f"{section.name} (render)"):
                body = section.render(result, figure_dir)
            states[section.name] = (
                f"skipped: {result.reason}" if isinstance(result, Skipped) else "done"
            )
        except Exception as error:  # noqa: BLE001 -- recorded in the report, others go on
            log.exception("section %s failed", section.name)
            text = "".join(traceback.format_exception_only(error)).strip()
            write_json(json_dir / f"{section.name}.json", {"failed": text})
            body = f"_This section failed: `{text}`_\n"
            states[section.name] = f"failed: {text}"
        bodies.append(f"## {section.title}\n\n{body}")
        if progress:
            progress(section.name, states[section.name])
    head = header(context, commit)
    head["sections"] = states
    head["timings_s"] = context.timings.to_json()
    write_json(json_dir / "header.json", head)
    text = header_markdown(head, context.timings.to_json()) + "\n" + "\n".join(bodies)
    atomic_write_text(out / "report.md", text)
    return ReportOutput(out / "report.md", json_dir, figure_dir, states)
