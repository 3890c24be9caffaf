"""Errors the router answers with, in OpenAI's JSON shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Every failure a handler can meet becomes an ``APIError`` with the right status; nothing the
client sends may surface as a 500.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# HTTP status -> OpenAI error type
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_server_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


@dataclasses.dataclass(eq=False)
class APIError(Exception):
    """An error answer: HTTP status, message, the offending request field, optional headers."""

    status: int  # HTTP status code
    message: str  # human-readable
    param: str | None = None  # request field at fault, e.g. "messages" or "temperature"
    code: str | None = None  # machine-readable, e.g. "context_length_exceeded"
    retry_after_s: int | None = None  # sent as Retry-After (429 / 503)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status, "api_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return headers


# HTTP status -> Anthropic's error type (docs.anthropic.com's "Errors"); other 4xx: invalid_request_error
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"  # the paths whose errors take Anthropic's shape


def anthropic_status(error: APIError) -> int:
    """Anthropic's status for ``error``: no usable node (503) is its 529, overloaded."""
    return 529 if error.status == 503 else error.status


def anthropic_body(error: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``; the message names the field at fault."""
    status = anthropic_status(error)
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = error.message
    if error.param is not None and error.param.split(".")[0] not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response_parts(path: str, error: APIError) -> tuple[dict[str, Any], int]:
    """The body and status of ``error`` on ``path``: Anthropic's shape on its API, else OpenAI's."""
    if path.startswith(ANTHROPIC_PATHS):
        return anthropic_body(error), anthropic_status(error)
    return error.body(), error.status


def bad_request(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
