"""``actmap compare-product``: actmap-plus against the strongest baseline and the ViT."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, user_errors, write_result


@app.command("compare-product")
def compare_product_command(
    store: Path = typer.Option(..., help="Map store (with 'generations' and 'attention' tables)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for comparison.{md,json}."),
    vit_run: Path = typer.Option(
        None, help="`actmap train --detector vit` run on this store: load its seeds, no training."
    ),
    vit_epochs: int = typer.Option(80, help="ViT epochs when training here (no --vit-run)."),
    permutations: int = typer.Option(3, help="Permuted-label refits per supervised method."),
    resamples: int = typer.Option(2000, help="Bootstrap resamples."),
    device: str = typer.Option(None, help="cpu | cuda for the ViT (default: cuda when available)."),
) -> None:
    """actmap-plus vs the strongest single-pass baseline vs the paper's ViT, with intervals."""
    with user_errors():
        from actmap.detectors import load_detector
        from actmap.experiments.compare_product import compare_product
        from actmap.store import MapStore
        from actmap.training.run_folder import seed_folders

        vits = None
        if vit_run is not None:
            folders = list(seed_folders(vit_run).values())
            if not folders:
                raise ValueError(f"{vit_run} has no seed-*/ folders; is it an `actmap train` run?")
            vits = [load_detector(f, device=device) for f in folders]
        result = compare_product(
            MapStore.open(store),
            vit_epochs=vit_epochs,
            vit_detectors=vits,
            device=device,
            n_resamples=resamples,
            n_permutations=permutations,
        )
        write_result(out, "comparison", result)


@app.command("compare-stacked")
def compare_stacked_command(
    store: Path = typer.Option(..., help="Map store (positions and attention when kept)."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for stacked.{md,json}."),
    presets: str = typer.Option("deployable,full", help="Comma-separated presets."),
    resamples: int = typer.Option(2000, help="Bootstrap resamples."),
    v1: bool = typer.Option(
        True, help="Also fit actmap-plus v1 (map PCA + scalars) for reference."
    ),
    cross_fit: int = typer.Option(
        0,
        help="K >= 3: instead, a K-fold cross-fit over every labelled row (each row tested "
        "once; no v1; writes cross_fit.{md,json}).",
    ),
) -> None:
    """The stacked actmap-plus's presets vs every single-pass baseline, with paired intervals."""
    with user_errors():
        from actmap.store import MapStore

        wanted = [p.strip() for p in presets.split(",") if p.strip()]
        if cross_fit:
            from actmap.experiments.cross_fit import cross_fitted_comparison

            result = cross_fitted_comparison(
                MapStore.open(store), cross_fit, wanted, n_resamples=resamples
            )
            name = "cross_fit"
        else:
            from actmap.experiments.stacked import compare_stacked

            result = compare_stacked(
                MapStore.open(store), wanted, n_resamples=resamples, with_v1=v1
            )
            name = "stacked"
        write_result(out, name, result)


@app.command("cascade")
def cascade_command(
    small_store: Path = typer.Option(..., help="The small model's store (the answers routed)."),
    large_store: Path = typer.Option(
        ..., help="The large model's store on the same questions (`actmap capture --splits test`)."
    ),
    run: Path = typer.Option(
        None, help="`actmap train` run on the small store: routing by actmap p(correct)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for cascade.{md,json,png}."),
    split: str = typer.Option("test", help="The split of the small store the questions come from."),
    shares: str = typer.Option("0.1,0.2,0.3,0.5", help="Routed shares, comma-separated."),
    baselines: str = typer.Option(
        "perplexity,rauq,answer_length", help="Baselines routed by, read from the small store."
    ),
    resamples: int = typer.Option(2000, min=1, help="Bootstrap resamples."),
) -> None:
    """Final accuracy when the small model's least trusted answers go to a large model: by
    actmap p(correct) vs baselines, random and the oracle, with paired intervals and a plot."""
    with user_errors():
        from actmap.errors import ActmapUserError
        from actmap.experiments.cascade import cascade_inputs, measure_cascade, plot_cascade
        from actmap.store import MapStore

        try:
            wanted = [float(q) for q in shares.split(",") if q.strip()]
        except ValueError:
            raise ActmapUserError(f"--shares must be numbers in [0, 1], got {shares!r}") from None
        methods = [m.strip() for m in baselines.split(",") if m.strip()]
        inputs = cascade_inputs(
            MapStore.open(small_store), MapStore.open(large_store), run, split, methods
        )
        about = {"small_store": str(small_store), "large_store": str(large_store),
                 "run": str(run) if run else None, "split": split, "unavailable": inputs.unavailable}  # fmt: skip
        result = measure_cascade(
            inputs.small, inputs.large, inputs.routers, wanted, n_resamples=resamples, about=about
        )
        write_result(out, "cascade", result)
        for method, why in inputs.unavailable.items():
            console.print(f"[yellow]{method} unavailable:[/yellow] {why}")
        plot_cascade(result, out / "cascade.png")
        console.print(f"plot written to {out / 'cascade.png'}")
