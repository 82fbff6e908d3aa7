"""A scheduler worker process: the step loops of some executors, away from the front's GIL.

The front (the process serving the public API) hands each worker some executors. For each, the
worker runs an `AsyncExecutorLane` (its own `Scheduler` and block pool, and its own gRPC client
for the steps), the logic of an `ExecutorLane` in the front, all on one event loop: its lanes,
their grpc.aio streams and the pipe to the front share one thread, so a step costs no thread
wake-ups (a thread per lane, each with gRPC's threads behind it, spent most of a step's CPU
handing the GIL around). The worker never chooses where requests go and never talks to clients:
it applies the front's commands and reports what every step produced.

Wire, both ways over one `multiprocessing` pipe (`pipe_link`), each message a list (a batch):
  front -> worker: ("add", lane_key, executor_id, address, info, instance_id)
                   | ("submit", lane_key, [Request])
                   | ("finish", lane_key, [req_id], RequestStatus) | ("down", lane_key, reason)
                   | ("stop", lane_key) | ("call", call_id, lane_key, fn) | ("exit",)
  worker -> front: ("started",), once, when its loop runs
                   | `LaneReport` | ("reply", call_id, ok, value or error text)
Everything sent in one turn of the loop leaves as one message, so a busy worker reports many
lanes' steps per message. The front acknowledges each message of reports once it has handled it
(("ack",)); while `MAX_UNACKED_REPORTS` messages wait for that, the worker's lanes start no new
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
from typing import Any

import structlog

from npuserve.deploy.runtime.gc_heap import settle_heap_for_serving
from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.core.request import Request
from npuserve.scheduler.core.scheduler import Scheduler, SchedulerConfig
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.async_lane import AsyncExecutorLane
from npuserve.scheduler.lanes.background import BackgroundTasks
from npuserve.scheduler.lanes.executor_client import ClientSpec
from npuserve.scheduler.lanes.lane import ExecutorLane, LaneEvent
from npuserve.scheduler.lanes.pipe_link import PipeLink
from npuserve.scheduler.lanes.step_frames import LaneReport, carries_reports, evacuated, make_report
from npuserve.scheduler.structured.grammar_compiler import GrammarCompiler, GrammarSettings

log = structlog.get_logger(__name__)

Message = list[Any]
STOP_LANE_TIMEOUT_S = 5.0
MAX_UNACKED_REPORTS = 4  # messages of reports the front may hold unhandled before lanes wait
ROOM_WAIT_S = 0.05  # a lane waiting for room checks its commands this often


class ReportWindow:
    """Messages of reports sent to the front and not acknowledged yet (on the worker's loop)."""

    def __init__(self, limit: int = MAX_UNACKED_REPORTS) -> None:
        self.limit = limit
        self._unacked = 0
        self._room = asyncio.Event()
        self._room.set()

    def sent(self, batch: list[Any]) -> None:
        if carries_reports(batch):
            self._unacked += 1
            if self._unacked >= self.limit:
                self._room.clear()

    def acked(self) -> None:
        self._unacked = max(0, self._unacked - 1)
        if self._unacked < self.limit:
            self._room.set()

    async def has_room(self, timeout_s: float = ROOM_WAIT_S) -> bool:
        """Waits up to ``timeout_s`` for the front to catch up; whether a lane may step now."""
        if self._unacked < self.limit:
            return True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room.wait(), timeout_s)
        return self._unacked < self.limit


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
        self.lanes: dict[str, AsyncExecutorLane] = {}
        self.window = ReportWindow()
        self._background = BackgroundTasks()

    async def run(self) -> None:
        """Serves the front's commands until it says exit or its end of the pipe closes."""
        self.done = asyncio.Event()
        self.pipe = PipeLink(
            self.conn, self._received, self._front_gone, asyncio.get_running_loop(), self.window.sent
        )
        self.pipe.start()
        settle_heap_for_serving()
        self.pipe.send(("started",))  # NOTE: its imports are done: it steps at full speed from here
        try:
            await self.done.wait()
        finally:
            await asyncio.gather(*(lane.aclose(STOP_LANE_TIMEOUT_S) for lane in self.lanes.values()))
            self.pipe.close()

    def _front_gone(self) -> None:
        log.info("the scheduler front is gone; worker exiting")
        self.done.set()

    def _received(self, message: Message) -> None:
        for command in message:
            if command[0] == "exit":
                self.done.set()
                return
            if command[0] == "ack":
                self.window.acked()
                continue
            self._apply(command)

    def _apply(self, command: tuple[Any, ...]) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
            return
        if kind == "call":
            _, call_id, lane_key, fn = command
            self._call(call_id, lane_key, fn)
            return
        lane_key = command[1]
        lane = self.lanes.get(lane_key)
        if kind == "submit":
            requests: list[Request] = command[2]
            if lane is None:  # stopped meanwhile: the front places them again
                self._report_gone(lane_key, requests)
            else:
                for request in requests:
                    self._attach_grammar(request)
                lane.submit(requests)
        elif lane is None:
            return
        elif kind == "finish":
            lane.finish(command[2], command[3])
        elif kind == "down":
            lane.take_down(command[2])
        elif kind == "stop":
            del self.lanes[lane_key]
            self._background.spawn(lane.aclose(STOP_LANE_TIMEOUT_S))

    def _attach_grammar(self, request: Request) -> None:
        """A constrained request's matcher, here, at the request's output tokens."""
        constraint = request.params.structured_outputs
        if constraint is None or self.grammars is None:
            return
        request.grammar = self.grammars.grammar_for(constraint).new_state(request.max_output_tokens)
        request.grammar.sync(request.output_token_ids)

    def _add(
        self, lane_key: str, executor_id: str, address: str, info: ExecutorInfo, instance_id: str
    ) -> None:
        # NOTE: the front's handshake named the executor's process: steps go to that one only.
        client = AioExecutorClient.from_spec(self.spec, address, instance_id)
        settings = self.settings
        scheduler = Scheduler(
            SchedulerConfig.for_executor(
                info,
                settings.enable_prefix_caching,
                settings.num_scheduler_steps,
                early_first_tokens=client.answers_early,
            )
        )
        scheduler.kv.pool.events = []  # the front mirrors the prefix cache from these

        def on_event(lane: ExecutorLane, event: LaneEvent) -> None:
            self.pipe.send(make_report(lane_key, lane, event))

        lane = AsyncExecutorLane(
            executor_id,
            client,
            scheduler,
            on_event,
            self.settings.async_scheduling,
            self.window.has_room,
            joins_steps=info.joins_steps,
        )
        self.lanes[lane_key] = lane
        lane.start()

    def _report_gone(self, lane_key: str, requests: list[Request]) -> None:
        error = f"lane {lane_key} left this scheduler worker"
        self.pipe.send(LaneReport(lane_key, evacuated=[evacuated(r) for r in requests], error=error))

    def _call(self, call_id: int, lane_key: str, fn: Callable[[Scheduler], object]) -> None:
        lane = self.lanes.get(lane_key)
        if lane is None:
            self.pipe.send(("reply", call_id, False, f"error:lane {lane_key} is not in this worker"))
            return

        def reply(future: Future[object]) -> None:
            exc = future.exception()
            if exc is None:
                self.pipe.send(("reply", call_id, True, future.result()))
            else:
                kind = "assertion" if isinstance(exc, AssertionError) else "error"
                self.pipe.send(("reply", call_id, False, f"{kind}:{exc}"))

        lane.call(fn).add_done_callback(reply)


def run_step_worker(
    conn: Connection,
    spec: ClientSpec,
    settings: LaneSettings,
    log_level: str,
    json_logs: bool,
) -> None:
    """The worker process's entry point (spawned by `StepWorkerPool`)."""
    from npuserve.deploy.runtime.event_loop import run as run_loop
    from npuserve.deploy.runtime.logs import configure_logging
    from npuserve.deploy.runtime.process_name import STEP_WORKER, set_process_name

    set_process_name(STEP_WORKER)
    configure_logging(log_level, json_logs)
    run_loop(StepWorker(conn, spec, settings).run())
