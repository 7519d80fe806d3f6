"""``actmap demo``: the main job on the embedded default model, end to end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from actmap.cli import app
from actmap.cli.common import console, progress_bar, quiet_transformers, user_errors


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
) -> None:
    """Generate with capture on built-in questions, label, store maps, train, and summarise."""
    with user_errors():
        import torch

        from actmap.atomic import atomic_write_text
        from actmap.baselines.controls import AnswerLengthPredictor, PermutedLabelControl
        from actmap.capture import CaptureConfig
        from actmap.capture.overhead import measure_overhead
        from actmap.capture.run import natural_accuracy, run_capture, store_config
        from actmap.cli.common import parse_ints
        from actmap.cli.train import print_summary, recipe_config, train_on_store
        from actmap.data.builtin import BuiltinArithmeticTask
        from actmap.detectors.base import CorrectnessDetector
        from actmap.maps import MapConfig
        from actmap.metrics import compute_metrics
        from actmap.models import load_model
        from actmap.store import MAP_BYTES, MapStore

        started = time.perf_counter()
        task = BuiltinArithmeticTask(n_questions=questions)
        examples = task.load_all()
        config = CaptureConfig(max_new_tokens=task.max_new_tokens, batch_size=32)
        with (
            console.status("loading the embedded default model (SmolLM2-135M-Instruct) ..."),
            quiet_transformers(),
        ):
            model, tokenizer, source = load_model()

        prompts = [task.prompt(e, tokenizer) for e in examples[: config.batch_size]]
        with console.status(
            f"measuring capture overhead: {overhead_repeats} interleaved plain/hooked "
            f"generations of {len(prompts)} prompts ..."
        ):
            overhead = measure_overhead(model, tokenizer, prompts, config, repeats=overhead_repeats)
        console.print(f"capture overhead measured: {overhead.overhead_pct:+.1f}%")

        store = MapStore.create(out / "store", store_config(task, source, config, MapConfig(), {}))
        with progress_bar() as bar:
            job = bar.add_task("capture", total=len(examples), info="")
            summary = run_capture(
                model,
                tokenizer,
                source,
                task,
                examples,
                store,
                config,
                progress=lambda n: bar.advance(job, n),
            )
        del model
        runs, splits = train_on_store(
            out / "store", detector, parse_ints(seeds), out / f"run-{detector}", max_epochs, None
        )

        # controls on the identical balanced rows
        meta = store.metadata().set_index("id")
        rows = {s: list(meta.loc[v.ids].itertuples()) for s, v in splits.items()}  # .n_tokens
        length_model = AnswerLengthPredictor().fit(rows["train"], splits["train"].labels)
        length_metrics = compute_metrics(
            length_model.score(rows["test"]).confidence, splits["test"].labels
        )
        permuted = PermutedLabelControl(
            CorrectnessDetector(detector, seed=42, config=recipe_config(max_epochs)), seed=0
        ).fit(
            splits["train"].maps,
            splits["train"].labels,
            splits["validation"].maps,
            splits["validation"].labels,
        )
        permuted_metrics = compute_metrics(
            permuted.score(splits["test"].maps).confidence, splits["test"].labels
        )

        accuracy = natural_accuracy(store)
        result = {
            "rows": summary.written + summary.skipped_existing,
            "empty_answers": summary.skipped_empty,
            "natural_accuracy": accuracy,
            "balanced_rows": {s: len(v.ids) for s, v in splits.items()},
            "bytes_per_map": MAP_BYTES,
            "store_bytes_per_row": _store_bytes(out / "store") / max(1, len(meta)),
            "capture_overhead": {
                "median_ratio_hooked_over_plain": overhead.median_ratio,
                "overhead_pct": overhead.overhead_pct,
                "plain_s": overhead.plain_s,
                "hooked_s": overhead.hooked_s,
                "identical_tokens": overhead.identical_tokens,
                "batch": len(prompts),
                "threads": torch.get_num_threads(),
            },
            "detector": {"name": detector, **runs.summary},
            "answer_length_only": length_metrics.__dict__,
            "permuted_labels": permuted_metrics.__dict__,
            "wall_time_s": time.perf_counter() - started,
        }
        atomic_write_text(out / "demo-summary.json", json.dumps(result, indent=2, default=float))
        print_summary(runs.summary)
        console.print(
            f"\n[bold]actmap demo[/bold]: {result['rows']} answers, natural accuracy {accuracy['all']:.3f}, "
            f"balanced rows {result['balanced_rows']}\n"
            f"map: {MAP_BYTES:,} bytes (float16 12x32x128); store: {result['store_bytes_per_row']:,.0f} bytes/row "
            f"with metadata and side tables\n"
            f"capture overhead (batch {len(prompts)}, median of {overhead_repeats}): "
            f"{overhead.overhead_pct:+.1f}% (hooked/plain {overhead.median_ratio:.3f}); "
            f"identical tokens: {overhead.identical_tokens}\n"
            f"{detector} test AUROC {runs.summary['mean']['auroc']:.3f} ± {runs.summary['std']['auroc']:.3f}, "
            f"ECE {runs.summary['mean']['ece']:.3f} | answer length only AUROC {length_metrics.auroc:.3f} | "
            f"permuted labels AUROC {permuted_metrics.auroc:.3f}\n"
            f"summary: {out / 'demo-summary.json'} ({result['wall_time_s']:.0f} s)"
        )


def _store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.parquet"))
