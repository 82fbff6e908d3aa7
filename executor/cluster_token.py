"""The cluster token: executors serve only the scheduler that presents it.

Every process of a deployment gets the same secret (``--cluster-token`` or
``NPUSERVE_CLUSTER_TOKEN``; `npuserve serve` makes one up when none is given). The scheduler sends
it on every call (`ExecutorClient`); the executor's `ClusterTokenInterceptor` checks it in
constant time before any handler runs. `Health` stays open for probes and load balancers.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)


OPEN_METHODS = frozenset({"Health"})  # load balancers and probes hold no token
REFUSAL_LOG_INTERVAL_S = 10.0


class ClusterTokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through only when it presents the cluster token, as ``authorization: Bearer
    TOKEN`` or ``x-npuserve-cluster-token: TOKEN`` (compared in constant time); any other call
    but `Health` ends UNAUTHENTICATED before its handler runs."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()
        self._last_logged = 0.0

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.rsplit("/", 1)[-1] in OPEN_METHODS:
            return handler
        problem = self._problem(handler_call_details.invocation_metadata or ())
        if problem is None:
            return handler
        now = time.monotonic()
        if now - self._last_logged >= REFUSAL_LOG_INTERVAL_S:  # a misconfigured peer retries often
            self._last_logged = now
            log.warning("call refused", method=method, reason=problem)
        return _refusing(handler, problem)

    def _problem(self, metadata: Any) -> str | None:
        presented = None
        for key, value in metadata:
            if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
                presented = value[7:].strip()
            elif key == "x-npuserve-cluster-token" and isinstance(value, str):
                presented = value.strip()
        if presented is None:
            return (
                "this executor requires the cluster token: start the scheduler with the executors' "
                "--cluster-token (or NPUSERVE_CLUSTER_TOKEN)"
            )
        if not hmac.compare_digest(presented.encode(), self._token):
            return "the cluster token presented does not match this executor's --cluster-token"
        return None


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    def refuse_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable: makes this a generator, as a streaming handler must be

    codecs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **codecs)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **codecs)
