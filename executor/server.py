"""The executor's gRPC server: one ModelRunner behind the `npuserve.executor.v1.Executor` service.

`ExecutorServicer` (in `servicer`) serves each RPC: it decodes the message, calls the runner
and encodes the answer, running a `StepStream`'s steps as a pipeline under one lock. One
interceptor (`StatusInterceptor`, in `rpc_status`) turns exceptions into status codes: a plan the
runner refuses is INVALID_ARGUMENT, anything else INTERNAL, and the process keeps serving either way.
With a cluster token, `TokenInterceptor` (`npuserve.proto.auth`) runs first and ends every call but
`Health` that does not present the token as UNAUTHENTICATED (`ReadBlocks`, another executor's
pull of KV blocks, included); with ``--tls-cert``/``--tls-key`` the port is TLS. The executor's
own pulls (`kv_transfer`) present the same token, and over TLS trust its own certificate chain. A non-loopback ``--host`` without a token refuses to start (``--allow-unauthenticated``).

`serve_executor` is the process entry: it builds the runner (model load and KV sizing fail here,
as ConfigError or PlatformError, before anything is served), binds, writes the ready file, and
serves until SIGTERM or SIGINT; with ``--registry`` it registers in Redis meanwhile
(`registration`). `npuserve executor` runs it (its flags: `npuserve.deploy.executor_flags`).

SIGTERM drains: Health answers not serving, every step's answer says it drains and a registered
executor marks its record draining (the scheduler stops routing new requests to it; `Info`
refuses a new scheduler), and steps go on until the requests it holds are done
or ``--shutdown-timeout`` passes (then steps get UNAVAILABLE and the scheduler moves what is left
to other executors); a second signal stops at once. Each process start has its own
``instance_id``: a plan addressed to another instance (a scheduler that handshook with this
address before a restart) is refused as UNAVAILABLE, so that scheduler reconnects with a fresh
block pool instead of trusting a KV cache this process never wrote.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import socket
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog

from npuserve.deploy.runtime.gc_heap import settle_heap_for_serving
from npuserve.deploy.runtime.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, Shutdown
from npuserve.executor.config import ConfigError, ExecutorConfig
from npuserve.executor.cpu_threads import AUTO_CPU_THREADS, choose_cpu_threads
from npuserve.executor.kv_transfer import ReadBlocksClient
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.registration import ExecutorRegistration, RegistryConfig
from npuserve.executor.rpc_status import StatusInterceptor
from npuserve.executor.servicer import ExecutorServicer, StepRunner
from npuserve.executor.step_profiler import StepClock, StepProfiler
from npuserve.executor.warmup import warm_up
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto.auth import CLUSTER_TOKEN, TokenInterceptor
from npuserve.proto.channel import MAX_STEP_MESSAGE_BYTES, bind_target, message_size_options
from npuserve.proto.ready_file import write_ready_file
from npuserve.proto.registry_record import registration_record
from npuserve.proto.step_plan import ExecutorInfo

if TYPE_CHECKING:
    from npuserve.executor.parallel import StartRanks
    from npuserve.executor.parallel_config import ParallelConfig

log = structlog.get_logger(__name__)

SERVER_OPTIONS = [
    *message_size_options(MAX_STEP_MESSAGE_BYTES),
    # NOTE: gRPC sets SO_REUSEPORT by default, which lets a second executor bind a port that is
    # already served and silently share its traffic; a busy port must fail the bind instead.
    ("grpc.so_reuseport", 0),
]
STOP_GRACE_S = 5.0
# Hosts that bind every interface: the executor is reached there by another name.
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
# Steps are serialised by a lock, so a few threads suffice: one per open StepStream, plus
# Info/Health answered while a step runs.
NUM_WORKER_THREADS = 8


@dataclass
class RunningExecutor:
    """A started server: where it listens and how to stop it."""

    server: grpc.Server
    servicer: ExecutorServicer
    port: int
    address: str  # host:port a client on this machine connects to
    executor_id: str
    version: str
    info: ExecutorInfo

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Refuses new calls, ends open streams after the current step, waits up to `grace_s`."""
        stopped = self.server.stop(grace_s)
        self.servicer.shut_down()
        stopped.wait()


def start_executor_server(
    runner: StepRunner,
    host: str,
    port: int,
    executor_id: str | None = None,
    *,
    cluster_token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    profile_dir: Path | None = None,
    step_clock: StepClock | None = None,
) -> RunningExecutor:
    """Binds `host:port` (port 0: a free one) and starts serving `runner` on worker threads.

    ``cluster_token``: refuse calls that do not present it; ``tls``: (private key, certificate
    chain) in PEM, to serve over TLS; ``profile_dir``: allow profiles, written there; ``step_clock``: the runner's, synchronized with
    the device while a profile runs (`StepClock`).
    """
    interceptors: list[grpc.ServerInterceptor] = [StatusInterceptor()]
    if cluster_token:
        interceptors.insert(0, TokenInterceptor(CLUSTER_TOKEN, cluster_token))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=NUM_WORKER_THREADS, thread_name_prefix="executor-rpc"),
        interceptors=interceptors,
        options=SERVER_OPTIONS,
    )
    credentials = grpc.ssl_server_credentials([tls]) if tls is not None else None
    bound = _bind(server, host, port, credentials)
    executor_id = executor_id or f"{socket.gethostname()}:{bound}"
    try:
        version = importlib.metadata.version("npuserve")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    info = runner.info()
    profiler = StepProfiler(profile_dir, info.device, executor_id, step_clock)
    servicer = ExecutorServicer(runner, executor_id, version, profiler)
    pb_grpc.add_ExecutorServicer_to_server(servicer, server)
    server.start()
    local = host in (*WILDCARD_HOSTS, "localhost", "127.0.0.1")
    address = f"127.0.0.1:{bound}" if local else bind_target(host, bound)
    return RunningExecutor(server, servicer, bound, address, executor_id, version, info)


def _bind(server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    target = bind_target(host, port)
    cause: RuntimeError | None = None
    try:
        bound = (
            server.add_secure_port(target, credentials) if credentials else server.add_insecure_port(target)
        )
    except RuntimeError as exc:
        bound, cause = 0, exc
    if bound == 0:
        raise ConfigError(
            f"cannot listen on {target} ({cause or 'bind failed'}): another process may hold the "
            "port; choose another --port (0 picks a free one) or --host"
        )
    return bound


def drain_executor(
    running: RunningExecutor,
    registration: ExecutorRegistration | None,
    shutdown: Shutdown,
    timeout_s: float,
) -> None:
    """Readiness off and, when registered, the record marked draining (the scheduler routes no new
    request here); then steps go on until no request is held, ``timeout_s`` passes or a second
    signal comes."""
    servicer = running.servicer
    servicer.start_draining()
    if registration is not None:
        registration.drain()
    log.info("executor draining", requests=servicer.num_held_requests, timeout_s=timeout_s)
    drained = shutdown.drain_until(lambda: servicer.num_held_requests == 0, timeout_s)
    log.info(
        "executor stopping",
        drained=drained,
        requests_left=servicer.num_held_requests,
        second_signal=shutdown.now.is_set(),
    )


def serve_executor(
    config: ExecutorConfig,
    host: str,
    port: int,
    ready_file: Path | None,
    executor_id: str | None,
    *,
    cluster_token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    registry: RegistryConfig | None = None,
    parallel: ParallelConfig | None = None,
    start_ranks: StartRanks | None = None,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> None:
    """Loads the model, serves it until SIGTERM/SIGINT, drains (up to ``shutdown_timeout_s``, or
    until a second signal), then stops. Main thread only.

    With ``registry`` the executor registers once it serves, marks its record draining at the
    first signal and deregisters before it stops.
    With ``parallel.size > 1`` the runner is a tensor-parallel group (`npuserve.executor.parallel`);
    rank 0 of a single-node group starts the other ranks with ``start_ranks``.
    """
    leader = None
    if parallel is not None and parallel.size > 1:
        from npuserve.executor.parallel import start_tensor_parallel  # NOTE: only a group loads it

        leader = start_tensor_parallel(config, parallel, start_ranks)  # NOTE: ranks >= 1 end in it
    model_runner = leader.runner if leader is not None else ModelRunner(config)
    # NOTE: the chain's certificates are the roots it trusts: its peers serve the same certificate.
    model_runner.kv_puller.client = ReadBlocksClient(cluster_token, tls[1] if tls is not None else None)
    runner = leader or model_runner
    if config.warmup:
        warm_up(runner)
    # NOTE: a tensor-parallel group's ranks would each time their share alone: it keeps torch's.
    if leader is None and config.cpu_threads == AUTO_CPU_THREADS and model_runner.device.type == "cpu":
        choose_cpu_threads(model_runner)
    running = start_executor_server(
        runner,
        host,
        port,
        executor_id,
        cluster_token=cluster_token,
        tls=tls,
        profile_dir=config.profile_dir,
        step_clock=model_runner.step_clock,
    )
    if leader is not None:  # NOTE: a lost group's rank 0 must not join a scheduler while it stops
        leader.on_lost = running.servicer.start_draining
    registration = None
    shutdown = Shutdown()
    restore_signals = shutdown.install()
    settle_heap_for_serving()  # NOTE: the model's modules and weights' Python objects are the start-up heap
    try:
        if ready_file is not None:  # the address and handshake
            ready = {
                "address": running.address,
                "pid": os.getpid(),
                "executor_id": running.executor_id,
                "version": running.version,
                "info": dataclasses.asdict(running.info),
            }
            write_ready_file(ready_file, ready)
        if registry is not None:
            # Where the scheduler connects: the host name when bound to every interface (127.0.0.1
            # means nothing to another machine).
            wildcard = host in WILDCARD_HOSTS
            advertised = f"{socket.gethostname()}:{running.port}" if wildcard else running.address
            record = registration_record(
                registry.advertise_address or advertised,
                running.executor_id,
                running.info,
                running.version,
                registry.ttl_s,
                instance_id=running.servicer.instance_id,
            )
            registration = ExecutorRegistration(registry, record)
            registration.start()
        if not cluster_token:
            log.warning("no --cluster-token: any client that reaches this port can drive the executor")
        log.info(
            "executor serving",
            address=running.address,
            executor_id=running.executor_id,
            model=running.info.model,
            device=running.info.device,
            dtype=running.info.dtype,
            num_blocks=running.info.num_blocks,
            block_size=running.info.block_size,
            tls=tls is not None,
        )
        shutdown.wait_for_drain()
        drain_executor(running, registration, shutdown, shutdown_timeout_s)
    finally:
        if registration is not None:
            registration.stop()  # first: the scheduler stops sending work here
        running.stop(0.0 if shutdown.now.is_set() else STOP_GRACE_S)
        restore_signals()
        if leader is not None:
            leader.close()  # stops the other ranks; SystemExit(1) if the group was lost
    log.info("executor stopped")
