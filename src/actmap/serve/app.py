"""The OpenAI-compatible HTTP server: every answer carries p(correct) and a decision.

`create_app(settings)` builds a FastAPI app whose lifespan loads the generator,
the detector, the policy and the audit trail once (`build_engine`). Requests are
checked and rendered to prompts by `actmap.serve.request_path` (the checks, message
flattening and OpenAI-shaped errors of every server mode: plain, vLLM, proxy), and handed to the micro-batcher (`actmap.serve.batcher`), which runs
`actmap.serve.engine.Engine.run` off the event loop. Endpoints:
``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /ready`` (readiness, `actmap.serve.lifecycle`),
``GET /metrics``, and ``POST /v1/actmap/score`` (existing answers,
`actmap.serve.score_endpoint`). With ``settings.proxy`` set (``--upstream``), the two
completion endpoints forward to that server instead (`actmap.serve.proxy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from actmap.errors import ActmapUserError
from actmap.serve.actions import act, held, start_actions, stop_actions
from actmap.serve.answers import PrefixCache, chat_prefix, score_answers
from actmap.serve.batcher import MicroBatcher, QueueFull
from actmap.serve.engine import Answer, BatchTimings, Engine, Job
from actmap.serve.feedback import install_feedback_route
from actmap.serve.lifecycle import install_readiness
from actmap.serve.prometheus import ServeMetrics
from actmap.serve.protocol import (
    ActmapInfo,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    DeltaMessage,
    ModelCard,
    ModelList,
    RunningScore,
    ShiftInfo,
    random_id,
    sse_event,
    usage_of,
)
from actmap.serve.proxy import install_proxy_routes, start_proxy, stop_proxy
from actmap.serve.reload import install_reload_route, load_pair
from actmap.serve.request_path import (
    APIError,
    check_generation,
    check_length,
    check_request,
    request_prompt,
    retry_headers,
    server_busy,
    validation_error,
)
from actmap.serve.review import REVIEW_PAGE, install_review_routes
from actmap.serve.score_endpoint import install_score_route
from actmap.serve.settings import ServeSettings

log = logging.getLogger(__name__)

API_KEY_ENV = "ACTMAP_API_KEY"


def build_engine(settings: ServeSettings) -> Engine:
    """Load generator, detector, policy and audit trail (the server's lifespan calls this once)."""
    from actmap.llm.models import load_model

    if settings.vllm is not None:
        raise ActmapUserError(
            "--engine vllm is served by vLLM's own server with the actmap plugin "
            "(actmap.serve.vllm_launch), not by this app"
        )
    if settings.detector is None:  # a plain generator: nothing to score, decide or audit
        given = {
            "policy": settings.policy, "audit": settings.audit, "monitor": settings.monitor,
            "upstream": settings.proxy, "route_to": settings.actions.route_to,
        }  # fmt: skip
        needs = [n for n, value in given.items() if value]
        if needs:
            raise ActmapUserError(
                "a detector run folder is required (--detector RUN) with --"
                + ", --".join(n.replace("_", "-") for n in needs)
            )
    detector, policy, monitor = load_scoring(settings)
    dtype = settings.dtype or (detector.dtype if detector is not None else "float32")
    proxy = settings.proxy
    if detector is not None and proxy is not None:  # refused unless allowed
        from actmap.llm.models import check_dtype
        from actmap.serve.proxy import check_read_dtype

        check_read_dtype(proxy, detector.dtype, check_dtype(dtype))
        if proxy.dtype is not None:
            check_dtype(proxy.dtype)
    elif detector is not None and dtype != detector.dtype:
        log.warning(
            "serving %s in %s, but detector %s was fit on maps captured in %s: scores may shift",
            settings.model,
            dtype,
            detector.id,
            detector.dtype,
        )
    if settings.actions.acting and proxy is not None:
        raise ActmapUserError(
            "--route-to and --abstain-message act on answers generated here, not --upstream's"
        )
    # no remote code
    model, tokenizer, source = load_model(settings.model, device=settings.device, dtype=dtype)
    limit = getattr(
        getattr(model.config, "text_config", model.config), "max_position_embeddings", 2048
    )
    engine = Engine(
        model,
        tokenizer,
        source,
        detector,
        policy,
        max_context=settings.max_context or int(limit),
        score_every=settings.score_every,
        audit=audit_trail(settings, detector),
        monitor=monitor,
    )
    if proxy is not None and proxy.reader == "vllm" and detector is not None:
        from actmap.serve.vllm_reader import InProcessReader

        engine.forced_reader = InProcessReader.build(settings, engine, dtype)
    return engine


def load_scoring(settings: ServeSettings):
    """(detector or None, policy, shift monitor or None) of ``settings``: what scores answers
    (`build_engine`, and the vLLM plugin's middleware)."""
    detector, policy = load_pair(settings.detector, settings.seed, settings.policy, settings.device)
    monitor = load_streaming_monitor(settings.monitor, settings.monitor_window)
    return detector, policy, monitor


def audit_trail(settings: ServeSettings, detector):
    """The audit trail of ``settings`` (None without ``--audit``)."""
    from actmap.serve.audit import AuditTrail

    if settings.audit is None:
        return None
    return AuditTrail(
        settings.audit,
        detector.map_config,
        keep_text=settings.audit_text,
        max_rows=settings.audit_max_rows,
        max_age_days=settings.audit_max_age_days,
        sync=settings.audit_sync,
        review_sample=settings.review_sample,
    )


def load_streaming_monitor(path: Path | None, window: int):
    """The monitor of ``--monitor`` (its folder, or a run folder holding ``monitor/``)."""
    if path is None:
        return None
    from actmap.monitor import ShiftMonitor
    from actmap.monitor.stream import StreamingMonitor

    folder = Path(path)
    if not (folder / "config.json").is_file() and (folder / "monitor" / "config.json").is_file():
        folder = folder / "monitor"
    return StreamingMonitor(ShiftMonitor.load(folder), window)


# -- requests (`actmap.serve.request_path`: the checks every mode shares) ---------------------


def _job(request, state: ServerState, endpoint: str) -> Job:
    """The generation job of a checked request."""
    settings = state.settings
    check_request(request, settings.model_name)
    max_tokens = check_generation(request, settings.default_max_tokens, settings.max_tokens_cap)
    prompt, audit_text = request_prompt(request, state.engine, endpoint)
    n = check_length(state.engine, prompt, max_tokens, endpoint)
    options = request.actmap
    stream_scores = state.settings.stream_scores
    if options is not None and options.stream_scores is not None:
        stream_scores = options.stream_scores
    return Job(
        prompt=prompt,
        prompt_tokens=n,
        max_tokens=max_tokens,
        stop=request.stop_strings(),
        stream_scores=bool(request.stream) and stream_scores,
        abort_below=options.abort_below if options is not None else None,
        prompt_for_audit=audit_text,
        endpoint=endpoint,
    )


# -- the server state -------------------------------------------------------------------------


def serve_metrics(engine: Engine) -> ServeMetrics:
    """The server's metrics, with the shift monitor's gauges when ``engine`` has a monitor."""
    metrics = ServeMetrics()
    if engine.monitor is not None:
        metrics.add_shift_gauges()
    return metrics


class ServerState:
    """What the routes share: settings, engine, metrics, the generation batcher (``batcher``)
    and the teacher-forced scoring batcher (``scorer``). ``metrics``: those to count into
    (default: `serve_metrics` of the engine); ``generate=False`` builds the scoring side alone
    (``batcher`` is None: the vLLM plugin's score route, whose generation is vLLM's)."""

    def __init__(
        self,
        settings: ServeSettings,
        engine: Engine,
        metrics: ServeMetrics | None = None,
        generate: bool = True,
    ) -> None:
        self.settings, self.engine = settings, engine
        self.metrics = metrics if metrics is not None else serve_metrics(engine)
        self.batcher = self._generation_batcher() if generate else None
        # existing answers are read by a teacher-forced pass of the transformers model; the
        # vLLM engine holds none (POST /v1/actmap/score then answers 400)
        self.scorer = None
        if engine.model is not None:
            # the proxy's --reader vllm: teacher-forced requests to an in-process vLLM engine
            read = getattr(engine, "forced_reader", None) or partial(
                score_answers,
                engine,
                prefix=PrefixCache(engine, chat_prefix(engine)) if engine.detector else None,
            )
            self.scorer = MicroBatcher(
                read,
                max_batch=settings.max_batch,
                window_s=settings.batch_window_ms / 1000,
                max_queue=settings.max_queue,
                on_batch=lambda jobs, timings: self.metrics.observe_forced(timings),
            )
        self.started_at = time.time()

    def _generation_batcher(self):
        settings, engine = self.settings, self.engine
        return MicroBatcher(
            engine.run,
            max_batch=settings.max_batch,
            window_s=settings.batch_window_ms / 1000,
            max_queue=settings.max_queue,
            on_batch=self._on_batch,
        )

    def _on_batch(self, jobs: list[Job], timings: BatchTimings) -> None:
        self.metrics.observe_batch(timings)

    def submit(self, job: Job) -> asyncio.Future:
        job.on_drop = self.metrics.on_drop(job.endpoint)  # cancelled and dropped: counted
        try:
            future = self.batcher.submit(job)
        except QueueFull as error:
            self.metrics.rejected.inc()
            raise server_busy(str(error)) from None
        self.metrics.queue_depth.set(self.batcher.depth)
        return future

    async def audit_committed(self, answers: list[Answer]) -> None:
        """``audit_sync``: wait until the answers' audit rows are committed, so that a crash
        loses no answer a client received (a failed flush is logged by the writer; the answer
        still goes out)."""
        if not self.settings.audit_sync:
            return
        for answer in answers:
            if answer.committed is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(answer.committed)

    def info(self, answer: Answer) -> ActmapInfo | None:
        return actmap_info(self.engine, answer)


def actmap_info(engine: Engine, answer: Answer) -> ActmapInfo | None:
    """The ``actmap`` block of one answer (None from a plain generator); the vLLM plugin's
    blocks are these too (`actmap.serve.vllm_plugin`)."""
    if engine.detector is None:  # a plain generator: no actmap block
        return None
    return ActmapInfo(
        p_correct=answer.p_correct,
        p_correct_raw=answer.p_correct_raw,
        decision=answer.decision,
        detector=answer.detector or engine.detector.id,  # the one that scored it
        policy=answer.policy,
        map_id=answer.map_id,
        prevalence=answer.prevalence,
        shift=None if answer.shift is None else ShiftInfo(**answer.shift.to_json()),
    )


def _detector_id(state: ServerState) -> str | None:
    return state.engine.detector.id if state.engine.detector is not None else None


# -- middleware: auth and body size -----------------------------------------------------------


class Guard:
    """Bearer-token check and request body limit, before anything is parsed."""

    # /ready: readiness probes carry no key; the review page holds no data: its calls need it
    OPEN_PATHS = ("/health", "/ready", REVIEW_PAGE)

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key and scope["path"] not in self.OPEN_PATHS:
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not secrets.compare_digest(token.encode(), self.api_key.encode()):
                error = APIError(
                    401,
                    "missing or wrong API key (Authorization: Bearer ...)",
                    type="authentication_error",
                    code="invalid_api_key",
                )
                return await error.response({"WWW-Authenticate": "Bearer"})(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._too_large()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:  # a chunked body without Content-Length
                    raise HTTPException(413, f"request body exceeds {self.max_body} bytes")
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> JSONResponse:
        return APIError(
            413, f"request body exceeds {self.max_body} bytes", code="body_too_large"
        ).response()


# -- the app ----------------------------------------------------------------------------------


def create_app(
    settings: ServeSettings, engine_factory: Callable[[], Engine] | None = None
) -> FastAPI:
    """The server app; ``engine_factory`` replaces `build_engine` (tests with tiny models)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = engine_factory() if engine_factory else build_engine(settings)
        state = ServerState(settings, engine)
        if settings.proxy is not None:  # probe first: a mismatch stops here, nothing started
            state.upstream_probe = getattr(app.state, "upstream_probe", None)  # the CLI's
            await start_proxy(state)
        await start_actions(state)  # route target's client, when decisions act
        await state.batcher.start()
        if state.scorer is not None:
            await state.scorer.start()
        app.state.actmap = state
        try:
            yield
        finally:
            if settings.proxy is not None:
                await stop_proxy(state)
            await stop_actions(state)
            await state.batcher.stop()
            if state.scorer is not None:
                await state.scorer.stop()
            if engine.audit is not None:
                engine.audit.close()

    app = FastAPI(title="actmap", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response(retry_headers(error))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return APIError(
            error.status_code,
            str(error.detail),
            type="not_found_error" if error.status_code == 404 else "invalid_request_error",
        ).response()

    @app.get("/health")
    async def health(request: Request) -> dict:
        state: ServerState = request.app.state.actmap
        proxy = state.settings.proxy  # proxy mode's engine
        return {
            "status": "ok",
            "model": state.settings.model_name,
            "detector": _detector_id(state),
            "queue": state.batcher.depth,
            "upstream": None if proxy is None else proxy.upstream,  # None: generates here
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state: ServerState = request.app.state.actmap
        state.metrics.queue_depth.set(state.batcher.depth)
        if state.engine.monitor is not None:
            state.metrics.observe_shift(state.engine.monitor.state())
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        state: ServerState = request.app.state.actmap
        source = state.engine.source
        card = ModelCard(
            id=state.settings.model_name,
            created=int(state.started_at),
            root=f"{source.name}@{source.revision}",
            actmap_detector=_detector_id(state),
        )
        return ModelList(data=[card])

    install_score_route(app)
    install_readiness(app)  # GET /ready: off from SIGTERM on (`actmap.serve.lifecycle`)
    install_feedback_route(app)
    install_review_routes(app)
    install_reload_route(app)
    if settings.proxy is not None:
        install_proxy_routes(app)  # answers come from the upstream, read by teacher forcing
        app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
        return app

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state: ServerState = request.app.state.actmap
        return await _serve(state, body, _job(body, state, "chat"), "chat", request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state: ServerState = request.app.state.actmap
        return await _serve(state, body, _job(body, state, "completion"), "completion", request)

    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    return app


# -- answering --------------------------------------------------------------------------------


async def _serve(state: ServerState, body, job: Job, endpoint: str, request: Request | None = None):
    started = time.perf_counter()
    if body.stream:
        return await _stream(state, body, job, endpoint, started)
    answer = await _answer(state, job, state.submit(job), endpoint, request)
    if answer is None:  # the client left: nobody reads a response
        return Response(status_code=499)
    await state.audit_committed([answer])
    state.metrics.observe_answer(endpoint, answer, time.perf_counter() - started)
    usage = usage_of(answer)
    if endpoint == "chat":
        response = ChatCompletionResponse(
            model=state.settings.model_name,
            choices=[
                ChatCompletionChoice(
                    message=ChatMessageOut(content=answer.text), finish_reason=answer.finish_reason
                )
            ],
            usage=usage,
            actmap=state.info(answer),
        )
    else:
        response = CompletionResponse(
            model=state.settings.model_name,
            choices=[CompletionChoice(text=answer.text, finish_reason=answer.finish_reason)],
            usage=usage,
            actmap=state.info(answer),
        )
    return await act(state, body, job, answer, response)  # route / abstain, when they act


async def _answer(state: ServerState, job: Job, future, endpoint: str, request) -> Answer | None:
    """The answer of a non-streamed request (504 past the timeout), or None when its client
    left first: the request is then cancelled and counted, as a stream's is."""
    timeout = state.settings.timeout_s
    waiting = asyncio.ensure_future(asyncio.wait_for(asyncio.shield(future), timeout))
    left = asyncio.ensure_future(_client_left(request)) if request is not None else None
    try:
        await asyncio.wait([t for t in (waiting, left) if t], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server cancels the request (shutdown past the drain)
        waiting.cancel()
        job.cancelled = True
        raise
    finally:
        if left is not None:
            left.cancel()
    if not waiting.done():  # the client went away first
        waiting.cancel()
        job.cancelled = True
        state.metrics.client_disconnects.labels(endpoint).inc()
        return None
    try:
        return waiting.result()
    except TimeoutError:
        job.cancelled = True
        state.metrics.requests.labels(endpoint, "504").inc()
        raise APIError(504, f"request timed out after {timeout:g} s", type="timeout") from None


async def _client_left(request: Request) -> None:
    """Returns when the client disconnects (its body is read: the next message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Chunks:
    """OpenAI stream chunks of one answer, chat or completion shaped."""

    def __init__(self, endpoint: str, model: str) -> None:
        self.chat = endpoint == "chat"
        self.id = random_id("chatcmpl" if self.chat else "cmpl")
        self.created, self.model = int(time.time()), model

    def make(self, text: str | None, finish=None, actmap=None, role=None, usage=None, empty=False):
        if empty:
            choices = []
        elif self.chat:
            delta = DeltaMessage(role=role, content=text)
            choices = [ChatStreamChoice(delta=delta, finish_reason=finish)]
        else:
            choices = [CompletionStreamChoice(text=text or "", finish_reason=finish)]
        chunk = ChatCompletionChunk if self.chat else CompletionChunk
        return chunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
            actmap=actmap,
        )  # fmt: skip


def _end_events(events: asyncio.Queue) -> Callable[[asyncio.Future], None]:
    """The answer future's done callback: ends the stream's events, and reads the future's
    exception so that one nobody awaits (the client left) is not logged as an error."""

    def done(future: asyncio.Future) -> None:
        if not future.cancelled():
            future.exception()
        events.put_nowait(None)

    return done


async def _stream(state: ServerState, body, job: Job, endpoint: str, started: float):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job.sink = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
    future = state.submit(job)  # a full queue is a 429 before the stream starts
    future.add_done_callback(_end_events(events))
    chunks = _Chunks(endpoint, state.settings.model_name)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    deadline = loop.time() + state.settings.timeout_s

    async def generate() -> AsyncIterator[str]:
        sent = ""
        try:
            if chunks.chat:
                yield sse_event(chunks.make("", role="assistant"))
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), deadline - loop.time())
                except TimeoutError:
                    job.cancelled = True
                    state.metrics.requests.labels(endpoint, "504").inc()
                    message = f"request timed out after {state.settings.timeout_s:g} s"
                    yield APIError(504, message, type="timeout").event()
                    return
                if event is None:
                    break
                sent += event["text"]
                running = None
                if event["p_correct"] is not None:
                    running = RunningScore(p_correct=event["p_correct"], n_tokens=event["n_tokens"])
                yield sse_event(chunks.make(event["text"], actmap=running))
            error = future.exception()
            if error is not None:
                yield APIError(500, f"generation failed: {error}", type="server_error").event()
                return
            answer: Answer = future.result()
            await state.audit_committed([answer])
            rest = answer.text[len(sent) :] if answer.text.startswith(sent) else ""
            if rest:
                yield sse_event(chunks.make(rest))
            yield sse_event(
                chunks.make(
                    None if chunks.chat else "",
                    finish=answer.finish_reason,
                    actmap=state.info(answer),
                )
            )
            if include_usage:
                yield sse_event(chunks.make(None, usage=usage_of(answer), empty=True))
            yield "data: [DONE]\n\n"
            state.metrics.observe_answer(endpoint, answer, time.perf_counter() - started)
        finally:
            if not future.done():  # the client went away: stop generating this row
                job.cancelled = True

    sent = generate()
    if getattr(state, "actions", None) is not None:  # held until the decision (route, abstain)
        sent = held(state, sent, future, chunks, body, job)
    return StreamingResponse(
        state.metrics.watch_stream(sent, endpoint),  # a client that leaves is counted
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
