"""The executor's gRPC servicer: decode each RPC's message, call the runner, encode the answer.

`ExecutorServicer` implements the `npuserve.executor.v1.Executor` service over a `StepRunner`
(`ModelRunner` in production). A `StepStream` runs as a pipeline (`step_stream`), so that a step
sent while the one before it ran starts as that one ends; a single lock keeps steps from
overlapping, whichever of the scheduler's streams brings them. The servicer refuses a
plan addressed to another instance of the executor, a plan older than one of the same scheduler
already run, and any step once it shuts down (`rpc_status` turns those into status codes).
`ReadBlocks` serves another executor's pull of this one's KV blocks (`kv_transfer`) beside the
steps, not between them; it refuses a puller of another tensor-parallel size.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc
import structlog

from npuserve.executor.input_batch import PlanError
from npuserve.executor.rpc_status import ExecutorRestarted, ExecutorStopping, NoKvBlocks, StaleStep
from npuserve.executor.step_profiler import StepProfiler
from npuserve.executor.step_stream import StepStreamPipeline
from npuserve.proto import executor_pb2 as pb
from npuserve.proto import executor_pb2_grpc as pb_grpc
from npuserve.proto import step_codec
from npuserve.proto.step_plan import (
    FirstPassAnswer,
    JoiningSteps,
    PlanRunner,
    StepPlan,
    StepResult,
)

log = structlog.get_logger(__name__)


class StepRunner(PlanRunner, Protocol):
    """What the server needs of a runner (`ModelRunner` in production)."""

    @property
    def num_requests(self) -> int:
        """Requests whose state the runner holds (a failed step drops the plan's requests)."""


class ExecutorServicer(pb_grpc.ExecutorServicer):
    """Decode, call the runner, encode. Owns the lock that keeps steps from overlapping.

    With profiling enabled, steps and the profiler's start and stop run on one thread of their
    own (torch's profiler records the thread that starts it); otherwise on the RPC's thread.
    """

    def __init__(self, runner: StepRunner, executor_id: str, version: str, profiler: StepProfiler) -> None:
        self._runner = runner
        self.instance_id = uuid.uuid4().hex
        self._info = step_codec.info_to_proto(runner.info(), executor_id, version)
        self._info.instance_id = self.instance_id
        self._step_lock = threading.Lock()
        self._last_step_id: int | None = None
        self._last_session = 0  # the scheduler that sent that step (`StepPlan.session`)
        self._streams: set[grpc.ServicerContext] = set()  # open StepStream calls
        self._profiler = profiler
        self._step_thread = (
            futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-step")
            if self._profiler.enabled
            else None
        )
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

    def StepStream(
        self, request_iterator: Iterator[pb.StepRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.StepResponse]:
        self._streams.add(context)
        pipeline = StepStreamPipeline(request_iterator, self._read, self._run, self._answer)
        try:
            yield from pipeline.answers()
        finally:
            pipeline.close()
            self._streams.discard(context)

    def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.BlockChunk]:
        """The blocks another executor pulls, read beside this executor's steps (`kv_transfer`
        says why no step waits for a read). A draining executor still serves reads (its blocks
        may be what another executor's requests continue from)."""
        if request.instance_id and request.instance_id != self.instance_id:
            raise ExecutorRestarted("this executor restarted and holds none of the blocks asked for")
        asked, own = request.tensor_parallel_size or 1, self._info.tensor_parallel_size or 1
        if asked != own:
            raise PlanError(
                f"a pull by an executor of tensor-parallel size {asked} from one of size {own}: KV "
                "blocks move only between executors of the same --tensor-parallel-size (each rank "
                "holds its share of every block's KV heads)"
            )
        read_blocks = getattr(self._runner, "read_blocks", None)
        if read_blocks is None:
            raise NoKvBlocks("this executor has no KV cache to read blocks of")
        chunks = read_blocks(request.block_ids[:])  # NOTE: checks the ids (PlanError), reads nothing yet
        for chunk in chunks:
            if not self.serving:
                raise ExecutorStopping("the executor is shutting down")
            yield chunk

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
