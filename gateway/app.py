"""The gateway's routes: OpenAI's and vLLM's REST surface over the scheduler's gRPC API.

Handlers read and check the body, translate it (`convert`), call the scheduler
(`scheduler_client`), and answer in OpenAI's shape
(`generate`, `protocol`). The app holds no model state beyond the served model's name, which it
asks the scheduler for once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from npuserve.gateway import convert
from npuserve.gateway.auth import APIKeyMiddleware
from npuserve.gateway.chat_output import OutputShape, ParserSettings
from npuserve.gateway.drain import Drain, DrainMiddleware
from npuserve.gateway.errors import APIError, bad_request, error_body, request_timeout, unavailable
from npuserve.gateway.generate import ChatFormat, CompletionFormat, Generation, start_calls
from npuserve.gateway.limits import DEFAULT_MAX_STREAM_BUFFER_BYTES, RequestLimits, flag_name
from npuserve.gateway.metrics import CONTENT_TYPE, GatewayMetrics, ObservabilityMiddleware
from npuserve.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    model_card,
    parse_json_object,
    validate,
)
from npuserve.gateway.scheduler_client import SchedulerClient
from npuserve.gateway.tool_calls import tool_plan

log = structlog.get_logger(__name__)

DEFAULT_BODY_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


@dataclass
class Gateway:
    """What the routes share: the scheduler client, the served model's name, the request limits,
    and the thread that checks tools' schemas."""

    client: SchedulerClient
    served_model_name: str | None
    limits: RequestLimits = field(default_factory=RequestLimits)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    parsers: ParserSettings = field(default_factory=ParserSettings)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    # NOTE: one thread: the event loop shares the GIL with one schema check at a time, at most.
    schema_checks: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tool-schemas")
    )
    _models: list[convert.ModelInfo] = field(default_factory=list)

    async def models(self) -> list[convert.ModelInfo]:
        if not self._models:
            self._models = await self.client.list_models()
        return self._models

    async def model_name(self) -> str:
        """The name clients see: --served-model-name, else the scheduler's."""
        if self.served_model_name:
            return self.served_model_name
        models = await self.models()
        return models[0].id if models else ""

    async def scheduler_model(self, requested: str | None) -> tuple[str, str]:
        """(the name to send the scheduler, the name to answer with) for a request's `model`."""
        name = await self.model_name()
        if not requested or requested == name:
            return "", name  # "" is the scheduler's served model
        return requested, requested  # the scheduler answers NOT_FOUND for a model it lacks

    async def check_output_tokens(
        self, sequences: int, n: int, max_tokens: int | None, max_tokens_param: str
    ) -> None:
        """`RequestLimits.check_output_tokens`; sequences without a max_tokens may each run to the
        longest context served, asked of the scheduler only then."""
        context_len = 0
        if max_tokens is None and sequences > 1:
            context_len = max((m.max_model_len for m in await self.models()), default=0)
        self.limits.check_output_tokens(sequences, n, max_tokens, max_tokens_param, context_len)

    async def request_body(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object within every limit, bytes first, that the JSON shows."""
        raw = parse_json_object(await read_body(request, self.limits.max_request_bytes, self.body_timeout_s))
        self.limits.check(raw)
        return raw

    async def validated(self, raw: dict[str, Any], model: type[M]) -> M:
        """`raw` as a `model`; a body with tools on the schema-check thread, since checking their
        schemas takes up to about 10 us a byte (`tool_calls.check_parameters_schema`)."""
        if not raw.get("tools"):
            return validate(raw, model)
        return await asyncio.get_running_loop().run_in_executor(self.schema_checks, validate, raw, model)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _request_id(request: Request) -> str:
    """The id the observability middleware gave this request (it also names the scheduler's)."""
    return getattr(request.state, "request_id", None) or uuid.uuid4().hex


def _json(payload: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    body = json.dumps(payload, ensure_ascii=False).encode()
    return Response(body, status, headers, media_type="application/json")


async def read_body(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """The whole body, refused with 413 past `limit` bytes (by Content-Length, then as it streams)
    and with 408 (closing the connection) when it takes longer than `timeout_s` to arrive."""
    too_large = APIError(
        413,
        f"the request body exceeds {limit} bytes ({flag_name('max_request_bytes')})",
        code="request_too_large",
    )
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise bad_request("Content-Length is not a number")
        if int(length) > limit:
            raise too_large

    async def collect() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(collect(), timeout_s)
    except asyncio.TimeoutError:
        raise request_timeout(f"the request body did not arrive within {timeout_s:g} s") from None


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it and raising ClientGone if the client closes the connection."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone


async def _in_request_terms(body: BaseModel, work: Awaitable[T]) -> T:
    """Awaits `work`; a refused field is named as `body` sent it (see `convert.in_request_terms`)."""
    try:
        return await work
    except APIError as exc:
        raise convert.in_request_terms(exc, body) from None


class EventStreamResponse(StreamingResponse):
    """SSE; the event generator is closed however the response ends, so its calls are cancelled."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _log_ignored(body: Any) -> None:
    if body.model_extra:
        log.warning("ignored request fields", fields=sorted(body.model_extra))


async def _generate(
    request: Request,
    gateway: Gateway,
    body: CompletionRequest | ChatCompletionRequest,
    requests: list[Any],
    kind: CompletionFormat | ChatFormat,
    response_id: str,
    model: str,
) -> Response:
    if body.stream and request.scope.get("http_version") == "1.0":
        # NOTE: a stream of unknown length needs HTTP/1.1's chunked encoding.
        raise bad_request(
            "stream: true needs HTTP/1.1; send the request over HTTP/1.1 or without stream", "stream"
        )
    started = _in_request_terms(body, start_calls(gateway.client, requests))
    calls, firsts = await _until_disconnected(request, started)
    generation = Generation(kind, calls, firsts, body.n, response_id, model, body.include_usage)
    if body.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return EventStreamResponse(generation.stream(), headers=headers)
    try:
        return _json(await _until_disconnected(request, generation.collect()))
    finally:
        generation.cancel()


def _routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        gateway = _gateway(request)
        body = validate(await gateway.request_body(request), CompletionRequest)
        _log_ignored(body)
        target, model = await gateway.scheduler_model(body.model)
        await gateway.check_output_tokens(len(body.prompt) * body.n, body.n, body.max_tokens, "max_tokens")
        response_id = f"cmpl-{_request_id(request)}"
        requests = convert.completion_requests(body, response_id, target)
        kind = CompletionFormat(body.prompt, body.echo, body.logprobs is not None)
        return await _generate(request, gateway, body, requests, kind, response_id, model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        gateway = _gateway(request)
        body = await gateway.validated(await gateway.request_body(request), ChatCompletionRequest)
        _log_ignored(body)
        target, model = await gateway.scheduler_model(body.model)
        await gateway.check_output_tokens(body.n, body.n, body.completion_limit, body.completion_limit_param)
        response_id = f"chatcmpl-{_request_id(request)}"
        parsers = gateway.parsers
        tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, parsers.auto_tool_parser)
        requests = [convert.chat_request(body, response_id, target, tools)]
        kind = ChatFormat(body.logprobs, OutputShape(tools, parsers.reasoning))
        return await _generate(request, gateway, body, requests, kind, response_id, model)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gateway = _gateway(request)
        name = await gateway.model_name()
        cards = [model_card(name, m.created, m.root, m.max_model_len) for m in await gateway.models()]
        return _json({"object": "list", "data": cards})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        gateway = _gateway(request)
        raw = await gateway.request_body(request)
        body: TokenizeChatRequest | TokenizeCompletionRequest = (
            await gateway.validated(raw, TokenizeChatRequest)
            if "messages" in raw
            else validate(raw, TokenizeCompletionRequest)
        )
        target, _ = await gateway.scheduler_model(body.model)
        result = await _in_request_terms(body, gateway.client.tokenize(body, target))
        return _json(
            {
                "count": len(result.tokens),
                "max_model_len": result.max_model_len,
                "tokens": result.tokens,
                "token_strs": result.token_strs,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        gateway = _gateway(request)
        body = validate(await gateway.request_body(request), DetokenizeRequest)
        target, _ = await gateway.scheduler_model(body.model)
        text = await _in_request_terms(body, gateway.client.detokenize(body.tokens, target))
        return _json({"prompt": text})

    @app.get("/health")
    async def health(request: Request) -> Response:
        try:
            info = await _gateway(request).client.health(timeout_s=HEALTH_TIMEOUT_S)
        except APIError as exc:  # whatever the scheduler's failure, this gateway cannot serve
            raise unavailable(exc.message) from None
        if not info.serving:
            raise unavailable(info.message or "no executor is ready")
        body = {
            "status": "degraded" if info.degraded else "ok",
            "ready_executors": info.ready_executors,
            "total_executors": info.total_executors,
        }
        return _json(body | ({"message": info.message} if info.message else {}))

    @app.post("/start_profile")
    async def start_profile(request: Request) -> Response:
        executor_ids = await _gateway(request).client.start_profile()
        return _json({"status": "profiling", "executors": executor_ids})

    @app.post("/stop_profile")
    async def stop_profile(request: Request) -> Response:
        traces = await _gateway(request).client.stop_profile()
        return _json({"status": "stopped", "traces": traces})

    @app.get("/version")
    async def version() -> Response:
        try:
            return _json({"version": metadata.version("npuserve")})
        except metadata.PackageNotFoundError:
            return _json({"version": "unknown"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gateway = _gateway(request)
        text = gateway.metrics.render()
        try:
            text += await gateway.client.metrics_text()
        except APIError as exc:
            log.warning("scheduler metrics unavailable", error=exc.message)
            text += f"# scheduler metrics unavailable: {exc.message}\n"
        return Response(text, media_type=CONTENT_TYPE)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        if exc.status >= 500:
            log.warning("request failed", status=exc.status, error=exc.message)
        return _json(exc.body(), exc.status, exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _json(error_body(str(exc.detail), kind), exc.status_code, exc.headers)

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: Exception) -> Response:
        log.info("client disconnected before the response")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", error=str(exc))
        return _json(error_body("internal server error", "server_error"), 500)


def create_app(
    scheduler_address: str,
    api_key: str | None = None,
    served_model_name: str | None = None,
    *,
    limits: RequestLimits | None = None,
    scheduler_api_key: str | None = None,
    scheduler_tls_ca: bytes | None = None,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    parsers: ParserSettings | None = None,
    max_stream_buffer_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES,
) -> FastAPI:
    """The gateway app; its gRPC channel opens when the app starts (inside the server's loop).
    `limits` bound every request, `scheduler_api_key` is presented to the scheduler,
    `scheduler_tls_ca` verifies its TLS; `parsers` read tool calls and reasoning out of chat
    answers; `max_stream_buffer_bytes` bounds the output a stream holds for a slow client."""
    metrics = GatewayMetrics()
    client = SchedulerClient(
        scheduler_address,
        scheduler_api_key,
        scheduler_tls_ca,
        on_resend=metrics.generations_resent.inc,
        on_resume=metrics.generations_resumed.inc,
        max_stream_buffer_bytes=max_stream_buffer_bytes,
    )

    gateway = Gateway(
        client,
        served_model_name,
        limits or RequestLimits(),
        body_timeout_s,
        parsers or ParserSettings(),
        metrics,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.open()
        try:
            yield
        finally:
            gateway.schema_checks.shutdown(wait=False, cancel_futures=True)
            await client.close()

    app = FastAPI(title="npuserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    _routes(app)
    _error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    # NOTE: added last, so it is outermost: refused keys are counted, logged and carry an id too.
    app.add_middleware(ObservabilityMiddleware, metrics=gateway.metrics)
    return app
