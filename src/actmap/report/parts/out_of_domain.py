"""Out of domain (issue 57): each task held out from a generalist fit on the others, against
RAUQ and the other baselines, and what its first labels buy; read from the folders
``actmap out-of-domain --out`` wrote (`actmap report --out-of-domain DIR`, or the option
``[report.out_of_domain] runs = [...]``), never recomputed here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actmap.errors import ActmapUserError
from actmap.experiments.out_of_domain import OutOfDomain, read_out_of_domain
from actmap.report.plots import save_figure
from actmap.report.plots.out_of_domain import plot_first_labels
from actmap.report.sections import ReportContext, Section, Skipped, figure_markdown
from actmap.report.sections import skipped_markdown as skipped_text

HOW = (
    "no `actmap out-of-domain` results given (`actmap report --out-of-domain DIR`, or "
    "`[report.out_of_domain] runs`)"
)


@dataclass(frozen=True)
class OutOfDomainResults:
    results: dict[str, OutOfDomain]  # by folder
    notes: list[str]  # folders that hold no readable result

    def to_json(self) -> dict:
        return {"runs": {k: v.to_json() for k, v in self.results.items()}, "notes": self.notes}


def compute(context: ReportContext) -> OutOfDomainResults | Skipped:
    folders = [str(f) for f in context.option("out_of_domain", "runs", None) or ()]
    if not folders:
        return Skipped(HOW)
    results, notes = {}, []
    for folder in folders:
        try:
            results[folder] = read_out_of_domain(folder)
        except ActmapUserError as error:
            notes.append(str(error))
    if not results:
        return Skipped(
            "no folder given holds an `actmap out-of-domain` result: " + "; ".join(notes)
        )
    return OutOfDomainResults(results, notes)


def generator_name(result: OutOfDomain) -> str:
    """The generator as a reader knows it: its GGUF file, else its name."""
    return str(result.generator.get("gguf_file") or result.generator.get("name"))


def _vs(interval) -> str:
    if interval is None:
        return "n/a"
    beyond = interval.low > 0 or interval.high < 0
    return f"{interval.estimate:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]" + (
        " *" if beyond else ""
    )


def summary_lines(results: dict[str, OutOfDomain]) -> list[str]:
    lines = [
        "| generator | held out | trained on | balanced test n | generalist AUROC [95%] "
        "| RAUQ AUROC [95%] | generalist - RAUQ [95%] | generalist PRR | RAUQ PRR "
        "| in-domain AUROC (reference) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results.values():
        name = generator_name(result)
        for h in result.held_out:
            if h.note:
                lines.append(f"| {name} | {h.task} | {', '.join(h.sources)} | - | {h.note} "
                             "| | | | | |")  # fmt: skip
                continue
            by = {m.method: m for m in h.methods}
            gen, rauq, ref = by.get("generalist"), by.get("rauq"), by.get("in-domain stacked")
            lines.append(
                f"| {name} | {h.task} | {', '.join(h.sources)} | {h.n_test} "
                f"| {gen.auroc if gen else 'n/a'} | {rauq.auroc if rauq else 'n/a'} "
                f"| {_vs(rauq.vs_auroc) if rauq else 'n/a'} "
                f"| {gen.prr.estimate:.3f} | {rauq.prr.estimate if rauq else float('nan'):.3f} "
                f"| {ref.auroc if ref else 'n/a'} |"
            )
    return lines


def curve_lines(result: OutOfDomain) -> list[str]:
    lines = []
    for h in result.held_out:
        if not h.curve:
            continue
        ks = sorted({p.k for p in h.curve})
        ref = h.in_domain
        lines += [
            "",
            f"First labels of {h.task} ({generator_name(result)}; {result.config.draws} "
            f"draws per k from {h.n_train_all} labelled training rows): balanced-test AUROC "
            f"(ECE on every labelled test row), mean over draws; in-domain detector on all of "
            f"them: AUROC {ref.get('auroc', float('nan')):.3f}, ECE "
            f"{ref.get('ece', float('nan')):.3f}.",
            "",
            "| step | " + " | ".join(f"k = {k}" for k in ks) + " |",
            "|---|" + "---|" * len(ks),
        ]
        for step in dict.fromkeys(p.step for p in h.curve):
            at = {p.k: p for p in h.curve if p.step == step}
            cells = [f"{at[k].auroc:.3f} ({at[k].ece:.3f})" if k in at else "-" for k in ks]
            lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def render(result: OutOfDomainResults | Skipped, figure_dir: Path) -> str:
    if isinstance(result, Skipped):
        return skipped_text(result)
    lines = [
        "Each task held out from a generalist (`actmap train --store A --store B ...`) fit on the "
        "other tasks of its generator, on the held-out task's balanced test rows; RAUQ needs "
        "no training. Intervals: 95% bootstrap; * marks a paired difference whose interval "
        "excludes 0. Full tables (perplexity, mean token entropy, TAD and the paper's MLP "
        "trained on the other tasks, calibration): each folder's out_of_domain.md.",
        "",
        *summary_lines(result.results),
    ]
    for i, (folder, one) in enumerate(result.results.items()):
        lines += curve_lines(one)
        if any(h.curve for h in one.held_out):
            path = save_figure(plot_first_labels(one), figure_dir / f"out_of_domain_{i}.png")
            lines += ["", figure_markdown(path, f"First labels, {generator_name(one)} "
                                                f"(from {folder})")]  # fmt: skip
    lines += ["", "Read from: " + ", ".join(f"`{f}`" for f in result.results)]
    lines += [f"- not read: {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


SECTION = Section(
    "out_of_domain", "Out of domain: a generalist per generator, and the first labels",
    compute, render,
)  # fmt: skip
