"""A resumable capture run on the vLLM engine: the same plan, commits and store as the others.

The driver plans the run as the local engine does (`actmap.capture.run.plan_capture`: the
examples not yet in the store, rendered, sorted by length, cut into batches) and commits
every batch with the local engine's `commit_all`, so the store, its manifest and a resumed
run are the local engine's; the manifest's run record says ``engine: vllm``. Generation is
continuous: the prompts of the next batches join vLLM's running batch while the current one
finishes (``ahead`` batches in flight), and a batch is committed as soon as all its answers
are done, in plan order. A killed run loses at most the batches in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence

from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.run import (
    CapturePlan,
    RunSummary,
    check_map_config,
    commit_all,
    given_answers,
    plan_capture,
)
from actmap.capture.vllm_engine import VllmCapture
from actmap.data.base import Example, Task
from actmap.errors import ActmapUserError
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig

log = logging.getLogger(__name__)


def run_capture_vllm(
    engine: VllmCapture,
    tokenizer,
    source: ModelSource,
    task: Task,
    examples: Sequence[Example],
    store,
    capture: CaptureConfig = CaptureConfig(),
    map_config: MapConfig = MapConfig(),
    keep_trajectories: bool = False,
    progress: Callable[[int], None] | None = None,
    sort_by_length: bool = True,
    resumed: Callable[[int], None] | None = None,
    ahead: int = 2,
) -> RunSummary:
    """`actmap.capture.run.run_capture` with generation inside ``engine`` (vLLM)."""
    check_map_config(map_config)
    plan = plan_capture(task, examples, store, tokenizer, capture.batch_size, sort_by_length)
    if any(given_answers(task, batch) is not None for batch in plan.batches[:1]):
        raise ActmapUserError(
            f"task '{task.name}' reads given answers (teacher forcing): use --engine local"
        )
    import vllm

    info = {"name": "vllm", "vllm": vllm.__version__, "dtype": engine.dtype}
    keys: list[list[str]] = []
    captured = _captured(engine, plan, capture, max(1, ahead), keys)
    try:
        return commit_all(
            store, task, source, plan, captured, map_config, keep_trajectories, progress, info,
            resumed,
        )  # fmt: skip
    finally:  # a run that dies leaves no request running in the engine
        captured.close()
        for key in (k for batch in keys for k in batch):
            engine.abort(key)


def _captured(
    engine: VllmCapture,
    plan: CapturePlan,
    capture: CaptureConfig,
    ahead: int,
    keys: list[list[str]],
) -> Iterator[tuple[list[Example], list[Generation], float]]:
    """(examples, generations, seconds) per planned batch, in plan order; ``keys`` collects
    the request keys submitted, batch by batch."""
    done: dict[str, Generation] = {}
    started = time.perf_counter()
    committed = 0

    def submit_next() -> None:
        prompts = plan.prompts[len(keys)]
        ids = engine.encode(prompts, capture)
        keys.append([engine.submit(p, capture, i) for p, i in zip(prompts, ids, strict=True)])

    while committed < len(plan.batches):
        while len(keys) < len(plan.batches) and len(keys) < committed + ahead:
            submit_next()
        for event in engine.step():
            if event.finished is not None:
                done[event.key] = event.finished
        while committed < len(keys) and all(k in done for k in keys[committed]):
            records = [done.pop(k) for k in keys[committed]]
            now = time.perf_counter()
            yield plan.batches[committed], records, now - started
            started = now
            committed += 1
        if not engine.busy and committed < len(keys):
            raise RuntimeError("vLLM finished without answering every request")
