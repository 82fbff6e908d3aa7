"""The executor's RPC errors and the status code each one ends a call with, in one place.

`ExecutorStopping` (and `ExecutorRestarted`) and `StaleStep` are what the servicer raises when a
step must not run; `StatusInterceptor` wraps every handler of the executor's gRPC server so that an
exception becomes a status code instead of a dead stream or process: a plan the runner refuses
(`PlanError`, `CodecError`) is INVALID_ARGUMENT, a stopping or restarted executor UNAVAILABLE, a
stale step or a profiler in the wrong state FAILED_PRECONDITION, disabled profiling (or blocks
read off an executor that has none) UNIMPLEMENTED, a step whose pull from another executor
failed ABORTED, and anything else INTERNAL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc
import structlog

from npuserve.executor.input_batch import PlanError
from npuserve.executor.step_profiler import ProfilerStateError, ProfilingDisabled
from npuserve.proto.auth import same_kind_handler
from npuserve.proto.step_codec import CodecError

log = structlog.get_logger(__name__)


class ExecutorStopping(RuntimeError):
    """A step that arrived after shutdown began (UNAVAILABLE: the executor state is unchanged)."""


class ExecutorRestarted(ExecutorStopping):
    """A plan addressed to an earlier instance of this executor (UNAVAILABLE: reconnect)."""


class StaleStep(RuntimeError):
    """A plan older than one of the same scheduler already run (FAILED_PRECONDITION; the state is
    unchanged): a step of a stream that broke, still queued here after the scheduler went on
    over a new stream. Run then, it would advance requests that the scheduler has sent again
    whole since."""


class KvPullFailed(RuntimeError):
    """A step's pull from another executor failed there or on the way (`kv_transfer`): ABORTED,
    not UNAVAILABLE or INTERNAL, because this executor is fine and serves on; the step's requests
    are dropped (the scheduler sends them again whole) and the message names the source's error."""


class NoKvBlocks(RuntimeError):
    """`ReadBlocks` on an executor with no KV cache to read (a simulated one): UNIMPLEMENTED."""


class StatusInterceptor(grpc.ServerInterceptor):
    """Wraps every handler so an exception becomes a status code (`_STATUSES`, else INTERNAL with
    the exception's type and text) instead of a dead stream/process."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        unary = handler.unary_unary or handler.stream_unary
        stream = handler.unary_stream or handler.stream_stream
        return same_kind_handler(
            handler, unary and _guard_unary(unary, method), stream and _guard_stream(stream, method)
        )


def _guard_unary(behavior: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Callable:
    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(request, context)
        except Exception as exc:
            _abort(context, method, exc)

    return guarded


def _guard_stream(behavior: Callable[[Any, grpc.ServicerContext], Iterator], method: str) -> Callable:
    def guarded(request: Any, context: grpc.ServicerContext) -> Iterator:
        try:
            yield from behavior(request, context)
        except Exception as exc:
            if not context.is_active():  # the client went away (cancel, closed channel)
                return
            _abort(context, method, exc)

    return guarded


# The exceptions that end an RPC with another status than INTERNAL, first match first, with their
# message, and the warning each logs (None: none). A refused plan means "the plan is wrong", not
# "the executor is broken" (the runner has already dropped the plan's requests).
_STATUSES: tuple[tuple[type[Exception] | tuple[type[Exception], ...], grpc.StatusCode, str | None], ...] = (
    ((PlanError, CodecError), grpc.StatusCode.INVALID_ARGUMENT, "plan refused"),
    (ExecutorStopping, grpc.StatusCode.UNAVAILABLE, None),
    ((ProfilingDisabled, NoKvBlocks), grpc.StatusCode.UNIMPLEMENTED, None),
    (KvPullFailed, grpc.StatusCode.ABORTED, "kv pull failed"),
    ((ProfilerStateError, StaleStep), grpc.StatusCode.FAILED_PRECONDITION, None),
)


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> NoReturn:
    """Ends the RPC with the status for `exc` (`context.abort` raises)."""
    for kinds, code, warning in _STATUSES:
        if isinstance(exc, kinds):
            if warning is not None:
                log.warning(warning, method=method, error=str(exc))
            context.abort(code, str(exc))
    log.error("rpc failed", method=method, exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    raise AssertionError("unreachable: context.abort raises")
