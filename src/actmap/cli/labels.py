"""``actmap relabel`` and ``actmap judge``: new labels for a store without generating again."""

from __future__ import annotations

from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import (
    JUDGE_DTYPE_HELP,
    console,
    fraction,
    progress_bar,
    user_errors,
)
from actmap.errors import ActmapUserError


def announce_judge(spec: str) -> None:
    console.print(f"loading judge [bold]{spec}[/bold] ...")


@app.command()
def relabel(
    store: Path = typer.Option(..., help="A QA store (TriviaQA, NQ-Open, prompts with answers)."),
    rule: str = typer.Option(..., help="Label rule: paper | contains."),
    out: Path = typer.Option(..., "--out", "-o", help="New store folder (shares side tables)."),
) -> None:
    """Relabel a store under another named rule, without generating again."""
    with user_errors():
        from actmap.labelling.relabel import relabel_store
        from actmap.store import MapStore
        from actmap.store.rows import natural_accuracy

        new = relabel_store(MapStore.open(store), out, rule)
        accuracy = natural_accuracy(new)
        console.print(
            f"relabelled under rule '{rule}' into {out}; natural accuracy "
            + ", ".join(f"{k} {fraction(v)}" for k, v in accuracy.items())
        )


judge_app = typer.Typer(
    help="Label summaries with a factuality judge, or check a judge first (`actmap judge check`).",
    invoke_without_command=True,
)
app.add_typer(judge_app, name="judge")


@judge_app.callback()
def judge_command(
    ctx: typer.Context,
    store: Path = typer.Option(None, help="A CNN/DM store captured without a judge."),
    judge: str = typer.Option(
        None, help="A causal LM (e.g. a .gguf path of Qwen2.5-Coder-1.5B) or 'minicheck:<path>'."
    ),
    out: Path = typer.Option(
        None, "--out", "-o", help="Judged store folder (created, or resumed when it exists)."
    ),
    threshold: float = typer.Option(0.5, help="Support a sentence needs (MiniCheck: 0.5)."),
    batch_size: int = typer.Option(8, min=1, help="Summaries per committed batch."),
    limit: int = typer.Option(None, min=1, help="Judge at most this many summaries in this call."),
    up_to: int = typer.Option(
        None, min=1, help="Stop once this many summaries are judged in --out, over every call."
    ),
    judge_dtype: str = typer.Option("float32", help=JUDGE_DTYPE_HELP),
) -> None:
    """Label the summaries of a store with a factuality judge (resumable, separate pass)."""
    if ctx.invoked_subcommand is not None:
        return
    with user_errors():
        from actmap.labelling.judge_pass import judge_store, judged_labels
        from actmap.store import MapStore
        from actmap.store.rows import natural_accuracy

        missing = [
            f"--{n}" for n, v in (("store", store), ("judge", judge), ("out", out)) if v is None
        ]
        if missing:
            raise ActmapUserError(
                f"actmap judge needs {', '.join(missing)} (or `actmap judge check` to check a judge)"
            )
        source = MapStore.open(store)
        from actmap.data.factuality import load_factuality_judge

        the_judge = load_factuality_judge(judge, judge_dtype, lazy=True, on_load=announce_judge)
        total = len(source.ids("maps"))
        with progress_bar() as bar:
            job = bar.add_task("judge summaries", total=min(total, up_to or total), info="")
            judged = judge_store(
                source,
                out,
                the_judge,
                threshold=threshold,
                batch_size=batch_size,
                limit=limit,
                progress=lambda n: bar.advance(job, n),
                resumed=lambda n: bar.resume(job, n),
                up_to=up_to,
            )
        accuracy = natural_accuracy(judged)
        console.print(
            f"{len(judged_labels(judged))} of {total} summaries judged into {out}; "
            "factual fraction " + ", ".join(f"{k} {fraction(v)}" for k, v in accuracy.items())
        )


@judge_app.command("check")
def judge_check_command(
    judge: str = typer.Option(
        ..., help="A causal LM (e.g. a .gguf path of Qwen2.5-Coder-1.5B) or 'minicheck:<path>'."
    ),
    pairs: int = typer.Option(500, min=1, help="CNN/DM validation articles, two claims each."),
    out: Path = typer.Option(
        ..., "--out", "-o", help="Folder for the resumable cache and check.json."
    ),
    threshold: float = typer.Option(0.5, help="Support that counts as 'supported'."),
    seed: int = typer.Option(0, help="Seed of the article order and the foreign claims."),
    data_dir: Path = typer.Option(None, help="Folder holding cnn_dm/ (default ../shared/data)."),
    judge_dtype: str = typer.Option("float32", help=JUDGE_DTYPE_HELP),
) -> None:
    """Can the judge tell an article's own highlight from another article's? Accuracy, AUROC, s/claim."""
    with user_errors():
        from actmap.artifacts import write_json
        from actmap.data.datasets import load_cnn_dm
        from actmap.labelling.judge_pass import CHECK_RESULT, claim_pairs, judge_check

        rows = [r for r in load_cnn_dm(data_dir) if r.meta.get("source_split") == "validation"]
        the_pairs = claim_pairs(rows, pairs, seed)
        from actmap.data.factuality import load_factuality_judge

        the_judge = load_factuality_judge(judge, judge_dtype, lazy=True, on_load=announce_judge)
        with progress_bar() as bar:
            job = bar.add_task("judge check", total=len(the_pairs), info="")
            result = judge_check(
                the_judge,
                the_pairs,
                out,
                threshold,
                progress=lambda n: bar.advance(job, n),
                resumed=lambda n: bar.resume(job, n),
            )
        write_json(Path(out) / CHECK_RESULT, result.to_json())
        console.print(
            f"judge {result.judge}: {result.pairs} pairs, accuracy {result.accuracy:.3f}, "
            f"AUROC {result.auroc}, {result.seconds_per_claim:.2f} s per claim; "
            f"written to {Path(out) / CHECK_RESULT}"
        )
