"""A resumable capture run: task examples -> generations -> labels -> maps -> the store.

Each batch is committed by writing its side tables first and its ``maps``
shard last, so the ids in ``maps`` are exactly the finished rows. A run that
is killed loses at most the batch in flight; on restart, ids already in
``maps`` (or recorded as skipped) are not generated again, and side-table rows
of an unfinished batch are superseded by the rerun (readers keep the last).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa

from actmap.capture.forced import capture_answers_batch
from actmap.capture.generate import generate_batch
from actmap.capture.records import CaptureConfig, Generation
from actmap.data.base import Example, Task
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig, build_maps_from_list, map_shape, pool_layers
from actmap.store import MANIFEST, MapRecord, MapStore, encode_array

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What one capture run did; also written into the store manifest."""

    written: int  # rows committed by this run
    skipped_existing: int  # rows already in the store (resume)
    skipped_empty: int  # answers with no token before the stop token (no map can be built)
    correct: int  # among rows written by this run with a known label
    labelled: int
    wall_time_s: float
    generation_time_s: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.labelled if self.labelled else float("nan")


def example_id(example: Example) -> str:
    return f"{example.dataset}:{example.source_key}"


def store_config(
    task: Task,
    source: ModelSource,
    capture: CaptureConfig,
    maps: MapConfig,
    keep: dict,
    dtype: str = "float32",
) -> dict:
    """The config a store is created with; a resumed run must match it exactly."""
    describe = getattr(task, "describe", None)
    settings = asdict(capture)
    # recorded only when not at their old default: older stores resume unchanged
    if not settings["share_prefix"]:
        del settings["share_prefix"]
    if settings["greybox"]:
        del settings["greybox"]
    if not settings["lookback_attention"]:
        del settings["lookback_attention"]
    if not settings["keep_positions"]:
        del settings["keep_positions"]
    model = {"name": source.name, "revision": source.revision, "gguf_file": source.gguf_file}
    if dtype != "float32":
        model["dtype"] = dtype
    return {
        "task": describe() if describe else {"task": task.name},
        "model": model,
        "capture": settings,
        "map": asdict(maps),
        "keep": keep,
    }


def _label_text(task: Task, raw: str) -> str:
    postprocess = getattr(task, "postprocess", None)
    return postprocess(raw) if postprocess else raw


def _steps(records: list[Generation], field: str) -> pa.Array:
    """Per-step values as a list column; null where they were not captured (map-only)."""
    values = [getattr(r, field) for r in records]
    return pa.array([None if v is None else v.tolist() for v in values], pa.list_(pa.float32()))


def _side_tables(
    ids: list[str], examples: list[Example], records: list[Generation], label_texts: list[str]
) -> pa.Table:
    return pa.table(
        {
            "id": ids,
            "question": [e.question for e in examples],
            "references": [list(e.references) for e in examples],
            "label_text": label_texts,
            "token_ids": pa.array([r.token_ids for r in records], pa.list_(pa.int32())),
            "logprobs": _steps(records, "logprobs"),
            "entropies": _steps(records, "entropies"),
            "stopped": [r.stopped for r in records],
            "prompt_tokens": pa.array([r.prompt_tokens for r in records], pa.int32()),
            "eos_logprob": pa.array([r.extras.get("eos_logprob") for r in records], pa.float32()),
            "eos_entropy": pa.array([r.extras.get("eos_entropy") for r in records], pa.float32()),
        }
    )


def _array_table(ids: list[str], arrays: list, column: str) -> pa.Table:
    """Tensors of varying shape as float16 bytes plus their shape."""
    return pa.table(
        {
            "id": ids,
            "shape": pa.array([list(a.shape) for a in arrays], pa.list_(pa.int32())),
            column: [encode_array(a.float().numpy()) for a in arrays],
        }
    )


def commit_batch(
    store: MapStore,
    task: Task,
    source: ModelSource,
    examples: list[Example],
    records: list[Generation],
    map_config: MapConfig,
    keep_trajectories: bool,
) -> tuple[int, int, int]:
    """Write one batch; returns (written, correct, labelled). Empty answers go to ``skipped``."""
    empty = [i for i, r in enumerate(records) if r.n_tokens == 0]
    if empty:
        store.write_table(
            "skipped",
            pa.table(
                {
                    "id": [example_id(examples[i]) for i in empty],
                    "split": [examples[i].split for i in empty],
                    "reason": ["empty answer"] * len(empty),
                }
            ),
        )
        log.warning("%d empty answers (stop token first) recorded in 'skipped'", len(empty))
    keep = [i for i in range(len(records)) if records[i].n_tokens > 0]
    if not keep:
        return 0, 0, 0
    examples = [examples[i] for i in keep]
    records = [records[i] for i in keep]
    ids = [example_id(e) for e in examples]
    maps = build_maps_from_list([r.trajectory for r in records], map_config)  # (B, 12, 32, 128)
    label_texts = [_label_text(task, r.answer) for r in records]
    labels = [task.label(t, e) for t, e in zip(label_texts, examples, strict=True)]
    store.write_table("generations", _side_tables(ids, examples, records, label_texts))
    if keep_trajectories:
        store.write_table(
            "trajectories", _array_table(ids, [r.trajectory for r in records], "trajectory")
        )
    if records[0].attention is not None:
        store.write_table(
            "attention", _array_table(ids, [r.attention for r in records], "attention")
        )
    if records[0].dense is not None:
        # ACT-ViT's layer max-pooling to 8 groups, done once here (L/8 smaller)
        dense = [pool_layers(r.dense.float()) for r in records]  # (8, N, D)
        store.write_table("dense", _array_table(ids, dense, "dense"))
    if records[0].positions is not None:  # (4, L, D) float16 each
        store.write_table(
            "positions", _array_table(ids, [r.positions for r in records], "positions")
        )
    store.write_maps(  # last: the commit of this batch
        [
            MapRecord(
                id=key,
                source_key=e.source_key,
                dataset=e.dataset,
                split=e.split,
                model_name=source.name,
                model_revision=source.revision,
                prompt=r.prompt,
                answer=r.answer,
                n_tokens=r.n_tokens,
                label=None if label is None else int(label),
                map=m.numpy(),
            )
            for key, e, r, label, m in zip(ids, examples, records, labels, maps, strict=True)
        ]
    )
    known = [label for label in labels if label is not None]
    return len(ids), int(sum(known)), len(known)


def order_by_prompt_length(prompts: Sequence[str], tokenizer) -> list[int]:
    """Indices of ``prompts`` from the fewest tokens to the most (ties keep their order)."""
    lengths = [len(ids) for ids in tokenizer(list(prompts), add_special_tokens=False)["input_ids"]]
    return sorted(range(len(prompts)), key=lengths.__getitem__)


@dataclass(frozen=True)
class CapturePlan:
    """What a capture run has left to do: the batches of examples not yet in the store."""

    batches: list[list[Example]]
    prompts: list[list[str]]  # the rendered prompt of every example, batch by batch
    total: int  # examples asked for
    skipped_existing: int  # already committed (or recorded as skipped) by an earlier run


def pending(examples: Sequence[Example], store: MapStore) -> list[Example]:
    """The examples ``store`` has no row for: neither committed nor recorded as skipped."""
    done = store.ids("maps") | store.ids("skipped")
    return [e for e in examples if example_id(e) not in done]


def finished_store(root: str | Path, examples: Sequence[Example], model: dict) -> MapStore | None:
    """The store at ``root`` when it already holds every one of ``examples`` and records the
    generator section ``model`` of `store_config` (name, revision or file digest, GGUF file,
    dtype) exactly: a resumed capture with nothing left to do, which needs no model load. None
    otherwise (no store yet, rows to capture, or another generator, which a load must check)."""
    if not (Path(root) / MANIFEST).is_file():
        return None
    store = MapStore.open(root)
    if (store.manifest.get("config") or {}).get("model") != model:
        return None
    return store if not pending(examples, store) else None


def plan_capture(
    task: Task,
    examples: Sequence[Example],
    store: MapStore,
    tokenizer,
    batch_size: int,
    sort_by_length: bool = True,
) -> CapturePlan:
    """The examples not yet in ``store``, rendered and cut into batches (shortest prompts first
    with ``sort_by_length``). Every engine captures exactly these batches."""
    todo = pending(examples, store)
    prompts = [task.prompt(e, tokenizer) for e in todo]
    if sort_by_length and prompts:
        order = order_by_prompt_length(prompts, tokenizer)
        todo, prompts = [todo[i] for i in order], [prompts[i] for i in order]
    starts = range(0, len(todo), batch_size)
    return CapturePlan(
        batches=[todo[i : i + batch_size] for i in starts],
        prompts=[prompts[i : i + batch_size] for i in starts],
        total=len(examples),
        skipped_existing=len(examples) - len(todo),
    )


def commit_all(
    store: MapStore,
    task: Task,
    source: ModelSource,
    plan: CapturePlan,
    captured: Iterable[tuple[list[Example], list[Generation], float]],
    map_config: MapConfig = MapConfig(),
    keep_trajectories: bool = False,
    progress: Callable[[int], None] | None = None,
    engine: dict | None = None,
    resumed: Callable[[int], None] | None = None,
) -> RunSummary:
    """Commit every (examples, generations, seconds spent generating) batch of ``captured`` as
    it arrives, recording the run in the manifest after each batch (``finished_at`` stays None
    until the last, so a killed run keeps the rows and seconds it committed). Shared by every
    capture engine.

    The examples an earlier run stored are reported once, before any batch, to ``resumed``
    when given (a display can then tell them from this run's work), else to ``progress``."""
    started = time.perf_counter()
    restored = resumed or progress
    if restored is not None and plan.skipped_existing:
        restored(plan.skipped_existing)
    run_id = uuid.uuid4().hex
    written = correct = labelled = empty = 0
    generation_time = 0.0

    def summary() -> RunSummary:
        return RunSummary(
            written=written,
            skipped_existing=plan.skipped_existing,
            skipped_empty=empty,
            correct=correct,
            labelled=labelled,
            wall_time_s=time.perf_counter() - started,
            generation_time_s=generation_time,
        )

    for batch, records, seconds in captured:
        generation_time += seconds
        w, c, n = commit_batch(store, task, source, batch, records, map_config, keep_trajectories)
        written, correct, labelled = written + w, correct + c, labelled + n
        empty += len(batch) - w
        record_run(store, run_id, summary(), engine, finished=False)
        if progress is not None:
            progress(len(batch))
    done = summary()
    record_run(store, run_id, done, engine, finished=True)
    return done


def record_run(
    store: MapStore, run_id: str, summary: RunSummary, engine: dict | None, finished: bool
) -> None:
    """Write (or overwrite) the manifest's record of run ``run_id``: its counts so far, and
    ``finished_at`` once it ends (None while it runs, and for good if it is killed)."""
    run = {
        "id": run_id,
        **asdict(summary),
        "finished_at": time.time() if finished else None,
        **({"engine": engine} if engine else {}),
    }

    def edit(manifest: dict) -> None:
        runs = manifest.setdefault("runs", [])
        at = next((i for i, r in enumerate(runs) if r.get("id") == run_id), None)
        if at is None:
            runs.append(run)
        else:
            runs[at] = run

    store.edit_manifest(edit)


def given_answers(task: Task, batch: list[Example]) -> list[str] | None:
    """The answers to read for a task of given answers (teacher forcing); None = generate."""
    if getattr(task, "teacher_forced", False):
        return [e.meta["answer"] for e in batch]
    return None


def capture_batch(
    model, tokenizer, prompts: list[str], answers: list[str] | None,
    capture: CaptureConfig, layers_path: str | None,
) -> list[Generation]:  # fmt: skip
    """One batch through the model: generation, or one teacher-forced pass for given answers."""
    if answers is not None:
        return capture_answers_batch(model, tokenizer, prompts, answers, capture, layers_path)
    return generate_batch(model, tokenizer, prompts, capture, layers_path)


def run_capture(
    model,
    tokenizer,
    source: ModelSource,
    task: Task,
    examples: Sequence[Example],
    store: MapStore,
    capture: CaptureConfig = CaptureConfig(),
    map_config: MapConfig = MapConfig(),
    keep_trajectories: bool = False,
    layers_path: str | None = None,
    progress: Callable[[int], None] | None = None,
    sort_by_length: bool = True,
    resumed: Callable[[int], None] | None = None,
) -> RunSummary:
    """Capture every example not yet in ``store``, one committed batch at a time (this process).

    With ``sort_by_length`` the batches take the prompts in order of token count,
    so a batch pads little; ids, labels and maps are those of each example
    whatever the order, and a resumed run skips finished ids as always.
    """
    check_map_config(map_config)
    plan = plan_capture(task, examples, store, tokenizer, capture.batch_size, sort_by_length)

    def captured() -> Iterator[tuple[list[Example], list[Generation], float]]:
        for batch, prompts in zip(plan.batches, plan.prompts, strict=True):
            tick = time.perf_counter()
            answers = given_answers(task, batch)
            records = capture_batch(model, tokenizer, prompts, answers, capture, layers_path)
            yield batch, records, time.perf_counter() - tick

    return commit_all(
        store, task, source, plan, captured(), map_config, keep_trajectories, progress,
        resumed=resumed,
    )  # fmt: skip


def check_map_config(map_config: MapConfig) -> None:
    if map_shape(map_config) != (12, 32, 128):
        raise ValueError(
            "the store keeps the paper's 12x32x128 maps; build ablation maps from trajectories"
        )
