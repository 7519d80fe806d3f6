"""Decisions that act: route a question to a stronger model, or replace an answer by a message.

`action_for(decision, settings)` is the one rule, a pure function::

    decision "route"                      and --route-to set         -> "route"
    decision "abstain" / "abstain_early"  and --abstain-message set  -> "abstain"
    anything else                                                    -> "answer" (as today)

**Route** (``actmap serve --route-to URL``, any OpenAI-compatible server): the request the
client sent (its messages or prompt, stop, max_tokens; the server's default max_tokens when it
gave none) is sent, non-streamed, to the route target with ``model`` set to ``--route-model``
(default: the one model the target lists), through `actmap.serve.upstream.Upstream` (proxy
mode's client). The client gets the target's body with the ``actmap`` block of the small
model's answer (its p_correct and decision) plus ``routed: true`` and ``route_model``.
When the target fails (unreachable, times out after ``--route-timeout-s``, a 4xx/5xx, a body
that is not JSON or holds no answer) the client gets the small model's own answer, status 200,
flagged ``routed: false`` with ``route_error`` saying why; the failure is logged and counted in
``actmap_actions_total{action="route",outcome=<kind>}``.

**Abstain** (``--abstain-message TEXT``): the answer text is replaced by the message, its
``finish_reason`` is ``"content_filter"`` (OpenAI's value for an answer withheld by the
server) and the block says ``abstained: true``. ``usage`` still counts the small model's
tokens (they were generated). The original answer is kept only in the audit store (its text
with ``--audit-text``, its map always).

**Streaming**: with either option set, a streamed answer is held back until its decision
(the small model's whole answer is generated and scored first; no time-to-first-token gain).
Then: "answer" replays the held chunks unchanged (running scores included); "abstain" sends
the message as one chunk; "route" sends the target's answer as one chunk (the target is asked
without ``stream``), its final chunk carrying the block; a failed route replays the held
chunks with ``routed: false`` and ``route_error`` in the final block. A stream that ended in
an error or a timeout is passed on as it is.

**Audit**: the audit row is the small model's (its map, score and decision); what the action
did goes to the side table ``audit_actions`` (``AuditTrail.note_action``): ``routed``,
``route_failed`` (with the error) or ``abstained``, plus the target's model.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from prometheus_client import Counter

from actmap.errors import ActmapUserError
from actmap.serve.protocol import ActmapInfo, UsageInfo, sse_event, usage_of
from actmap.serve.proxy import PATHS, choice_text
from actmap.serve.upstream import Upstream, UpstreamFailure, upstream_model_name

log = logging.getLogger(__name__)

ACTIONS = ("answer", "route", "abstain")
ABSTAIN_FINISH_REASON = "content_filter"
FINISH_REASONS = ("stop", "length", ABSTAIN_FINISH_REASON)
ABSTAIN_DECISIONS = ("abstain", "abstain_early")


def action_for(decision: str, settings) -> str:
    """What the server does with an answer decided ``decision`` (``settings``: anything with
    ``route_to`` and ``abstain_message``, e.g. `actmap.serve.settings.ActionSettings`)."""
    if decision == "route" and settings.route_to is not None:
        return "route"
    if decision in ABSTAIN_DECISIONS and settings.abstain_message is not None:
        return "abstain"
    return "answer"


class ActionInfo(ActmapInfo):
    """The ``actmap`` block of an answer an action touched."""

    routed: bool | None = None  # True: the route target's answer; False: its failure, ours
    route_model: str | None = None  # the model the route target answered with
    route_error: str | None = None  # why routing failed (the small model's answer was sent)
    abstained: bool | None = None  # the answer was replaced by the abstain message


def _final_finish(value) -> str:
    return value if value in FINISH_REASONS else "stop"


@dataclass
class Actions:
    """The running server's actions: the route target's client and the counter."""

    settings: object  # ActionSettings
    route: Upstream | None
    route_model: str | None
    counter: Counter

    # -- routing -------------------------------------------------------------------------
    def route_body(self, body, max_tokens: int) -> dict:
        """The client's request as the route target gets it: non-streamed, its model."""
        out = body.model_dump(exclude_none=True, exclude={"actmap", "stream", "stream_options"})
        out["model"] = self.route_model
        if "max_tokens" not in out and "max_completion_tokens" not in out:
            out["max_tokens"] = max_tokens
        return out

    async def ask_route(self, body, max_tokens: int, endpoint: str) -> tuple[dict, str, str]:
        """(the target's body, its answer text, its finish reason); `UpstreamFailure` when the
        target gave no usable answer."""
        status, out = await self.route.post_json(PATHS[endpoint], self.route_body(body, max_tokens))
        if status >= 400:
            error = out.get("error")
            message = error.get("message") if isinstance(error, dict) else out
            raise UpstreamFailure(
                502, "refused", f"the route target refused the request ({status}): {message}"
            )
        text, _, _ = choice_text(out, endpoint)
        return out, text, _final_finish(out["choices"][0].get("finish_reason"))

    def failed(self, failure: UpstreamFailure) -> None:
        log.warning("route to %s failed (%s): %s", self.settings.route_to, failure.kind, failure.message)  # fmt: skip
        self.counter.labels("route", failure.kind).inc()

    # -- what an action did: counted, noted in the audit store, said in the block --------
    def note(self, state, answer, action: str, **detail) -> None:
        audit = state.engine.audit
        if audit is not None and answer.map_id is not None:
            audit.note_action(answer.map_id, action, **detail)

    def abstained(self, state, answer) -> ActionInfo:
        self.counter.labels("abstain", "done").inc()
        self.note(state, answer, "abstained")
        return ActionInfo(**state.info(answer).model_dump(), abstained=True)

    def routed(self, state, answer) -> ActionInfo:
        self.counter.labels("route", "done").inc()
        self.note(state, answer, "routed", route_model=self.route_model)
        return ActionInfo(**state.info(answer).model_dump(), routed=True, route_model=self.route_model)  # fmt: skip

    def route_failed(self, state, answer, failure: UpstreamFailure) -> ActionInfo:
        self.failed(failure)
        self.note(state, answer, "route_failed", route_error=failure.message)
        return ActionInfo(**state.info(answer).model_dump(), routed=False, route_error=failure.message)  # fmt: skip


def route_model_name(settings) -> str:
    """``--route-model``, else the one model the route target lists; `ActmapUserError` (one
    line) when it cannot be listed or lists several."""
    if settings.route_model:
        return settings.route_model
    try:
        return upstream_model_name(
            settings.route_to, None, "", settings.route_timeout_s, "--route-model"
        )
    except UpstreamFailure as failure:
        raise ActmapUserError(f"--route-to: {failure.message}") from None


async def start_actions(state) -> None:
    """``state.actions``: None when no decision acts; else the route target's client (its
    model asked from ``GET /models`` when ``--route-model`` is not given)."""
    settings = state.settings.actions
    state.actions = None
    if not settings.acting:
        return
    route = model = None
    if settings.route_to is not None:
        model = await asyncio.to_thread(route_model_name, settings)
        route = Upstream(settings.route_to, settings.route_timeout_s, settings.route_api_key)
    counter = Counter(
        "actmap_actions", "Answers an action changed, by action and outcome",
        ["action", "outcome"], registry=state.metrics.registry,
    )  # fmt: skip
    state.actions = Actions(settings, route, model, counter)


async def stop_actions(state) -> None:
    actions = getattr(state, "actions", None)
    if actions is not None and actions.route is not None:
        await actions.route.close()


# -- a plain answer ---------------------------------------------------------------------------


def _dumped(response, block: ActionInfo) -> JSONResponse:
    data = response.model_dump(mode="json")
    data["actmap"] = block.model_dump(mode="json", exclude_none=True)
    return JSONResponse(data)


async def act(state, body, job, answer, response):
    """The response the client gets for ``answer``: ``response`` (the small model's, built
    by the server) unless the decision's action replaces or flags it."""
    actions: Actions | None = state.actions
    kind = "answer" if actions is None else action_for(answer.decision, state.settings.actions)
    if kind == "answer":
        return response
    choice = response.choices[0]
    if kind == "abstain":
        if hasattr(choice, "message"):
            choice.message.content = state.settings.actions.abstain_message
        else:
            choice.text = state.settings.actions.abstain_message
        choice.finish_reason = ABSTAIN_FINISH_REASON
        return _dumped(response, actions.abstained(state, answer))
    try:
        out, _, _ = await actions.ask_route(body, job.max_tokens, job.endpoint)
    except UpstreamFailure as failure:
        return _dumped(response, actions.route_failed(state, answer, failure))
    out["actmap"] = actions.routed(state, answer).model_dump(mode="json", exclude_none=True)
    return JSONResponse(out)


# -- a stream ---------------------------------------------------------------------------------


def _replaced(chunks, text: str, finish: str, block: ActionInfo, usage) -> list[str]:
    """A whole stream of one answer ``text``: role, text, the final chunk, usage, [DONE]."""
    events = [sse_event(chunks.make("", role="assistant"))] if chunks.chat else []
    events.append(sse_event(chunks.make(text)))
    final = chunks.make(None if chunks.chat else "", finish=finish)
    payload = final.model_dump(mode="json", exclude_none=True)
    payload["actmap"] = block.model_dump(mode="json", exclude_none=True)
    events.append(f"data: {json.dumps(payload, ensure_ascii=False)}\n\n")
    if usage is not None:
        events.append(sse_event(chunks.make(None, usage=usage, empty=True)))
    return [*events, "data: [DONE]\n\n"]


def _flag_final(events: list[str], block: ActionInfo) -> list[str]:
    """The held events with the final chunk's block (the one holding a decision) replaced."""
    out = []
    for event in events:
        payload = event[5:].strip() if event.startswith("data:") else "[DONE]"
        if payload != "[DONE]":
            chunk = json.loads(payload)
            if isinstance(chunk.get("actmap"), dict) and "decision" in chunk["actmap"]:
                chunk["actmap"] = block.model_dump(mode="json", exclude_none=True)
                event = f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        out.append(event)
    return out


def _routed_usage(out: dict) -> UsageInfo:
    try:
        return UsageInfo.model_validate(out.get("usage") or {})
    except ValueError:
        return UsageInfo()


async def held(state, stream: AsyncIterator[str], future, chunks, body, job) -> AsyncIterator[str]:
    """``stream`` (the server's events of one answer) held until the answer's decision, then
    sent as it is, replaced by the abstain message or by the route target's answer."""
    try:
        events = [event async for event in stream]
    finally:
        await stream.aclose()
    answer = None
    if future.done() and not future.cancelled() and future.exception() is None:
        answer = future.result()
    kind = "answer" if answer is None else action_for(answer.decision, state.settings.actions)
    if kind == "answer" or not events or events[-1] != "data: [DONE]\n\n":
        for event in events:  # as generated (or an error / timeout the stream ended with)
            yield event
        return
    actions: Actions = state.actions
    usage = None
    if body.stream_options and body.stream_options.include_usage:
        usage = usage_of(answer)
    if kind == "abstain":
        block = actions.abstained(state, answer)
        message = state.settings.actions.abstain_message
        for event in _replaced(chunks, message, ABSTAIN_FINISH_REASON, block, usage):
            yield event
        return
    try:
        out, text, finish = await actions.ask_route(body, job.max_tokens, job.endpoint)
    except UpstreamFailure as failure:
        for event in _flag_final(events, actions.route_failed(state, answer, failure)):
            yield event
        return
    block = actions.routed(state, answer)
    chunks.model = actions.route_model
    for event in _replaced(chunks, text, finish, block, usage and _routed_usage(out)):
        yield event
