"""The executor's gRPC server: one ModelRunner behind the `npuserve.executor.v1.Executor` service.

Each RPC decodes its message, calls the runner and encodes the answer (`ExecutorServicer`); a
`StepStream` does so as a pipeline (`step_stream`), so that a step sent while the one before it
ran starts as that one ends. A single lock keeps steps from overlapping, whichever RPC (unary
`Step` or a `StepStream`) brings them. One interceptor (`StatusInterceptor`) turns exceptions
into status codes: a plan the runner refuses is INVALID_ARGUMENT, anything else INTERNAL, and
the process keeps serving either way.
With a cluster token, `TokenInterceptor` (`npuserve.proto.auth`) runs first and ends every call but
`Health` that does not present the token as UNAUTHENTICATED; with ``--tls-cert``/``--tls-key`` the
port is TLS. A non-loopback ``--host`` without a token refuses to start (``--allow-unauthenticated``).

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
import queue
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import grpc
import structlog

from npuserve.deploy.gc_heap import settle_heap_for_serving
from npuserve.deploy.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S, Shutdown
from npuserve.executor.config import ConfigError, ExecutorConfig
from npuserve.executor.cpu_threads import AUTO_CPU_THREADS, choose_cpu_threads
from npuserve.executor.input_batch import PlanError
from npuserve.executor.model_runner import ModelRunner
from npuserve.executor.registration import ExecutorRegistration, RegistryConfig
from npuserve.executor.step_profiler import ProfilerStateError, ProfilingDisabled, StepProfiler
from npuserve.executor.step_stream import StepStreamPipeline
from npuserve.executor.warmup import warm_up
from npuserve.proto import executor_pb2 as pb
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto import step_codec
from npuserve.proto.auth import CLUSTER_TOKEN, TokenInterceptor
from npuserve.proto.channel import MAX_STEP_MESSAGE_BYTES, bind_target, message_size_options
from npuserve.proto.ready_file import write_ready_file
from npuserve.proto.registry_record import registration_record
from npuserve.proto.step_codec import CodecError
from npuserve.proto.step_plan import ExecutorInfo, FirstPassAnswer, JoiningSteps, StepPlan, StepResult

if TYPE_CHECKING:
    from npuserve.executor.parallel import ParallelConfig

log = structlog.get_logger(__name__)

SERVER_OPTIONS = [
    *message_size_options(MAX_STEP_MESSAGE_BYTES),
    # NOTE: gRPC sets SO_REUSEPORT by default, which lets a second executor bind a port that is
    # already served and silently share its traffic; a busy port must fail the bind instead.
    ("grpc.so_reuseport", 0),
]
STOP_GRACE_S = 5.0
# Steps are serialised by a lock, so a few threads suffice: one per open StepStream, plus
# Info/Health answered while a step runs.
NUM_WORKER_THREADS = 8
# Exceptions that mean "the plan is wrong", not "the executor is broken".
INVALID_PLAN_ERRORS = (PlanError, CodecError)


class ExecutorStopping(RuntimeError):
    """A step that arrived after shutdown began (UNAVAILABLE: the executor state is unchanged)."""


class ExecutorRestarted(ExecutorStopping):
    """A plan addressed to an earlier instance of this executor (UNAVAILABLE: reconnect)."""


class StaleStep(RuntimeError):
    """A plan older than one of the same scheduler already run (FAILED_PRECONDITION; the state is
    unchanged): a step of a stream that broke, still queued here after the scheduler went on
    over a new stream. Run then, it would advance requests that the scheduler has sent again
    whole since."""


class StepRunner(Protocol):
    """What the server needs of a runner (`ModelRunner` in production)."""

    def info(self) -> ExecutorInfo: ...

    def execute(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult: ...

    @property
    def num_requests(self) -> int:
        """Requests whose state the runner holds (a failed step drops the plan's requests)."""
        ...


# --------------------------------------------------------------------------------------------
# The servicer
# --------------------------------------------------------------------------------------------


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Decode, call the runner, encode. Owns the lock that keeps steps from overlapping.

    With profiling enabled, steps and the profiler's start and stop run on one thread of their
    own (torch's profiler records the thread that starts it); otherwise on the RPC's thread.
    """

    def __init__(
        self,
        runner: StepRunner,
        executor_id: str,
        version: str,
        profiler: StepProfiler | None = None,
        *,
        pipelined_streams: bool = True,
    ) -> None:
        self._runner = runner
        self.instance_id = uuid.uuid4().hex
        self._info = step_codec.info_to_proto(runner.info(), executor_id, version)
        self._info.instance_id = self.instance_id
        # NOTE: a step joins another's passes only on a pipelined stream (`step_stream`).
        self._info.joins_steps = self._info.joins_steps and pipelined_streams
        self._step_lock = threading.Lock()
        self._last_step_id: int | None = None
        self._last_session = 0  # the scheduler that sent that step (`StepPlan.session`)
        self._streams: set[grpc.ServicerContext] = set()  # open StepStream calls
        # A StepStream's steps read, run and answered on threads of their own (`step_stream`).
        self._pipelined_streams = pipelined_streams
        self._profiler = profiler or StepProfiler(None, "cpu", executor_id)  # off
        self._step_thread = (
            futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
            if self._profiler.enabled
            else None
        )
        # Runs the steps whose first-pass answer goes out before they end (`early_results`) of a
        # StepStream that is not pipelined.
        self._answering = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="executor-answer")
        self.serving = True  # steps accepted
        self.draining = False  # Health says not serving, steps go on

    def _on_step_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._step_thread is None:
            return fn(*args)
        return self._step_thread.submit(fn, *args).result()

    def StartProfile(
        self, request: pb.StartProfileRequest, context: grpc.ServicerContext
    ) -> pb.StartProfileResponse:
        with self._step_lock:
            profile_dir = self._on_step_thread(self._profiler.start)
        return pb.StartProfileResponse(profile_dir=str(profile_dir))

    def StopProfile(
        self, request: pb.StopProfileRequest, context: grpc.ServicerContext
    ) -> pb.StopProfileResponse:
        with self._step_lock:
            files = self._on_step_thread(self._profiler.stop)
        return pb.StopProfileResponse(trace_files=[str(f) for f in files])

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.ExecutorInfo:
        if self.draining:  # NOTE: no scheduler may start on an executor that is on its way out
            raise ExecutorStopping("the executor is draining; it takes no new scheduler")
        return self._info

    def Step(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        return self._step(request)

    def StepStream(
        self, request_iterator: Iterator[pb.StepRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StepResponse]:
        self._streams.add(context)
        try:
            if self._pipelined_streams:
                pipeline = StepStreamPipeline(request_iterator, self._read, self._run, self._answer)
                try:
                    yield from pipeline.answers()
                finally:
                    pipeline.close()
                return
            for request in request_iterator:
                if request.early_results:
                    yield from self._step_answers(request)
                else:
                    yield self._step(request)
        finally:
            self._streams.discard(context)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return pb.HealthResponse(
            serving=self.serving and not self.draining,
            executor_id=self._info.executor_id,
            last_step_id=self._last_step_id,
            instance_id=self.instance_id,
        )

    def start_draining(self) -> None:
        """Health says not serving, `Info` refuses new schedulers; steps go on."""
        self.draining = True

    @property
    def num_held_requests(self) -> int:
        """Requests whose state this executor holds (a drained executor holds none)."""
        return self._runner.num_requests

    def shut_down(self) -> None:
        """Refuses further steps and ends every open stream once the step in flight is done.

        NOTE: without this an idle StepStream would hold the server for its whole stop grace.
        """
        self.serving = False
        with self._step_lock:
            for context in list(self._streams):
                context.cancel()
            if self._profiler.running:
                self._on_step_thread(self._profiler.stop)  # keep what was recorded
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
        self._answering.shutdown(wait=True)

    def _step_answers(self, request: pb.StepRequest) -> Iterator[pb.StepResponse]:
        """A step's early answer (`early_results`), sent while its later passes run, then its result."""
        answers: queue.SimpleQueue[pb.StepResponse | None] = queue.SimpleQueue()

        def answer_early(early: StepResult) -> None:
            answers.put(self._answer(early))  # NOTE: encoded as every answer is, as the pipeline does

        final = self._answering.submit(self._step, request, answer_early)
        final.add_done_callback(lambda _: answers.put(None))
        while (answer := answers.get()) is not None:
            yield answer
        yield final.result()

    def _step(self, request: pb.StepRequest, on_first_pass: FirstPassAnswer | None = None) -> pb.StepResponse:
        plan, _ = self._read(request)
        return self._answer(self._run(plan, on_first_pass))

    def _read(self, request: pb.StepRequest) -> tuple[StepPlan, bool]:
        """A step's plan, and whether its first pass is answered early (`early_results`)."""
        if request.executor_instance_id and request.executor_instance_id != self.instance_id:
            raise ExecutorRestarted(
                "this executor restarted and holds none of the scheduler's requests; reconnect"
            )
        return step_codec.plan_from_proto(request), request.early_results

    def _run(
        self,
        plan: StepPlan,
        on_first_pass: FirstPassAnswer | None = None,
        joining: JoiningSteps | None = None,
    ) -> StepResult:
        """Runs a step under the step lock; ``joining`` (a pipelined stream's, where the runner
        `joins_steps`): the steps that may join its passes, each logged and recorded as run."""
        joins = None
        if joining is not None and plan.num_steps and self._info.joins_steps:  # NOTE: passes to join
            joins = _RecordedJoins(self, joining)
        with self._step_lock:
            if not self.serving:
                raise ExecutorStopping("the executor is shutting down; send the step to another")
            last = self._last_step_id
            if (
                plan.session
                and plan.session == self._last_session
                and last is not None
                and plan.step_id < last
            ):
                raise StaleStep(
                    f"step {plan.step_id} is older than step {last} of its scheduler, which ran; not run"
                )
            result = self._on_step_thread(self._runner.execute, plan, on_first_pass, joins)
            self._ran(plan, result)
        return result

    def _ran(self, plan: StepPlan, result: StepResult) -> None:
        """Records a step as run (the stale-step check's reference) and logs it."""
        if (
            plan.session != self._last_session
            or self._last_step_id is None
            or plan.step_id > self._last_step_id
        ):
            self._last_step_id, self._last_session = plan.step_id, plan.session
        t = result.timings
        log.debug(
            "step",
            step_id=plan.step_id,
            joined=plan.joins_running,
            num_reqs=len(plan.num_scheduled_tokens),
            num_tokens=plan.total_num_scheduled_tokens,
            num_sampled=len(result.sampled_token_ids),
            prepare_s=t.prepare_s,
            forward_s=t.forward_s,
            sample_s=t.sample_s,
            total_s=t.total_s,
        )

    def _answer(self, result: StepResult) -> pb.StepResponse:
        response = step_codec.result_to_proto(result)
        response.draining = self.draining
        return response


class _RecordedJoins:
    """A stream's joining steps as the servicer hands them to its runner: each one joined is
    recorded as run (it is newer than the step it joined) when its answer goes out. None is
    stale: it came after the running step on that step's own stream."""

    def __init__(self, servicer: ExecutorServicer, joining: JoiningSteps) -> None:
        self._servicer, self._joining = servicer, joining
        self._plans: dict[int, StepPlan] = {}

    def take(self, max_tokens: int) -> StepPlan | None:
        plan = self._joining.take(max_tokens)
        if plan is not None:
            self._plans[plan.step_id] = plan
        return plan

    def answer(self, result: StepResult) -> None:
        self._servicer._ran(self._plans.pop(result.step_id), result)
        self._joining.answer(result)


# --------------------------------------------------------------------------------------------
# Exceptions -> status codes, in one place
# --------------------------------------------------------------------------------------------


class StatusInterceptor(grpc.ServerInterceptor):
    """Wraps every handler so an exception becomes a status code instead of a dead stream/process.

    `PlanError`/`CodecError` -> INVALID_ARGUMENT with the message (the runner has already dropped
    the plan's requests); `ExecutorStopping` -> UNAVAILABLE; anything else -> INTERNAL with the
    exception's type and text.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        codecs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard_unary(handler.unary_unary, method), **codecs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard_stream(handler.unary_stream, method), **codecs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_guard_unary(handler.stream_unary, method), **codecs)
        return grpc.stream_stream_rpc_method_handler(_guard_stream(handler.stream_stream, method), **codecs)


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


def _abort(context: grpc.ServicerContext, method: str, exc: Exception) -> NoReturn:
    """Ends the RPC with the status for `exc` (`context.abort` raises)."""
    if isinstance(exc, INVALID_PLAN_ERRORS):
        log.warning("plan refused", method=method, error=str(exc))
        code, details = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    elif isinstance(exc, ExecutorStopping):
        code, details = grpc.StatusCode.UNAVAILABLE, str(exc)
    elif isinstance(exc, ProfilingDisabled):
        code, details = grpc.StatusCode.UNIMPLEMENTED, str(exc)
    elif isinstance(exc, (ProfilerStateError, StaleStep)):
        code, details = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    else:
        log.error("rpc failed", method=method, exc_info=exc)
        code, details = grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
    context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


# --------------------------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------------------------


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


def npuserve_version() -> str:
    try:
        return importlib.metadata.version("npuserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def start_executor_server(
    runner: StepRunner,
    host: str,
    port: int,
    executor_id: str | None = None,
    *,
    cluster_token: str | None = None,
    tls: tuple[bytes, bytes] | None = None,
    profile_dir: Path | None = None,
    pipelined_streams: bool = True,
) -> RunningExecutor:
    """Binds `host:port` (port 0: a free one) and starts serving `runner` on worker threads.

    ``cluster_token``: refuse calls that do not present it; ``tls``: (private key, certificate
    chain) in PEM, to serve over TLS; ``profile_dir``: allow profiles, written there;
    ``pipelined_streams``: run each StepStream's steps as a pipeline (`step_stream`), as an
    executor process does (False: in the call's handler, one step at a time).
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
    version = npuserve_version()
    info = runner.info()
    profiler = StepProfiler(profile_dir, info.device, executor_id)
    servicer = ExecutorServicer(runner, executor_id, version, profiler, pipelined_streams=pipelined_streams)
    pb_grpc.add_ExecutorServicer_to_server(servicer, server)
    server.start()
    return RunningExecutor(server, servicer, bound, _connect_address(host, bound), executor_id, version, info)


def _bind(
    server: grpc.Server, host: str, port: int, credentials: grpc.ServerCredentials | None = None
) -> int:
    target = bind_target(host, port)
    cause: RuntimeError | None = None
    try:
        if credentials is not None:
            bound = server.add_secure_port(target, credentials)
        else:
            bound = server.add_insecure_port(target)
    except RuntimeError as exc:
        bound, cause = 0, exc
    if bound == 0:
        raise ConfigError(
            f"cannot listen on {target} ({cause or 'bind failed'}): another process may hold the "
            "port; choose another --port (0 picks a free one) or --host"
        )
    return bound


def _connect_address(host: str, port: int) -> str:
    wildcard_or_local = {"", "0.0.0.0", "::", "[::]", "localhost", "127.0.0.1"}
    return f"127.0.0.1:{port}" if host in wildcard_or_local else f"{host}:{port}"


def write_executor_ready_file(path: Path, running: RunningExecutor) -> None:
    """Writes the address and handshake as JSON, atomically (temp file + rename)."""
    payload = {
        "address": running.address,
        "pid": os.getpid(),
        "executor_id": running.executor_id,
        "version": running.version,
        "info": dataclasses.asdict(running.info),
    }
    write_ready_file(path, payload)


def _advertised(host: str, running: RunningExecutor, registry: RegistryConfig) -> str:
    """Where the scheduler connects: ``--advertise-address``, else the bound address (the host
    name when bound to every interface, since 127.0.0.1 means nothing to another machine)."""
    if registry.advertise_address:
        return registry.advertise_address
    if host in ("", "0.0.0.0", "::", "[::]"):
        return f"{socket.gethostname()}:{running.port}"
    return running.address


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
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> None:
    """Loads the model, serves it until SIGTERM/SIGINT, drains (up to ``shutdown_timeout_s``, or
    until a second signal), then stops. Main thread only.

    With ``registry`` the executor registers once it serves, marks its record draining at the
    first signal and deregisters before it stops.
    With ``parallel.size > 1`` the runner is a tensor-parallel group (`npuserve.executor.parallel`).
    """
    leader = None
    if parallel is not None and parallel.size > 1:
        from npuserve.executor.parallel import start_tensor_parallel  # NOTE: it imports this module

        leader = start_tensor_parallel(config, parallel)
        if leader is None:  # a rank >= 1: it ran the group's steps until rank 0 stopped it
            return
    runner = leader or ModelRunner(config)
    if config.warmup:
        warm_up(runner)
    # NOTE: a tensor-parallel group's ranks would each time their share alone: it keeps torch's.
    if (
        config.cpu_threads == AUTO_CPU_THREADS
        and isinstance(runner, ModelRunner)
        and runner.device.type == "cpu"
    ):
        choose_cpu_threads(runner)
    running = start_executor_server(
        runner, host, port, executor_id, cluster_token=cluster_token, tls=tls, profile_dir=config.profile_dir
    )
    if leader is not None:  # NOTE: a lost group's rank 0 must not join a scheduler while it stops
        leader.on_lost = running.servicer.start_draining
    registration = None
    shutdown = Shutdown()
    restore_signals = shutdown.install()
    settle_heap_for_serving()  # NOTE: the model's modules and weights' Python objects are the start-up heap
    try:
        if ready_file is not None:
            write_executor_ready_file(ready_file, running)
        if registry is not None:
            record = registration_record(
                _advertised(host, running, registry),
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
