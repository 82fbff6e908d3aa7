"""One executor's gRPC service from an event loop: the client of every scheduler process.

Steps go over one long-lived `StepStream`, opened on the first step and again after any
failure; steps may be pipelined (`submit` the next before the last one's `result`), the executor
runs them in order. Every gRPC failure becomes `ExecutorError` (the status code's name and
message). (A unary call per step cost more CPU on both sides and gave fewer tokens/s at every
scale measured, 40k against 54k tok/s at 16 executors x 1,024 streams.)

`timeout_s` bounds each step's wait for its response (DEADLINE_EXCEEDED, and the stream ends),
and each other call but `Health` (`HEALTH_CHECK_TIMEOUT_S`) and `StopProfile`. The capacity
handshake (`info`) names the executor's process: every step is addressed to that one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from npuserve.proto import executor_pb2 as pb
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto import step_codec
from npuserve.proto.auth import bearer_metadata
from npuserve.proto.channel import MAX_STEP_MESSAGE_BYTES, aio_client_channel, message_size_options
from npuserve.proto.step_plan import ExecutorInfo, StepPlan, StepResult
from npuserve.scheduler.lanes.executor_client import ClientSpec, ExecutorError

CHANNEL_OPTIONS = message_size_options(MAX_STEP_MESSAGE_BYTES)
# NOTE: stopping a profile exports its trace, which takes long after a busy profile.
PROFILE_EXPORT_TIMEOUT_S = 600.0
# A health check (the scheduler's own, and after a failed step: `lane.down_reason`) waits this
# long for an executor's answer: one that takes longer is not taken as serving.
HEALTH_CHECK_TIMEOUT_S = 5.0


def _late(timeout_s: float | None) -> ExecutorError:
    return ExecutorError("DEADLINE_EXCEEDED", f"no step response within {timeout_s} s")


def _closed_under(client: AioExecutorClient, stream: Any, exc: asyncio.CancelledError) -> ExecutorError:
    """A stream this client cancelled (a step before failed) cancels what waits on it; a wait
    on the open stream was the task's own cancellation, which goes on."""
    if stream is client._stream:
        raise exc
    return ExecutorError("CANCELLED", "the step stream was closed after a failed step")


class AioPendingStep:
    """A step sent whose result has not been read yet."""

    def __init__(self, client: AioExecutorClient, stream: Any) -> None:
        self.client = client
        self.stream = stream  # the StepStream call it went on

    async def result(self) -> StepResult:
        """The step's next answer: its early answer first (`StepResult.partial`) when it has one
        (`early_results`), then its result."""
        client = self.client
        # NOTE: a timer that ends the stream, not `wait_for`: that wraps the read in a task of
        # its own (Python < 3.12), a task and a loop turn more per step.
        timeout_s, expired = client.timeout_s, False

        def expire() -> None:
            nonlocal expired
            expired = True
            client.close_stream(self.stream)

        timer = None if timeout_s is None else asyncio.get_running_loop().call_later(timeout_s, expire)
        try:
            response = await self.stream.read()
        except asyncio.CancelledError as exc:
            if expired:
                raise _late(timeout_s) from None
            raise _closed_under(client, self.stream, exc) from None
        except grpc.aio.AioRpcError as exc:
            client.close_stream(self.stream)
            if expired:
                raise _late(timeout_s) from None
            raise ExecutorError.from_rpc_error(exc) from None
        finally:
            if timer is not None:
                timer.cancel()
        if response is grpc.aio.EOF:
            client.close_stream(self.stream)
            raise ExecutorError("UNAVAILABLE", "the executor closed the step stream")
        return step_codec.result_from_proto(response)


class AioExecutorClient:
    """Calls to one executor instance (``instance_id``: the process the front handshook with;
    empty until `info` learns it, for a client that makes the handshake)."""

    def __init__(
        self,
        address: str,
        instance_id: str,
        timeout_s: float | None = 60.0,
        token: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        self.address = address
        self.instance_id = instance_id
        self.timeout_s = timeout_s
        self.channel = aio_client_channel(address, CHANNEL_OPTIONS, tls_ca)
        self.stub = pb_grpc.ExecutorStub(self.channel)
        self.metadata = bearer_metadata(token)
        self._stream: Any | None = None
        # Filled by `info`: the executor's identity, next to the capacity handshake.
        self.executor_id: str | None = None
        self.version: str | None = None

    @classmethod
    def from_spec(cls, spec: ClientSpec, address: str, instance_id: str = "") -> AioExecutorClient:
        """The client ``spec`` describes (the one the front's processes share), for one instance."""
        return cls(address, instance_id, spec.timeout_s, spec.token, spec.tls_ca)

    async def submit(self, plan: StepPlan, early_results: bool = False) -> AioPendingStep:
        """Sends a step now; read its answers with ``.result()``, in order. ``early_results``: a
        multi-step plan's first-pass-only requests come in an answer of their own before its result."""
        request = step_codec.plan_to_proto(plan)
        request.executor_instance_id = self.instance_id  # NOTE: a restarted process refuses it
        request.early_results = early_results and plan.has_first_pass_only
        if self._stream is None:
            self._stream = self.stub.StepStream(metadata=self.metadata)
        stream = self._stream
        try:
            await stream.write(request)
        except grpc.aio.AioRpcError as exc:
            self.close_stream(stream)
            raise ExecutorError.from_rpc_error(exc) from None
        except asyncio.InvalidStateError:  # the stream ended meanwhile (its reader saw why)
            self.close_stream(stream)
            raise ExecutorError("UNAVAILABLE", "the executor closed the step stream") from None
        except asyncio.CancelledError as exc:
            raise _closed_under(self, stream, exc) from None
        return AioPendingStep(self, stream)

    async def step(self, plan: StepPlan) -> StepResult:
        return await (await self.submit(plan)).result()

    async def info(self, timeout_s: float | None = None) -> ExecutorInfo:
        """The capacity handshake: waits (up to ``timeout_s``, else the client's) for an executor
        that is still starting; from then on steps go to the process that answered."""
        msg = await self._call(self.stub.Info, pb.InfoRequest(), timeout_s, wait_for_ready=True)
        self.executor_id, self.version, self.instance_id = msg.executor_id, msg.version, msg.instance_id
        return step_codec.info_from_proto(msg)

    async def start_profile(self) -> str:
        """Starts profiling the executor's steps; returns where its trace will be written."""
        return str((await self._call(self.stub.StartProfile, pb.StartProfileRequest())).profile_dir)

    async def stop_profile(self) -> list[str]:
        """Ends the profile; returns the files the executor wrote (paths on its machine)."""
        reply = await self._call(self.stub.StopProfile, pb.StopProfileRequest(), PROFILE_EXPORT_TIMEOUT_S)
        return list(reply.trace_files)

    async def _call(
        self, method: Any, request: Any, timeout_s: float | None = None, wait_for_ready: bool = False
    ) -> Any:
        try:
            return await method(
                request,
                timeout=timeout_s or self.timeout_s,
                wait_for_ready=wait_for_ready,
                metadata=self.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            raise ExecutorError.from_rpc_error(exc) from None

    async def health(self) -> bool:
        """True when the executor answers and serves, as the process the front handshook with
        (asked after a failed step: was it gone?); False when it is unreachable, stopping, or
        another process (a restart on the same address, which holds none of the requests)."""
        try:
            response = await self._call(self.stub.Health, pb.HealthRequest(), HEALTH_CHECK_TIMEOUT_S)
        except (ExecutorError, grpc.aio.UsageError):  # the second: a closed channel
            return False
        ours, theirs = self.instance_id, response.instance_id  # NOTE: empty on either side: any process
        return response.serving and (not ours or not theirs or theirs == ours)

    def close_stream(self, stream: Any) -> None:
        """Ends ``stream`` if it is still the open one: the next step opens another."""
        if self._stream is stream and stream is not None:
            self._stream = None
            stream.cancel()

    async def close(self) -> None:
        self.close_stream(self._stream)
        await self.channel.close(grace=None)
