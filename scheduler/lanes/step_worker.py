"""A scheduler worker process: the step loops of some executors, away from the front's GIL.

The front (the process serving the public API) hands each worker some executors. For each, the
worker runs an `ExecutorLane` (its own `Scheduler`, block pool and gRPC client), as the front
runs its own without workers, all on one event loop beside the pipe to the front (`async_lane`
says why one thread). The worker never chooses where requests go and never talks to clients: it
applies the front's commands and reports what every step produced.

The front and the worker talk over one `multiprocessing` pipe (`pipe_link`), in batches of the
messages of `worker_messages`: `FrontToWorker` one way, `WorkerToFront` the other.
Everything sent in one turn of the loop leaves as one batch, so a busy worker reports many
lanes' steps per batch. The front acknowledges each batch of reports once it has handled it
(`AckReports`); while `MAX_UNACKED_REPORTS` messages wait for that, the worker's lanes start no new
step. That is the flow control between the two: a front that falls behind slows the steps down
(each then carries more requests) instead of letting reports pile up between the processes,
unbounded, while its clients wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

import structlog

from npuserve.deploy.runtime.gc_heap import IdleHeapRelease, settle_heap_for_serving
from npuserve.deploy.runtime.unknown_message import unknown_message
from npuserve.scheduler.core.request import Request
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.lanes import worker_messages as msg
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.async_lane import ExecutorLane
from npuserve.scheduler.lanes.background import BackgroundTasks
from npuserve.scheduler.lanes.executor_client import ClientSpec
from npuserve.scheduler.lanes.lane import LANE_CLOSE_TIMEOUT_S, LaneEvent
from npuserve.scheduler.lanes.pipe_link import PipeLink
from npuserve.scheduler.lanes.step_frames import (
    LaneReport,
    RelayProgress,
    carries_reports,
    evacuated,
    make_report,
)
from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler, GrammarSettings

log = structlog.get_logger(__name__)

MAX_UNACKED_REPORTS = 4  # messages of reports the front may hold unhandled before lanes wait
ROOM_WAIT_S = 0.05  # a lane waiting for room checks its commands this often


class ReportWindow:
    """Messages of reports sent to the front and not acknowledged yet (on the worker's loop)."""

    def __init__(self) -> None:
        self._unacked = 0
        self._room = asyncio.Event()
        self._room.set()

    def sent(self, batch: list[msg.WorkerToFront]) -> None:
        if carries_reports(batch):
            self._unacked += 1
            if self._unacked >= MAX_UNACKED_REPORTS:
                self._room.clear()

    def acked(self) -> None:
        self._unacked = max(0, self._unacked - 1)
        if self._unacked < MAX_UNACKED_REPORTS:
            self._room.set()

    async def has_room(self) -> bool:
        """Waits up to `ROOM_WAIT_S` for the front to catch up; whether a lane may step now."""
        if self._unacked < MAX_UNACKED_REPORTS:
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room.wait(), ROOM_WAIT_S)
        return self._unacked < MAX_UNACKED_REPORTS


@dataclass(frozen=True, slots=True)
class LaneSettings:
    """How a worker's lanes schedule: the engine's settings (`EngineConfig`), passed on."""

    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    grammar: GrammarSettings | None = None  # to build matchers for constrained requests
    num_scheduler_steps: int = 1  # passes per step of a sampling request (multi-step decoding)


class StepWorker:
    def __init__(self, conn: Connection, spec: ClientSpec, settings: LaneSettings) -> None:
        self.conn = conn
        self.settings = settings
        self.grammars = None if settings.grammar is None else GrammarCompiler(*settings.grammar)
        self.spec = spec
        self.lanes: dict[str, ExecutorLane] = {}
        self.window = ReportWindow()
        self._background = BackgroundTasks()
        self._heap = IdleHeapRelease(self._idle)

    async def run(self) -> None:
        """Serves the front's commands until it says exit or its end of the pipe closes."""
        self.done = asyncio.Event()
        self.pipe: PipeLink[msg.WorkerToFront, msg.FrontToWorker] = PipeLink(
            self.conn, self._received, self._front_gone, asyncio.get_running_loop(), self.window.sent
        )
        self.pipe.start()
        settle_heap_for_serving()
        self.pipe.send(msg.WorkerStarted())  # NOTE: its imports are done: it steps at full speed from here
        try:
            await self.done.wait()
        finally:
            self._heap.cancel()
            await asyncio.gather(*(lane.aclose(LANE_CLOSE_TIMEOUT_S) for lane in self.lanes.values()))
            self.pipe.close()

    def _idle(self) -> bool:
        """No lane of this worker has a step to send."""
        return not any(lane.has_work for lane in self.lanes.values())

    def _front_gone(self) -> None:
        log.info("the scheduler front is gone; worker exiting")
        self.done.set()

    def _received(self, batch: list[msg.FrontToWorker]) -> None:
        """The front's messages, in order; those for a lane this worker no longer has are dropped
        (the front retired it), but for requests, which the front places again."""
        lanes = self.lanes
        for message in batch:
            match message:
                case msg.AckReports():
                    self.window.acked()
                case msg.SubmitRequests(lane_key=lane_key, requests=requests):
                    self._submit(lane_key, requests)
                case msg.FinishRequests(lane_key=lane_key, req_ids=req_ids, status=status):
                    if (lane := lanes.get(lane_key)) is not None:
                        lane.finish(req_ids, status)
                case msg.ReleaseHeld(lane_key=lane_key, req_ids=req_ids):
                    if (lane := lanes.get(lane_key)) is not None:
                        lane.release_held(req_ids)
                case msg.StartDecode(lane_key=lane_key, prefilled=prefilled):
                    if (lane := lanes.get(lane_key)) is not None:
                        lane.start_decode(prefilled)
                case msg.TakeLaneDown(lane_key=lane_key, reason=reason):
                    if (lane := lanes.get(lane_key)) is not None:
                        lane.take_down(reason)
                case msg.OpenLane():
                    self._open_lane(message)
                case msg.StopLane(lane_key=lane_key):
                    if (lane := lanes.pop(lane_key, None)) is not None:
                        self._background.spawn(lane.aclose(LANE_CLOSE_TIMEOUT_S))
                case msg.CallLane(call_id=call_id, lane_key=lane_key, fn=fn):
                    self._call(call_id, lane_key, fn)
                case msg.ExitWorker():
                    self.done.set()
                    return
                case _:
                    unknown_message("a scheduler worker", message)

    def _submit(self, lane_key: str, requests: list[Request]) -> None:
        lane = self.lanes.get(lane_key)
        if lane is None:  # stopped meanwhile: the front places them again
            error = f"lane {lane_key} left this scheduler worker"
            self.pipe.send(LaneReport(lane_key, evacuated=[evacuated(r) for r in requests], error=error))
            return
        for request in requests:  # a constrained request's matcher, here, at its output tokens
            constraint = request.params.structured_outputs
            if constraint is not None and self.grammars is not None:
                request.grammar = self.grammars.grammar_for(constraint).new_state(request.max_output_tokens)
                request.grammar.sync(request.output_token_ids)
        lane.submit(requests)

    def _open_lane(self, command: msg.OpenLane) -> None:
        # NOTE: the front's handshake named the executor's process: steps go to that one only.
        client = AioExecutorClient.from_spec(self.spec, command.address, command.instance_id)
        lane_key, info = command.lane_key, command.info
        progress: RelayProgress = {}  # what the lane has sent of the streams API processes serve

        def on_event(lane: ExecutorLane, event: LaneEvent) -> None:
            self.pipe.send(make_report(lane_key, lane, event, progress))

        settings = self.settings
        lane = ExecutorLane.for_executor(
            command.executor_id,
            client,
            info,
            on_event,
            self.window.has_room,
            enable_prefix_caching=settings.enable_prefix_caching,
            num_scheduler_steps=settings.num_scheduler_steps,
            async_scheduling=settings.async_scheduling,
            on_idle=self._heap.work_ended,
        )
        lane.scheduler.kv.pool.events = []  # the front mirrors the prefix cache from these
        self.lanes[lane_key] = lane
        lane.start()

    def _call(self, call_id: int, lane_key: str, fn: Callable[[Scheduler], object]) -> None:
        lane = self.lanes.get(lane_key)
        if lane is None:
            self.pipe.send(msg.CallRaised(call_id, f"lane {lane_key} is not in this worker", assertion=False))
            return

        def reply(future: Future[object]) -> None:
            exc = future.exception()
            if exc is None:
                self.pipe.send(msg.CallReturned(call_id, future.result()))
            else:
                self.pipe.send(msg.CallRaised(call_id, str(exc), assertion=isinstance(exc, AssertionError)))

        lane.call(fn).add_done_callback(reply)


def run_step_worker(
    conn: Connection, spec: ClientSpec, settings: LaneSettings, log_level: str, json_logs: bool
) -> None:
    """The worker process's entry point (spawned by `StepWorkerPool`)."""
    from npuserve.deploy.runtime.event_loop import run as run_loop
    from npuserve.deploy.runtime.logs import configure_logging
    from npuserve.deploy.runtime.process_name import STEP_WORKER, set_process_name

    set_process_name(STEP_WORKER)
    configure_logging(log_level, json_logs)
    run_loop(StepWorker(conn, spec, settings).run())
