"""Bearer secrets on gRPC links: the server-side check, the client-side metadata, and the
refusal to expose an unprotected port.

Two links carry a secret: the cluster token (the scheduler presents it to its executors) and the
API key (clients present it to the scheduler's public API). Both travel as ``authorization:
Bearer SECRET``, are compared in constant time before any handler runs, and leave `Health` open
for probes and load balancers. `TokenInterceptor` guards the executor's thread-pool server,
`AioTokenInterceptor` the scheduler's asyncio server; both use one `Credential` check.
"""

from __future__ import annotations

import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

OPEN_METHODS = frozenset({"Health"})  # load balancers and probes hold no secret
REFUSAL_LOG_INTERVAL_S = 10.0
ALLOW_UNAUTHENTICATED_FLAG = "--allow-unauthenticated"


@dataclass(frozen=True, slots=True)
class Credential:
    """What a server requires and how its errors name it."""

    name: str  # "cluster token"
    server: str  # "executor"
    flag: str  # "--cluster-token"
    env: str  # "NPUSERVE_CLUSTER_TOKEN"
    how_to_send: str  # the fix a refused client is told
    extra_header: str | None = None  # a second header that may carry the secret


CLUSTER_TOKEN = Credential(
    "cluster token",
    "executor",
    "--cluster-token",
    "NPUSERVE_CLUSTER_TOKEN",
    "start the scheduler with the executors' --cluster-token (or NPUSERVE_CLUSTER_TOKEN)",
    extra_header="x-npuserve-cluster-token",
)
API_KEY = Credential(
    "API key",
    "scheduler",
    "--api-key",
    "NPUSERVE_API_KEY",
    "send `authorization: Bearer KEY` metadata with the scheduler's --api-key (or NPUSERVE_API_KEY)",
)

# The same key on the gateway's HTTP routes (`npuserve gateway`, the OpenAI API of `serve`).
GATEWAY_API_KEY = Credential(
    "API key", "OpenAI API", "--api-key", "NPUSERVE_API_KEY", "send `Authorization: Bearer KEY`"
)


def bearer_metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that presents ``secret`` (None: nothing to present)."""
    return (("authorization", f"Bearer {secret}"),) if secret else None


def presented_secret(metadata: Any, extra_header: str | None = None) -> str | None:
    """The secret in ``authorization: Bearer S`` (or ``extra_header: S``) metadata, if any."""
    presented = None
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            presented = value[7:].strip()
        elif extra_header is not None and key == extra_header and isinstance(value, str):
            presented = value.strip()
    return presented


class _Check:
    """The refusal reason for a call's metadata, logged at most once per interval (the base of
    both server interceptors)."""

    def __init__(self, credential: Credential, secret: str) -> None:
        self.credential = credential
        self._secret = secret.encode()
        self._last_logged = 0.0

    def problem(self, details: grpc.HandlerCallDetails) -> str | None:
        """None when the call may run: an open method, or the right secret presented."""
        method, metadata = details.method, details.invocation_metadata
        if method.rsplit("/", 1)[-1] in OPEN_METHODS:
            return None
        c = self.credential
        presented = presented_secret(metadata or (), c.extra_header)
        if presented is None:
            problem = f"this {c.server} requires the {c.name}: {c.how_to_send}"
        elif not hmac.compare_digest(presented.encode(), self._secret):
            problem = f"the {c.name} presented does not match this {c.server}'s {c.flag}"
        else:
            return None
        now = time.monotonic()
        if now - self._last_logged >= REFUSAL_LOG_INTERVAL_S:  # a misconfigured peer retries often
            self._last_logged = now
            log.warning("call refused", method=method, reason=problem)
        return problem


class TokenInterceptor(_Check, grpc.ServerInterceptor):
    """For a `grpc.server`: any call but `Health` without the secret ends UNAUTHENTICATED before
    its handler runs."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        problem = self.problem(handler_call_details)
        return handler if problem is None else _refusing(handler, problem)


class AioTokenInterceptor(_Check, grpc.aio.ServerInterceptor):
    """`TokenInterceptor` for a `grpc.aio.server`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        problem = self.problem(handler_call_details)
        return handler if problem is None else _refusing_async(handler, problem)


def same_kind_handler(handler: grpc.RpcMethodHandler, unary: Any, stream: Any) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind and codecs running ``unary`` or ``stream`` (by response)."""
    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **codecs)
    return grpc.stream_stream_rpc_method_handler(stream, **codecs)


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable: makes this a generator, as a streaming handler must be

    return same_kind_handler(handler, refuse, refuse_stream)


def _refusing_async(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable: makes this an async generator, as a streaming handler must be

    return same_kind_handler(handler, refuse, refuse_stream)


# -- client side ------------------------------------------------------------------------------------


class _BearerClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, secret: str) -> None:
        self._metadata = bearer_metadata(secret) or ()

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        """Every kind of call: ``request`` is the request, or the iterator of them."""
        with_secret = _CallDetails(
            details.method,
            details.timeout,
            (*(details.metadata or ()), *self._metadata),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )
        return continuation(with_secret, request)

    intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = intercept_unary_unary


@dataclass(frozen=True, slots=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def with_bearer(channel: grpc.Channel, secret: str | None) -> grpc.Channel:
    """``channel`` presenting ``secret`` on every call (a blocking channel; as is without one)."""
    return grpc.intercept_channel(channel, _BearerClientInterceptor(secret)) if secret else channel


# -- exposure ---------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the port on this machine (a name other than localhost, or
    a wildcard, counts as reachable from outside)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, credential: Credential, has_secret: bool, allowed: bool) -> str | None:
    """Why a server may not bind ``host`` as configured, or None: a port reachable from other
    machines needs its secret unless the operator allowed it explicitly."""
    if has_secret or allowed or is_loopback(host):
        return None
    c = credential
    return (
        f"refusing to serve the {c.server} on {host} with no {c.name}: anyone who reaches the "
        f"port could use it; give {c.flag} (or set {c.env}), bind --host 127.0.0.1, or pass "
        f"{ALLOW_UNAUTHENTICATED_FLAG} if the network is trusted"
    )
