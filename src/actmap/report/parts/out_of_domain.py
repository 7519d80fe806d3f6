"""Out of domain (issue 57): each task held out from a generalist fit on the others, against
RAUQ and the other baselines, and what its first labels buy; read from the folders
``actmap out-of-domain --out`` wrote (`actmap report --out-of-domain DIR`, or the option
``[report.out_of_domain] runs = [...]``), never recomputed here. A folder may instead hold one
such folder per held-out task (``scripts/ood-four.sh``'s ``held-out-TASK``). Every generator
given is shown side by side (one column each), and the learning curves of all of them say
where the head refit paid against recalibration, by the labelled answers of the rarer class:
the evidence behind ``actmap train --generalist``'s ``--adapt auto``
(`actmap.experiments.new_task.choose_step`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from actmap.errors import ActmapUserError
from actmap.experiments.new_task import HEAD_REFIT_MIN
from actmap.experiments.out_of_domain import HeldOut, OutOfDomain, read_out_of_domain
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
    for folder in (one for given in folders for one in result_folders(Path(given))):
        try:
            results[str(folder)] = read_out_of_domain(folder)
        except ActmapUserError as error:
            notes.append(str(error))
    if not results:
        return Skipped(
            "no folder given holds an `actmap out-of-domain` result: " + "; ".join(notes)
        )
    return OutOfDomainResults(results, notes)


def result_folders(folder: Path) -> list[Path]:
    """``folder`` when it holds a result; else its subfolders that do (one per held-out task,
    `scripts/ood-four.sh`), in name order; else ``folder`` (reading it then says why)."""
    if (folder / "out_of_domain.json").is_file() or not folder.is_dir():
        return [folder]
    held = sorted(p.parent for p in folder.glob("*/out_of_domain.json"))
    return held or [folder]


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


def generator_label(result: OutOfDomain) -> str:
    return f"{generator_name(result)} ({result.generator.get('dtype')})"


def by_generator(results: dict[str, OutOfDomain]) -> dict[str, dict[str, HeldOut]]:
    """{generator: {task: held out}} over every folder given: a task held out in several
    folders of one generator is taken where it was evaluated, from the generalist trained on
    the most other tasks (the later folder on a tie)."""
    merged: dict[str, dict[str, HeldOut]] = {}
    for result in results.values():
        tasks = merged.setdefault(generator_label(result), {})
        for h in result.held_out:
            have = tasks.get(h.task)
            if have is None or (bool(h.methods), len(h.sources)) >= (
                bool(have.methods),
                len(have.sources),
            ):
                tasks[h.task] = h
    return merged


def side_by_side_lines(results: dict[str, OutOfDomain]) -> list[str]:
    """One row per held-out task, one column per generator: the generalist's AUROC, RAUQ's,
    the paired difference and the balanced test rows."""
    merged = by_generator(results)
    tasks = list(dict.fromkeys(task for held in merged.values() for task in held))
    lines = [
        "Every generator side by side: generalist AUROC / RAUQ AUROC, the paired difference "
        "[95%] (* beyond the noise), the held-out task's balanced test rows n and how many "
        "other tasks the generalist was trained on.",
        "",
        "| held out | " + " | ".join(merged) + " |",
        "|---|" + "---|" * len(merged),
    ]
    for task in tasks:
        cells = []
        for held in merged.values():
            h = held.get(task)
            by = {m.method: m for m in h.methods} if h is not None else {}
            gen, rauq = by.get("generalist"), by.get("rauq")
            if h is None:
                cells.append("-")
            elif gen is None:
                cells.append(f"not evaluated: {h.note}" if h.note else "n/a")
            else:
                vs = f"{rauq.auroc.estimate:.3f}, {_vs(rauq.vs_auroc)}" if rauq else "n/a"
                cells.append(f"{gen.auroc.estimate:.3f} / {vs} (n={h.n_test}, "
                             f"trained on {len(h.sources)})")  # fmt: skip
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return lines


TIE = 0.0005  # AUROC differences below this are a tie (the tables print three decimals)


def head_refit_points(held: HeldOut) -> list[tuple[float, float]]:
    """(labelled answers of the rarer class per draw (mean), head refit minus recalibrate
    AUROC) at every k of a learning curve where both steps ran."""
    at = {(p.step, p.k): p for p in held.curve}
    points = []
    for (step, k), p in at.items():
        recal = at.get(("recalibrate", k))
        if step == "head refit" and k > 0 and recal is not None:
            points.append((min(p.mean_correct, k - p.mean_correct), p.auroc - recal.auroc))
    return points


def head_refit_lines(results: dict[str, OutOfDomain]) -> list[str]:
    """Where the head refit paid against recalibration, over every generator's learning curves,
    by the labelled answers of the rarer class per draw; `choose_step` refits the head from
    ``HEAD_REFIT_MIN`` of each class."""
    merged = by_generator(results)
    points = {
        name: [pt for h in held.values() for pt in head_refit_points(h)]
        for name, held in merged.items()
    }
    if not any(points.values()):
        return []
    bins = [(0.0, 3.0), (3.0, float(HEAD_REFIT_MIN)), (float(HEAD_REFIT_MIN), float("inf"))]

    def label(low: float, high: float) -> str:
        if high == float("inf"):
            return f">= {low:g} (auto: head refit)"
        return f"{low:g} to < {high:g}"

    lines = [
        "",
        "First labels: the head refit against recalibration at each k of every learning curve "
        "(AUROC, mean over draws), by the labelled answers of the rarer class per draw (mean); "
        f"`actmap train --generalist` (`--adapt auto`) refits the head from {HEAD_REFIT_MIN} "
        f"of each class. Differences within {TIE} are ties.",
        "",
        "| generator | rarer class per draw | points | head refit better | worse | tie "
        "| mean difference [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [*points.items(), ("all", [pt for pts in points.values() for pt in pts])]
    for name, pts in rows:
        for low, high in bins:
            d = [diff for rare, diff in pts if low <= rare < high]
            if not d:
                continue
            better, worse = sum(x >= TIE for x in d), sum(x <= -TIE for x in d)
            lines.append(
                f"| {name} | {label(low, high)} | {len(d)} | {better} | {worse} "
                f"| {len(d) - better - worse} | {sum(d) / len(d):+.3f} [{min(d):+.3f}, "
                f"{max(d):+.3f}] |"
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
        "",
        *side_by_side_lines(result.results),
        *head_refit_lines(result.results),
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
