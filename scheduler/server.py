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
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from npuserve.deploy.demo_model import default_served_name
from npuserve.deploy.runtime.gc_heap import settle_heap_for_serving
from npuserve.deploy.runtime.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, Shutdown
from npuserve.proto import scheduler_pb2 as pb
from npuserve.proto.ready_file import write_ready_file
from npuserve.scheduler.api import api_codec
from npuserve.scheduler.api.api_process import ApiProcessSettings
from npuserve.scheduler.api.api_relay import ApiProcessPool
from npuserve.scheduler.api.api_servers import serve_public_api, stop_api_servers
from npuserve.scheduler.api.api_servicer import PublicApiServicer
from npuserve.scheduler.api.api_status import guarded
from npuserve.scheduler.engine.engine import Engine
from npuserve.scheduler.engine.engine_config import EngineConfig
from npuserve.scheduler.engine.engine_probes import start_profile, stop_profile
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

SERVER_STOP_GRACE_S = 1.0  # after the drain: for the answers of calls other than Generate
INTEGRITY_SETTLE_S = 5.0


class SchedulerServicer(PublicApiServicer):
    """The public API served by the engine's own process (every call answered here)."""

    def __init__(self, engine: Engine, config: ServiceConfig, known_executors: Callable[[], int]) -> None:
        super().__init__(engine, engine.prompts, stream_stall_timeout_s=config.stream_stall_timeout_s)
        self.engine = engine
        self.model_root = config.model
        self.created = int(time.time())
        self.known_executors = known_executors  # how many executors the scheduler knows of, ready or not

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

    @guarded
    async def StartProfile(
        self, request: pb.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartProfileResponse:
        return pb.StartProfileResponse(executor_ids=await start_profile(self.engine.live_lanes))

    @guarded
    async def StopProfile(
        self, request: pb.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopProfileResponse:
        traces = await stop_profile(self.engine.live_lanes)
        return pb.StopProfileResponse(
            executors=[pb.ExecutorProfile(executor_id=e, trace_files=f) for e, f in traces.items()]
        )

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
    make_client = functools.partial(AioExecutorClient.from_spec, spec)
    membership: StaticMembership | RedisMembership
    if config.registry:
        membership = RedisMembership(make_client, config.registry, config.registry_prefix)
        executors = await membership.wait_for_executors(config.connect_timeout_s)
    else:
        executors = await wait_for_executors(make_client, config.executors, config.connect_timeout_s)
        membership = StaticMembership(make_client, config.executors, executors)
    num_workers = (
        default_scheduler_workers() if config.scheduler_workers is None else config.scheduler_workers
    )
    step_workers = StepWorkerPool(num_workers, spec, log_level, json_logs) if num_workers > 0 else None
    # NOTE: each field of the engine's config is the service config's field of the same name.
    engine_fields = {field.name: getattr(config, field.name) for field in dataclasses.fields(EngineConfig)}
    engine_fields["served_model_name"] = config.served_model_name or default_served_name(config.model)
    engine = Engine(EngineConfig(**engine_fields), tokenizer, executors, step_workers)
    num_api = default_api_server_count() if config.api_server_count is None else config.api_server_count
    engine.start(serve_prompts=num_api == 1)
    watcher = asyncio.create_task(membership.run(engine))
    servicer = SchedulerServicer(engine, config, membership.num_known)
    api_processes: ApiProcessPool | None = None
    servers: list[grpc.aio.Server] = []
    if num_api > 1:
        settings = ApiProcessSettings(0, num_api, config, engine.limits, host, port, log_level, json_logs)
        api_processes = ApiProcessPool(engine, servicer, settings)
        bound = await api_processes.start(port)
    else:
        servers, bound = await serve_public_api(servicer, config, host, port)
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
