"""The one request path of every server mode: request checks, message flattening and errors.

The plain server (`actmap.serve.app`, transformers engine) and the proxy (`actmap.serve.proxy`)
read a request with the same pydantic models (`actmap.serve.protocol`) and the same functions
here, so the same malformed request gets the same OpenAI-shaped error (`APIError`) in every
mode (``--engine vllm`` is vLLM's own server: vLLM checks requests; the plugin takes
`limit_max_tokens` and `validation_error` from here):

* `validation_error`: a body the models refuse -> 400 naming the field;
* `check_request`: the model name (404 ``model_not_found``) and ``n`` (one answer is scored);
* `check_generation`: what only a server that generates the answer itself checks
  (greedy decoding, ``max_tokens`` against the cap, stop strings, ``echo``, the context);
* `request_prompt`: the prompt and the audit text. Chat messages are flattened to
  ``{"role", "content"}`` with text parts only (`flatten_messages`); a conversation in which
  no message holds any text (empty, whitespace, or non-text parts only) is refused with 400
  ``messages hold no text`` in every mode: there is nothing to answer, and a map read over
  the chat template alone scores no question. A single message without text (an assistant
  turn that only called a tool) is fine. A completion's prompt must be one string holding
  text.

Errors: `APIError` is an error as OpenAI sends it (``{"error": {message, type, param,
code}}``), as a JSON response (`APIError.response`) or as a stream's last event
(`APIError.event`).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from actmap.serve.protocol import ChatCompletionRequest, ErrorInfo, ErrorResponse

MAX_STOP_STRINGS = 4  # as OpenAI
RETRY_AFTER_S = 1  # the Retry-After of a 429 (queue full) or 503 (draining)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)

    def event(self) -> str:
        """The error as a server-sent event: how a stream that already started ends."""
        return f"data: {self.body().model_dump_json()}\n\n"


def server_busy(reason: str) -> APIError:
    """A full queue: 429 (as OpenAI's rate limit, which clients retry after ``Retry-After``)."""
    return APIError(
        429, f"server busy: {reason}; retry later", type="server_busy", code="queue_full"
    )


def retry_headers(error: APIError) -> dict | None:
    """``Retry-After`` for the statuses a client should retry: 429 and 503."""
    return {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None


def validation_error(errors: list) -> APIError:
    """A body the request models refused (pydantic's ``errors()``): 400 naming the first field."""
    first = errors[0] if errors else {}
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    message = (
        f"invalid request: {where}: {first.get('msg', 'invalid value')}"
        if where
        else f"invalid request: {first.get('msg', 'invalid body')}"
    )
    return APIError(400, message, param=where or None)


# -- checks ----------------------------------------------------------------------------------


def check_request(request, model_name: str) -> None:
    """What every mode checks: the served model's name and one answer per request."""
    if request.model != model_name:
        raise APIError(
            404,
            f"The model '{request.model}' does not exist; this server serves '{model_name}'",
            param="model",
            code="model_not_found",
        )
    if request.n not in (None, 1):
        raise APIError(400, f"n must be 1, got {request.n}: one answer is scored", param="n")


def limit_max_tokens(max_tokens: int | None, default_max_tokens: int, max_tokens_cap: int) -> int:
    """A request's ``max_tokens`` with the server's default filled in (``--max-tokens``),
    refused below 1 or above ``--max-tokens-cap`` (also the vLLM plugin's rule)."""
    if max_tokens is None:
        max_tokens = min(default_max_tokens, max_tokens_cap)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > max_tokens_cap:
        raise APIError(
            400,
            f"max_tokens={max_tokens} exceeds this server's cap of {max_tokens_cap}",
            param="max_tokens",
        )
    return max_tokens


def check_generation(request, default_max_tokens: int, max_tokens_cap: int) -> int:
    """What a server that generates the answer itself checks (the proxy leaves these to its
    upstream): greedy decoding, ``max_tokens`` (returned, the default filled in), stop
    strings and ``echo``."""
    if request.temperature not in (None, 0, 0.0):
        raise APIError(
            400,
            f"temperature must be 0 or omitted, got {request.temperature}: actmap serves greedy "
            "answers, the decoding its detectors are trained on",
            param="temperature",
        )
    if request.top_p not in (None, 1, 1.0):
        raise APIError(400, f"top_p must be 1 or omitted, got {request.top_p}", param="top_p")
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest):
        max_tokens = request.max_completion_tokens or request.max_tokens
    max_tokens = limit_max_tokens(max_tokens, default_max_tokens, max_tokens_cap)
    stops = request.stop_strings()
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise APIError(
            400, f"stop must be at most {MAX_STOP_STRINGS} non-empty strings", param="stop"
        )
    if getattr(request, "echo", False):
        raise APIError(400, "echo is not supported", param="echo")
    return max_tokens


def check_length(engine, prompt: str, max_tokens: int, endpoint: str) -> int:
    """The prompt's token count; 400 ``context_length_exceeded`` when it and ``max_tokens``
    exceed the engine's context."""
    n = engine.count_tokens(prompt)
    if n + max_tokens > engine.max_context:
        raise APIError(
            400,
            f"the prompt has {n} tokens; with max_tokens={max_tokens} that exceeds this "
            f"model's context of {engine.max_context} tokens",
            param=prompt_param(endpoint),
            code="context_length_exceeded",
        )
    return n


# -- prompts ---------------------------------------------------------------------------------


def prompt_param(endpoint: str) -> str:
    return "messages" if endpoint == "chat" else "prompt"


def flatten_messages(messages) -> list[dict]:
    """``[{"role", "content"}]`` with each message's text parts joined; 400 when the list is
    empty or no message holds text (the one rule of every mode, see the module doc)."""
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    flat = [{"role": m.role, "content": m.text()} for m in messages]
    if not any(m["content"].strip() for m in flat):
        raise APIError(400, "messages hold no text", param="messages")
    return flat


def audit_text(messages: list[dict]) -> str:
    """What the audit trail keeps of a conversation (hashed unless ``--audit-text``)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def request_prompt(request, engine, endpoint: str) -> tuple[str, str]:
    """(prompt, audit text) of a chat or completion request: the rendered conversation or
    the one prompt string."""
    if endpoint == "chat":
        messages = flatten_messages(request.messages)
        try:
            prompt = engine.render_chat(messages)
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from None
        except Exception as error:  # a template that rejects the conversation (roles, order)
            raise APIError(
                400, f"the chat template rejected the messages: {error}", param="messages"
            ) from None
        return prompt, audit_text(messages)
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt.strip():
        raise APIError(400, "prompt must not be empty", param="prompt")
    return prompt, prompt
