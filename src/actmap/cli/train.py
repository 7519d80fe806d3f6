"""``actmap train`` and ``actmap evaluate``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from actmap.atomic import atomic_write_text
from actmap.cli.app import app
from actmap.cli.common import (
    console,
    mean_std,
    parse_ints,
    progress_bar,
    sampling_option,
    user_errors,
)


def train_with_progress(
    store_path: Path,
    detector: str,
    seeds: tuple[int, ...],
    out: Path | None,
    max_epochs: int | None,
    device: str | None,
):
    """`actmap.experiments.seeds.train_on_store` with a progress bar per seed."""
    from actmap.experiments.seeds import load_balanced, recipe_config, train_on_store

    config = recipe_config(max_epochs)
    splits, store = load_balanced(store_path)  # bad rows fail before any progress bar
    sizes = {s: len(v.row_ids()) for s, v in splits.items()}
    console.print(f"balanced rows: {sizes}; detector {detector}; seeds {seeds}")
    with progress_bar() as bar:
        progress = SeedBars(bar, seeds, config.max_epochs)
        runs, splits = train_on_store(
            store_path, detector, seeds, out, config, device, progress, (splits, store)
        )
        progress.finish()
    return runs, splits


class SeedBars:
    """One progress task per training seed, counting its epochs up to the recipe's cap; called
    as a training progress callback ``(epoch, info)``. Hidden tasks (``visible=False``) show
    from their seed's first epoch; `finish` fills the seeds early stopping ended sooner."""

    def __init__(self, bar, seeds, max_epochs: int, visible: bool = True) -> None:
        self.bar, self.max_epochs = bar, max_epochs
        self.jobs = {
            int(s): bar.add_task(f"seed {s}", total=max_epochs, info="", visible=visible)
            for s in seeds
        }

    def __call__(self, epoch: int, info: dict) -> None:
        loss, auroc = info.get("train_loss", float("nan")), info.get("val_auroc", float("nan"))
        text = f"loss {loss:.3f} val AUROC {auroc:.3f}"
        self.bar.update(self.jobs[int(info["seed"])], completed=epoch + 1, info=text, visible=True)

    def finish(self) -> None:
        for job in self.jobs.values():  # early-stopped seeds end before max_epochs
            self.bar.update(job, completed=self.max_epochs, visible=True)


@app.command()
def train(
    store: list[Path] = typer.Option(
        ...,
        help="Map store to train on (its balanced rows). Repeat it for a generalist over "
        "several tasks of one generator (actmap-plus stacked presets; `actmap out-of-domain`).",
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Run folder: one seed-<s>/ per seed."),
    detector: str = typer.Option(
        None,
        help="vit | mlp | mlp4x | logreg (the paper's), or actmap-plus:v1 | "
        "actmap-plus:deployable | actmap-plus:full (the one to deploy; choices on validation; "
        "ignores seeds/epochs), or plain actmap-plus with --preset. Default: vit; with "
        "--generalist, the generalist's own.",
        show_default=False,
    ),
    generalist: Path = typer.Option(
        None,
        help="A generalist run (`actmap train --store A --store B ...`): adapt it to --store, "
        "a new task's small store of labelled answers, instead of training from scratch "
        "(see --adapt).",
    ),
    adapt: str = typer.Option(
        "auto",
        help="With --generalist: recalibrate (prior and temperature of its logit) | head refit "
        "(the stack's head on its block logits) | auto (head refit once each class holds 10 "
        "labelled rows, else recalibrate: the cheapest step that paid in docs/out_of_domain.md).",
    ),
    preset: str = typer.Option(
        None,
        help="With plain actmap-plus (alone it means actmap-plus:v1): v1 (map PCA + six "
        "scalars) | full (the stacked version: map, scalars, position probes, lookback "
        "attention, RAUQ, TAD; what the store holds) | deployable (stacked, no attention "
        "weights: what vLLM gives) | auto (the richest the store can train: full with position "
        "states and attention weights, deployable with position states, else v1). A "
        "generalist (several --store) takes auto when none is given.",
    ),
    fallback: bool = typer.Option(
        True,
        help="Stacked presets: fit one regression on the map and scalars beside the stack and "
        "keep it instead when it ranks validation better (few correct training answers).",
    ),
    seeds: str = typer.Option("42,123,456", help="Comma-separated seeds."),
    max_epochs: int = typer.Option(
        None, help="Override the recipe's 80 epochs (tests, quick looks)."
    ),
    device: str = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Delete --out first. Without it, --out may only hold seeds of the same detector "
        "and recipe (they are extended).",
    ),
    sampling: str = sampling_option(),
) -> None:
    """Train a detector with the paper's recipe, one run per seed, and test each selected checkpoint once."""
    from actmap.store.served import served_sampling

    with user_errors(), served_sampling(sampling):
        from actmap.device import resolve_device
        from actmap.experiments.seeds import recipe_config
        from actmap.training.run_folder import extend_run_record, prepare_run_folder

        resolve_device(device)  # a device this machine lacks fails before any work
        if generalist is not None:
            from actmap.cli.out_of_domain import adapt_generalist_run

            prepare_run_folder(out, "actmap-plus", None, overwrite)
            adapt_generalist_run(store, generalist, out, detector, adapt)
            console.print(f"run written to {out}")
            return
        detector = detector or "vit"
        if len(store) > 1:
            from actmap.cli.out_of_domain import train_generalist

            prepare_run_folder(out, detector, None, overwrite)
            print_summary(train_generalist(store, out, detector, preset or "auto", fallback))
            console.print(f"run written to {out}")
            return
        store = store[0]
        if detector.startswith("actmap-plus"):
            from actmap.experiments.stacked import plus_preset, train_plus_preset

            preset = plus_preset(detector, preset)
            prepare_run_folder(out, "actmap-plus", None, overwrite)
            chosen, summary, details = train_plus_preset(store, out, preset, fallback)
            if preset == "auto":
                console.print(f"actmap-plus preset: {chosen} (what {store} holds)")
            if chosen == "v1":
                console.print(
                    f"actmap-plus: {details['selected']} on {details['train_rows']} rows "
                    f"(validation AUROC {details['validation_auroc']:.3f})"
                )
            else:
                console.print(f"actmap-plus ({chosen}): blocks {', '.join(details['selected'])}")
            print_summary(summary)
            console.print(f"run written to {out}")
            return
        prepare_run_folder(out, detector, recipe_config(max_epochs).to_dict(), overwrite)
        train_with_progress(store, detector, parse_ints(seeds), out, max_epochs, device)
        print_summary(extend_run_record(out))
        console.print(f"run written to {out}")


def print_summary(summary: dict) -> None:
    from rich.table import Table

    detector = summary.get("detector")
    rows = summary.get("rows", "balanced")  # what `evaluate --rows` scored; training: balanced
    scored = (
        "test metrics (balanced rows)"
        if rows == "balanced"
        else f"metrics ({rows} rows: n={summary.get('n')}, {summary.get('n_correct')} correct)"
    )
    title = f"{detector + ' ' if detector else ''}{scored}"
    table = Table(title=title)
    for column in ("seed", "AUROC", "AUPRC", "ECE"):
        table.add_column(column)
    for seed, m in summary["per_seed"].items():
        table.add_row(seed, f"{m['auroc']:.3f}", f"{m['auprc']:.3f}", f"{m['ece']:.3f}")
    mean, std = summary["mean"], summary["std"]
    one_seed = len(summary["per_seed"]) == 1
    table.add_row(
        "(one seed: no spread)" if one_seed else "mean ± std",
        *(mean_std(mean[k], std[k]) for k in ("auroc", "auprc", "ece")),
    )
    console.print(table)


@app.command()
def evaluate(
    run: Path = typer.Option(..., help="Run folder written by `actmap train`."),
    store: Path = typer.Option(
        None,
        help="Score this store's rows (see --rows) with the frozen detectors "
        "(transfer); default: the run's own test scores.",
    ),
    rows: str = typer.Option(
        "balanced",
        help="With --store: balanced (its balanced test split) | test (every labelled test "
        "row, natural prevalence; empty answers count as incorrect) | all (every labelled row). "
        "The store is only read.",
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="JSON file for the metrics (default <run>/evaluation.json)."
    ),
    sampling: str = sampling_option(),
) -> None:
    """AUROC / AUPRC / ECE per seed and their mean, written as JSON."""
    from actmap.store.served import served_sampling

    with user_errors(), served_sampling(sampling):
        from actmap.experiments.seeds import evaluate_run

        result = evaluate_run(run, store, rows)
        print_summary(result)
        target = out or run / "evaluation.json"
        atomic_write_text(target, json.dumps(result, indent=2, default=float))
        console.print(f"metrics written to {target}")
