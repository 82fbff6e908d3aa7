"""The scheduler process: the public gRPC API over an engine driving remote executors.

With an API key every call but `Health` must present it (`npuserve.proto.auth`); with a
certificate and key the API is served over TLS.

`Health` is serving while at least one executor is ready, and degraded while fewer are ready
than the scheduler knows of. SIGTERM drains: new `Generate` calls get UNAVAILABLE and `Health`
answers not serving, the streams in flight finish (up to ``--shutdown-timeout``; a second signal
stops at once), the block pools' integrity is checked and logged, and the process exits.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc
import structlog

from npuserve.deploy.demo_model import default_served_name
from npuserve.deploy.runtime.gc_heap import settle_heap_for_serving
from npuserve.deploy.runtime.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, Shutdown
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto import scheduler_pb2_grpc as pb_grpc
from npuserve.proto.auth import API_KEY, AioTokenInterceptor
from npuserve.proto.channel import DEFAULT_STREAM_STALL_TIMEOUT_S
from npuserve.proto.ready_file import write_ready_file
from npuserve.scheduler.api import api_codec
from npuserve.scheduler.api.api_process import ApiProcessSettings
from npuserve.scheduler.api.api_relay import ApiProcessPool
from npuserve.scheduler.api.api_servers import start_api_servers, stop_api_servers
from npuserve.scheduler.api.api_servicer import PublicApiServicer
from npuserve.scheduler.api.api_status import guard
from npuserve.scheduler.engine.engine import Engine
from npuserve.scheduler.engine.engine_config import EngineConfig
from npuserve.scheduler.engine.membership import StaticMembership, wait_for_executors
from npuserve.scheduler.engine.registry import RedisMembership
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.executor_client import ClientSpec
from npuserve.scheduler.lanes.step_workers import StepWorkerPool
from npuserve.scheduler.service_config import (
    ServiceConfig,
    default_api_server_count,
    default_scheduler_workers,
)
from npuserve.scheduler.text.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

T = TypeVar("T")
SERVER_STOP_GRACE_S = 1.0  # after the drain: for the answers of calls other than Generate
INTEGRITY_SETTLE_S = 5.0


class SchedulerServicer(PublicApiServicer):
    """The public API served by the engine's own process (every call answered here)."""

    def __init__(
        self,
        engine: Engine,
        model_root: str,
        known_executors: Callable[[], int] | None = None,
        stream_stall_timeout_s: float = DEFAULT_STREAM_STALL_TIMEOUT_S,
    ) -> None:
        super().__init__(engine, engine.prompts, stream_stall_timeout_s=stream_stall_timeout_s)
        self.engine = engine
        self.model_root = model_root
        self.created = int(time.time())
        # How many executors the scheduler knows of, ready or not (default: its lanes).
        self.known_executors = known_executors or (lambda: len(engine.lanes))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id))

    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        model = pb.Model(
            id=self.engine.model_name,
            max_model_len=self.engine.max_model_len,
            root=self.model_root,
            created=self.created,
        )
        return pb.ListModelsResponse(models=[model])

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext) -> pb.HealthResponse:
        lanes = self.engine.live_lanes
        total = max(self.known_executors(), len(self.engine.lanes))
        ready = sum(await asyncio.gather(*(lane.client.health() for lane in lanes)))
        if self.draining:
            message = "the scheduler is shutting down"
        elif not ready:
            message = "no executor is reachable"
        elif ready < total:
            message = f"{total - ready} of {total} executors are not ready"
        else:
            message = ""
        serving = ready > 0 and not self.draining
        return pb.HealthResponse(
            serving=serving,
            ready_executors=ready,
            total_executors=total,
            message=message,
            degraded=serving and ready < total,
        )

    async def CheckIntegrity(
        self, request: pb.CheckIntegrityRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckIntegrityResponse:
        try:
            states = await self.engine.check_integrity(request.expect_idle)
        except AssertionError as exc:
            return pb.CheckIntegrityResponse(ok=False, message=str(exc))
        return pb.CheckIntegrityResponse(
            ok=True, executors=[api_codec.pool_state_to_proto(s) for s in states]
        )

    async def StartProfile(
        self, request: pb.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartProfileResponse:
        async def run() -> pb.StartProfileResponse:
            return pb.StartProfileResponse(executor_ids=await self.engine.start_profile())

        return await guard(context, run)

    async def StopProfile(
        self, request: pb.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopProfileResponse:
        async def run() -> pb.StopProfileResponse:
            traces = await self.engine.stop_profile()
            return pb.StopProfileResponse(
                executors=[pb.ExecutorProfile(executor_id=e, trace_files=f) for e, f in traces.items()]
            )

        return await guard(context, run)

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricsResponse:
        self.engine.refresh_gauges()
        return pb.GetMetricsResponse(text=self.engine.metrics.render())


async def serve_scheduler(
    config: ServiceConfig,
    host: str,
    port: int,
    ready_file: Path | None,
    log_level: str = "info",
    json_logs: bool = False,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> None:
    tokenizer = Tokenizer.from_pretrained(config.model, chat_template=config.chat_template)
    spec = ClientSpec(config.step_timeout_s, config.cluster_token, config.tls_ca)

    def make_client(address: str) -> AioExecutorClient:
        return AioExecutorClient.from_spec(spec, address)

    membership: StaticMembership | RedisMembership
    if config.registry:
        membership = RedisMembership(make_client, config.registry, config.registry_prefix)
        executors = await membership.wait_for_executors(config.connect_timeout_s)
    else:
        executors = await wait_for_executors(make_client, config.executors, config.connect_timeout_s)
        membership = StaticMembership(make_client, config.executors)
        for address, (executor_id, _, _) in zip(config.executors, executors, strict=True):
            membership.joined(address, executor_id)
    num_workers = (
        default_scheduler_workers() if config.scheduler_workers is None else config.scheduler_workers
    )
    step_workers = StepWorkerPool(num_workers, spec, log_level, json_logs) if num_workers > 0 else None
    engine = Engine(
        EngineConfig(
            served_model_name=config.served_model_name or default_served_name(config.model),
            enable_prefix_caching=config.enable_prefix_caching,
            routing=config.routing,
            routing_prefill_weight=config.routing_prefill_weight,
            max_queued_requests=config.max_queued_requests,
            max_local_prefill_length=config.max_local_prefill_length,
            trust_request_chat_template=config.trust_request_chat_template,
            async_scheduling=config.async_scheduling,
            stream_interval=config.stream_interval,
            num_scheduler_steps=config.num_scheduler_steps,
        ),
        tokenizer,
        executors,
        step_workers,
    )
    num_api = default_api_server_count() if config.api_server_count is None else config.api_server_count
    engine.start(serve_prompts=num_api == 1)
    watcher = asyncio.create_task(membership.run(engine))
    servicer = SchedulerServicer(engine, config.model, membership.num_known, config.stream_stall_timeout_s)
    api_processes: ApiProcessPool | None = None
    servers: list[grpc.aio.Server] = []
    if num_api > 1:

        def settings_for(index: int, bind_port: int) -> ApiProcessSettings:
            return ApiProcessSettings(
                index,
                num_api,
                config.model,
                config.chat_template,
                engine.limits,
                config.trust_request_chat_template,
                engine.config.stream_interval,
                config.stream_stall_timeout_s,
                host,
                bind_port,
                config.tls,
                config.api_key,
                log_level,
                json_logs,
            )

        api_processes = ApiProcessPool(num_api, engine, servicer, settings_for)
        bound = await api_processes.start(port)
    else:
        interceptors = [AioTokenInterceptor(API_KEY, config.api_key)] if config.api_key else []
        servers, bound = await start_api_servers(
            lambda server: pb_grpc.add_SchedulerServicer_to_server(servicer, server),
            interceptors,
            host,
            port,
            config.tls,
        )
    address = f"{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{bound}"
    await engine.wait_started()
    settle_heap_for_serving()
    log.info(
        "scheduler serving",
        address=address,
        executors=len(executors),
        scheduler_workers=num_workers,
        api_servers=num_api,
        model=engine.model_name,
        api_key=bool(config.api_key),
        tls=config.tls is not None,
    )
    if ready_file is not None:
        write_ready_file(ready_file, {"address": address, "pid": os.getpid(), "model": engine.model_name})
    shutdown = Shutdown()
    shutdown.install_on_loop(asyncio.get_running_loop())
    await shutdown.wait_drain_async()
    if api_processes is not None:
        api_processes.drain()
    await drain_scheduler(servicer, shutdown, shutdown_timeout_s)
    watcher.cancel()
    await stop_api_servers(servers, 0 if shutdown.now.is_set() else SERVER_STOP_GRACE_S)
    if api_processes is not None:
        await api_processes.close()
    await engine.stop()
    log.info("scheduler stopped")


async def drain_scheduler(servicer: SchedulerServicer, shutdown: Shutdown, timeout_s: float) -> None:
    """Refuses new requests and waits for the streams in flight to finish (up to ``timeout_s`` or
    a second signal); once drained, checks and logs that every block pool is whole and idle."""
    engine = servicer.engine
    servicer.drain()
    log.info("scheduler draining", requests=engine.num_active_requests, timeout_s=timeout_s)
    drained = await shutdown.drain_until_async(lambda: engine.num_active_requests == 0, timeout_s)
    if not drained:
        log.warning(
            "scheduler stopping with requests in flight",
            requests=engine.num_active_requests,
            second_signal=shutdown.now.is_set(),
        )
        return
    # NOTE: a finished request's blocks come back on its lane a moment after its stream
    # ends, and the executors learn of it in one more step; both are waited for.
    await shutdown.drain_until_async(lambda: engine.lanes_settled, INTEGRITY_SETTLE_S)
    deadline = time.monotonic() + INTEGRITY_SETTLE_S
    while True:
        try:
            states = await asyncio.wait_for(engine.check_integrity(expect_idle=True), INTEGRITY_SETTLE_S)
            break
        except (AssertionError, asyncio.TimeoutError) as exc:
            if time.monotonic() > deadline:
                log.error("block pools not intact after the drain", error=str(exc) or type(exc).__name__)
                return
            await asyncio.sleep(0.05)
    log.info("scheduler drained; block pools intact and idle", executors=len(states))
