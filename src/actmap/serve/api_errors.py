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
