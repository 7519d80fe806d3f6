"""``actmap capture``: generate answers with the hooks on and store their maps.

The command parses its options into an `actmap.capture.job.CaptureJob`, hands it to
`capture_store` (the library does the rest) and prints what was written.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path

import typer

from actmap.capture.job import AUTO_SHARE_PREFIX, SPLITS, CaptureJob, CaptureProgress, comma_list
from actmap.capture.needs import CAPTURE_NEEDS
from actmap.cli.app import app
from actmap.cli.common import (
    console,
    fraction,
    progress_bar,
    quiet_transformers,
    tensor_parallel_option,
    user_errors,
    vllm_compile_option,
)
from actmap.llm.models import DTYPE_HELP


@app.command()
def capture(
    out: Path = typer.Option(
        ..., "--out", "-o", help="Store folder (created, or resumed when it exists)."
    ),
    task: str = typer.Option("builtin", help="builtin | gsm8k | nq_open | triviaqa | cnn_dm"),
    prompts: Path = typer.Option(
        None,
        help="JSONL file of {'prompt', 'id'?, 'answers'?, 'split'?} instead of a task; "
        "each prompt is answered once.",
    ),
    answers: Path = typer.Option(
        None,
        help="JSONL file of {'prompt', 'answer', 'id'?, 'answers'?, 'label'?, 'split'?}: "
        "answers made elsewhere, read by one teacher-forced pass each (no generation).",
    ),
    model: str = typer.Option(
        "smollm2-135m-instruct", help="Embedded name, .gguf path, local folder or hub id."
    ),
    revision: str = typer.Option("main", help="Hub revision of the model."),
    limit: int = typer.Option(None, min=1, help="At most this many examples per split."),
    splits: str = typer.Option(",".join(SPLITS), help="Comma-separated splits to capture."),
    batch_size: int = typer.Option(32, min=1, help="Prompts per generation batch."),
    max_new_tokens: int = typer.Option(
        None, min=1, help="Default: the task's (32 short answers, 384 summaries)."
    ),
    keep_trajectories: bool = typer.Option(
        False, help="Also store pooled L x T x 128 trajectories (ablations)."
    ),
    attention_keys: int = typer.Option(
        0, min=0, help="Keep attention to the K previous tokens (RAUQ/TAD need 10)."
    ),
    keep_dense: bool = typer.Option(
        False, help="Keep unpooled states of the first 100 tokens (ACT-ViT)."
    ),
    lookback_attention: bool = typer.Option(
        False,
        help="With --attention-keys: compute the K weights beside the fused attention kernel "
        "(exact log-sum-exp) instead of eager attention; llama/mistral/qwen2/qwen3/gemma.",
    ),
    keep_positions: bool = typer.Option(
        False,
        help="Keep full-width states at the last prompt token, the first and last answer "
        "tokens and the answer mean, every layer (float16, 8 x layers x hidden bytes a row; "
        "the stacked actmap-plus reads them).",
    ),
    greybox: bool = typer.Option(
        None,
        "--greybox/--no-greybox",
        help="Per-step log-probs and entropies over the vocabulary (grey-box baselines, RAUQ, "
        "TAD). Default: on, or what --methods needs; --no-greybox = map-only capture.",
    ),
    methods: str = typer.Option(
        None,
        help="Comma-separated methods the store must serve (e.g. 'actmap' for map-only, "
        "'actmap,perplexity,tad'); switches on only the capture they need, on top of the "
        f"flags above. Known: {', '.join(CAPTURE_NEEDS)}.",
    ),
    data_dir: Path = typer.Option(
        None, help="Folder of local dataset files (default ../shared/data)."
    ),
    prompt_style: str = typer.Option(
        None, help="few_shot | zero_shot (default: the task's; few_shot for QA and GSM8K)."
    ),
    judge: str = typer.Option(
        None,
        help="CNN/DM factuality judge: a causal LM (e.g. a .gguf path of Qwen2.5-Coder-1.5B) "
        "or 'minicheck:<path>'. Without one, summaries are stored unlabelled.",
    ),
    label_rule: str = typer.Option("paper", help="QA label rule: paper | contains."),
    demonstrations_from: Path = typer.Option(
        None,
        help="Reuse the few-shot demonstrations recorded in this store's config (same task), "
        "so prompts match it even when your data lacks the fixed demonstration rows.",
    ),
    builtin_questions: int = typer.Option(
        400, min=1, help="Questions the built-in task generates."
    ),
    chat_template: bool = typer.Option(
        True, help="Wrap prompts in the tokenizer's chat template (--no-chat-template: plain text)."
    ),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    dtype: str = typer.Option(
        "float32", help=DTYPE_HELP + " Recorded in the store: a resume must use the same."
    ),
    layers_path: str = typer.Option(
        None, help="Dotted path to the decoder-layer list for unknown layouts."
    ),
    stop: list[str] = typer.Option(
        None,
        "--stop",
        help="Text that ends an answer, Python escapes allowed (repeatable). Default: the "
        "task's ('\\n' for short answers and GSM8K, none for summaries and the built-in task).",
    ),
    no_stop: bool = typer.Option(
        False, "--no-stop", help="No stop strings: answers end at end-of-sequence only."
    ),
    engine: str = typer.Option(
        "local",
        help="local (this process) | ray (Ray Data: an actor pool of model replicas; "
        "pip install 'actmap[ray]') | vllm (vLLM's scheduler in this process, --batch-size "
        "requests in flight; pip install 'actmap[vllm]'). Same store either way.",
    ),
    vllm_compile: bool = vllm_compile_option(),
    tensor_parallel_size: int = tensor_parallel_option(),
    workers: int = typer.Option(1, min=1, help="--engine ray: model replicas."),
    ray_replica: str = typer.Option(
        "transformers",
        help="--engine ray: what each replica generates with: transformers | vllm (an "
        "in-process vLLM engine per replica; pip install 'actmap[vllm]' on every node).",
    ),
    gpus_per_worker: float = typer.Option(
        None, min=0, help="--engine ray: GPUs per replica (default: 1 with --device cuda, else 0)."
    ),
    ray_address: str = typer.Option(
        None,
        help="--engine ray: an existing cluster ('auto' after `ray start`, or ray://HEAD:10001); "
        "default: a local Ray instance for this run.",
    ),
    share_prefix: int = typer.Option(
        None,
        min=0,
        help="Run the token prefix all prompts of a batch share (the few-shot block) once "
        "when it has at least this many tokens; 0 = off. Same tokens, recorded in the store. "
        f"Default: {AUTO_SHARE_PREFIX} for a new store, the recorded value when resuming.",
    ),
) -> None:
    """Generate answers with capture on, label them, and store one 12x32x128 map per answer."""
    with user_errors():
        from actmap.capture.job import capture_store

        job = CaptureJob(
            out=out, task=task, prompts=prompts, answers=answers, model=model,
            revision=revision, limit=limit, splits=comma_list(splits), batch_size=batch_size,
            max_new_tokens=max_new_tokens, keep_trajectories=keep_trajectories,
            attention_keys=attention_keys, keep_dense=keep_dense,
            lookback_attention=lookback_attention, keep_positions=keep_positions,
            greybox=greybox, methods=None if methods is None else comma_list(methods),
            data_dir=data_dir, prompt_style=prompt_style, judge=judge, label_rule=label_rule,
            demonstrations_from=demonstrations_from, builtin_questions=builtin_questions,
            chat_template=chat_template, device=device, dtype=dtype, layers_path=layers_path,
            stop=tuple(stop) if stop else None, no_stop=no_stop, engine=engine,
            vllm_compile=vllm_compile, tensor_parallel_size=tensor_parallel_size, workers=workers, ray_replica=ray_replica,
            gpus_per_worker=gpus_per_worker, ray_address=ray_address, share_prefix=share_prefix,
        )  # fmt: skip
        with ExitStack() as stack:
            outcome = capture_store(job, BarProgress(stack))
        if outcome.summary is None:
            console.print(
                f"nothing to capture: {out} holds every one of the {outcome.examples} "
                "examples asked for (the model was not loaded)"
            )
        else:
            summary = outcome.summary
            console.print(
                f"wrote {summary.written} rows ({summary.skipped_existing} already stored, "
                f"{summary.skipped_empty} empty answers) in {summary.wall_time_s:.1f} s; "
                f"accuracy of this run {fraction(summary.accuracy)}"
            )
        print_accuracy(outcome.store)


class BarProgress(CaptureProgress):
    """A spinner while the model loads, then a progress bar (opened on ``stack``)."""

    def __init__(self, stack: ExitStack) -> None:
        self.stack, self.bar, self.job = stack, None, None

    @contextmanager
    def loading(self, model: str):
        with console.status(f"loading {model} ..."), quiet_transformers():
            yield

    def start(self, task: str, total: int) -> None:
        self.bar = self.stack.enter_context(progress_bar())
        self.job = self.bar.add_task(f"capture {task}", total=total, info="")

    def advance(self, n: int) -> None:
        self.bar.advance(self.job, n)

    def resume(self, n: int) -> None:
        self.bar.resume(self.job, n)


def print_accuracy(store) -> None:
    from actmap.store.rows import natural_accuracy

    accuracy = natural_accuracy(store)
    console.print(
        "natural accuracy in the store: "
        + ", ".join(f"{k} {fraction(v)}" for k, v in accuracy.items())
    )
