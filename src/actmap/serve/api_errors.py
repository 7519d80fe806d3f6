"""`APIError`: a failed request as OpenAI's error JSON (``{"error": {message, type, param, code}}``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from actmap.serve.protocol import ErrorInfo, ErrorResponse


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

    def response(self, headers: dict | None = None) -> JSONResponse:
        body = ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        )
        return JSONResponse(body.model_dump(), status_code=self.status, headers=headers)


RETRY_AFTER_S = 1  # the Retry-After of a 429 (queue full) or 503 (draining)


def server_busy(reason: str) -> APIError:
    """A full queue: 429 (as OpenAI's rate limit, which clients retry after ``Retry-After``)."""
    return APIError(
        429, f"server busy: {reason}; retry later", type="server_busy", code="queue_full"
    )


def retry_headers(error: APIError) -> dict | None:
    """``Retry-After`` for the statuses a client should retry: 429 and 503."""
    return {"Retry-After": str(RETRY_AFTER_S)} if error.status in (429, 503) else None
