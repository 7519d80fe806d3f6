"""``actmap train`` and ``actmap evaluate``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from actmap.atomic import atomic_write_text
from actmap.cli import app
from actmap.cli.common import console, parse_ints, progress_bar, user_errors
from actmap.errors import ActmapUserError


def load_balanced(store_path: Path):
    """{split: LabeledMaps} on the store's balanced rows, plus the store."""
    import numpy as np

    from actmap.rows import balanced_splits
    from actmap.store import MapStore
    from actmap.training import LabeledMaps

    store = MapStore.open(store_path)
    chosen = balanced_splits(store)
    out = {}
    for split, ids in chosen.items():
        if not ids:
            raise ActmapUserError(
                f"the balanced '{split}' split of {store_path} is empty (need both labels)"
            )
        maps, meta = store.load_maps(ids)
        finite = np.isfinite(maps.reshape(len(maps), -1)).all(axis=1)
        if not finite.all():
            bad = [key for key, ok in zip(ids, finite, strict=True) if not ok]
            raise ActmapUserError(
                f"store {store_path}: the map of id '{bad[0]}' has NaN or infinite values "
                f"({len(bad)} such maps in its balanced '{split}' split)"
            )
        out[split] = LabeledMaps(maps, meta["label"].to_numpy().astype("int64"), ids)
    return out, store


def recipe_config(max_epochs: int | None = None):
    """The paper's training recipe, with an optional epoch cap (tests, quick looks, CPU)."""
    from dataclasses import replace

    from actmap.training import TrainConfig

    return TrainConfig() if max_epochs is None else replace(TrainConfig(), max_epochs=max_epochs)


def train_on_store(
    store_path: Path,
    detector: str,
    seeds: tuple[int, ...],
    out: Path,
    max_epochs: int | None,
    device: str | None,
):
    """The paper's recipe on a store's balanced rows, with a progress bar per seed.

    Returns the seed runs and the balanced splits they were trained and tested on.
    """
    from actmap.training import run_seeds

    splits, store = load_balanced(store_path)
    config = recipe_config(max_epochs)
    sizes = {s: len(v.ids) for s, v in splits.items()}
    console.print(f"balanced rows: {sizes}; detector {detector}; seeds {seeds}")
    with progress_bar() as bar:
        jobs = {s: bar.add_task(f"seed {s}", total=config.max_epochs, info="") for s in seeds}

        def progress(epoch: int, info: dict) -> None:
            job = jobs[int(info["seed"])]
            text = f"loss {info.get('train_loss', float('nan')):.3f} val AUROC {info.get('val_auroc', float('nan')):.3f}"
            bar.update(job, completed=epoch + 1, info=text)

        runs = run_seeds(
            splits["train"],
            splits["validation"],
            splits["test"],
            out,
            detector=detector,
            config=config,
            seeds=seeds,
            device=device,
            inputs={
                "store": str(store_path),
                "store_created_at": store.manifest.get("created_at"),
                "store_config": store.manifest.get("config"),
                "balanced_rows": sizes,
            },
            progress=progress,
        )
        for job in jobs.values():  # early-stopped seeds end before max_epochs
            bar.update(job, completed=config.max_epochs)
    return runs, splits


@app.command()
def train(
    store: Path = typer.Option(..., help="Map store to train on (its balanced rows)."),
    out: Path = typer.Option(..., "--out", "-o", help="Run folder: one seed-<s>/ per seed."),
    detector: str = typer.Option(
        "vit",
        help="vit | mlp | mlp4x | logreg (the paper's), or actmap-plus (the one to deploy: "
        "map PCA + per-answer scalars, settings chosen on validation; ignores seeds/epochs).",
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
) -> None:
    """Train a detector with the paper's recipe, one run per seed, and test each selected checkpoint once."""
    with user_errors():
        from actmap.runs import extend_run_record, prepare_run_folder
        from actmap.training import resolve_device

        resolve_device(device)  # a device this machine lacks fails before any work
        if detector == "actmap-plus":
            from actmap.cli.product import train_plus_run

            prepare_run_folder(out, detector, None, overwrite)
            print_summary(train_plus_run(store, out))
            console.print(f"run written to {out}")
            return
        prepare_run_folder(out, detector, recipe_config(max_epochs).to_dict(), overwrite)
        train_on_store(store, detector, parse_ints(seeds), out, max_epochs, device)
        print_summary(extend_run_record(out))
        console.print(f"run written to {out}")


def print_summary(summary: dict) -> None:
    from rich.table import Table

    detector = summary.get("detector")
    title = f"{detector + ' ' if detector else ''}test metrics (balanced rows)"
    table = Table(title=title)
    for column in ("seed", "AUROC", "AUPRC", "ECE"):
        table.add_column(column)
    for seed, m in summary["per_seed"].items():
        table.add_row(seed, f"{m['auroc']:.3f}", f"{m['auprc']:.3f}", f"{m['ece']:.3f}")
    mean, std = summary["mean"], summary["std"]
    table.add_row(
        "mean ± std", *(f"{mean[k]:.3f} ± {std[k]:.3f}" for k in ("auroc", "auprc", "ece"))
    )
    console.print(table)


@app.command()
def evaluate(
    run: Path = typer.Option(..., help="Run folder written by `actmap train`."),
    store: Path = typer.Option(
        None,
        help="Score this store's balanced test rows with the frozen detectors "
        "(transfer); default: the run's own test scores.",
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="JSON file for the metrics (default <run>/evaluation.json)."
    ),
) -> None:
    """AUROC / AUPRC / ECE per seed and their mean, written as JSON."""
    with user_errors():
        import numpy as np
        import pandas as pd

        from actmap.detectors.base import CorrectnessDetector
        from actmap.metrics import compute_metrics, seed_summary
        from actmap.runs import read_run

        checked = read_run(run)  # one detector, one recipe: its seeds can be averaged
        seed_dirs = list(checked.seed_dirs.values())
        per_seed = {}
        if store is not None:
            splits, _ = load_balanced(store)
            test = splits["test"]
        for folder in seed_dirs:
            if store is None:
                scores = pd.read_parquet(folder / "test_scores.parquet")
                probs, labels = scores["p_correct"].to_numpy(), scores["label"].to_numpy()
            else:
                detector = CorrectnessDetector.load(folder)
                probs, labels = detector.predict_proba(test.maps), np.asarray(test.labels)
            per_seed[folder.name.split("-", 1)[1]] = compute_metrics(probs, labels).__dict__
        names = ("auroc", "auprc", "ece")
        mean_std = {k: seed_summary([m[k] for m in per_seed.values()]) for k in names}
        result = {
            "run": str(run),
            "detector": checked.detector,
            "store": str(store) if store else None,
            "per_seed": per_seed,
            "mean": {k: v[0] for k, v in mean_std.items()},
            "std": {k: v[1] for k, v in mean_std.items()},
        }
        print_summary(result)
        target = out or run / "evaluation.json"
        atomic_write_text(target, json.dumps(result, indent=2, default=float))
        console.print(f"metrics written to {target}")
