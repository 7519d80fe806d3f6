"""actmap inside vLLM's own OpenAI server: the API-server half of the vLLM plugin.

vLLM's server, started with three flags (docs/vllm.md)::

    python -m vllm.entrypoints.openai.api_server --model FOLDER \\
        --worker-extension-cls actmap.capture.vllm_worker.ActmapWorker \\
        --middleware actmap.serve.vllm_plugin.ActmapMiddleware \\
        --additional-config '{"actmap": {"detector": "runs/plus"}}'

(the command ``actmap serve --engine vllm`` builds from its flags and runs:
`actmap.serve.vllm_launch`) captures every generated token's map in vLLM's worker processes
(`actmap.capture.vllm_worker`) and adds the ``actmap`` block of ``actmap serve`` to vLLM's own
chat and completion responses.
`ActmapMiddleware` is plain ASGI middleware on vLLM's app:

* at start-up (the ASGI lifespan) it loads the detector, policy, audit trail and shift monitor
  (`actmap.serve.app.load_scoring`: the settings are ``actmap serve``'s, under
  ``additional_config["actmap"]``), refuses a detector trained on another generator
  (`actmap.serve.loaded_run.generator_problem`) and asks the workers to start recording
  (``collective_rpc("actmap_configure")``); any of these failing stops vLLM's server with one
  line saying why;
* each ``POST /v1/chat/completions`` or ``/v1/completions`` goes to vLLM unchanged, with an
  ``X-Request-Id`` header when the client sent none, so that vLLM names the request (and its
  ``n > 1`` children) after an id the middleware knows;
* when vLLM has answered (status 200), it takes the answer's rows from the workers (one
  ``collective_rpc("actmap_take")`` for every answer finished meanwhile), cuts them as the
  in-process engine does (`actmap.capture.vllm_worker.generation_from_payload`) and scores them
  with `actmap.serve.engine.Engine.score` (the same maps, detector, prior correction, policy and
  audit as ``actmap serve``); the block goes into the JSON body (``actmap``, and per choice
  with ``n > 1``) or, for a stream, into one more chunk before ``data: [DONE]``.

Anything vLLM answers with another status (its own validation errors) passes through untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import Counter, Histogram
from pydantic import ValidationError

from actmap.capture.vllm_engine import end_ids
from actmap.capture.vllm_push import RowSubscriber, same_host
from actmap.capture.vllm_rows import child_index, generation_from_payload, payload_arrays
from actmap.errors import ActmapUserError
from actmap.llm.models import ModelSource, resolve_model
from actmap.serve.app import actmap_info, audit_trail, load_scoring, serve_metrics
from actmap.serve.engine import Engine, Job
from actmap.serve.loaded_run import generator_problem, refuse_what_vllm_cannot_read
from actmap.serve.protocol import ActmapOptions
from actmap.serve.request_path import APIError, limit_max_tokens, validation_error
from actmap.serve.review import REVIEW_PAGE
from actmap.serve.settings import ServeSettings
from actmap.serve.vllm_reader import VllmReader

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
SCORE_PATH = "/v1/actmap/score"
# actmap serve's feedback route and review queue (`VllmPlugin.start_label_routes`)
LABEL_PATHS = ("/v1/actmap/feedback", "/v1/actmap/review/queue", REVIEW_PAGE)
CONFIG_KEY = "actmap"
# ServeSettings fields the plugin reads from additional_config["actmap"]
SETTINGS = (
    "detector", "seed", "policy", "audit", "audit_text", "audit_max_rows",
    "audit_max_age_days", "review_sample", "monitor", "monitor_window", "device",
    "stream_scores", "score_every", "max_score_items", "default_max_tokens", "max_tokens_cap",
)  # fmt: skip
# given either, a request's max_tokens gets actmap serve's default and cap (else vLLM's rules)
TOKEN_LIMITS = ("default_max_tokens", "max_tokens_cap")
# the plugin's own: check the detector's generator or not; serve /v1/actmap/score; how long
# an answer waits for its pushed rows before it takes them by RPC (actmap.capture.vllm_push)
PLUGIN_SETTINGS = ("allow_generator_mismatch", "score_route", "push_wait_s")
# the workers': how long / how many finished answers' rows wait to be taken; push them or not
WORKER_SETTINGS = ("hold_s", "max_held", "push")
PUSH_WAIT_S = 2.0
WORKER_EXTENSION = "actmap.capture.vllm_worker.ActmapWorker"


def plugin_settings(options: object, model: str) -> tuple[ServeSettings, dict]:
    """(ServeSettings, worker options) from ``additional_config["actmap"]``."""
    if not isinstance(options, dict) or not options.get("detector"):
        raise ActmapUserError(
            f"""--additional-config needs '{{"{CONFIG_KEY}": {{"detector": "RUN"}}}}' """
            "(a run folder from `actmap train`)"
        )
    for key in ("fallback_run", "fallback-run"):  # not built here (docs/out_of_domain.md)
        if key in options:
            raise ActmapUserError(
                f"{key}: the vLLM plugin takes no fallback detector; use `actmap serve "
                "--fallback-run` with the transformers engine (docs/out_of_domain.md)"
            )
    worker = {k: options[k] for k in WORKER_SETTINGS if k in options}
    unknown = sorted(set(options) - set(SETTINGS) - set(worker) - set(PLUGIN_SETTINGS))
    if unknown:
        raise ActmapUserError(
            f"unknown actmap settings {unknown}; known: {', '.join(SETTINGS)}, "
            f"{', '.join(WORKER_SETTINGS)}, {', '.join(PLUGIN_SETTINGS)}"
        )
    paths = {f.name for f in fields(ServeSettings) if "Path" in str(f.type)}
    values = {k: Path(v) if k in paths and v is not None else v for k, v in options.items()
              if k in SETTINGS}  # fmt: skip
    return ServeSettings(model=model, **values), worker


def worker_settings(detector, options: dict) -> dict:
    """What the workers record for ``detector`` (``actmap_configure``): the scalars' log-probs
    and entropies when it reads them, position states when it reads those (a stacked
    actmap-plus), the lookback attention when it reads that (a full one), the map rows always; ``options``: the worker's own (``hold_s``, ``max_held``)."""
    capture = detector.capture_settings()
    return {
        "greybox": capture["greybox"],
        "keep_positions": bool(capture.get("keep_positions")),
        "attention_keys": int(capture.get("attention_keys", 0)),
        "pooled_dim": 128,
        **options,
    }


class _Rows:
    """Fetches answers' rows from the workers, one ``collective_rpc`` of ``method`` for every
    answer waiting (``actmap_take``: finished answers, taken once; ``actmap_peek``: the rows so
    far of running ones)."""

    def __init__(self, engine_client, method: str = "actmap_take") -> None:
        self.client, self.method = engine_client, method
        self.waiting: dict[str, asyncio.Future] = {}
        self.task: asyncio.Task | None = None

    async def take(self, base: str) -> list[dict]:
        future = self.waiting.get(base)
        if future is None:
            future = self.waiting[base] = asyncio.get_running_loop().create_future()
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        return await asyncio.shield(future)

    async def _run(self) -> None:
        while self.waiting:
            batch, self.waiting = self.waiting, {}
            try:
                per_worker = await self.client.collective_rpc(self.method, args=(list(batch),))
            except Exception as error:  # every waiting answer learns why
                for future in batch.values():
                    if not future.done():
                        future.set_exception(error)
                continue
            found = defaultdict(list)
            for items in per_worker:
                for item in items or ():
                    found[item["base"]].append(item)
            for base, future in batch.items():
                if not future.done():
                    future.set_result(found.get(base, []))


class _Forget:
    """Drops rows that came by the push socket from the workers: one ``actmap_forget`` RPC per
    batch, in the background (no answer waits for it)."""

    def __init__(self, engine_client) -> None:
        self.client, self.ids = engine_client, []
        self.task: asyncio.Task | None = None

    def add(self, req_ids: list[str]) -> None:
        self.ids += req_ids
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while self.ids:
            batch, self.ids = self.ids, []
            try:
                await self.client.collective_rpc("actmap_forget", args=(batch,))
            except Exception as error:  # they expire after hold_s anyway
                log.debug("actmap: forgetting %d pushed rows failed: %s", len(batch), error)


class VllmPlugin:
    """The scoring side: an `Engine` without a generator, fed with the workers' rows."""

    limits_tokens = False  # max_tokens: actmap serve's default and cap (TOKEN_LIMITS given)

    def __init__(
        self, engine: Engine, client, ends: set[int], settings: ServeSettings | None = None
    ) -> None:
        self.engine, self.ends, self.client = engine, ends, client
        self.settings = settings if settings is not None else ServeSettings(model="")
        self.score_app = self.score_state = None  # POST /v1/actmap/score (score_route)
        self.label_app = None  # feedback and review queue (`start_label_routes`)
        self.taker = _Rows(client, "actmap_take")
        self.peeker = _Rows(client, "actmap_peek")
        self.pushed: RowSubscriber | None = None  # rows the recording worker pushes
        self.push_wait_s = PUSH_WAIT_S
        self.forgetter = _Forget(client)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="actmap-score")
        self.metrics = serve_metrics(engine)  # actmap serve's metrics, on vLLM's /metrics
        self.rows_by = Counter(
            "actmap_vllm_rows",
            "Answers whose rows came from vLLM's workers, by the way they came (push: the "
            "recording worker's socket; rpc: collective_rpc, after push_wait_s or without push)",
            ["way"],
            registry=self.metrics.registry,
        )
        self.rows_wait = Histogram(
            "actmap_vllm_rows_wait_seconds",
            "How long an answer vLLM finished waited for its rows from the workers",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4),
            registry=self.metrics.registry,
        )

    def expose_metrics(self) -> None:
        """Serve the ``actmap_*`` metrics from vLLM's own ``/metrics`` (its registry). With
        several API-server processes (``--api-server-count``) vLLM serves the values every
        process writes into ``PROMETHEUS_MULTIPROC_DIR``, which prometheus-client does for these
        metrics too (they are made after vLLM set it): nothing to register, and each answer is
        counted once, by the process that answered it."""
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return
        try:
            get_prometheus_registry().register(self.metrics.registry)
        except ValueError as error:  # names taken (a second plugin in this process)
            log.warning("actmap: metrics not exposed: %s", error)

    @classmethod
    async def start(cls, app_state) -> VllmPlugin:
        from transformers import AutoTokenizer

        vllm_config = app_state.vllm_config
        model_config = vllm_config.model_config
        options = (vllm_config.additional_config or {}).get(CONFIG_KEY)
        settings, worker_options = plugin_settings(options, model_config.model)
        parallel = vllm_config.parallel_config
        count = int(getattr(parallel, "_api_process_count", 1))
        if count > 1 and settings.audit is not None:  # one audit store per API-server process
            rank = int(getattr(parallel, "_api_process_rank", 0))
            settings = replace(settings, audit=settings.audit / f"api-{rank}")
        detector, policy, monitor = load_scoring(settings)
        served = _served_source(model_config)
        problem = generator_problem(detector, served)
        if problem is not None and not options.get("allow_generator_mismatch"):
            raise ActmapUserError(problem)
        if not (detector.generator or {}).get("name"):
            log.warning("actmap: %s records no generator; not checked against %s",
                        detector.id, served.path)  # fmt: skip
        refuse_what_vllm_cannot_read(
            detector, "serve a deployable run",
            getattr(model_config.hf_text_config, "model_type", None),
        )  # fmt: skip
        dtype = str(model_config.dtype).removeprefix("torch.")
        if dtype != detector.dtype:
            log.warning("actmap: vLLM runs %s, but %s was fit on %s maps: scores may shift",
                        dtype, detector.id, detector.dtype)  # fmt: skip
        worker = worker_settings(detector, worker_options)
        client = app_state.engine_client
        try:
            infos = await client.collective_rpc("actmap_configure", args=(worker,))
        except Exception as error:
            if "actmap_configure" in str(error) and "not implemented" in str(error).lower():
                raise ActmapUserError(
                    f"vLLM's workers do not have actmap's extension: add --worker-extension-cls "
                    f"{WORKER_EXTENSION}"
                ) from None
            raise ActmapUserError(f"vLLM's workers could not start recording: {error}") from None
        if not any(info["recording"] for info in infos):
            raise ActmapUserError(f"no vLLM worker of global rank 0 started recording: {infos}")
        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, revision=model_config.tokenizer_revision
        )
        engine = Engine(
            None, tokenizer, served, detector, policy,
            max_context=int(model_config.max_model_len), audit=audit_trail(settings, detector),
            monitor=monitor,
        )  # fmt: skip
        log.info("actmap: scoring vLLM's answers with %s (workers: %s)", detector.id, infos)
        plugin = cls(engine, client, end_ids(model_config.tokenizer, tokenizer), settings)
        plugin.limits_tokens = any(k in options for k in TOKEN_LIMITS)
        plugin.expose_metrics()
        plugin.push_wait_s = float(options.get("push_wait_s", PUSH_WAIT_S))
        plugin.subscribe(infos)
        keys = _api_keys(app_state)
        plugin.start_label_routes(keys)
        if options.get("score_route"):  # /v1/actmap/score: answers read by vLLM itself
            names = model_config.served_model_name
            name = names[0] if isinstance(names, list) else names
            await plugin.start_score_route(name, keys)
        return plugin

    async def start_score_route(self, model_name: str, api_keys: list[str] = ()) -> None:
        """``POST /v1/actmap/score`` (`actmap.serve.score_endpoint`, ``actmap serve``'s route) on a
        small app of its own, over this plugin's engine and metrics; each answer is read by a
        teacher-forced request to vLLM (`actmap.serve.vllm_reader.VllmReader`). ``api_keys``:
        vLLM's own (`_api_keys`), checked as vLLM checks them (`_actmap_app`)."""
        from actmap.serve.app import ServerState
        from actmap.serve.score_endpoint import install_score_route

        settings = replace(self.settings, served_model_name=model_name)
        # the scoring side alone (vLLM generates and reads), counting into the metrics on
        # vLLM's /metrics
        state = ServerState(settings, self.engine, metrics=self.metrics, generate=False)
        state.scorer = VllmReader(self, settings.max_queue, self.metrics.observe_forced)
        await state.scorer.start()
        self.score_app = _actmap_app(state, install_score_route, api_keys)
        self.score_state = state

    def start_label_routes(self, api_keys: list[str] = ()) -> None:
        """``actmap serve``'s feedback route (``POST /v1/actmap/feedback``, a label for a served
        answer into the audit store: `actmap.serve.feedback`) and review queue (``GET
        /v1/actmap/review/queue`` and its page, `actmap.serve.review`) over this plugin's audit
        store, on a small app of their own. With several API-server processes each serves its
        own store (``AUDIT/api-<rank>``): a label for an answer another process served is a 404
        there."""
        from actmap.serve.feedback import install_feedback_route
        from actmap.serve.review import install_review_routes

        def install(app) -> None:
            install_feedback_route(app)
            install_review_routes(app)

        # what these routes read of a server's state: its engine's audit trail (and fallback)
        state = SimpleNamespace(settings=self.settings, engine=self.engine)
        self.label_app = _actmap_app(state, install, api_keys)

    def subscribe(self, infos: list[dict]) -> None:
        """Receive the rows the recording worker pushes, when it pushes and runs on this host
        (else every answer's rows come by RPC)."""
        for info in infos:
            if info.get("rows_address") and same_host(info.get("rows_host")):
                self.pushed = RowSubscriber(info["rows_address"], child_index)
                return
        log.info("actmap: no pushed rows on this host; answers' rows come by RPC")

    def expect(self, base: str) -> None:
        """A request named after ``base`` goes to vLLM: keep its pushed rows."""
        if self.pushed is not None:
            self.pushed.expect(base)

    def release(self, base: str) -> None:
        """The request ended: rows still kept for it are dropped here and in the worker."""
        if self.pushed is not None:
            left = self.pushed.release(base)
            if left:
                self.forgetter.add([item["req_id"] for item in left])

    async def rows(self, base: str, count: int) -> list[dict]:
        """The ``count`` answers' rows of the request named after ``base``: pushed ones at
        once; what has not come within ``push_wait_s`` by RPC (``actmap_take``)."""
        started, pushed = time.perf_counter(), []
        if self.pushed is not None:
            pushed = await self.pushed.take(base, count, self.push_wait_s)
            if len(pushed) >= count:
                self.forgetter.add([item["req_id"] for item in pushed])
                self.rows_by.labels("push").inc(len(pushed))
                self.rows_wait.observe(time.perf_counter() - started)
                return pushed
        taken = await self.taker.take(base)
        have = {item["req_id"] for item in taken}
        self.rows_by.labels("rpc").inc(len(taken))
        self.rows_wait.observe(time.perf_counter() - started)
        return taken + [item for item in pushed if item["req_id"] not in have]

    async def close(self) -> None:
        if self.pushed is not None:
            await self.pushed.close()
        if self.score_state is not None:
            await self.score_state.scorer.stop()
        self.pool.shutdown(wait=True)
        if self.engine.audit is not None:
            self.engine.audit.close()

    async def blocks(
        self, base: str, body: dict, endpoint: str, arrived: float, tokens: int | None = None
    ) -> dict[int, dict]:
        """choice index -> its ``actmap`` block, for the request vLLM named after ``base``
        (``arrived``: `time.perf_counter` when the request came in, for the latency metric;
        ``tokens``: the answer was ended after its first ``tokens`` tokens by ``abort_below``)."""
        items = await self.rows(base, _answers(body, endpoint))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.pool, self._score, items, body, endpoint, arrived, tokens
        )

    def _ends(self, body: dict) -> set[int]:
        """The token ids that end this request's answers (vLLM's sampling fields)."""
        ends = set() if body.get("ignore_eos") else set(self.ends)
        ends.update(int(t) for t in body.get("stop_token_ids") or ())
        return ends

    def _score(
        self, items: list[dict], body: dict, endpoint: str, started: float, tokens: int | None
    ) -> dict:
        stop = _stop_strings(body)
        ends = self._ends(body)
        items = sorted(items, key=lambda item: item["index"])
        generations = [
            generation_from_payload(item, self.engine.tokenizer, ends, stop, tokens)
            for item in items
        ]
        text = _audit_text(body, endpoint)
        jobs = [
            Job(prompt=g.prompt, prompt_tokens=g.prompt_tokens, max_tokens=max(1, g.n_tokens),
                stop=stop, prompt_for_audit=text, endpoint=endpoint, enqueued_at=started)
            for g in generations
        ]  # fmt: skip
        answers = []
        if jobs:
            aborted = [tokens is not None] * len(jobs)  # abort_below: decision abstain_early
            answers = self.engine.score(jobs, generations, started, aborted)
        for answer in answers:
            self.metrics.observe_answer(endpoint, answer, time.perf_counter() - started)
        if self.engine.monitor is not None and answers:
            self.metrics.observe_shift(self.engine.monitor.state())
        return {
            item["index"]: actmap_info(self.engine, answer).model_dump()
            for item, answer in zip(items, answers, strict=True)
        }

    @property
    def gives_running_scores(self) -> bool:
        """A detector of whole answers (position states) gives no running score."""
        return not self.engine.detector.needs_generations

    async def running(
        self, request: _Request, choices: set[int], since: dict[int, int]
    ) -> dict[int, tuple[float, int]]:
        """choice -> (running p(correct), answer tokens it read) for ``choices`` of a running
        request whose answer grew by at least ``score_every`` tokens since ``since[choice]``."""
        items = [i for i in await self.peeker.take(request.base) if i["index"] in choices]
        if not items:
            return {}
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._running, items, request.body, since)

    def _running(self, items: list[dict], body: dict, since: dict[int, int]) -> dict:
        engine, ends = self.engine, self._ends(body)
        every = max(1, int(self.settings.score_every))
        chosen = []
        for item in items:
            t = min(int(item["recorded"]), len(item["token_ids"]))
            if t == 0 or item["token_ids"][t - 1] in ends:  # the end token: scored whole next
                continue
            if t - since.get(item["index"], 0) >= every:
                chosen.append((item, t))
        if not chosen:
            return {}
        prefixes = []
        for item, t in chosen:
            states, entropies, _ = payload_arrays(item)
            prefixes.append((states, item["logprobs"], entropies, t))
        p = engine.prefix_scores(prefixes)  # the running scorer of both vLLM step loops
        return {item["index"]: (float(v), t) for (item, t), v in zip(chosen, p, strict=True)}


def _actmap_app(state, install, api_keys: list[str] = ()):
    """A small FastAPI app of ``actmap serve``'s routes (``install(app)``) over ``state``, with
    its error handling; behind vLLM's own API-key check (``api_keys``: `_api_keys`), which
    sits inside this middleware and so never sees these routes' requests."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.state.actmap = state
    install(app)
    app.add_exception_handler(APIError, lambda request, error: error.response())
    app.add_exception_handler(
        RequestValidationError,
        lambda request, error: validation_error(error.errors()).response(),
    )
    if not api_keys:
        return app
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    return AuthenticationMiddleware(app, tokens=list(api_keys))


def _api_keys(app_state) -> list[str]:
    """The keys vLLM's server wants on ``/v1`` paths, read as vLLM reads them: its
    ``--api-key`` values, else ``VLLM_API_KEY`` (``actmap serve --engine vllm`` sets that)."""
    from vllm import envs

    keys = getattr(getattr(app_state, "args", None), "api_key", None) or [envs.VLLM_API_KEY]
    return [key for key in keys if key]


def _served_source(model_config) -> ModelSource:
    try:
        return resolve_model(model_config.model, model_config.revision or "main")
    except (FileNotFoundError, ActmapUserError):
        return ModelSource(model_config.model, model_config.model, None, "unknown")


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(s for s in stop if isinstance(s, str))


def _audit_text(body: dict, endpoint: str) -> str:
    """The request's text as ``actmap serve`` audits it (hashed unless audit_text)."""
    if endpoint == "completion":
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    lines = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        lines.append(f"{message.get('role', '')}: {content or ''}")
    return "\n".join(lines)


def _choices(body: dict) -> int:
    """The request's ``n`` (1 when absent or not a count above 1: vLLM's own check answers)."""
    n = body.get("n")
    return n if isinstance(n, int) and n > 1 else 1


def _answers(body: dict, endpoint: str) -> int:
    """How many answers vLLM makes for a request: ``n`` per prompt (a completion may give a
    list of prompts)."""
    n = _choices(body)
    prompt = body.get("prompt") if endpoint == "completion" else None
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return n * len(prompt)
    return n


def _missing(index: int) -> dict:
    return {"error": f"no map was recorded for choice {index}"}


class ActmapMiddleware:
    """ASGI middleware on vLLM's API server (``--middleware actmap.serve.vllm_plugin.
    ActmapMiddleware``): the actmap block on vLLM's chat and completion answers."""

    def __init__(self, app) -> None:
        self.app = app
        self.plugin: VllmPlugin | None = None
        # the request ids vLLM names this process's answers after, while they run: a client
        # that sends one X-Request-Id twice at once gets a suffix on the second (the rows are
        # taken by this id; duplicates across API-server processes are not told apart)
        self.in_flight: set[str] = set()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(scope, receive, send)
        if scope["type"] == "http" and scope.get("path") == SCORE_PATH and self.plugin is not None:
            return await self._score_route(scope, receive, send)
        if (
            scope["type"] == "http"
            and scope.get("path") in LABEL_PATHS
            and self.plugin is not None
            and self.plugin.label_app is not None
        ):
            return await self.plugin.label_app(scope, receive, send)
        endpoint = ENDPOINTS.get(scope.get("path", ""))
        if (
            scope["type"] != "http"
            or endpoint is None
            or scope.get("method") != "POST"
            or self.plugin is None
        ):
            return await self.app(scope, receive, send)
        return await self._request(scope, receive, send, endpoint)

    async def _lifespan(self, scope, receive, send) -> None:
        async def wrapped(message) -> None:
            if message["type"] == "lifespan.startup.complete":
                try:
                    self.plugin = await VllmPlugin.start(scope["app"].state)
                except (ActmapUserError, FileNotFoundError, ValueError) as error:
                    message = {"type": "lifespan.startup.failed", "message": f"actmap: {error}"}
            elif message["type"] == "lifespan.shutdown.complete" and self.plugin is not None:
                await self.plugin.close()
            await send(message)

        await self.app(scope, receive, wrapped)

    async def _score_route(self, scope, receive, send) -> None:
        if self.plugin.score_app is None:
            error = APIError(
                400, "scoring existing answers (a teacher-forced reading by vLLM) is off on this "
                f"server: start it with --additional-config "
                f"""'{{"{CONFIG_KEY}": {{"score_route": true, ...}}}}'""", param="score_route",
            )  # fmt: skip
            return await error.response()(scope, receive, send)
        return await self.plugin.score_app(scope, receive, send)

    async def _request(self, scope, receive, send, endpoint: str) -> None:
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        headers = list(scope["headers"])
        request = None
        if isinstance(body, dict):  # else vLLM answers it with its own error
            try:
                request, raw = self._read(body, raw, endpoint)
            except APIError as error:
                return await error.response()(scope, receive, send)
            base = next(
                (v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None
            )
            if base is None:
                base = f"actmap-{uuid.uuid4().hex}"
            elif base in self.in_flight:  # a client's id twice at once: rows told apart
                base = f"{base}-{uuid.uuid4().hex[:8]}"
            request = replace(request, base=base)
            headers = [(k, v) for k, v in headers
                       if k.lower() not in (b"content-length", b"x-request-id")]  # fmt: skip
            headers += [(b"x-request-id", base.encode()),
                        (b"content-length", str(len(raw)).encode())]  # fmt: skip
            scope = {**scope, "headers": headers}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            if request is None or request.abort_below is None:
                return await receive()
            # an answer abort_below ends: vLLM hears a client that left, and aborts it
            client = asyncio.ensure_future(receive())
            ended = asyncio.ensure_future(request.ended.wait())
            done, _ = await asyncio.wait({client, ended}, return_when=asyncio.FIRST_COMPLETED)
            if client in done:
                ended.cancel()
                return client.result()
            client.cancel()
            return {"type": "http.disconnect"}

        if request is None:
            return await self.app(scope, replay, send)
        self.in_flight.add(request.base)
        self.plugin.expect(request.base)
        try:
            if request.stream:
                sender = _StreamSender(send, self.plugin, request)
                await self.app(scope, replay, sender)
                await sender.end_early()
            else:
                await self.app(scope, replay, _JsonSender(send, self.plugin, request))
        finally:
            self.in_flight.discard(request.base)
            self.plugin.release(request.base)

    def _read(self, body: dict, raw: bytes, endpoint: str) -> tuple[_Request, bytes]:
        """The request as the middleware sees it, and the body vLLM gets (without ``actmap``,
        actmap's own per-request options: ``stream_scores``, ``abort_below``)."""
        options = ActmapOptions()
        changed = False
        if "actmap" in body:
            try:
                options = ActmapOptions.model_validate(body.pop("actmap") or {})
            except ValidationError as error:  # named as actmap.<field>
                errors = [{**e, "loc": ("actmap", *e.get("loc", ()))} for e in error.errors()]
                raise validation_error(errors) from None
            changed = True
        if self.plugin.limits_tokens:
            changed = self._limit_tokens(body, endpoint) or changed
        if changed:
            raw = json.dumps(body).encode()
        n = _choices(body)
        stream = bool(body.get("stream"))
        if options.abort_below is not None and not stream:
            raise APIError(
                400, "actmap.abort_below needs stream: true on vLLM's server (the answer is ended "
                "while it streams)", param="actmap.abort_below",
            )  # fmt: skip
        if options.abort_below is not None and n > 1:
            raise APIError(
                400, "actmap.abort_below needs n = 1 (vLLM ends a request's choices together)",
                param="actmap.abort_below",
            )  # fmt: skip
        scores = self.plugin.settings.stream_scores
        if options.stream_scores is not None:
            scores = options.stream_scores
        running = self.plugin.gives_running_scores
        request = _Request(
            "", body, endpoint, n, time.perf_counter(), stream=stream,
            stream_scores=stream and bool(scores) and running,
            abort_below=options.abort_below if running else None,
        )  # fmt: skip
        return request, raw

    def _limit_tokens(self, body: dict, endpoint: str) -> bool:
        """``max_tokens`` as ``actmap serve`` has it (`limit_max_tokens`: its default filled in,
        refused above its cap); a value that is not a number is left to vLLM's own check."""
        key = "max_tokens"
        if endpoint == "chat" and body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
        given = body.get(key)
        if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
            return False
        settings = self.plugin.settings
        body[key] = limit_max_tokens(given, settings.default_max_tokens, settings.max_tokens_cap)
        return given is None


@dataclass(frozen=True)
class _Request:
    """One chat / completion request as the middleware sees it."""

    base: str  # the X-Request-Id vLLM names the request (and its children) after
    body: dict
    endpoint: str  # chat | completion
    n: int  # choices
    arrived: float  # time.perf_counter()
    stream: bool = False
    stream_scores: bool = False  # a running score in every streamed chunk
    abort_below: float | None = None  # end the answer when its running score falls below
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # abort_below fired

    @property
    def watched(self) -> bool:
        return self.stream_scores or self.abort_below is not None

    async def blocks(self, plugin: VllmPlugin, tokens: int | None = None) -> dict[int, dict]:
        return await plugin.blocks(self.base, self.body, self.endpoint, self.arrived, tokens)


class _JsonSender:
    """Holds vLLM's JSON answer until the blocks are in it (other statuses pass untouched)."""

    def __init__(self, send, plugin: VllmPlugin, request: _Request) -> None:
        self.send, self.plugin, self.request = send, plugin, request
        self.start: dict | None = None
        self.parts: list[bytes] = []

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] != 200:
                self.start = None
                self.passthrough = True
                return await self.send(message)
            self.start, self.passthrough = message, False
            return None
        if message["type"] != "http.response.body" or getattr(self, "passthrough", True):
            return await self.send(message)
        self.parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return None
        raw = b"".join(self.parts)
        try:
            out = json.loads(raw)
            blocks = await self.request.blocks(self.plugin)
            out["actmap"] = blocks.get(0, _missing(0))
            if self.request.n > 1:
                for choice in out.get("choices") or ():
                    index = choice.get("index", 0)
                    choice["actmap"] = blocks.get(index, _missing(index))
            raw = json.dumps(out, ensure_ascii=False).encode()
        except Exception:  # vLLM's answer goes out as it was; the block says nothing
            log.exception("actmap: scoring request %s failed", self.request.base)
        headers = [(k, v) for k, v in self.start["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": raw, "more_body": False})


class _StreamSender:
    """Passes vLLM's server-sent events through as they come; before ``data: [DONE]`` adds one
    chunk with the ``actmap`` block (``choices: []``; with ``n > 1`` one entry per choice,
    ``{"index", "delta": {}, "actmap"}``).

    A watched request (``stream_scores``, ``abort_below``) has its rows so far read from the
    workers at each chunk (``actmap_peek``) and scored: ``stream_scores`` puts the running
    score (``{"p_correct", "n_tokens"}``, as ``actmap serve``) in the chunk (per choice with
    ``n > 1``); a score below ``abort_below`` ends the answer: the chunk goes out, vLLM aborts
    the request (it hears a client that left), and once it has, one more chunk
    (``finish_reason: "stop"``) carries the block of the answer's first ``n_tokens`` tokens,
    decision ``abstain_early``, then ``data: [DONE]``."""

    def __init__(self, send, plugin: VllmPlugin, request: _Request) -> None:
        self.send, self.plugin, self.request = send, plugin, request
        self.streaming = False
        self.pending = b""
        self.head: dict | None = None
        self.failed = False
        self.scored: dict[int, int] = {}  # choice -> answer tokens of its last running score
        self.cut: int | None = None  # abort_below ended the answer after this many tokens
        self.done = False  # the client's stream is complete

    async def __call__(self, message) -> None:
        if self.done:  # the rest of an answer abort_below ended: nobody reads it
            return None
        if message["type"] == "http.response.start":
            headers = dict((k.lower(), v) for k, v in message.get("headers", []))
            self.streaming = message["status"] == 200 and headers.get(
                b"content-type", b""
            ).startswith(b"text/event-stream")
            return await self.send(message)
        if message["type"] != "http.response.body" or not self.streaming:
            return await self.send(message)
        self.pending += message.get("body", b"")
        out = []
        while b"\n\n" in self.pending:
            event, self.pending = self.pending.split(b"\n\n", 1)
            data = event.strip()
            if data == b"data: [DONE]":
                if not self.failed:
                    out.append(await self._final())
            else:
                chunk = self._look(data)
                if chunk is not None and self.request.watched and chunk.get("choices"):
                    event = await self._running(chunk, event)
            out.append(event + b"\n\n")
            if self.cut is not None:  # the rest comes once vLLM has aborted (`end_early`)
                self.pending = b""
                self.request.ended.set()
                await self.send({"type": "http.response.body", "body": b"".join(out),
                                 "more_body": True})  # fmt: skip
                self.done = True
                return None
        more = message.get("more_body", False)
        if not more:
            out.append(self.pending)
            self.pending = b""
            self.done = True
        await self.send({"type": "http.response.body", "body": b"".join(out), "more_body": more})

    def _look(self, data: bytes) -> dict | None:
        if not data.startswith(b"data: "):
            return None
        try:
            chunk = json.loads(data[6:])
        except ValueError:
            return None
        if not isinstance(chunk, dict):
            return None
        if "error" in chunk:
            self.failed = True
            return None
        if self.head is None and "id" in chunk:
            self.head = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        return chunk

    async def _running(self, chunk: dict, event: bytes) -> bytes:
        """The chunk with its running score(s); sets ``cut`` when abort_below fires."""
        request = self.request
        choices = {c.get("index", 0) for c in chunk["choices"] if isinstance(c, dict)}
        try:
            running = await self.plugin.running(request, choices, self.scored)
        except Exception:
            log.exception("actmap: running score of request %s failed", request.base)
            return event
        if not running:
            return event
        for index, (_, t) in running.items():
            self.scored[index] = t
        if request.stream_scores:
            blocks = {i: {"p_correct": p, "n_tokens": t} for i, (p, t) in running.items()}
            if request.n == 1:
                chunk["actmap"] = blocks[0]
            else:
                for choice in chunk["choices"]:
                    if choice.get("index", 0) in blocks:
                        choice["actmap"] = blocks[choice.get("index", 0)]
            event = b"data: " + json.dumps(chunk, ensure_ascii=False).encode()
        if request.abort_below is not None and 0 in running:
            p, t = running[0]
            if p < request.abort_below:
                self.cut = t
        return event

    async def end_early(self) -> None:
        """After vLLM has aborted an answer abort_below ended: its block, then ``[DONE]``."""
        if self.cut is None:
            return
        chunk = {**(self.head or {}), "choices": [], "actmap": _missing(0)}
        empty = {"delta": {}} if self.request.endpoint == "chat" else {"text": ""}
        chunk["choices"] = [{"index": 0, **empty, "finish_reason": "stop"}]
        try:
            blocks = await self.request.blocks(self.plugin, tokens=self.cut)
            chunk["actmap"] = blocks.get(0, _missing(0))
        except Exception:
            log.exception("actmap: scoring request %s failed", self.request.base)
        tail = b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
        await self.send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n",
                         "more_body": False})  # fmt: skip

    async def _final(self) -> bytes:
        try:
            blocks = await self.request.blocks(self.plugin)
        except Exception:
            log.exception("actmap: scoring request %s failed", self.request.base)
            return b""
        chunk = {**(self.head or {}), "choices": [], "actmap": blocks.get(0, _missing(0))}
        if self.request.n > 1:
            empty = {"delta": {}} if self.request.endpoint == "chat" else {"text": ""}
            chunk["choices"] = [
                {"index": i, **empty, "finish_reason": None, "actmap": blocks.get(i, _missing(i))}
                for i in range(self.request.n)
            ]
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
