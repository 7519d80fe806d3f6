"""actmap inside vLLM's own worker processes: the worker half of the vLLM plugin.

``--worker-extension-cls actmap.capture.vllm_worker.ActmapWorker`` mixes `ActmapWorker` into
every vLLM worker (vLLM's documented extension point, reachable with ``collective_rpc``). It is
the one capture inside vLLM: `vllm serve` with the plugin and the in-process
`actmap.capture.vllm_engine.VllmCapture` (``actmap capture --engine vllm``) both record here,
with `actmap.capture.vllm_engine`'s record points (put in while vLLM loads the model), row plan
before each forward (chunked prefill, preemption with recompute, prefix caching) and pooled
buffer copied once per step. Nobody submits to the recorder: every request vLLM schedules is
tracked when it first appears in the runner's batch (``_Recorder(track=...)``), and the
recorder reads each sampled token and its raw log-prob at the runner's sampler
(``own_tokens``). What a request keeps is the worker's settings (``actmap_configure``), or what
its id names (`actmap.capture.vllm_engine.request_settings`: `VllmCapture`'s requests).

A request's rows wait here until the API server's middleware (`actmap.serve.vllm_plugin`) or
`VllmCapture` takes them with ``collective_rpc("actmap_take", ...)`` once vLLM has answered; a request vLLM
finished that nobody takes (a client that went away, an endpoint without the middleware) is
dropped after ``hold_s`` seconds or when more than ``max_held`` wait. Only the worker of global
rank 0 records (with tensor parallel the residual stream after each layer's all-reduce is the
same on every rank); the others keep their record points idle.

Loading this module (vLLM does, in each worker process, before it builds the worker) makes
every model runner of the process put the record points in when it loads its model; they cost
one opaque op call per layer and return at once until ``actmap_configure`` starts a recorder.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import replace

import torch

from actmap.capture.records import CaptureConfig
from actmap.capture.vllm_engine import (
    _ACTIVE,
    RECORD_OP,
    _Recorder,
    forced_read_of,
    forced_rows,
    forced_statistics,
    patch_model_loading,
    reading_logits,
    request_settings,
)
from actmap.capture.vllm_push import RowPublisher
from actmap.capture.vllm_rows import ForcedRead, _Request, child_index, payload
from actmap.errors import ActmapUserError

log = logging.getLogger(__name__)

HOLD_S = 120.0  # a finished request's rows wait this long to be taken
MAX_HELD = 4096  # finished requests kept at most
FIRST_ROWS = 64  # host rows allocated when a request is first seen (grown by doubling)


def _check_compilation(vllm_config) -> None:
    """A compiled model keeps the record op as a piecewise split point (it runs eagerly between
    captured graphs); full CUDA graphs would replay the layers without it."""
    compilation = vllm_config.compilation_config
    if vllm_config.model_config.enforce_eager or not compilation.mode:
        return
    mode = str(compilation.cudagraph_mode).upper()
    if "FULL" in mode:
        raise ActmapUserError(
            f"cudagraph_mode={mode} replays the layers without Python: actmap's capture needs "
            'PIECEWISE or NONE (-cc \'{"cudagraph_mode": "PIECEWISE"}\')'
        )
    if compilation.splitting_ops is not None and RECORD_OP not in compilation.splitting_ops:
        compilation.splitting_ops.append(RECORD_OP)


def _before_load(runner) -> None:
    _check_compilation(runner.vllm_config)


patch_model_loading(before=_before_load)


class ActmapWorker:
    """Mixed into every vLLM worker: ``actmap_configure`` once, ``actmap_take`` per answer."""

    def actmap_configure(self, settings: dict) -> dict:
        """Start recording (rank 0 only). ``settings``: greybox, keep_positions, pooled_dim,
        and optionally attention_keys (lookback attention, `actmap.capture.vllm_attention`),
        hold_s, max_held. A second call with the same settings (another API
        server process) changes nothing."""
        current = getattr(self, "_actmap_settings", None)
        if current is not None:
            if current != settings:
                raise ActmapUserError(
                    f"actmap is already recording with {current}; an API server asked for "
                    f"{settings}: start every API server with the same detector"
                )
            return self._actmap_info()
        runner = self.model_runner
        model = runner.get_model()
        if not hasattr(model, "_actmap_hooks"):
            raise ActmapUserError(
                "vLLM loaded its model without actmap's record points: this worker module "
                "must be loaded before the model (--worker-extension-cls "
                "actmap.capture.vllm_worker.ActmapWorker)"
            )
        self._actmap_settings = dict(settings)
        self._actmap_configs: dict[tuple, CaptureConfig] = {}
        self._actmap_done: OrderedDict[str, tuple[float, _Request]] = OrderedDict()
        self._actmap_recorder = self._actmap_push = None
        if self.rank == 0:
            if _ACTIVE:
                raise ActmapUserError("one actmap recorder per process: another one is open")
            self._actmap_config = CaptureConfig(
                max_new_tokens=1,
                greybox=bool(settings.get("greybox", False)),
                keep_positions=bool(settings.get("keep_positions", False)),
                attention_keys=int(settings.get("attention_keys", 0)),
            )
            recorder = _Recorder(
                runner,
                model,
                len(model._actmap_hooks),
                int(settings.get("pooled_dim", 128)),
                int(runner.scheduler_config.max_num_seqs),
                self._actmap_config.greybox,
                own_tokens=True,
                track=self._actmap_track,
            )
            if self._actmap_config.attention_keys:
                try:
                    recorder.keep_attention()  # refused by name where it cannot be read
                except ActmapUserError:
                    recorder.remove()
                    del self._actmap_settings
                    raise
            self._actmap_recorder = recorder
            if settings.get("push", True):  # finished rows also go out at once (vllm_push)
                self._actmap_push = RowPublisher()
            self._actmap_wrap_execute(runner)
        elif settings.get("greybox"):
            self._actmap_follow_readings(runner)
        return self._actmap_info()

    def actmap_take(self, bases: list[str]) -> list[dict]:
        """The captured rows of every request whose id holds one of ``bases`` (each taken
        once; a worker that does not record returns nothing)."""
        return self._actmap_rows(bases, take=True)

    def actmap_peek(self, bases: list[str]) -> list[dict]:
        """The rows recorded so far of every request whose id holds one of ``bases``, left in
        place (the running score of a streamed answer)."""
        return self._actmap_rows(bases, take=False)

    @torch.inference_mode()
    def _actmap_rows(self, bases: list[str], take: bool) -> list[dict]:
        """(In inference mode: the host rows were made inside vLLM's forward, in inference
        mode, and the last step's rows are scattered into them in place; an RPC that arrives
        before the next step does that scatter.)"""
        recorder = getattr(self, "_actmap_recorder", None)
        if recorder is None:
            return []
        recorder.scatter()
        found = []
        for base in bases:
            for held, unpack in ((recorder.requests, None), (self._actmap_done, 1)):
                for rid in [r for r in held if child_index(r, base) is not None]:
                    request = held.pop(rid) if take else held[rid]
                    found.append((base, request if unpack is None else request[unpack]))
        out = []
        for base, request in found:
            item = payload(request, child_index(request.key, base))
            item["base"] = base
            out.append(item)
        return out

    def actmap_forget(self, req_ids: list[str]) -> int:
        """Drop finished requests' rows an API server got by the push socket; how many."""
        done = getattr(self, "_actmap_done", None) or {}
        return sum(done.pop(rid, None) is not None for rid in req_ids)

    def actmap_keep_attention(self) -> None:
        """Read lookback attention from now on, for requests that name attention keys
        (`actmap.capture.vllm_engine.request_settings`); refused by name where it cannot be."""
        recorder = getattr(self, "_actmap_recorder", None)
        if recorder is not None:
            recorder.keep_attention()
            self._actmap_configs.clear()  # what requests named before may be kept now

    def actmap_record(self, on: bool) -> None:
        """Switch recording off (the record points return at once, nothing is tracked) or on."""
        recorder = getattr(self, "_actmap_recorder", None)
        if recorder is not None:
            recorder.activate(on)

    def actmap_close(self) -> None:
        """Stop recording for good (the engine is shutting down)."""
        recorder = getattr(self, "_actmap_recorder", None)
        if recorder is not None:
            recorder.remove()
        self._actmap_recorder = None

    def actmap_held(self) -> dict:
        """How many requests the recorder follows and how many finished ones wait (tests)."""
        recorder = getattr(self, "_actmap_recorder", None)
        if recorder is None:
            return {"live": 0, "held": 0}
        return {"live": len(recorder.requests), "held": len(self._actmap_done)}

    # -- inside the worker ---------------------------------------------------------------------
    def _actmap_info(self) -> dict:
        model = self.model_runner.get_model()
        push = getattr(self, "_actmap_push", None)
        return {
            "rank": int(self.rank),
            "recording": getattr(self, "_actmap_recorder", None) is not None,
            "rows_address": None if push is None else push.address,
            "rows_host": None if push is None else push.host,
            "n_layers": len(model._actmap_hooks),
            "hidden_size": int(self.model_runner.model_config.get_hidden_size()),
        }

    def _actmap_track(self, req_id: str) -> _Request | None:
        """A request vLLM scheduled: its host arrays start small and grow with its answer."""
        state = self.model_runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        if state is None or params is None or state.prompt_token_ids is None:
            return None  # pooling requests and prompt embeddings have no answer rows
        recorder = self._actmap_recorder
        config = self._actmap_request_config(req_id)
        read = self._actmap_read_of(req_id)
        if read is not None:  # a teacher-forced reading: its rows are the answer's positions
            rows = len(read.chosen)
            return _Request(
                req_id, "", list(state.prompt_token_ids[: read.origin]), config,
                torch.zeros(recorder.n_layers, rows, recorder.pooled_dim),
                torch.zeros(rows) if config.greybox else None,
                full_rows=[] if config.keep_positions else None, token_ids=list(read.chosen),
                logprobs=[float("nan")] * rows if config.greybox else [],
                internal_id=req_id, max_rows=rows, forced=read,
            )  # fmt: skip
        max_rows = int(params.max_tokens) if params.max_tokens else None
        first = min(FIRST_ROWS, max_rows or FIRST_ROWS)
        states = torch.zeros(recorder.n_layers, first, recorder.pooled_dim)
        entropies = torch.zeros(first) if config.greybox else None
        attention = None
        if config.attention_keys:
            tap = recorder.attention
            attention = torch.zeros(first, tap.n_layers, tap.heads, config.attention_keys)
        request = _Request(
            req_id, "", list(state.prompt_token_ids), config, states, entropies,
            full_rows=[] if config.keep_positions else None, internal_id=req_id,
            max_rows=max_rows if max_rows is not None else 1 << 30, attention=attention,
        )  # fmt: skip
        return request

    def _actmap_request_config(self, req_id: str) -> CaptureConfig:
        """What request ``req_id`` keeps: what its id names (a request of
        `actmap.capture.vllm_engine.VllmCapture`: `request_settings`), within what this worker
        records; else the worker's settings."""
        named = request_settings(req_id)
        if named is None:
            return self._actmap_config
        config = self._actmap_configs.get(named)
        if config is None:
            greybox, positions, keys = named
            recorder = self._actmap_recorder
            config = self._actmap_configs[named] = replace(
                self._actmap_config,
                greybox=greybox and recorder.greybox,
                keep_positions=positions,
                attention_keys=keys if recorder.attention is not None else 0,
            )
        return config

    def _actmap_read_of(self, req_id: str) -> ForcedRead | None:
        """The teacher-forced reading request ``req_id`` is (its id says so:
        `actmap.capture.vllm_engine.forced_request_id`), or None."""
        state = self.model_runner.requests.get(req_id)
        if state is None or getattr(state, "sampling_params", None) is None:
            return None
        return forced_read_of(req_id, state.prompt_token_ids)

    def _actmap_follow_readings(self, runner) -> None:
        """A rank that does not record (tensor parallel): the recording rank computes logits
        for the rows of teacher-forced readings, and ``compute_logits`` is a collective, so
        this rank computes the same rows' logits with it (and drops them)."""
        original = runner._model_forward
        compute_logits = reading_logits(runner.get_model())

        def model_forward(*args, **kwargs):
            step = forced_rows(runner, self._actmap_read_of)
            out = original(*args, **kwargs)
            if step is not None:
                forced_statistics(compute_logits, out, step)
            return out

        runner._model_forward = model_forward

    def _actmap_wrap_execute(self, runner) -> None:
        """Before each step: move the last step's rows to the host and retire the requests vLLM
        says are finished (they wait to be taken)."""
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            if self._actmap_recorder is not None:  # None: closed
                self._actmap_retire(scheduler_output.finished_req_ids)
            return original(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model

    def _actmap_retire(self, finished) -> None:
        recorder = self._actmap_recorder
        recorder.scatter()
        now = time.monotonic()
        for rid in finished or ():
            request = recorder.requests.pop(rid, None)
            if request is not None:
                self._actmap_done[rid] = (now, request)
                if self._actmap_push is not None:
                    self._actmap_push.send(payload(request, 0))
        hold = float(self._actmap_settings.get("hold_s", HOLD_S))
        limit = int(self._actmap_settings.get("max_held", MAX_HELD))
        done = self._actmap_done
        while done and (len(done) > limit or now - next(iter(done.values()))[0] > hold):
            rid, _ = done.popitem(last=False)
            log.debug("actmap: dropped the rows of %s (never taken)", rid)
