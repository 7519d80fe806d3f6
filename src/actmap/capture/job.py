"""One capture, start to end: `CaptureJob` says what to capture, `capture_store` does it.

    capture_store(CaptureJob(out="stores/x", task="triviaqa", limit=300))

`capture_store` loads the task and its examples, settles the capture settings (the
methods' needs, `actmap.capture.needs`; stop strings; the shared prefix), checks the
model, dtype, engine and device, claims the store (a config mismatch or a second writer is
refused before the model's load time is spent), returns early when a resumed store already
holds every example (no model load), then loads the model on the chosen engine (``local``:
this process; ``ray``: an actor pool; ``vllm``: vLLM's scheduler in this process) and runs
the resumable capture (`actmap.capture.run`). ``actmap capture`` and ``actmap reproduce``
both call it; a `CaptureProgress` shows what happens (the CLI's draws a spinner and a bar).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actmap.capture.needs import capture_settings
from actmap.errors import ActmapUserError

SPLITS = ("train", "validation", "test")
ENGINES = ("local", "ray", "vllm")
# A new store runs the token prefix every prompt of a batch shares once when it is at least
# this long (a few-shot block; a chat template's system prompt alone is shorter).
AUTO_SHARE_PREFIX = 64


@dataclass(frozen=True)
class CaptureJob:
    """What one capture writes: the `actmap capture` options, one field each (see its --help)."""

    out: Path  # the store folder (created, or resumed when it exists)
    task: str = "builtin"  # builtin | gsm8k | nq_open | triviaqa | cnn_dm
    prompts: Path | None = None  # a JSONL prompts file instead of a task
    answers: Path | None = None  # a JSONL file of answers made elsewhere (teacher-forced)
    model: str = "smollm2-135m-instruct"
    revision: str = "main"
    limit: int | None = None  # at most this many examples per split
    splits: tuple[str, ...] = SPLITS
    batch_size: int = 32
    max_new_tokens: int | None = None  # None: the task's
    keep_trajectories: bool = False
    attention_keys: int = 0
    keep_dense: bool = False
    lookback_attention: bool = False
    keep_positions: bool = False
    greybox: bool | None = None  # None: on, or what ``methods`` needs
    methods: tuple[str, ...] | None = None  # methods the store must serve (their needs)
    data_dir: Path | None = None
    prompt_style: str | None = None
    judge: str | None = None  # CNN/DM's factuality judge (`load_factuality_judge`)
    label_rule: str = "paper"
    demonstrations_from: Path | None = None
    builtin_questions: int = 400
    chat_template: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    layers_path: str | None = None
    stop: tuple[str, ...] | None = None  # Python escapes allowed; None: the task's
    no_stop: bool = False
    engine: str = "local"  # local | ray | vllm
    vllm_compile: bool | None = None
    tensor_parallel_size: int = 1  # vllm: vLLM's tensor parallel size
    workers: int = 1  # ray: model replicas
    ray_replica: str = "transformers"  # ray: transformers | vllm
    gpus_per_worker: float | None = None  # ray: default 1 with a CUDA device, else 0
    ray_address: str | None = None
    share_prefix: int | None = None  # None: AUTO_SHARE_PREFIX for a new store, else recorded

    @classmethod
    def from_options(cls, out: str | Path, options: Mapping[str, Any]) -> CaptureJob:
        """A job from a table of options (a reproduce config's ``[stores.capture]``): the
        field names, checked by type; an unknown name or a wrong type is refused by name."""
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)} - {"out"}
        values: dict[str, Any] = {}
        for key, value in options.items():
            if key not in names:
                raise ActmapUserError(
                    f"unknown capture option {key!r}; known: {', '.join(sorted(names))}"
                )
            values[key] = _coerce(key, value, hints[key])
        return cls(Path(out), **values)


COMMA_LISTS = ("splits", "methods")  # a string of these is comma-separated, as on the CLI


def comma_list(text: str) -> tuple[str, ...]:
    """``"a, b,"`` -> ``("a", "b")``."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """``value`` as field type ``hint`` (str -> Path, list -> tuple), or a clear error."""
    if key in COMMA_LISTS and isinstance(value, str):
        value = comma_list(value)
    kinds = [k for k in typing.get_args(hint) if k is not type(None)] if _optional(hint) else [hint]
    if value is None and _optional(hint):
        return None
    for kind in kinds:
        origin = typing.get_origin(kind) or kind
        if origin is tuple and isinstance(value, list | tuple | str):
            items = [value] if isinstance(value, str) else list(value)
            if all(isinstance(v, str) for v in items):
                return tuple(items)
        elif origin is Path and isinstance(value, str | Path):
            return Path(value)
        elif origin is bool and isinstance(value, bool):
            return value
        elif origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        elif origin is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        elif origin is str and isinstance(value, str):
            return value
    raise ActmapUserError(f"capture option {key!r} must be {_type_name(hint)}, got {value!r}")


def _optional(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)


def _type_name(hint: Any) -> str:
    """``int``, ``str or None``, ``a list of str`` ... as a config's author reads it."""
    if _optional(hint):
        kinds = [k for k in typing.get_args(hint) if k is not type(None)]
        return " or ".join(_type_name(k) for k in kinds) + " or None"
    if typing.get_origin(hint) is tuple:
        return "a list of str"
    return "a path" if hint is Path else getattr(hint, "__name__", str(hint))


@dataclass
class CaptureProgress:
    """What a capture reports while it runs; every hook does nothing here (override them)."""

    def loading(self, model: str) -> contextlib.AbstractContextManager:
        """A context around the model load."""
        return contextlib.nullcontext()

    def start(self, task: str, total: int) -> None:
        """The capture of ``total`` examples of ``task`` begins."""

    def advance(self, n: int) -> None:
        """``n`` more examples done."""

    def resume(self, n: int) -> None:
        """``n`` examples were already in the store."""


@dataclass(frozen=True)
class CaptureOutcome:
    """What `capture_store` did: the store, the examples asked for, and the run's summary
    (None: the store already held every example, so nothing ran and no model was loaded)."""

    store: Any  # MapStore
    examples: int
    summary: Any = None  # actmap.capture.run.RunSummary | None
    settings: dict = field(default_factory=dict)  # the CaptureConfig fields used


def load_task(job: CaptureJob):
    """The task ``job`` captures: its prompts or answers file, or a named task."""
    from actmap.data import get_task
    from actmap.data.factuality import load_factuality_judge
    from actmap.data.promptfile import AnswersFileTask, PromptFileTask

    if job.prompts is not None and job.answers is not None:
        raise ActmapUserError("--prompts and --answers exclude each other; give one")
    if job.prompts is not None:
        return PromptFileTask(job.prompts, chat_template=job.chat_template)
    if job.answers is not None:
        return AnswersFileTask(job.answers, chat_template=job.chat_template)
    if job.task == "builtin":
        return get_task("builtin", n_questions=job.builtin_questions)
    kwargs: dict[str, Any] = {"data_dir": job.data_dir, "chat_template": job.chat_template}
    if job.prompt_style is not None:
        kwargs["prompt_style"] = job.prompt_style
    if job.task == "cnn_dm":
        kwargs["judge"] = load_factuality_judge(job.judge)
    if job.task in ("triviaqa", "nq_open"):
        kwargs["label_rule"] = job.label_rule
    if job.demonstrations_from is not None:
        kwargs["demonstrations"] = store_demonstrations(job.demonstrations_from, job.task)
    return get_task(job.task, **kwargs)


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


def resolve_share_prefix(out: Path, share_prefix: int | None) -> int:
    """``--share-prefix``, else the value a resumed store recorded (absent = 0), else the default."""
    if share_prefix is not None:
        return share_prefix
    if (Path(out) / "manifest.json").is_file():
        from actmap.store import MapStore

        recorded = MapStore.open(out).manifest.get("config", {}).get("capture", {})
        return int(recorded.get("share_prefix", 0))
    return AUTO_SHARE_PREFIX


def stop_strings(task, stop: Sequence[str] | None, no_stop: bool) -> tuple[str, ...]:
    """The stop strings a capture uses: ``--stop`` values (escapes decoded), else the task's."""
    if no_stop and stop:
        raise ActmapUserError("--stop and --no-stop contradict each other; give one")
    if no_stop:
        return ()
    if stop:
        return tuple(codecs.decode(s, "unicode_escape") for s in stop)
    return tuple(getattr(task, "stop_strings", ()))


def _check_engine(job: CaptureJob, attention_keys: int, keep_dense: bool):
    """The engine's checks (installed, what it can keep); the Ray options for ``ray``."""
    from actmap.device import check_device

    if job.engine not in ENGINES:
        raise ActmapUserError(f"--engine must be 'local', 'ray' or 'vllm', got {job.engine!r}")
    if job.tensor_parallel_size != 1 and job.engine != "vllm":
        raise ActmapUserError("--tensor-parallel-size needs --engine vllm")
    if job.engine == "vllm":
        from actmap.capture.vllm_engine import require_vllm

        require_vllm()  # says how to install it when missing
        if keep_dense:
            raise ActmapUserError(
                "--engine vllm captures maps, grey-box statistics, position states and "
                "attention entries: --keep-dense needs --engine local"
            )
    if job.engine != "ray":
        check_device(job.device)  # a Ray replica checks its own device on its own node
        return None
    from actmap.capture.ray_engine import RayOptions, require_ray

    require_ray()  # says how to install it when missing
    gpus = job.gpus_per_worker
    return RayOptions(
        workers=job.workers,
        gpus_per_worker=(1.0 if job.device.startswith("cuda") else 0.0) if gpus is None else gpus,
        address=job.ray_address,
        replica=job.ray_replica,
        vllm_compile=job.vllm_compile,
    )


def _load(job: CaptureJob, config):
    """(the generator on the job's engine, its tokenizer, its `ModelSource`)."""
    from actmap.llm.models import load_model, load_tokenizer

    if job.engine == "ray":  # each replica loads its own
        tokenizer, source = load_tokenizer(job.model, job.revision)
        return None, tokenizer, source
    if job.engine == "vllm":
        from actmap.capture.vllm_engine import VllmCapture, VllmOptions, enforce_eager_for

        tp = job.tensor_parallel_size
        options = VllmOptions(
            max_num_seqs=job.batch_size, enforce_eager=enforce_eager_for(job.vllm_compile),
            engine_args={"tensor_parallel_size": tp} if tp != 1 else {},
        )  # fmt: skip
        lm = VllmCapture(
            job.model, job.dtype, options, greybox=config.greybox,
            max_context=config.max_context, revision=job.revision, layers_path=job.layers_path,
        )  # fmt: skip
        if config.attention_keys:
            try:
                lm.keep_attention()  # refused by name before anything is written
            except ActmapUserError:
                lm.close()
                raise
        return lm, lm.tokenizer, lm.source
    return load_model(job.model, job.revision, job.device, job.dtype)


def capture_store(job: CaptureJob, progress: CaptureProgress | None = None) -> CaptureOutcome:
    """Capture (or resume) the store ``job.out``; see the module's docstring."""
    from actmap.capture.records import CaptureConfig
    from actmap.capture.run import finished_store, run_capture, store_config
    from actmap.llm.models import check_dtype, check_model
    from actmap.maps import MapConfig
    from actmap.store import MapStore, claim_store

    progress = progress or CaptureProgress()
    task = load_task(job)
    examples = [e for split in job.splits for e in task.load(split, job.limit)]
    if not examples:
        raise ActmapUserError(f"task '{task.name}' has no examples in splits {list(job.splits)}")
    needs = capture_settings(
        job.methods, job.greybox, job.attention_keys, job.keep_dense,
        job.keep_positions, job.lookback_attention,
    )  # fmt: skip
    config = CaptureConfig(
        max_new_tokens=job.max_new_tokens or task.max_new_tokens,
        batch_size=job.batch_size,
        stop_strings=stop_strings(task, job.stop, job.no_stop),
        share_prefix=resolve_share_prefix(job.out, job.share_prefix),
        **needs,
    )
    keep = {
        "trajectories": job.keep_trajectories,
        "attention_keys": needs["attention_keys"],
        "dense": needs["keep_dense"],
        **({"positions": True} if needs["keep_positions"] else {}),
    }
    # a missing path, an unreachable hub id or an absent device: refused before any write
    check_dtype(job.dtype)
    resolved = check_model(job.model, job.revision)
    ray_options = _check_engine(job, needs["attention_keys"], needs["keep_dense"])
    # refuse a config mismatch or a second writer before the model's load time is spent
    wanted = store_config(task, resolved, config, MapConfig(), keep, job.dtype)
    claim = claim_store(job.out, wanted)  # its "model" section is checked after the load
    settings = dataclasses.asdict(config)
    try:
        done = finished_store(job.out, examples, wanted["model"])
        if done is not None:  # a resumed capture with nothing left: no model load
            return CaptureOutcome(done, len(examples), None, settings)
        with progress.loading(job.model):
            lm, tokenizer, source = _load(job, config)
        store = MapStore.create(
            job.out, store_config(task, source, config, MapConfig(), keep, job.dtype)
        )
    finally:
        claim.release()
    progress.start(task.name, len(examples))
    common = dict(
        capture=config,
        keep_trajectories=job.keep_trajectories,
        progress=progress.advance,
        resumed=progress.resume,
    )
    if job.engine == "ray":
        from actmap.capture.ray_engine import run_capture_ray

        summary = run_capture_ray(
            job.model, job.revision, job.device, tokenizer, source, task, examples, store,
            options=ray_options, dtype=job.dtype, layers_path=job.layers_path, **common,
        )  # fmt: skip
    elif job.engine == "vllm":
        from actmap.capture.vllm_run import run_capture_vllm

        summary = run_capture_vllm(lm, tokenizer, source, task, examples, store, **common)
    else:
        summary = run_capture(
            lm, tokenizer, source, task, examples, store, layers_path=job.layers_path, **common
        )
    return CaptureOutcome(store, len(examples), summary, settings)
