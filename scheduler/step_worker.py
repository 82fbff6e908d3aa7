"""A scheduler worker process: the step loops of some executors, away from the front's GIL.

The front (the process serving the public API) hands each worker some executors. For each, the
worker runs an `ExecutorLane` (its own `Scheduler` and block pool, and its own gRPC client for the
steps) exactly as the front would in-process. The worker never chooses where requests go and
never talks to clients: it applies the front's commands and reports what every step produced.

Wire, both ways over one `multiprocessing` pipe, each message a list (a batch):
  front -> worker: ("add", lane_key, executor_id, address, info, instance_id)
                   | ("submit", lane_key, [Request])
                   | ("finish", lane_key, [req_id], RequestStatus) | ("down", lane_key, reason)
                   | ("stop", lane_key) | ("call", call_id, lane_key, fn) | ("exit",)
  worker -> front: `LaneReport` | ("reply", call_id, ok, value or error text)
Each side's sender thread sends everything queued since its last send as one message, so a busy
worker reports many lanes' steps per message. The front acknowledges each message of reports once
it has handled it (("ack",)); while `MAX_UNACKED_REPORTS` messages wait for that, the worker's
lanes start no new step. That is the flow control between the two: a front that falls behind
slows the steps down (each then carries more requests) instead of letting reports pile up
between the processes, unbounded, while its clients wait.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import structlog

from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.executor_client import ClientSpec
from npuserve.scheduler.lane import ExecutorLane, LaneEvent
from npuserve.scheduler.request import Request
from npuserve.scheduler.scheduler import Scheduler, SchedulerConfig
from npuserve.scheduler.step_frames import LaneReport, evacuated, make_report
from npuserve.scheduler.structured import GrammarCompiler, GrammarSettings

log = structlog.get_logger(__name__)

Message = list[Any]
STOP_LANE_TIMEOUT_S = 5.0
MAX_UNACKED_REPORTS = 4  # messages of reports the front may hold unhandled before lanes wait
ROOM_WAIT_S = 0.05  # a lane waiting for room checks its commands this often


class ReportWindow:
    """Messages of reports sent to the front and not acknowledged yet."""

    def __init__(self, limit: int = MAX_UNACKED_REPORTS) -> None:
        self.limit = limit
        self._unacked = 0
        self._changed = threading.Condition()

    def sent(self, batch: list[Any]) -> None:
        if any(isinstance(item, LaneReport) for item in batch):
            with self._changed:
                self._unacked += 1

    def acked(self) -> None:
        with self._changed:
            self._unacked = max(0, self._unacked - 1)
            self._changed.notify_all()

    def has_room(self, timeout_s: float = ROOM_WAIT_S) -> bool:
        """Waits up to ``timeout_s`` for the front to catch up; whether a lane may step now."""
        if self._unacked < self.limit:
            # NOTE: the common case, without the lock. The window is a soft bound anyway (lanes
            # that pass it at once all step); a read racing an ack just takes the lock below.
            return True
        with self._changed:
            return self._changed.wait_for(lambda: self._unacked < self.limit, timeout_s)


def send_batches(
    conn: Connection,
    outbox: queue.SimpleQueue[Any],
    on_broken: Callable[[], None],
    on_sent: Callable[[list[Any]], None] = lambda batch: None,
) -> None:
    """Sends whatever the outbox holds, as one message per wake-up; ends on None."""
    while True:
        batch = [outbox.get()]
        while not outbox.empty():  # NOTE: one consumer: what it saw there is still there
            batch.append(outbox.get_nowait())
        done = batch[-1] is None
        batch = [b for b in batch if b is not None]
        try:
            if batch:
                on_sent(batch)
                conn.send_bytes(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))  # NOTE: plain pickle: faster
        except (OSError, ValueError, EOFError):
            on_broken()
            return
        if done:
            return


@dataclass(frozen=True, slots=True)
class LaneSettings:
    """How a worker's lanes schedule: the engine's settings (`EngineConfig`), passed on."""

    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    grammar: GrammarSettings | None = None  # to build matchers for constrained requests


class StepWorker:
    def __init__(self, conn: Connection, spec: ClientSpec, settings: LaneSettings) -> None:
        self.conn = conn
        self.settings = settings
        self.grammars = None if settings.grammar is None else GrammarCompiler(*settings.grammar)
        self.spec = spec
        self.lanes: dict[str, ExecutorLane] = {}
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.window = ReportWindow()
        self._sender = threading.Thread(
            target=send_batches,
            args=(conn, self.outbox, lambda: None, self.window.sent),
            name="worker-send",
            daemon=True,
        )

    def run(self) -> None:
        self._sender.start()
        try:
            while True:
                try:
                    message: Message = self.conn.recv()
                except (EOFError, OSError):
                    log.info("the scheduler front is gone; worker exiting")
                    return
                for command in message:
                    if command[0] == "exit":
                        return
                    if command[0] == "ack":
                        self.window.acked()
                        continue
                    self._apply(command)
        finally:
            for lane in self.lanes.values():
                lane.stop(STOP_LANE_TIMEOUT_S)
                lane.executor.close()
            self.outbox.put(None)
            self._sender.join(STOP_LANE_TIMEOUT_S)

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
            lane.stop(STOP_LANE_TIMEOUT_S)
            lane.executor.close()

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
        client = self.spec.connect(address)
        # NOTE: the front's handshake named the executor's process: steps go to that one only.
        client.executor_id, client.instance_id = executor_id, instance_id
        scheduler = Scheduler(SchedulerConfig.for_executor(info, self.settings.enable_prefix_caching))
        scheduler.kv.pool.events = []  # the front mirrors the prefix cache from these

        def on_event(lane: ExecutorLane, event: LaneEvent) -> None:
            self.outbox.put(make_report(lane_key, lane, event))

        lane = ExecutorLane(
            executor_id, client, scheduler, on_event, self.settings.async_scheduling, self.window.has_room
        )
        self.lanes[lane_key] = lane
        lane.start()

    def _report_gone(self, lane_key: str, requests: list[Request]) -> None:
        error = f"lane {lane_key} left this scheduler worker"
        self.outbox.put(LaneReport(lane_key, evacuated=[evacuated(r) for r in requests], error=error))

    def _call(self, call_id: int, lane_key: str, fn: Callable[[Scheduler], object]) -> None:
        lane = self.lanes.get(lane_key)
        if lane is None:
            self.outbox.put(("reply", call_id, False, f"error:lane {lane_key} is not in this worker"))
            return

        def reply(future: Future[object]) -> None:
            exc = future.exception()
            if exc is None:
                self.outbox.put(("reply", call_id, True, future.result()))
            else:
                kind = "assertion" if isinstance(exc, AssertionError) else "error"
                self.outbox.put(("reply", call_id, False, f"{kind}:{exc}"))

        lane.call(fn).add_done_callback(reply)


def run_step_worker(
    conn: Connection,
    spec: ClientSpec,
    settings: LaneSettings,
    log_level: str,
    json_logs: bool,
) -> None:
    """The worker process's entry point (spawned by `StepWorkerPool`)."""
    from npuserve.deploy.logs import configure_logging
    from npuserve.deploy.process_name import STEP_WORKER, set_process_name

    set_process_name(STEP_WORKER)
    configure_logging(log_level, json_logs)
    StepWorker(conn, spec, settings).run()
