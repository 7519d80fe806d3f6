"""``actmap capture``: generate answers with the hooks on and store their maps."""

from __future__ import annotations

import codecs
from pathlib import Path

import typer

from actmap.cli.app import app
from actmap.cli.common import (
    console,
    fraction,
    load_factuality_judge,
    progress_bar,
    quiet_transformers,
    user_errors,
    vllm_compile_option,
)
from actmap.errors import ActmapUserError
from actmap.llm.models import DTYPE_HELP

SPLITS = ("train", "validation", "test")
# What each method reads from a capture (`--methods`); a method not listed needs only the map
# and the answer (its own passes, such as sampling or P(True), run later).
CAPTURE_NEEDS: dict[str, dict] = {
    "actmap": {},
    "answer_length": {},
    "permuted_label": {},
    "p_true": {},
    "semantic_entropy": {},
    "eigenscore": {},
    "perplexity": {"greybox": True},
    "mean_token_entropy": {"greybox": True},
    "rauq": {"greybox": True, "attention_keys": 1},
    "tad": {"greybox": True, "attention_keys": 10},
    "actvit": {"keep_dense": True},
}
# A new store runs the token prefix every prompt of a batch shares once when it is at least
# this long (a few-shot block; a chat template's system prompt alone is shorter).
AUTO_SHARE_PREFIX = 64


def load_task(
    task: str,
    prompts: Path | None,
    data_dir: Path | None,
    prompt_style: str,
    label_rule: str,
    chat_template: bool = True,
    builtin_questions: int = 400,
    judge: str | None = None,
    answers: Path | None = None,
    demonstrations_from: Path | None = None,
):
    from actmap.data import get_task
    from actmap.data.promptfile import AnswersFileTask, PromptFileTask

    if prompts is not None and answers is not None:
        raise ActmapUserError("--prompts and --answers exclude each other; give one")
    if prompts is not None:
        return PromptFileTask(prompts, chat_template=chat_template)
    if answers is not None:
        return AnswersFileTask(answers, chat_template=chat_template)
    if task == "builtin":
        return get_task("builtin", n_questions=builtin_questions)
    kwargs = {"data_dir": data_dir, "chat_template": chat_template}
    if prompt_style is not None:
        kwargs["prompt_style"] = prompt_style
    if task == "cnn_dm":
        kwargs["judge"] = load_factuality_judge(judge)
    if task in ("triviaqa", "nq_open"):
        kwargs["label_rule"] = label_rule
    if demonstrations_from is not None:
        kwargs["demonstrations"] = store_demonstrations(demonstrations_from, task)
    return get_task(task, **kwargs)


def store_demonstrations(store: Path, task: str) -> list[dict]:
    """The few-shot demonstrations a store's prompts showed (recorded in its task config)."""
    from actmap.store import read_manifest

    config = read_manifest(store).get("config", {}).get("task", {})
    if config.get("task") != task:
        raise ActmapUserError(
            f"--demonstrations-from {store} holds task '{config.get('task')}', not '{task}'"
        )
    found = config.get("demonstrations")
    if not found:
        raise ActmapUserError(
            f"--demonstrations-from {store}: its config records no demonstrations (a zero-shot "
            "store, or one made before actmap recorded them)"
        )
    return found


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
        from actmap.capture import CaptureConfig
        from actmap.capture.run import finished_store, run_capture, store_config
        from actmap.device import check_device
        from actmap.llm.models import (
            check_dtype,
            check_model,
            load_model,
            load_tokenizer,
        )
        from actmap.maps import MapConfig
        from actmap.store import MapStore, claim_store

        the_task = load_task(
            task,
            prompts,
            data_dir,
            prompt_style,
            label_rule,
            chat_template,
            builtin_questions,
            judge,
            answers,
            demonstrations_from,
        )
        wanted = [s.strip() for s in splits.split(",") if s.strip()]
        examples = [e for split in wanted for e in the_task.load(split, limit)]
        if not examples:
            raise ActmapUserError(f"task '{the_task.name}' has no examples in splits {wanted}")
        wanted_capture = capture_settings(methods, greybox, attention_keys, keep_dense)
        attention_keys, keep_dense = wanted_capture["attention_keys"], wanted_capture["keep_dense"]
        config = CaptureConfig(
            max_new_tokens=max_new_tokens or the_task.max_new_tokens,
            batch_size=batch_size,
            stop_strings=stop_strings(the_task, stop, no_stop),
            share_prefix=resolve_share_prefix(out, share_prefix),
            keep_positions=keep_positions,
            lookback_attention=lookback_attention,
            **wanted_capture,
        )
        keep = {
            "trajectories": keep_trajectories,
            "attention_keys": attention_keys,
            "dense": keep_dense,
            **({"positions": True} if keep_positions else {}),
        }
        # a missing path, an unreachable hub id or an absent device: refused before any write
        check_dtype(dtype)
        resolved = check_model(model, revision)
        if engine not in ("local", "ray", "vllm"):
            raise ActmapUserError(f"--engine must be 'local', 'ray' or 'vllm', got {engine!r}")
        if engine == "vllm":
            from actmap.capture.vllm_engine import require_vllm

            require_vllm()  # says how to install it when missing
            if attention_keys or keep_dense:
                raise ActmapUserError(
                    "--engine vllm captures maps and grey-box statistics only: "
                    "--attention-keys and --keep-dense need --engine local"
                )
        if engine == "ray":
            from actmap.capture.ray_engine import RayOptions, require_ray

            require_ray()  # says how to install it when missing
            options = RayOptions(
                workers=workers,
                gpus_per_worker=(1.0 if device.startswith("cuda") else 0.0)
                if gpus_per_worker is None
                else gpus_per_worker,
                address=ray_address,
                replica=ray_replica,
                vllm_compile=vllm_compile,
            )
        else:
            check_device(device)  # a Ray replica checks its own device on its own node
        # refuse a config mismatch or a second writer before the model's load time is spent
        wanted = store_config(the_task, resolved, config, MapConfig(), keep, dtype)
        claim = claim_store(out, wanted)  # its "model" section is checked after the load
        try:
            done = finished_store(out, examples, wanted["model"])
            if done is not None:  # a resumed capture with nothing left: no model load
                console.print(
                    f"nothing to capture: {out} holds every one of the {len(examples)} "
                    "examples asked for (the model was not loaded)"
                )
                print_accuracy(done)
                return
            with console.status(f"loading {model} ..."), quiet_transformers():
                if engine == "ray":
                    lm, (tokenizer, source) = None, load_tokenizer(model, revision)
                elif engine == "vllm":
                    from actmap.capture.vllm_engine import (
                        VllmCapture,
                        VllmOptions,
                        enforce_eager_for,
                    )

                    eager = enforce_eager_for(vllm_compile)
                    lm = VllmCapture(
                        model, dtype, VllmOptions(max_num_seqs=batch_size, enforce_eager=eager),
                        greybox=config.greybox, max_context=config.max_context,
                        revision=revision, layers_path=layers_path,
                    )  # fmt: skip
                    tokenizer, source = lm.tokenizer, lm.source
                else:
                    lm, tokenizer, source = load_model(model, revision, device, dtype)
            store = MapStore.create(
                out, store_config(the_task, source, config, MapConfig(), keep, dtype)
            )
        finally:
            claim.release()
        with progress_bar() as bar:
            job = bar.add_task(f"capture {the_task.name}", total=len(examples), info="")
            common = dict(
                capture=config,
                keep_trajectories=keep_trajectories,
                layers_path=layers_path,
                progress=lambda n: bar.advance(job, n),
                resumed=lambda n: bar.resume(job, n),
            )
            if engine == "ray":
                from actmap.capture.ray_engine import run_capture_ray

                summary = run_capture_ray(
                    model, revision, device, tokenizer, source, the_task, examples, store,
                    options=options, dtype=dtype, **common,
                )  # fmt: skip
            elif engine == "vllm":
                from actmap.capture.vllm_run import run_capture_vllm

                del common["layers_path"]
                summary = run_capture_vllm(
                    lm, tokenizer, source, the_task, examples, store, **common
                )
            else:
                summary = run_capture(lm, tokenizer, source, the_task, examples, store, **common)
        console.print(
            f"wrote {summary.written} rows ({summary.skipped_existing} already stored, "
            f"{summary.skipped_empty} empty answers) in {summary.wall_time_s:.1f} s; "
            f"accuracy of this run {fraction(summary.accuracy)}"
        )
        print_accuracy(store)


def print_accuracy(store) -> None:
    from actmap.store.rows import natural_accuracy

    accuracy = natural_accuracy(store)
    console.print(
        "natural accuracy in the store: "
        + ", ".join(f"{k} {fraction(v)}" for k, v in accuracy.items())
    )


def capture_settings(
    methods: str | None, greybox: bool | None, attention_keys: int, keep_dense: bool
) -> dict:
    """What one capture keeps: the explicit flags, plus whatever the named methods need."""
    settings = {"greybox": greybox, "attention_keys": attention_keys, "keep_dense": keep_dense}
    if methods is None:
        return {**settings, "greybox": True if greybox is None else greybox}
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in CAPTURE_NEEDS]
    if unknown or not names:
        raise ActmapUserError(
            f"unknown method {unknown[0]!r} in --methods; known: {', '.join(CAPTURE_NEEDS)}"
            if unknown
            else "--methods names no method"
        )
    needs = [CAPTURE_NEEDS[m] for m in names]
    if greybox is None:
        settings["greybox"] = any(n.get("greybox", False) for n in needs)
    elif not greybox and any(n.get("greybox", False) for n in needs):
        needy = [m for m in names if CAPTURE_NEEDS[m].get("greybox")]
        raise ActmapUserError(f"--no-greybox contradicts --methods: {', '.join(needy)} need it")
    settings["attention_keys"] = max([attention_keys] + [n.get("attention_keys", 0) for n in needs])
    settings["keep_dense"] = keep_dense or any(n.get("keep_dense", False) for n in needs)
    return settings


def resolve_share_prefix(out: Path, share_prefix: int | None) -> int:
    """``--share-prefix``, else the value a resumed store recorded (absent = 0), else the default."""
    if share_prefix is not None:
        return share_prefix
    if (out / "manifest.json").is_file():
        from actmap.store import MapStore

        recorded = MapStore.open(out).manifest.get("config", {}).get("capture", {})
        return int(recorded.get("share_prefix", 0))
    return AUTO_SHARE_PREFIX


def stop_strings(task, stop: list[str] | None, no_stop: bool) -> tuple[str, ...]:
    """The stop strings a capture uses: ``--stop`` values (escapes decoded), else the task's."""
    if no_stop and stop:
        raise ActmapUserError("--stop and --no-stop contradict each other; give one")
    if no_stop:
        return ()
    if stop:
        return tuple(codecs.decode(s, "unicode_escape") for s in stop)
    return tuple(getattr(task, "stop_strings", ()))
