"""Clients of one executor's gRPC service, for the scheduler (this module never imports torch).

`ExecutorClient` sends each step as a unary `Step` call; `StreamingExecutorClient` sends them over
one long-lived `StepStream`, reopened after any failure. Both expose the same `.step(plan)` and
turn every gRPC failure into `ExecutorError`, carrying the status code's name and message.
With a ``token`` every call presents the cluster token (``authorization: Bearer TOKEN``); with
``tls_ca`` (PEM root certificates) the channel is TLS, verified against those roots.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from npuserve.proto import executor_pb2 as pb
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto import step_codec
from npuserve.proto.auth import bearer_metadata
from npuserve.proto.channel import MAX_STEP_MESSAGE_BYTES, client_channel, message_size_options
from npuserve.proto.step_plan import ExecutorInfo, StepPlan, StepResult
from npuserve.scheduler.service_config import DEFAULT_STEP_TRANSPORT

CHANNEL_OPTIONS = message_size_options(MAX_STEP_MESSAGE_BYTES)
# NOTE: stopping a profile exports its trace, which takes long after a busy profile.
PROFILE_EXPORT_TIMEOUT_S = 600.0
# A health check (the scheduler's own, and after a failed step: `lane.down_reason`) waits this
# long for an executor's answer: one that takes longer is not taken as serving.
HEALTH_CHECK_TIMEOUT_S = 5.0


class ExecutorError(RuntimeError):
    """A failed call to an executor. `code` is the gRPC status name, e.g. "INVALID_ARGUMENT"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> ExecutorError:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else None
        return cls(code.name if code is not None else "UNKNOWN", details or str(exc))


def serves_as(health: pb.HealthResponse, instance_id: str) -> bool:
    """Whether a health answer comes from the executor process ``instance_id`` (empty: any)
    and it serves: a restart on the same address is another process, which holds none of the
    requests the first one did."""
    same = not instance_id or not health.instance_id or health.instance_id == instance_id
    return health.serving and same


def addressed_step(plan: StepPlan, instance_id: str) -> pb.StepRequest:
    """The plan, addressed to the executor instance a client handshook with (a restarted
    process refuses it)."""
    request = step_codec.plan_to_proto(plan)
    request.executor_instance_id = instance_id
    return request


class ExecutorClient:
    """Unary calls to one executor. `timeout_s` bounds each call (None: no deadline)."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = 60.0,
        token: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = client_channel(address, CHANNEL_OPTIONS, tls_ca)
        self._stub = pb_grpc.ExecutorStub(self._channel)
        self._metadata = bearer_metadata(token)
        # Filled by info(): the executor's identity, next to the capacity handshake.
        self.executor_id: str | None = None
        self.version: str | None = None
        self.instance_id = ""  # every step is addressed to this process (a restart refuses it)

    def info(self) -> ExecutorInfo:
        """The capacity handshake; waits (up to timeout_s) for an executor that is still starting."""
        msg = self._call(self._stub.Info, pb.InfoRequest(), wait_for_ready=True)
        self.executor_id, self.version, self.instance_id = msg.executor_id, msg.version, msg.instance_id
        return step_codec.info_from_proto(msg)

    def step_request(self, plan: StepPlan) -> pb.StepRequest:
        return addressed_step(plan, self.instance_id)

    def step(self, plan: StepPlan) -> StepResult:
        return step_codec.result_from_proto(self._call(self._stub.Step, self.step_request(plan)))

    def health(self) -> bool:
        """True when the executor answers and serves, as the process it handshook with; False
        when it is unreachable, stopping, or another process (`serves_as`)."""
        try:
            health = self._stub.Health(
                pb.HealthRequest(), timeout=HEALTH_CHECK_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.RpcError:
            return False
        return serves_as(health, self.instance_id)

    def start_profile(self) -> str:
        """Starts profiling the executor's steps; returns where its trace will be written."""
        return self._call(self._stub.StartProfile, pb.StartProfileRequest()).profile_dir

    def stop_profile(self) -> list[str]:
        """Ends the profile; returns the files the executor wrote (paths on its machine)."""
        reply = self._call(
            self._stub.StopProfile, pb.StopProfileRequest(), timeout_s=PROFILE_EXPORT_TIMEOUT_S
        )
        return list(reply.trace_files)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        wait_for_ready: bool = False,
        timeout_s: float | None = None,
    ) -> Any:
        try:
            return method(
                request,
                timeout=timeout_s or self.timeout_s,
                wait_for_ready=wait_for_ready,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            raise ExecutorError.from_rpc_error(exc) from None


_END = object()  # closes a stream's request iterator


class _StepDeadlines:
    """Ends step streams whose response is late.

    A lane reads its stream's responses in its own thread (no reader thread and queue between
    them: one thread wake-up less per step), and gRPC's response iterator has no timed
    ``next()``: this thread cancels a stream once a response is past its deadline, which ends the
    lane's wait. It looks every `TICK_S`, so a late step is seen within a tick of its deadline,
    and waiting costs a step two dict operations and no wake-up.
    """

    TICK_S = 0.05

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, float, _StepStream]] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, stream: _StepStream, timeout_s: float) -> int:
        key = next(self._keys)
        self._due[key] = (time.monotonic() + timeout_s, timeout_s, stream)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="step-deadlines", daemon=True)
                    self._thread.start()
        return key

    def unwatch(self, key: int) -> None:
        self._due.pop(key, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            now = time.monotonic()
            for key, (due, timeout_s, stream) in list(self._due.items()):
                if due <= now and self._due.pop(key, None) is not None:
                    stream.expire(timeout_s)


_DEADLINES = _StepDeadlines()


class _StepStream:
    """One open `StepStream` call: requests go in through a queue (gRPC's thread sends them),
    responses are read by the thread that waits for them, in the order the requests went out."""

    def __init__(self, stub: pb_grpc.ExecutorStub, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._call = stub.StepStream(iter(self._requests.get, _END), metadata=metadata)
        self._expired_after_s: float | None = None

    def send(self, request: pb.StepRequest) -> None:
        self._requests.put(request)

    def receive(self, timeout_s: float | None) -> pb.StepResponse:
        """The next response; DEADLINE_EXCEEDED (and the stream ended) past ``timeout_s``."""
        key = _DEADLINES.watch(self, timeout_s) if timeout_s is not None else None
        try:
            return next(self._call)
        except StopIteration:
            raise ExecutorError("UNAVAILABLE", "the executor closed the step stream") from None
        except grpc.RpcError as exc:
            if self._expired_after_s is not None:
                raise ExecutorError(
                    "DEADLINE_EXCEEDED", f"no step response within {self._expired_after_s} s"
                ) from None
            raise ExecutorError.from_rpc_error(exc) from None
        finally:
            if key is not None:
                _DEADLINES.unwatch(key)

    def expire(self, timeout_s: float) -> None:
        """A response is past ``timeout_s``: the stream ends, its reader sees DEADLINE_EXCEEDED."""
        self._expired_after_s = timeout_s
        self._call.cancel()

    def close(self) -> None:
        # NOTE: ending the request iterator also frees gRPC's thread that waits on it.
        self._requests.put(_END)
        self._call.cancel()


class _PendingStep:
    """A step sent on a stream whose result has not been read yet."""

    def __init__(self, client: StreamingExecutorClient, stream: _StepStream) -> None:
        self.client = client
        self.stream = stream

    def result(self) -> StepResult:
        try:
            response = self.stream.receive(self.client.timeout_s)
        except ExecutorError:
            self.client._close_stream(self.stream)
            raise
        return step_codec.result_from_proto(response)


class StreamingExecutorClient(ExecutorClient):
    """Steps over one long-lived bidirectional stream, opened on the first step.

    Steps may be pipelined (`submit` the next before the last one's `result`): the executor runs
    them in order. Any failed step closes the stream (the server ends it with the error's status);
    the next step opens a new one. `timeout_s` bounds each step's wait for its response.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float | None = 60.0,
        token: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        super().__init__(address, timeout_s, token, tls_ca)
        self._stream: _StepStream | None = None
        self._lock = threading.Lock()

    def submit(self, plan: StepPlan) -> _PendingStep:
        """Sends a step without waiting for its result (read it with ``.result()``, in order)."""
        request = self.step_request(plan)
        with self._lock:
            if self._stream is None:
                self._stream = _StepStream(self._stub, self._metadata)
            stream = self._stream
            stream.send(request)
        return _PendingStep(self, stream)

    def step(self, plan: StepPlan) -> StepResult:
        return self.submit(plan).result()

    def close(self) -> None:
        self._close_stream(None)
        super().close()

    def _close_stream(self, stream: _StepStream | None) -> None:
        """Closes the open stream (only if it is still ``stream``, when one is given)."""
        with self._lock:
            if self._stream is not None and (stream is None or self._stream is stream):
                self._stream.close()
                self._stream = None


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """How to reach executors (picklable: scheduler worker processes build their own clients)."""

    step_transport: str = DEFAULT_STEP_TRANSPORT  # one of STEP_TRANSPORTS
    timeout_s: float | None = 60.0
    token: str | None = None
    tls_ca: bytes | None = None

    def connect(self, address: str) -> ExecutorClient:
        kind = StreamingExecutorClient if self.step_transport == "stream" else ExecutorClient
        return kind(address, timeout_s=self.timeout_s, token=self.token, tls_ca=self.tls_ca)
