"""``actmap compare-product`` and the ``actmap-plus`` branch of ``actmap train``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import typer

from actmap.atomic import atomic_write_text
from actmap.cli.app import app
from actmap.cli.common import console, user_errors


def train_plus_run(store_path: Path, out: Path) -> dict:
    """Fit actmap-plus on a store (settings chosen on validation), save it, score the test rows.

    Writes ``<out>/seed-0/{model.safetensors, config.json, test_scores.parquet, metrics.json}``
    and ``<out>/summary.json``, the layout `actmap compare --run` reads.
    """
    import numpy as np

    from actmap.artifacts import write_json
    from actmap.experiments.compare_product import plus_scored, store_rows
    from actmap.experiments.seeds import RowScores, scoring_metrics, summarize_runs
    from actmap.store import MapStore

    store = MapStore.open(store_path)
    sets = store_rows(store)
    plus = plus_scored(sets)
    est, test = plus.estimator, sets["test"]
    folder = out / "seed-0"
    inputs = {"store_config": store.manifest.get("config")}  # the map settings serving reads
    est.save(folder, metadata={"store": str(store_path), "inputs": inputs, **plus.details})
    logits = est.decision_function(test.maps, test.scalars)
    scores = RowScores(
        test.ids,
        test.labels,
        logits.astype(np.float32),
        est.predict_proba(test.maps, test.scalars).astype(np.float32),
    )
    scores.write_parquet(folder / "test_scores.parquet")
    metrics = scoring_metrics(scores)
    write_json(folder / "metrics.json", metrics)

    summary = summarize_runs([SimpleNamespace(seed=0, test_metrics=metrics)])
    write_json(out / "summary.json", {"detector": "actmap-plus", **summary, **plus.details})
    console.print(
        f"actmap-plus: {plus.details['selected']} on {plus.details['train_rows']} rows "
        f"(validation AUROC {plus.validation_auroc:.3f})"
    )
    return summary


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
        from rich.markdown import Markdown

        from actmap.artifacts import json_safe
        from actmap.detectors.base import CorrectnessDetector
        from actmap.experiments.compare_product import compare_product
        from actmap.store import MapStore

        vits = None
        if vit_run is not None:
            folders = sorted(vit_run.glob("seed-*"))
            if not folders:
                raise ValueError(f"{vit_run} has no seed-*/ folders; is it an `actmap train` run?")
            vits = [CorrectnessDetector.load(f, device=device) for f in folders]
        result = compare_product(
            MapStore.open(store),
            vit_epochs=vit_epochs,
            vit_detectors=vits,
            device=device,
            n_resamples=resamples,
            n_permutations=permutations,
        )
        text = result.to_markdown()
        console.print(Markdown(text))
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "comparison.md", text)
        atomic_write_text(
            out / "comparison.json", json.dumps(json_safe(result.to_json()), indent=2) + "\n"
        )
        console.print(f"written to {out / 'comparison.md'} and {out / 'comparison.json'}")
