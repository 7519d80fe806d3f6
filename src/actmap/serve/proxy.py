"""Proxy mode: any OpenAI-compatible engine answers, actmap reads the answer and scores it.

``actmap serve --upstream URL`` forwards each ``/v1/chat/completions`` and
``/v1/completions`` request to the upstream (`actmap.serve.upstream`), then
reads the returned answer with one teacher-forced pass of the same local weights
(`actmap.serve.answers`, batched across concurrent requests), and returns the
upstream's body unchanged plus the ``actmap`` block: p(correct), the decision
and ``tokens``, which says which tokens the map was read over. Where the
upstream returns token ids (vLLM with ``return_token_ids``; the proxy asks for
them when the start-up probe saw them) the map is read over exactly those;
otherwise the text is re-tokenized and ``tokens.source`` says so, with
``tokens.mismatch`` set whenever a check failed (never silent). Fields the proxy
added to the upstream request (``return_token_ids``) are removed from the body
again unless the client asked for them.

Streaming passes every upstream chunk through as it arrives; the score comes in
one extra chunk (``choices: []`` plus ``actmap``) before ``[DONE]``. No running
score: re-reading the answer at every token costs a teacher-forced pass per
token (see ``benchmarks/bench_proxy.py``).

A request is validated and checked as in every mode (`actmap.serve.request_path`: the same
models, model name, ``n``, message flattening and errors); what only a generating server
checks (greedy decoding, ``max_tokens``, stop strings) is left to the upstream.

Failures (upstream unreachable, timed out, 5xx, malformed) answer 502/504 in
OpenAI's error shape (`APIError`) and count in ``actmap_upstream_failures_total``; nothing of
a failed request reaches the audit trail. An upstream 4xx goes back unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import Counter, Histogram

from actmap.errors import ActmapUserError
from actmap.serve.answers import ScoreJob, answer_ids, strip_end_tokens
from actmap.serve.prometheus import LATENCY_BUCKETS
from actmap.serve.protocol import (
    ActmapInfo,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIBaseModel,
)
from actmap.serve.request_path import APIError, check_request, request_prompt
from actmap.serve.score_endpoint import submit_scoring
from actmap.serve.upstream import (
    ProbeResult,
    Upstream,
    UpstreamFailure,
    UpstreamStatus,
    probe_weights,
    upstream_model_name,
)

log = logging.getLogger(__name__)

PATHS = {"chat": "chat/completions", "completion": "completions"}


class TokenInfo(OpenAIBaseModel):
    """Which tokens the map was read over."""

    source: str  # "upstream_ids": the upstream's own ids | "retokenized": its text, tokenized here
    mismatch: bool  # a check failed: the map may be read over other tokens than were generated
    detail: str | None = None  # what was checked or what differed


class ProxyInfo(ActmapInfo):
    tokens: TokenInfo
    upstream_latency_s: float  # the upstream's answer time, as the proxy saw it


@dataclass
class ProxyState:
    upstream: Upstream
    upstream_model: str
    probe: ProbeResult | None
    token_ids: bool  # ask the upstream for token ids
    failures: Counter
    upstream_latency: Histogram


def probe_upstream(engine, settings) -> ProbeResult:
    """Which model the upstream serves and whether it is ours (`ActmapUserError`, one line, when
    it is not and ``allow_weights_mismatch`` is off, or when the upstream cannot be reached)."""
    proxy = settings.proxy
    try:
        name = upstream_model_name(
            proxy.upstream, proxy.model, settings.model_name, proxy.timeout_s
        )
        probe = probe_weights(engine, proxy.upstream, name, proxy.timeout_s, proxy.dtype)
    except UpstreamFailure as failure:
        raise ActmapUserError(failure.message) from None
    check_probe(probe, settings)
    return probe


async def start_proxy(state) -> None:
    """Open the upstream client; probe the weights unless the CLI already did (``state.probe``)."""
    probe = getattr(state, "upstream_probe", None)
    if probe is None:
        probe = await asyncio.to_thread(probe_upstream, state.engine, state.settings)
    registry = state.metrics.registry
    settings = state.settings.proxy
    state.proxy = ProxyState(
        upstream=Upstream(settings.upstream, settings.timeout_s, settings.api_key),
        upstream_model=probe.upstream_model,
        probe=probe,
        token_ids=probe.token_ids,
        failures=Counter(
            "actmap_upstream_failures", "Upstream requests that failed", ["kind"],
            registry=registry,
        ),
        upstream_latency=Histogram(
            "actmap_upstream_latency_seconds", "Upstream answer time as the proxy sees it",
            buckets=LATENCY_BUCKETS, registry=registry,
        ),
    )  # fmt: skip


def check_probe(probe: ProbeResult, settings) -> None:
    """Refuse a weights mismatch (one line) unless ``allow_weights_mismatch``."""
    if probe.problem is None:
        log.info(
            "upstream weights probe passed (max log-prob diff %s, greedy margin %s; tolerance "
            "%s, local %s, upstream %s)", probe.max_logprob_diff, probe.max_margin,
            probe.tolerance, *probe.dtypes,
        )  # fmt: skip
        return
    line = (
        f"the upstream {settings.proxy.upstream} ({probe.upstream_model}) does not serve the "
        f"weights of {settings.model}: {probe.problem}"
    )
    if not settings.proxy.allow_weights_mismatch:
        raise ActmapUserError(line + " (--allow-weights-mismatch serves anyway)")
    log.warning("%s; serving anyway (--allow-weights-mismatch)", line)


def check_read_dtype(proxy, detector_dtype: str, dtype: str) -> None:
    """The proxy reads answers in the dtype the detector's training maps were captured in:
    another one is refused (one line) unless ``allow_dtype_mismatch``. The upstream may
    generate in any dtype; the probe's tolerance follows it (``ProxySettings.dtype``)."""
    if dtype == detector_dtype:
        return
    line = (
        f"--dtype {dtype}: the detector was fit on maps captured in {detector_dtype}, and the "
        f"proxy reads answers in the detector's dtype; fit one on a {dtype} store (`actmap "
        f"capture --dtype {dtype}`) or leave --dtype out"
    )
    if not proxy.allow_dtype_mismatch:
        raise ActmapUserError(line + " (--allow-dtype-mismatch reads anyway)")
    log.warning("%s; reading in %s anyway (--allow-dtype-mismatch)", line, dtype)


async def stop_proxy(state) -> None:
    proxy = getattr(state, "proxy", None)
    if proxy is not None:
        await proxy.upstream.close()


# -- requests -------------------------------------------------------------------------------


def _counted_failure(state, endpoint: str, failure: UpstreamFailure) -> APIError:
    """An upstream failure logged and counted (by kind and by status), as the error the client
    gets: a plain answer's body (`APIError.response`) or a stream's last event (`.event`)."""
    log.warning("%s: upstream failure (%s, %d): %s", endpoint, failure.kind, failure.status, failure.message)  # fmt: skip
    state.proxy.failures.labels(failure.kind).inc()
    state.metrics.requests.labels(endpoint, str(failure.status)).inc()
    kind = "timeout" if failure.status == 504 else "upstream_error"
    return APIError(failure.status, failure.message, type=kind, code=failure.kind)


def _answer_job(
    state, prompt: str, audit_text: str, endpoint: str, text: str, ids, prompt_ids, counted=None
) -> tuple[ScoreJob, TokenInfo]:
    """The scoring job of an upstream answer, over its own ids where they are usable."""
    engine = state.engine
    retokenized = answer_ids(engine, text)
    notes, mismatch = [], False
    if prompt_ids is not None:
        local = engine.encode(prompt)
        if list(prompt_ids) != local:
            mismatch = True
            notes.append(
                f"the upstream's prompt ids ({len(prompt_ids)}) differ from the local "
                f"tokenization ({len(local)}); the map reads the local prompt"
            )
    if ids is not None:
        ids = strip_end_tokens(engine, ids)
        if engine.tokenizer.decode(ids, skip_special_tokens=True) == text:
            if ids != retokenized:
                notes.append(
                    f"re-tokenizing the text would give other ids ({len(retokenized)} vs {len(ids)})"
                )
            detail = "; ".join(notes) or None
            job = ScoreJob(prompt, ids, audit_text, endpoint)
            return job, TokenInfo(source="upstream_ids", mismatch=mismatch, detail=detail)
        mismatch = True
        notes.append("the upstream's ids do not decode to its answer text; read the text instead")
    else:
        notes.append("the upstream returned no token ids")
        # its usage count may include the end token; any other difference is a mismatch
        if isinstance(counted, int) and counted not in (len(retokenized), len(retokenized) + 1):
            mismatch = True
            notes.append(
                f"the upstream counted {counted} answer tokens, re-tokenizing its text gives "
                f"{len(retokenized)}"
            )
    detail = "; ".join(notes)
    return ScoreJob(prompt, text, audit_text, endpoint), TokenInfo(
        source="retokenized", mismatch=mismatch, detail=detail
    )


def choice_text(out: dict, endpoint: str) -> tuple[str, list | None, list | None]:
    """(answer text, answer ids or None, prompt ids or None) of an upstream body."""
    choices = out.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise UpstreamFailure(502, "malformed", "the upstream's answer has no choices")
    choice = choices[0]
    if endpoint == "chat":
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        prompt_ids = out.get("prompt_token_ids")
    else:
        text = choice.get("text")
        prompt_ids = choice.get("prompt_token_ids", out.get("prompt_token_ids"))
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise UpstreamFailure(502, "malformed", "the upstream's answer text is not a string")
    ids = choice.get("token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        raise UpstreamFailure(502, "malformed", "the upstream's token_ids are not integers")
    return text, ids, prompt_ids


def _strip_added(out: dict) -> None:
    """Undo what ``return_token_ids`` added (the client did not ask for it): the fields read
    null, as the upstream sends them without it."""
    targets = [out, *(c for c in out.get("choices") or [] if isinstance(c, dict))]
    for target in targets:
        for key in ("prompt_token_ids", "token_ids"):
            if target.get(key) is not None:
                target[key] = None


def _block(state, answer, tokens: TokenInfo, upstream_s: float) -> dict:
    info = state.info(answer)
    return ProxyInfo(
        **info.model_dump(), tokens=tokens, upstream_latency_s=round(upstream_s, 6)
    ).model_dump(exclude_none=True)


async def proxy_request(state, request, body: dict, endpoint: str):
    """Answer one validated ``request`` (its JSON ``body`` is what goes upstream): the checks
    and the prompt are every mode's (`actmap.serve.request_path`); an `APIError` raised here is
    the app's error response."""
    started = time.perf_counter()
    check_request(request, state.settings.model_name)
    prompt, audit_text = request_prompt(request, state.engine, endpoint)
    proxy: ProxyState = state.proxy
    asked_ids = bool(body.get("return_token_ids"))
    forward = {**body, "model": proxy.upstream_model}
    if proxy.token_ids:
        forward["return_token_ids"] = True
    if body.get("stream"):
        return await _proxy_stream(state, forward, endpoint, prompt, audit_text, asked_ids, started)
    try:
        status, out = await proxy.upstream.post_json(PATHS[endpoint], forward)
        upstream_s = time.perf_counter() - started
        proxy.upstream_latency.observe(upstream_s)
        if status >= 400:  # the upstream refused the request: its own answer goes back
            state.metrics.requests.labels(endpoint, str(status)).inc()
            return JSONResponse(out, status_code=status)
        text, ids, prompt_ids = choice_text(out, endpoint)
    except UpstreamFailure as failure:
        return _counted_failure(state, endpoint, failure).response()
    counted = (out.get("usage") or {}).get("completion_tokens")
    job, tokens = _answer_job(state, prompt, audit_text, endpoint, text, ids, prompt_ids, counted)
    (answer,) = await submit_scoring(state, [job])  # busy or timed out: the APIError's 429/504
    if not asked_ids:
        _strip_added(out)
    out["actmap"] = _block(state, answer, tokens, upstream_s)
    state.metrics.observe_answer(endpoint, answer, time.perf_counter() - started)
    return JSONResponse(out)


async def _proxy_stream(state, forward, endpoint, prompt, audit_text, asked_ids, started):
    proxy: ProxyState = state.proxy
    try:
        response = await proxy.upstream.open_stream(PATHS[endpoint], forward)
    except UpstreamFailure as failure:
        return _counted_failure(state, endpoint, failure).response()
    except UpstreamStatus as refused:
        state.metrics.requests.labels(endpoint, str(refused.status)).inc()
        return JSONResponse(refused.body, status_code=refused.status)

    def error_event(failure: UpstreamFailure) -> str:
        return _counted_failure(state, endpoint, failure).event()

    async def events():
        parts, ids, prompt_ids, head, done = [], [], None, {}, False
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    chunk = json.loads(payload)
                    if not isinstance(chunk, dict):
                        raise ValueError("not an object")
                except ValueError:
                    yield error_event(UpstreamFailure(502, "malformed", "the upstream sent a chunk that is not JSON"))  # fmt: skip
                    return
                if "error" in chunk:  # the upstream failed mid-stream: pass it on, score nothing
                    yield error_event(UpstreamFailure(502, "http_5xx", f"the upstream failed mid-stream: {chunk['error']}"))  # fmt: skip
                    return
                head = head or {
                    k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk
                }
                prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
                for choice in chunk.get("choices") or []:
                    if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                        continue
                    delta = choice.get("delta") or {} if endpoint == "chat" else choice
                    parts.append(delta.get("content" if endpoint == "chat" else "text") or "")
                    ids.extend(choice.get("token_ids") or [])
                    prompt_ids = choice.get("prompt_token_ids", prompt_ids)
                if proxy.token_ids and not asked_ids:
                    _strip_added(chunk)
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
                else:
                    yield line + "\n\n"  # unchanged
        except httpx.HTTPError as error:
            yield error_event(proxy.upstream.failure(error))
            return
        finally:
            await response.aclose()
        if not done:
            yield error_event(UpstreamFailure(502, "malformed", "the upstream's stream ended without [DONE]"))  # fmt: skip
            return
        upstream_s = time.perf_counter() - started
        proxy.upstream_latency.observe(upstream_s)
        text = "".join(parts)
        job, tokens = _answer_job(
            state, prompt, audit_text, endpoint, text, ids if proxy.token_ids else None, prompt_ids
        )
        try:
            (answer,) = await submit_scoring(state, [job])
        except Exception as error:  # an APIError (busy, timeout) or a failed pass
            message = getattr(error, "message", str(error))
            yield APIError(500, f"scoring failed: {message}", type="server_error").event()
            return
        final = {**head, "choices": [], "actmap": _block(state, answer, tokens, upstream_s)}
        yield f"data: {json.dumps(final, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
        state.metrics.observe_answer(endpoint, answer, time.perf_counter() - started)

    return StreamingResponse(
        state.metrics.watch_stream(events(), endpoint),  # a client that leaves is counted
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def install_proxy_routes(app: FastAPI) -> None:
    """The two completion routes of proxy mode: the request is validated by the same models
    (and the app's same error handlers) as a server that generates; its JSON body, as the
    client sent it, is what goes upstream."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state = request.app.state.actmap
        return await proxy_request(state, body, await request.json(), "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state = request.app.state.actmap
        return await proxy_request(state, body, await request.json(), "completion")
