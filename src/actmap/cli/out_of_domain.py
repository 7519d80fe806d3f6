"""``actmap out-of-domain`` (leave one task out, and the first labels), and the generalist
that ``actmap train --store A --store B ...`` fits (`train_generalist`)."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, parse_ints, user_errors, write_result


def train_generalist(stores: list[Path], out: Path, detector: str, preset: str, fallback: bool):
    """`actmap train` on several stores: the generalist (`actmap.experiments.generalist`)."""
    from actmap.errors import ActmapUserError
    from actmap.experiments.generalist import train_generalist_run

    if detector != "actmap-plus":
        raise ActmapUserError(
            f"a detector over several stores is the stacked actmap-plus (--detector "
            f"actmap-plus), not {detector!r}"
        )
    summary = train_generalist_run(stores, out, preset, fallback)
    console.print(
        f"{summary['detector']} over {', '.join(summary['tasks'])}: blocks "
        f"{', '.join(summary['selected'])}"
    )
    for task, row in summary["per_task"].items():
        console.print(f"  {task}: balanced test AUROC {row['auroc']:.3f} (n={row['n_test']})")
    return summary


def adapt_generalist_run(stores: list[Path], generalist: Path, out: Path, detector, step: str):
    """`actmap train --store SMALL --generalist RUN`: the generalist adapted to a new task's
    labelled answers (`actmap.experiments.new_task.adapt_run`)."""
    from actmap.errors import ActmapUserError
    from actmap.experiments.new_task import OWN_RUN_MIN, adapt_run

    if detector is not None and not detector.startswith("actmap-plus"):
        raise ActmapUserError(
            f"--generalist adapts a stacked actmap-plus; --detector {detector!r} cannot be adapted"
        )
    if len(stores) != 1:
        raise ActmapUserError(
            f"--generalist adapts to one store (the new task's), got {len(stores)} --store"
        )
    summary = adapt_run(generalist, stores[0], out, step)
    console.print(
        f"{summary['task']}: generalist adapted by {summary['step']} on "
        f"{summary['labelled_rows']} labelled rows ({summary['labelled_correct']} correct)"
    )
    if "mean" in summary:
        m = summary["mean"]
        console.print(f"  balanced test rows: AUROC {m['auroc']:.3f}, ECE {m['ece']:.3f}")
    else:
        console.print("  no balanced test rows in the store: not scored")
    if summary["own_run_suggested"]:
        console.print(
            f"  {OWN_RUN_MIN}+ labelled answers of each class: the task's own run may do better "
            f"(actmap train --detector actmap-plus:full --store {stores[0]})"
        )
    return summary


@app.command("out-of-domain")
def out_of_domain_command(
    store: list[Path] = typer.Option(
        ..., help="One store per task, all of one generator and map configuration (repeat)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for out_of_domain.{md,json}."),
    held_out: list[str] = typer.Option(
        None, help="Hold out only these tasks (repeat; default: each task in turn)."
    ),
    preset: str = typer.Option(
        "auto", help="The generalist's preset: deployable | full | auto (what every store holds)."
    ),
    k: str = typer.Option(
        "0,25,50,100,200", help="First-labels curve: labelled rows of the held-out task ('' skips)."
    ),
    draws: int = typer.Option(10, help="Labelled draws per k (the curve's interval)."),
    mlp: bool = typer.Option(True, help="Train the paper's MLP on the other tasks."),
    mlp_epochs: int = typer.Option(None, help="The MLP's epoch cap (default: the recipe's 80)."),
    tad: bool = typer.Option(True, help="Train TAD on the other tasks (needs attention weights)."),
    in_domain: bool = typer.Option(
        True, help="Fit each held-out task's own stacked detector (the line to reach)."
    ),
    max_rejection: float = typer.Option(0.5, help="PRR: the largest fraction rejected."),
    resamples: int = typer.Option(2000, help="Bootstrap resamples."),
) -> None:
    """Each task held out from a generalist fit on the others, against RAUQ, perplexity, mean
    token entropy, TAD and the paper's MLP; then its first labels (recalibrate, head refit,
    in-domain refit)."""
    with user_errors():
        from actmap.experiments.out_of_domain import OutOfDomainConfig, leave_one_task_out

        config = OutOfDomainConfig(
            preset=preset,
            tad=tad,
            mlp=mlp,
            mlp_epochs=mlp_epochs,
            in_domain=in_domain,
            curve_k=parse_ints(k) if k.strip() else (),
            draws=draws,
            max_rejection=max_rejection,
            n_resamples=resamples,
        )
        result = leave_one_task_out(store, config, held_out or None, progress=console.print)
        write_result(out, "out_of_domain", result)
