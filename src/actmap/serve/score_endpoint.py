"""``POST /v1/actmap/score``: p(correct) of answers that already exist (logged, or from any engine).

A batch of ``{"messages" | "prompt", "answer" | "answer_token_ids", "id"?}`` items;
each is read by one teacher-forced pass of the served weights
(`actmap.serve.answers`), batched with other requests' items, and gets the same
detector, prior correction, policy and audit row as a generated answer.
``messages`` go through the chat template (as ``/v1/chat/completions``), a
``prompt`` is used verbatim (as ``/v1/completions``). The batch size is bounded
(``max_score_items``) and the body by the server's body limit; a bad item gets
a 400 whose message and ``param`` name it (``items[3].answer``).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field

from actmap.serve.answers import ScoreJob, answer_ids
from actmap.serve.batcher import QueueFull
from actmap.serve.protocol import ChatMessage, OpenAIBaseModel
from actmap.serve.request_path import APIError, server_busy


class ScoreItem(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None  # echoed back
    messages: list[ChatMessage] | None = None  # rendered with the chat template
    prompt: str | None = None  # used verbatim
    answer: str | None = None  # tokenized on its own (no special tokens)
    answer_token_ids: list[int] | None = None  # the engine's own ids, when it returned them


class ScoreRequest(OpenAIBaseModel):
    model: str | None = None  # when given, must be the served model's name
    items: list[ScoreItem] = Field(min_length=1)


class ScoreResult(OpenAIBaseModel):
    index: int
    id: str | None = None
    p_correct: float | None  # after the policy's prior correction; None for an empty answer
    p_correct_raw: float | None  # the detector's own output
    decision: str
    map_id: str | None  # the answer's row in the audit store (None without --audit)
    n_tokens: int  # answer tokens the map was read over
    prevalence: float | None = None


class ScoreResponse(OpenAIBaseModel):
    object: str = "actmap.score"
    model: str
    detector: str
    results: list[ScoreResult]


def _item_job(item: ScoreItem, index: int, state) -> ScoreJob:
    where = f"items[{index}]"
    engine = state.engine
    if (item.messages is None) == (item.prompt is None):
        raise APIError(400, f"{where}: give exactly one of 'messages' or 'prompt'", param=where)
    if (item.answer is None) == (item.answer_token_ids is None):
        raise APIError(
            400, f"{where}: give exactly one of 'answer' or 'answer_token_ids'", param=where
        )
    if item.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in item.messages]
        if not any(m["content"].strip() for m in messages):
            raise APIError(400, f"{where}: messages hold no text", param=f"{where}.messages")
        try:
            prompt = engine.render_chat(messages)
        except Exception as error:  # no template, or one that rejects the conversation
            raise APIError(
                400, f"{where}: the chat template rejected the messages: {error}",
                param=f"{where}.messages",
            ) from None  # fmt: skip
        audit_text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
    else:
        if not item.prompt.strip():
            raise APIError(400, f"{where}: prompt must not be empty", param=f"{where}.prompt")
        prompt = audit_text = item.prompt
    answer = item.answer if item.answer is not None else item.answer_token_ids
    ids = answer_ids(engine, answer)
    vocab = len(engine.tokenizer)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"{where}: answer_token_ids holds {bad[0]}, outside the vocabulary (0..{vocab - 1})",
            param=f"{where}.answer_token_ids",
        )  # fmt: skip
    n = engine.count_tokens(prompt)
    if n + len(ids) + 1 > engine.max_context:
        raise APIError(
            400, f"{where}: prompt ({n} tokens) + answer ({len(ids)} tokens) exceed this "
            f"model's context of {engine.max_context} tokens", param=where,
            code="context_length_exceeded",
        )  # fmt: skip
    return ScoreJob(prompt=prompt, answer=answer, prompt_for_audit=audit_text, endpoint="score")


async def submit_scoring(state, jobs: list[ScoreJob]) -> list:
    """Queue ``jobs`` on the scoring batcher and wait for their `Answer`s (429 when the queue is
    full, 504 on timeout)."""

    futures = []
    try:
        for job in jobs:
            job.on_drop = state.metrics.on_drop(job.endpoint)
            futures.append(state.scorer.submit(job))
    except QueueFull as error:
        for job in jobs:  # refused (counted below), not aborted
            job.cancelled, job.on_drop = True, None
        state.metrics.rejected.inc()
        raise server_busy(str(error)) from None
    try:
        answers = await asyncio.wait_for(
            asyncio.shield(asyncio.gather(*futures)), state.settings.timeout_s
        )
    except asyncio.CancelledError:  # the client left (a proxied stream): nobody reads these
        for job in jobs:
            job.cancelled = True
        raise
    except TimeoutError:
        for job in jobs:
            job.cancelled = True
        raise APIError(
            504, f"scoring timed out after {state.settings.timeout_s:g} s", type="timeout"
        ) from None
    await state.audit_committed(answers)
    return answers


def install_score_route(app: FastAPI) -> None:
    @app.post("/v1/actmap/score")
    async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
        state = request.app.state.actmap
        started = time.perf_counter()
        if state.engine.detector is None:
            raise APIError(400, "this server has no detector (actmap serve --detector RUN)")
        if state.scorer is None:
            raise APIError(
                400, "scoring existing answers needs the transformers engine (actmap serve "
                "--engine local): the vLLM engine does not read given answers yet",
            )  # fmt: skip
        if body.model is not None and body.model != state.settings.model_name:
            raise APIError(
                404, f"The model '{body.model}' does not exist; this server serves "
                f"'{state.settings.model_name}'", param="model", code="model_not_found",
            )  # fmt: skip
        limit = state.settings.max_score_items
        if len(body.items) > limit:
            raise APIError(
                400, f"{len(body.items)} items exceed this server's limit of {limit} per request",
                param="items",
            )  # fmt: skip
        jobs = [_item_job(item, i, state) for i, item in enumerate(body.items)]
        answers = await submit_scoring(state, jobs)
        elapsed = time.perf_counter() - started
        for answer in answers:
            state.metrics.observe_answer("score", answer, elapsed)
        results = [
            ScoreResult(
                index=i, id=item.id, p_correct=a.p_correct, p_correct_raw=a.p_correct_raw,
                decision=a.decision, map_id=a.map_id, n_tokens=a.n_tokens,
                prevalence=a.prevalence,
            )
            for i, (item, a) in enumerate(zip(body.items, answers, strict=True))
        ]  # fmt: skip
        return ScoreResponse(
            model=state.settings.model_name, detector=state.engine.detector.id, results=results
        )
