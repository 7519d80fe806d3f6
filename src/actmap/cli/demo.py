"""``actmap demo``: the main job on the embedded default model, end to end."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import (
    console,
    mean_std,
    parse_ints,
    progress_bar,
    quiet_transformers,
    user_errors,
)


@app.command()
def demo(
    out: Path = typer.Option(
        Path("demo-out"), "--out", "-o", help="Folder for the store and the runs."
    ),
    questions: int = typer.Option(400, help="Built-in questions to generate."),
    detector: str = typer.Option(
        "mlp", help="Detector to train (mlp keeps the demo within minutes on CPU)."
    ),
    seeds: str = typer.Option("42,123,456", help="Training seeds."),
    max_epochs: int = typer.Option(80, help="Epoch cap of the recipe."),
    overhead_repeats: int = typer.Option(
        3, help="Interleaved plain/hooked repeats for the overhead figure."
    ),
    batch_size: int = typer.Option(
        32, help="Capture batch; the overhead figure is measured on the first batch."
    ),
) -> None:
    """Generate with capture on built-in questions, label, store maps, train, and summarise."""
    with user_errors():
        from actmap.cli.train import SeedBars, print_summary
        from actmap.experiments.demo import DemoConfig, run_demo

        config = DemoConfig(
            questions, detector, parse_ints(seeds), max_epochs, overhead_repeats, batch_size
        )
        with progress_bar() as bar:
            capture = bar.add_task("capture", total=questions, info="", visible=False)
            on_epoch = SeedBars(bar, config.seeds, max_epochs, visible=False)

            def on_capture(n: int) -> None:
                bar.update(capture, visible=True)
                bar.advance(capture, n)

            with quiet_transformers():  # actmap shows its own progress
                result = run_demo(out, config, console.print, on_capture, on_epoch)
            on_epoch.finish()
        summary, overhead = result["detector"], result["capture_overhead"]
        length, permuted = result["answer_length_only"], result["permuted_labels"]
        print_summary(summary)
        console.print(
            f"\n[bold]actmap demo[/bold]: {result['rows']} answers, natural accuracy "
            f"{result['natural_accuracy']['all']:.3f}, balanced rows {result['balanced_rows']}\n"
            f"map: {result['bytes_per_map']:,} bytes (float16 12x32x128); store: "
            f"{result['store_bytes_per_row']:,.0f} bytes/row with metadata and side tables\n"
            f"capture overhead (batch {overhead['batch']}): {overhead['described']}, "
            f"hooked/plain {overhead['median_ratio_hooked_over_plain']:.3f}; "
            f"identical tokens: {overhead['identical_tokens']}\n"
            f"{detector} test AUROC {mean_std(summary['mean']['auroc'], summary['std']['auroc'])}, "
            f"ECE {summary['mean']['ece']:.3f} | answer length only AUROC {length['auroc']:.3f} | "
            f"permuted labels AUROC {permuted['auroc']:.3f}\n"
            f"summary: {out / 'demo-summary.json'} ({result['wall_time_s']:.0f} s)"
        )
