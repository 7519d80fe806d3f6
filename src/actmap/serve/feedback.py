"""``POST /v1/actmap/feedback``: a label for a served answer, kept with the audit store.

A body ``{"map_id", "label", "source"?, "correct_answer"?}`` (``label``: 1 = correct,
0 = incorrect; ``source``: who says so, e.g. "thumbs", "unit-tests", "review") appends one
row to the audit store's ``labels`` table (`actmap.serve.audit.AuditTrail.add_label`: one
atomic shard per label, written by the server, the store's one writer; durable when the
response is sent). Labels are never overwritten: a second label of a map is kept as history
and the latest wins (`actmap.store.served`). A map id the audit store does not hold is a
404 naming it; a label other than 0 or 1 a 400; the route sits behind the server's API key
and body limit like every other.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from pydantic import ConfigDict, Field, field_validator

from actmap.serve.audit import UnknownMapId
from actmap.serve.protocol import OpenAIBaseModel
from actmap.serve.request_path import APIError

MAX_ANSWER_CHARS = 20_000


class FeedbackRequest(OpenAIBaseModel):
    model_config = ConfigDict(extra="forbid")
    map_id: str = Field(min_length=1, max_length=200)  # the answer's actmap.map_id
    label: int  # 1 = correct, 0 = incorrect
    source: str = Field("api", min_length=1, max_length=100)
    correct_answer: str | None = Field(None, max_length=MAX_ANSWER_CHARS)  # the right answer

    @field_validator("label", mode="before")
    @classmethod
    def zero_or_one(cls, value):
        if isinstance(value, bool) or value not in (0, 1):
            raise ValueError(f"label must be 0 (incorrect) or 1 (correct), got {value!r}")
        return int(value)


class FeedbackResponse(OpenAIBaseModel):
    object: str = "actmap.feedback"
    map_id: str
    label: int
    source: str
    labelled_at: str  # ISO 8601, UTC


def audit_trail(state):
    """The server's audit trail, or a 400 saying the server keeps none."""
    trail = getattr(state.engine, "audit", None)
    if trail is None:
        raise APIError(
            400,
            "this server keeps no audit store (actmap serve --audit DIR): labels have nowhere "
            "to go",
        )
    return trail


async def record_label(state, body: FeedbackRequest) -> FeedbackResponse:
    """Append ``body``'s label to the audit store (404 for a map id it does not hold)."""
    trail = audit_trail(state)
    try:
        row = await asyncio.to_thread(
            trail.add_label, body.map_id, body.label, body.source, body.correct_answer
        )
    except UnknownMapId:
        raise APIError(
            404,
            f"no served answer with map_id '{body.map_id}' in the audit store",
            param="map_id",
            code="map_not_found",
        ) from None
    fallback = getattr(state.engine, "fallback", None)
    if fallback is not None:  # --fallback-run: its recalibration refit (actmap.serve.fallback)
        await asyncio.to_thread(fallback.labelled, row["id"], row["label"])
    return FeedbackResponse(
        map_id=row["id"],
        label=row["label"],
        source=row["source"],
        labelled_at=row["labelled_at"].isoformat(),
    )


def install_feedback_route(app: FastAPI) -> None:
    @app.post("/v1/actmap/feedback")
    async def feedback(body: FeedbackRequest, request: Request) -> FeedbackResponse:
        return await record_label(request.app.state.actmap, body)
