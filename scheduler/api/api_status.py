"""What the scheduler's errors become for gRPC clients: one status code per kind, the field a
client error names, and errors carried between the scheduler's processes with their status."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import grpc
import structlog

from npuserve.proto.error_details import field_status
from npuserve.proto.sampling_ranges import FieldValueError
from npuserve.scheduler.api.stall_watch import StreamStalled
from npuserve.scheduler.core.request import InvalidRequestError
from npuserve.scheduler.engine.engine_config import NoExecutorError, QueueFullError
from npuserve.scheduler.engine.engine_probes import ProfilingUnavailable
from npuserve.scheduler.lanes.executor_client import ExecutorError
from npuserve.scheduler.text.prompts import ModelNotFoundError
from npuserve.scheduler.text.sandbox_pool import SandboxUnavailable
from npuserve.scheduler.text.tokenizer import TokenizerError

log = structlog.get_logger(__name__)

Method = TypeVar("Method", bound=Callable[..., Awaitable[Any]])


class ShuttingDown(RuntimeError):
    """A new request while the scheduler drains (gRPC UNAVAILABLE, HTTP 503)."""


class RelayedError(Exception):
    """An error raised in another scheduler process, with the status it has there."""

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(code, message, field)
        self.code, self.message, self.field = code, message, field

    def __str__(self) -> str:
        return self.message


# Client errors and what they become on the wire; anything else is INTERNAL.
STATUS_OF: list[tuple[type[Exception], grpc.StatusCode]] = [
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (TokenizerError, grpc.StatusCode.INVALID_ARGUMENT),
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoExecutorError, grpc.StatusCode.UNAVAILABLE),
    (ShuttingDown, grpc.StatusCode.UNAVAILABLE),
    (StreamStalled, grpc.StatusCode.ABORTED),
    (SandboxUnavailable, grpc.StatusCode.UNAVAILABLE),
    (ProfilingUnavailable, grpc.StatusCode.UNIMPLEMENTED),
]
# An executor's answer to a call relayed to it keeps its code (profiling off, already running...).
RELAYED_EXECUTOR_CODES = frozenset(
    {"UNIMPLEMENTED", "FAILED_PRECONDITION", "UNAVAILABLE", "DEADLINE_EXCEEDED"}
)


def status_of(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, RelayedError):
        return grpc.StatusCode[exc.code]
    if isinstance(exc, ExecutorError) and exc.code in RELAYED_EXECUTOR_CODES:
        return grpc.StatusCode[exc.code]
    for kind, code in STATUS_OF:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def field_of(exc: Exception) -> str | None:
    """The request field a client error names (scheduler.proto lists the names), if any."""
    return exc.field if isinstance(exc, (RelayedError, FieldValueError, TokenizerError)) else None


def relayed(exc: Exception) -> RelayedError:
    """``exc`` as it crosses to another process (any exception pickles this way)."""
    return RelayedError(status_of(exc).name, str(exc), field_of(exc))


def client_status(exc: Exception) -> tuple[grpc.StatusCode, str, str | None]:
    """What a failed call tells its client: status code, message and the field it names (if
    any); an error that is not the client's is logged."""
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("request failed", error=str(exc))
    return code, str(exc), field_of(exc)


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    code, message, field = client_status(exc)
    if field is None:
        await context.abort(code, message)
    else:
        status = field_status(code, message, field)
        await context.abort(status.code, status.details, status.trailing_metadata)


def guarded(method: Method) -> Method:
    """A unary call's servicer method whose errors end the call with their status (`abort_with`)."""

    @functools.wraps(method)
    async def guarded_method(self: object, request: object, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except Exception as exc:
            await abort_with(context, exc)
            raise  # unreachable: abort raises

    return cast(Method, guarded_method)
