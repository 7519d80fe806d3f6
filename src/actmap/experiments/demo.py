"""The demo: the main job on the embedded default model, end to end, as one function.

Generate with capture on built-in questions, label, store maps, train a detector
with the paper's recipe, and score the two controls (answer length alone, and
the detector refit on permuted labels) on the identical balanced test rows.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actmap.artifacts import json_safe
from actmap.atomic import atomic_write_text
from actmap.baselines.controls import AnswerLengthPredictor, PermutedLabelControl
from actmap.capture import CaptureConfig
from actmap.capture.overhead import measure_overhead
from actmap.capture.run import run_capture, store_config
from actmap.data.builtin import BuiltinArithmeticTask
from actmap.detectors.base import CorrectnessDetector
from actmap.detectors.inputs import DetectorInputs
from actmap.experiments.seeds import recipe_config, train_on_store
from actmap.llm.models import load_model
from actmap.maps import MapConfig
from actmap.scoring.metrics import compute_metrics
from actmap.store import MAP_BYTES, MapStore
from actmap.store.rows import natural_accuracy
from actmap.training.recipe import ProgressCallback

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoConfig:
    """The demo's size; the defaults are `make demo`'s."""

    questions: int = 400  # built-in questions to generate (about a quarter are answered right)
    detector: str = "mlp"  # mlp keeps the demo within minutes on CPU
    seeds: tuple[int, ...] = (42, 123, 456)
    max_epochs: int = 80  # the recipe's epoch cap
    overhead_repeats: int = 3  # interleaved plain/hooked repeats for the overhead figure
    batch_size: int = 32  # capture batch; the overhead figure is measured on the first batch

    def __post_init__(self) -> None:
        for name in ("questions", "max_epochs", "overhead_repeats", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.seeds:
            raise ValueError("seeds is empty")


def run_demo(
    out: str | Path,
    config: DemoConfig = DemoConfig(),
    on_stage: Callable[[str], None] | None = None,
    on_capture: Callable[[int], None] | None = None,
    on_epoch: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Run the demo into ``out`` (store, run folder, demo-summary.json); returns the summary.

    ``on_stage(text)`` announces each stage, ``on_capture(n)`` counts captured answers,
    ``on_epoch(epoch, info)`` follows training.
    """
    import torch

    out = Path(out)
    stage = on_stage or (lambda text: log.info("%s", text))
    started = time.perf_counter()
    task = BuiltinArithmeticTask(n_questions=config.questions)
    examples = task.load_all()
    capture = CaptureConfig(max_new_tokens=task.max_new_tokens, batch_size=config.batch_size)
    stage("loading the embedded default model (SmolLM2-135M-Instruct) ...")
    model, tokenizer, source = load_model()

    prompts = [task.prompt(e, tokenizer) for e in examples[: capture.batch_size]]
    stage(f"measuring the capture overhead on a batch of {len(prompts)} ...")
    overhead = measure_overhead(model, tokenizer, prompts, capture, repeats=config.overhead_repeats)
    stage(f"capture overhead measured: {overhead.describe()}")

    store = MapStore.create(out / "store", store_config(task, source, capture, MapConfig(), {}))
    stage(f"capturing {len(examples)} answers ...")
    summary = run_capture(
        model, tokenizer, source, task, examples, store, capture, progress=on_capture
    )
    del model
    stage(f"training {config.detector} on the balanced rows ...")
    train_config = recipe_config(config.max_epochs)
    runs, splits = train_on_store(
        out / "store",
        config.detector,
        config.seeds,
        out / f"run-{config.detector}",
        train_config,
        None,
        on_epoch,
    )

    # controls on the identical balanced rows
    meta = store.metadata().set_index("id")
    # the one input bundle, its generations standing in by their .n_tokens (all the length reads)
    rows = {
        s: DetectorInputs(generations=list(meta.loc[v.ids].itertuples())) for s, v in splits.items()
    }
    length_model = AnswerLengthPredictor().fit(rows["train"], splits["train"].labels)
    length_metrics = compute_metrics(
        length_model.score(rows["test"]).confidence, splits["test"].labels
    )
    permuted = PermutedLabelControl(
        CorrectnessDetector(config.detector, seed=42, config=train_config), seed=0
    ).fit(
        splits["train"].maps,
        splits["train"].labels,
        splits["validation"].maps,
        splits["validation"].labels,
    )
    permuted_metrics = compute_metrics(
        permuted.score(splits["test"].maps).confidence, splits["test"].labels
    )

    result = {
        "rows": summary.written + summary.skipped_existing,
        "empty_answers": summary.skipped_empty,
        "natural_accuracy": natural_accuracy(store),
        "balanced_rows": {s: len(v.ids) for s, v in splits.items()},
        "bytes_per_map": MAP_BYTES,
        "store_bytes_per_row": store_bytes(out / "store") / max(1, len(meta)),
        "capture_overhead": {
            "median_ratio_hooked_over_plain": overhead.median_ratio,
            "overhead_pct": overhead.overhead_pct,
            "plain_spread_pct": overhead.plain_spread_pct,
            "within_noise": overhead.within_noise,
            "described": overhead.describe(),
            "plain_s": overhead.plain_s,
            "hooked_s": overhead.hooked_s,
            "identical_tokens": overhead.identical_tokens,
            "batch": len(prompts),
            "repeats": config.overhead_repeats,
            "threads": torch.get_num_threads(),
        },
        "detector": {"name": config.detector, **runs.summary},
        "answer_length_only": length_metrics.__dict__,
        "permuted_labels": permuted_metrics.__dict__,
        "wall_time_s": time.perf_counter() - started,
    }
    atomic_write_text(out / "demo-summary.json", json.dumps(json_safe(result), indent=2))
    return result


def store_bytes(root: Path) -> int:
    """Bytes of every Parquet file of a store (maps, metadata, side tables)."""
    return sum(p.stat().st_size for p in root.rglob("*.parquet"))
