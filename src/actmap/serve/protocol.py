"""Pydantic request and response models mirroring the OpenAI API, plus the ``actmap`` block.

Shaped after vLLM's ``entrypoints/openai/protocol.py``: unknown request fields are
accepted and ignored (clients send many), known fields the server cannot honour are
rejected with a 400 naming the field. Every response carries the OpenAI fields and an
``actmap`` object; a streamed answer carries it in its final chunk (and, with
``actmap.stream_scores``, a running score in every chunk).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- errors ---------------------------------------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# -- requests -------------------------------------------------------------------------------


class ActmapOptions(OpenAIBaseModel):
    """Per-request actmap settings, sent as ``"actmap": {...}`` (openai client: ``extra_body``)."""

    model_config = ConfigDict(extra="forbid")
    stream_scores: bool | None = None  # running p(correct) in every streamed chunk
    abort_below: float | None = Field(default=None, ge=0.0, le=1.0)  # end when running p < x


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # OpenAI content parts: keep the text parts
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class _SamplingFields(OpenAIBaseModel):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    user: str | None = None
    actmap: ActmapOptions | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str]
    echo: bool | None = False


# -- responses ------------------------------------------------------------------------------


class ShiftInfo(OpenAIBaseModel):
    """The shift monitor's view of one answer (``actmap serve --monitor``)."""

    map_distance: float  # squared Mahalanobis distance of the answer's map to the in-domain mean
    map_p_value: float  # conformal p-value among in-domain maps (small = unusual)
    flagged: bool  # map_p_value <= the monitor's map_alpha
    window_p_value: float | None  # latest window test over recent answers (None before one)
    alarm: bool  # the latest window test alarmed: traffic left the detector's domain


class ActmapInfo(OpenAIBaseModel):
    """What actmap adds to every answer."""

    p_correct: float | None  # after the policy's prior correction; None for an empty answer
    p_correct_raw: float | None  # the detector's own output
    decision: str  # accept | review | route | abstain | abstain_early
    detector: str  # detector id: name, run folder, seed, weights digest
    map_id: str | None  # id of the answer's map in the audit store
    policy: str | None = None  # the version of the policy that decided (a digest of its file)
    prevalence: float | None = None  # the prevalence p_correct was shifted to, if any
    shift: ShiftInfo | None = None  # the shift monitor's view, when the server runs one


class RunningScore(OpenAIBaseModel):
    """The ``actmap`` block of a streamed chunk with ``stream_scores``."""

    p_correct: float  # running p(correct) of the answer so far (prior-corrected)
    n_tokens: int  # answer tokens it was computed from


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def usage_of(answer) -> UsageInfo:
    """The usage of one served answer (anything with ``prompt_tokens`` and ``n_tokens``)."""
    return UsageInfo(
        prompt_tokens=answer.prompt_tokens,
        completion_tokens=answer.n_tokens,
        total_tokens=answer.prompt_tokens + answer.n_tokens,
    )


def sse_event(chunk) -> str:
    """One server-sent event of a stream chunk (unset fields left out, as OpenAI does)."""
    return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"


class ChatMessageOut(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(OpenAIBaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length", "content_filter"] | None
    logprobs: None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    actmap: ActmapInfo | None  # None: a server without a detector


class CompletionChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length", "content_filter"] | None
    logprobs: None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    actmap: ActmapInfo | None  # None: a server without a detector


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: Literal["stop", "length", "content_filter"] | None = None
    logprobs: None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    actmap: ActmapInfo | RunningScore | None = None


class CompletionStreamChoice(OpenAIBaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length", "content_filter"] | None = None
    logprobs: None = None


class CompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
    actmap: ActmapInfo | RunningScore | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "actmap"
    root: str | None = None  # where the weights came from
    actmap_detector: str | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
