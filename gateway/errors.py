"""OpenAI error bodies, and what each scheduler gRPC status becomes over HTTP.

Every error the gateway returns has OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, so the official clients raise their usual exception classes (BadRequestError,
AuthenticationError, NotFoundError, RateLimitError, ...). A client's mistake is always a 4xx;
a 5xx means the gateway or the scheduler behind it failed.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from starlette.types import Send

RETRY_AFTER_S = 1


@dataclasses.dataclass(eq=False)
class APIError(Exception):
    """An error reply: HTTP status, OpenAI error fields, and extra headers."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str) -> APIError:
    retry = {"Retry-After": str(RETRY_AFTER_S)}
    return APIError(503, message, "server_error", code="service_unavailable", headers=retry)


def request_timeout(message: str) -> APIError:
    """408 for a client too slow to send its request; the connection is closed after it."""
    return APIError(408, message, code="request_timeout", headers={"Connection": "close"})


# The scheduler's status codes for client errors and overload, as (HTTP status, type, code).
_HTTP_OF_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
}
# NOTE: the gateway calls Generate without a deadline and the small services with a short one,
# so DEADLINE_EXCEEDED means a scheduler that does not answer, like UNAVAILABLE.
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def from_status(code: grpc.StatusCode, details: str | None, field: str | None = None) -> APIError:
    """The HTTP error for a failed scheduler call; `field` is the request field it names."""
    message = details or code.name.lower()
    if code in _UNAVAILABLE:
        return unavailable(f"the scheduler is unavailable: {message}")
    if code not in _HTTP_OF_STATUS:
        return APIError(500, f"the scheduler failed: {message}", "server_error", code=code.name.lower())
    status, kind, error_code = _HTTP_OF_STATUS[code]
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else {}
    param = "model" if status == 404 else field
    return APIError(status, message, kind, param, error_code, headers)


def from_validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 naming the first field pydantic refused, as `messages[0].role` style paths."""
    first = errors[0]
    param = ""
    for part in first.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else str(part)
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return bad_request(message, param or None)


async def send_error(send: Send, error: APIError) -> None:
    """Writes a whole error response straight to ASGI (for middleware, before any route runs)."""
    body = error.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
