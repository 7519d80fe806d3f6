"""``actmap baselines`` (score a store's rows with every method) and ``actmap compare``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from actmap.atomic import atomic_write_text
from actmap.cli.app import app
from actmap.cli.common import (
    console,
    method_progress,
    progress_bar,
    quiet_transformers,
    user_errors,
)

STATUS_STYLE = {"done": "green", "skipped": "cyan", "unavailable": "yellow", "failed": "red"}


def print_results(results: dict) -> None:
    from rich.table import Table

    table = Table(title="baselines")
    for column in ("method", "status", "rows", "ms/answer", "note"):
        table.add_column(column)
    for name, result in results.items():
        latency = result.record.get("latency_ms_per_answer")
        table.add_row(
            name,
            f"[{STATUS_STYLE[result.status]}]{result.status}[/]",
            str(result.rows) if result.rows else "",
            "" if latency is None else f"{latency:.2f}",
            result.reason,
        )
    console.print(table)


@app.command("baselines")
def baselines_command(
    store: Path = typer.Option(..., help="Map store whose balanced rows are scored."),
    methods: str = typer.Option(
        "all",
        help="all, or comma-separated names: perplexity (ppl), mean_token_entropy (mte), "
        "answer_length, rauq, tad, p_true (ptrue), eigenscore, semantic_entropy (se), actvit, "
        "permuted_label.",
    ),
    model: str = typer.Option(
        None, help="Generator for P(True) and sampling (default: the store's own model)."
    ),
    judge: str = typer.Option(
        "qwen2.5-coder-1.5b-instruct",
        help="Semantic Entropy's entailment judge: qwen2.5-coder-1.5b-instruct, a .gguf path "
        "or model folder, or none.",
    ),
    judge_dtype: str = typer.Option(
        "float32", help="The LLM judge's weights: float32 | bfloat16 (faster on CPU) | float16."
    ),
    judge_prompt: str = typer.Option(
        "entailment",
        help="How SE asks the LLM judge: entailment (the Nature prompt, decoded) | same_answer "
        "(do the two answers name the same thing? yes vs no from one forward pass; small "
        "offline judges answer the Nature prompt 'neutral' to every pair).",
    ),
    force: bool = typer.Option(False, help="Recompute methods whose results are stored."),
    rows: str = typer.Option(
        "balanced",
        help="balanced: unsupervised methods score the balanced test rows; all-balanced: every "
        "balanced row. Supervised methods always fit on train, select on validation, score test.",
    ),
    n_samples: int = typer.Option(10, help="Sampled answers per prompt (SE, EigenScore)."),
    sample_max_new_tokens: int = typer.Option(
        None, help="Tokens per sampled answer (default: the store's capture setting)."
    ),
    actvit_grid: str = typer.Option(
        "full",
        help="full (24 configurations) | small (6: width 128, depth 1) | selected (1: the paper's selected configuration, no sweep).",
    ),
    actvit_epochs: int = typer.Option(15, help="ACT-ViT epochs per configuration and seed."),
    actvit_precision: str = typer.Option(
        "float32",
        help="ACT-ViT's forward pass: float32 | bfloat16 (autocast, float32 weights; about 2x "
        "faster at width 1024 on a CPU with AVX512-BF16). Recorded with each configuration.",
    ),
    actvit_micro_batch: int = typer.Option(
        None,
        help="ACT-ViT rows per forward pass; a batch of 128 is run in slices whose gradients "
        "add up (bounds memory: width 1024 with 1x1 patches needs about 14 GB at 128).",
    ),
    tad_previous: int = typer.Option(
        None, help="TAD's K previous tokens (default: min(10, keys in the store))."
    ),
    device: str = typer.Option(None, help="cpu | cuda (default: cuda when available)."),
) -> None:
    """Score the store's balanced rows with each baseline; results go into the store."""
    with user_errors():
        from actmap.baselines.runner import BaselineOptions, resolve_methods, run_baselines
        from actmap.store import MapStore

        names = resolve_methods(methods)
        options = BaselineOptions(
            force=force,
            model=model,
            device=device,
            judge=None if judge.lower() == "none" else judge,
            judge_dtype=judge_dtype,
            judge_prompt=judge_prompt,
            n_samples=n_samples,
            sample_max_new_tokens=sample_max_new_tokens,
            actvit_grid=actvit_grid,
            actvit_epochs=actvit_epochs,
            actvit_micro_batch=actvit_micro_batch,
            actvit_precision=actvit_precision,
            tad_previous=tad_previous,
        )
        the_store = MapStore.open(store)
        console.print(f"store {store}: methods {', '.join(names)}")
        with progress_bar() as bar, quiet_transformers():
            progress = method_progress(bar)
            results = run_baselines(the_store, names, rows=rows, progress=progress, options=options)
        print_results(results)
        if any(r.status == "failed" for r in results.values()):
            raise typer.Exit(1)


@app.command("compare")
def compare_command(
    store: Path = typer.Option(..., help="Map store holding baseline results."),
    run: list[Path] = typer.Option(
        None, help="Run folder written by `actmap train` (repeat for several)."
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="Markdown file (default <store>/compare.md); JSON beside it."
    ),
) -> None:
    """AUROC / AUPRC / ECE of every method on the store's balanced test rows, best first."""
    with user_errors():
        from rich.markdown import Markdown

        from actmap.artifacts import json_safe
        from actmap.report.side_by_side import compare_methods, format_table
        from actmap.store import MapStore

        rows = compare_methods(MapStore.open(store), run or [])
        text = format_table(rows)
        # a terminal gets the rendered table; a pipe or file the Markdown itself, unfolded
        console.print(Markdown(text) if console.is_terminal else text, soft_wrap=True)
        target = out or store / "compare.md"
        atomic_write_text(target, text)
        atomic_write_text(target.with_suffix(".json"), json.dumps(json_safe(rows), indent=2) + "\n")
        console.print(f"written to {target} and {target.with_suffix('.json')}")
