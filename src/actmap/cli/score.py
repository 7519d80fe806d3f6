"""``actmap score``: p(correct) of answers made elsewhere, offline, into a CSV or Parquet table."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import console, progress_bar, user_errors
from actmap.errors import ActmapUserError

TABLE_SUFFIXES = (".csv", ".parquet")


@app.command()
def score(
    answers: Path = typer.Option(
        ...,
        help="JSONL file of {'prompt', 'answer', 'id'?, 'label'?, 'split'?} (as `actmap capture "
        "--answers`): each answer is read by one teacher-forced pass.",
    ),
    detector: Path = typer.Option(..., help="Run folder from `actmap train` (or one seed-<s>/)."),
    out: Path = typer.Option(..., "--out", "-o", help="Table of scores: .csv or .parquet."),
    model: str = typer.Option(
        "smollm2-135m-instruct",
        help="The weights that made the answers: short name, .gguf, folder or hub id.",
    ),  # fmt: skip
    seed: int = typer.Option(None, help="Seed of the run (default: best validation AUROC)."),
    policy: Path = typer.Option(None, help="Policy TOML (`actmap policy fit`); default p >= 0.5."),
    chat_template: bool = typer.Option(
        True, help="Wrap each prompt in the tokenizer's chat template (when it has one)."
    ),
    batch_size: int = typer.Option(16, min=1, help="Answers per teacher-forced pass."),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    dtype: str = typer.Option(None, help="Default: the dtype the detector's maps came from."),
) -> None:
    """Score existing answers with a detector: the same scores `POST /v1/actmap/score` gives."""
    with user_errors():
        if out.suffix not in TABLE_SUFFIXES:
            raise ActmapUserError(f"--out {out}: use a .csv or .parquet file name")
        import pandas as pd

        from actmap.atomic import atomic_path
        from actmap.data.promptfile import AnswersFileTask
        from actmap.serve.answers import score_pairs
        from actmap.serve.app import ServeSettings, build_engine

        task = AnswersFileTask(answers, chat_template=chat_template)
        examples = task.load_all()  # a bad line fails here, before any model loads
        settings = ServeSettings(
            model=model, detector=detector, seed=seed, policy=policy, device=device, dtype=dtype
        )
        engine = build_engine(settings)
        prompts = [task.prompt(e, engine.tokenizer) for e in examples]
        texts = [e.meta["answer"] for e in examples]
        with progress_bar() as bar:
            task_id = bar.add_task("scoring", total=len(examples), info="")
            scored = score_pairs(
                engine, prompts, texts, batch_size, lambda n: bar.advance(task_id, n)
            )
        labels = [int(e.meta["label"]) if "label" in e.meta else None for e in examples]
        table = pd.DataFrame(
            {
                "id": [e.source_key for e in examples],
                "split": [e.split for e in examples],
                "n_tokens": [a.n_tokens for a in scored],
                "p_correct": [a.p_correct for a in scored],
                "p_correct_raw": [a.p_correct_raw for a in scored],
                "decision": [a.decision for a in scored],
                "label": pd.array(labels, dtype="Int64"),
                "detector": engine.detector.id,
            }
        )
        with atomic_path(out) as tmp:
            if out.suffix == ".csv":
                table.to_csv(tmp, index=False)
            else:
                table.to_parquet(tmp, index=False)
    counts = table["decision"].value_counts().to_dict()
    console.print(
        f"{len(table)} answers scored with {engine.detector.id}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"; written to {out}"
    )
