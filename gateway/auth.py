"""`--api-key`: `Authorization: Bearer KEY` on every route that does work (the API, tokenizing,
profiling); health, metrics and version stay open."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from npuserve.gateway.errors import APIError, send_error

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/start_profile", "/stop_profile")


class APIKeyMiddleware:
    """Refuses requests to the API routes that lack the key, with an OpenAI 401 body."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith(PROTECTED_PREFIXES)):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = header.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)):
                error = APIError(
                    401,
                    "missing or invalid API key: send `Authorization: Bearer KEY`",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await send_error(send, error)
                return
        await self.app(scope, receive, send)
