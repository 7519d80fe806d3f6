"""Capture on Ray Data: the same batches, the same store, many model replicas.

The driver plans the run as the local engine does (`actmap.capture.run.plan_capture`:
the examples not yet in the store, rendered, sorted by length, cut into batches),
turns the batches into a Ray dataset of prompts (one block per batch, so every
replica sees exactly the batches the local engine would), and runs it through
an actor pool of model replicas with ``map_batches``: each `CaptureReplica`
loads the model once and captures one batch per call. The driver is the store's
only writer: it commits every batch that comes back with the local engine's
`commit_all` (side tables first, the ``maps`` shard last), so the store, its
manifest and a resumed run are exactly the local engine's. A killed run loses
at most the batches in flight; rerunning it captures every id not yet in
``maps``, once.

Ray is an optional extra (``pip install 'actmap[ray]'``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.run import (
    CapturePlan,
    RunSummary,
    capture_batch,
    check_map_config,
    commit_all,
    given_answers,
    plan_capture,
)
from actmap.data.base import Example, Task
from actmap.errors import ActmapUserError
from actmap.llm.models import ModelSource
from actmap.maps import MapConfig

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'actmap[ray]'"
TENSORS = ("trajectory", "logprobs", "entropies", "attention", "dense", "positions")


def require_ray():
    """The ``ray`` module with Ray Data, or an error saying how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ActmapUserError(
            f"--engine ray needs Ray Data, which is not installed: {INSTALL_HINT}"
        ) from None
    return ray


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide a Ray capture runs."""

    workers: int = 1  # model replicas (actors), each capturing one batch at a time
    gpus_per_worker: float = 0.0  # GPUs each replica holds (1 per GPU on a GPU cluster)
    cpus_per_worker: float = 1.0
    # an existing cluster ("auto" after `ray start`, or "ray://head:10001"); None starts a
    # local instance for this run (and stops it afterwards)
    address: str | None = None
    # what each replica generates with: transformers (CaptureReplica) or an in-process vLLM
    # engine (`VllmCaptureReplica` below, one per GPU on a cluster)
    replica: str = "transformers"
    # vLLM replicas: compile the model (None: on a GPU, not on CPU; see VllmOptions)
    vllm_compile: bool | None = None

    def __post_init__(self) -> None:
        if self.replica not in ("transformers", "vllm"):
            raise ActmapUserError(f"replica must be 'transformers' or 'vllm', not {self.replica!r}")
        if self.workers < 1:
            raise ActmapUserError(f"--workers must be at least 1, got {self.workers}")
        if self.gpus_per_worker < 0 or self.cpus_per_worker <= 0:
            raise ActmapUserError("--gpus-per-worker must be >= 0 and CPUs per worker > 0")


# -- one model replica ---------------------------------------------------------------------------
def encode_generations(records: Sequence[Generation]):
    """Generations -> an Arrow table (what a replica sends back): plain columns plus every
    tensor of a row in one safetensors blob (exact float values, no pickle)."""
    import pyarrow as pa
    from safetensors.torch import save

    blobs = []
    for r in records:
        tensors = {name: getattr(r, name) for name in TENSORS if getattr(r, name) is not None}
        blobs.append(save({k: v.contiguous() for k, v in tensors.items()}))
    return pa.table(
        {
            "prompt": [r.prompt for r in records],
            "answer": [r.answer for r in records],
            "token_ids": pa.array([list(r.token_ids) for r in records], pa.list_(pa.int64())),
            "stopped": [bool(r.stopped) for r in records],
            "prompt_tokens": pa.array([int(r.prompt_tokens) for r in records], pa.int64()),
            "extras": [json.dumps(r.extras) for r in records],
            "tensors": pa.array(blobs, pa.binary()),
        }
    )


def decode_generations(batch: dict) -> list[Generation]:
    """The inverse of `encode_generations`, from a numpy batch of its columns."""
    from safetensors.torch import load

    out = []
    for i in range(len(batch["answer"])):
        tensors = load(bytes(batch["tensors"][i]))
        out.append(
            Generation(
                prompt=str(batch["prompt"][i]),
                answer=str(batch["answer"][i]),
                token_ids=[int(t) for t in batch["token_ids"][i]],
                logprobs=tensors.get("logprobs"),
                entropies=tensors.get("entropies"),
                trajectory=tensors["trajectory"],
                stopped=bool(batch["stopped"][i]),
                prompt_tokens=int(batch["prompt_tokens"][i]),
                attention=tensors.get("attention"),
                dense=tensors.get("dense"),
                positions=tensors.get("positions"),
                extras=json.loads(batch["extras"][i]),
            )
        )
    return out


class CaptureReplica:
    """A Ray Data actor: one loaded model that captures one batch of prompts per call."""

    def __init__(
        self,
        model: str,
        revision: str,
        device: str,
        capture: dict,
        layers_path: str | None,
        threads: int,
        dtype: str = "float32",
    ) -> None:
        import torch

        from actmap.llm.models import load_model

        if device == "cpu":
            torch.set_num_threads(threads)  # the CPUs Ray gave this replica, no more
        self.model, self.tokenizer, _ = load_model(model, revision, device, dtype)
        self.capture = CaptureConfig(**capture)
        self.layers_path = layers_path

    def __call__(self, batch: dict[str, np.ndarray]):
        import pyarrow as pa

        prompts = [str(p) for p in batch["prompt"]]
        answers = None if batch["answer"][0] is None else [str(a) for a in batch["answer"]]
        started = time.perf_counter()
        records = capture_batch(
            self.model, self.tokenizer, prompts, answers, self.capture, self.layers_path
        )
        table = encode_generations(records)
        table = table.append_column("index", pa.array(batch["index"].astype(np.int64)))
        seconds = [time.perf_counter() - started] + [0.0] * (len(records) - 1)
        return table.append_column("seconds", pa.array(seconds, pa.float64()))


class VllmCaptureReplica:
    """A Ray Data actor holding one in-process vLLM engine (``RayOptions(replica="vllm")``,
    `actmap.capture.vllm_engine`): the batches, blocks and returned tables of
    `CaptureReplica`, generated by vLLM."""

    def __init__(
        self,
        model: str,
        revision: str,
        device: str,
        capture: dict,
        layers_path: str | None,
        threads: int,
        dtype: str = "float32",
        vllm_compile: bool | None = None,
    ) -> None:
        import torch

        from actmap.capture.vllm_engine import VllmCapture, VllmOptions, enforce_eager_for

        if device == "cpu":
            torch.set_num_threads(threads)
        self.capture = CaptureConfig(**capture)
        self.engine = VllmCapture(
            model, dtype,
            VllmOptions(max_num_seqs=self.capture.batch_size, enforce_eager=enforce_eager_for(vllm_compile)),
            greybox=self.capture.greybox, max_context=self.capture.max_context,
            revision=revision, layers_path=layers_path,
        )  # fmt: skip

    def __call__(self, batch):
        import numpy as np
        import pyarrow as pa

        if batch["answer"][0] is not None:
            raise ActmapUserError(
                "vLLM replicas generate answers; teacher forcing needs transformers"
            )
        prompts = [str(p) for p in batch["prompt"]]
        started = time.perf_counter()
        records = self.engine.generate(prompts, self.capture)
        table = encode_generations(records)
        table = table.append_column("index", pa.array(batch["index"].astype(np.int64)))
        seconds = [time.perf_counter() - started] + [0.0] * (len(records) - 1)
        return table.append_column("seconds", pa.array(seconds, pa.float64()))


# -- the driver -------------------------------------------------------------------------------
def prompt_dataset(plan: CapturePlan, task: Task):
    """The plan as a Ray dataset: one row per prompt, one block per planned batch."""
    import pyarrow as pa
    import ray.data

    tables, index = [], 0
    for batch, prompts in zip(plan.batches, plan.prompts, strict=True):
        answers = given_answers(task, batch)
        tables.append(
            pa.table(
                {
                    "index": pa.array(range(index, index + len(batch)), pa.int64()),
                    "prompt": prompts,
                    "answer": pa.array(answers or [None] * len(batch), pa.string()),
                }
            )
        )
        index += len(batch)
    return ray.data.from_arrow(tables)


def run_capture_ray(
    model: str,
    revision: str,
    device: str,
    tokenizer,
    source: ModelSource,
    task: Task,
    examples: Sequence[Example],
    store,
    capture: CaptureConfig = CaptureConfig(),
    map_config: MapConfig = MapConfig(),
    keep_trajectories: bool = False,
    layers_path: str | None = None,
    options: RayOptions = RayOptions(),
    progress: Callable[[int], None] | None = None,
    sort_by_length: bool = True,
    dtype: str = "float32",
    resumed: Callable[[int], None] | None = None,
) -> RunSummary:
    """`actmap.capture.run.run_capture` on a pool of ``options.workers`` model replicas.

    ``model`` / ``revision`` / ``device`` / ``dtype`` are what every replica loads (each on its own
    GPU when ``gpus_per_worker`` is 1); ``tokenizer`` renders and sorts the prompts here.
    """
    ray = require_ray()
    check_map_config(map_config)
    plan = plan_capture(task, examples, store, tokenizer, capture.batch_size, sort_by_length)
    started_here = plan.batches and not ray.is_initialized()
    if started_here:
        local_cpus = options.workers * options.cpus_per_worker + 1  # + the driver's share
        ray.init(
            address=options.address,
            num_cpus=None if options.address else int(np.ceil(local_cpus)),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    replica = {
        "model": model,
        "revision": revision,
        "device": device,
        "capture": asdict(capture),
        "layers_path": layers_path,
        "threads": max(1, int(options.cpus_per_worker)),
        "dtype": dtype,
    }
    if options.replica == "vllm":
        replica["vllm_compile"] = options.vllm_compile
    try:
        captured = _captured(plan, task, replica, options)
        engine = {"name": "ray", **asdict(options)}
        return commit_all(
            store, task, source, plan, captured, map_config, keep_trajectories, progress, engine,
            resumed,
        )  # fmt: skip
    finally:
        if started_here:
            ray.shutdown()


def _captured(
    plan: CapturePlan, task: Task, replica: dict, options: RayOptions
) -> Iterator[tuple[list[Example], list[Generation], float]]:
    """(examples, generations, seconds) per batch, in the order the replicas finish them."""
    if not plan.batches:
        return
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False  # the CLI shows its own
    flat = [e for batch in plan.batches for e in batch]
    replica_class = VllmCaptureReplica if options.replica == "vllm" else CaptureReplica
    dataset = prompt_dataset(plan, task).map_batches(
        replica_class,
        fn_constructor_kwargs=replica,
        batch_size=None,  # one block = one planned batch
        batch_format="numpy",
        concurrency=options.workers,
        num_cpus=options.cpus_per_worker,
        num_gpus=options.gpus_per_worker,
    )
    for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
        rows = [int(i) for i in batch["index"]]
        yield [flat[i] for i in rows], decode_generations(batch), float(np.sum(batch["seconds"]))
