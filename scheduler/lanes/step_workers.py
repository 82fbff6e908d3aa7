"""The front's side of the scheduler worker processes (`--scheduler-workers`).

`StepWorkerPool` starts the workers (`step_worker`) and spreads executors over them; each
executor becomes a `RemoteLane`, which the engine and the router use as they use one of the
engine's own `ExecutorLane`s. A remote lane's load and prefix cache are mirrored from the
worker's reports (KV stored/removed events, in order), so prefix-aware routing stays exact: the
front sees every block hash an executor holds once the step that registered it has been reported.

Each worker's pipe is served by the engine's event loop (`PipeLink`): reports reach the engine one
at a time (`on_report`), in the order they came, a slice of the loop's time at a time
(`WorkerInbox`), on the loop thread. A worker that dies is reported once
(`on_lost`); the engine moves its requests and asks the pool to restart it.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import structlog

from npuserve.deploy.runtime.restart_policy import RestartHistory
from npuserve.deploy.runtime.unknown_message import unknown_message
from npuserve.proto.step_plan import ExecutorInfo
from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.block_pool import NOT_CACHED
from npuserve.scheduler.core.request import Prefilled, Request, RequestStatus
from npuserve.scheduler.core.scheduler import Scheduler
from npuserve.scheduler.lanes import worker_messages as msg
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.executor_client import ClientSpec
from npuserve.scheduler.lanes.pipe_link import PipeLink, join_or_kill
from npuserve.scheduler.lanes.step_frames import LaneLoad, LaneReport, carries_reports
from npuserve.scheduler.lanes.step_worker import LaneSettings, run_step_worker
from npuserve.scheduler.lanes.worker_inbox import WorkerInbox

log = structlog.get_logger(__name__)

T = TypeVar("T")

WORKER_START_TIMEOUT_S = 60.0  # how long the scheduler waits for its workers to start before it serves anyway
WORKER_EXIT_TIMEOUT_S = 10.0


class RemoteLane:
    """An executor's lane inside a worker process, as the front sees it."""

    def __init__(
        self, key: str, executor_id: str, client: AioExecutorClient, info: ExecutorInfo, worker: WorkerHandle
    ) -> None:
        self.key = key
        self.executor_id = executor_id
        self.client = client  # the front's own client: health, profiling (steps go from the worker)
        self.info = info
        self.role = info.role
        self.worker = worker
        self.alive = True
        self.draining = False
        self.queued_requests = 0
        self.queued_blocks = 0
        self.queued_prefill_blocks = 0
        self.reported = LaneLoad()
        self.cached: dict[BlockHash, int] = {}  # where the worker's pool holds each hash (`tier_of`)

    # -- what the engine and the router read --------------------------------------------------

    @property
    def load(self) -> int:
        return self.reported.num_waiting + self.reported.num_running

    @property
    def num_waiting(self) -> int:
        return self.reported.num_waiting

    @property
    def has_work(self) -> bool:
        return self.reported.has_work

    @property
    def num_running(self) -> int:
        return self.reported.num_running

    @property
    def num_scheduler_steps(self) -> int:
        return self.reported.num_scheduler_steps

    @property
    def num_used_blocks(self) -> int:
        return self.reported.num_used_blocks

    @property
    def kv_usage(self) -> float:
        return self.reported.kv_usage

    @property
    def prefix_stats(self) -> tuple[int, int]:
        return self.reported.prefix_queries, self.reported.prefix_hits

    def cached_tier(self, block_hash: BlockHash) -> int:
        return self.cached.get(block_hash, NOT_CACHED)

    def absorb(self, report: LaneReport) -> None:
        """Takes a report's load and prefix-cache changes (event loop thread)."""
        self.reported = report.load
        cached = self.cached
        for tier, block_hash in report.kv_events:
            if tier:
                cached[block_hash] = tier
            else:
                cached.pop(block_hash, None)

    # -- commands to the worker ----------------------------------------------------------------

    def start(self) -> None:
        client = self.client
        self.worker.send(
            msg.OpenLane(self.key, self.executor_id, client.address, self.info, client.instance_id)
        )

    async def aclose(self, timeout_s: float) -> None:
        """Stops the worker's lane (it closes its own client) and closes the front's."""
        self.worker.send(msg.StopLane(self.key))
        self.worker.lanes.pop(self.key, None)
        await self.client.close()

    def take_down(self, reason: str) -> None:
        self.worker.send(msg.TakeLaneDown(self.key, reason))

    def submit(self, requests: list[Request]) -> None:
        for request in requests:  # NOTE: the worker builds and advances its own matcher
            if request.grammar is not None:
                request.grammar.release()
                request.grammar = None
        self.worker.send(msg.SubmitRequests(self.key, requests))

    def finish(self, req_ids: list[str], status: RequestStatus) -> None:
        self.worker.send(msg.FinishRequests(self.key, req_ids, status))

    def release_held(self, req_ids: list[str]) -> None:
        self.worker.send(msg.ReleaseHeld(self.key, req_ids))

    def start_decode(self, prefilled: Prefilled) -> None:
        self.worker.send(msg.StartDecode(self.key, prefilled))

    def call(self, fn: Callable[[Scheduler], T]) -> Future[T]:
        """Runs ``fn(scheduler)`` on the worker's lane, between steps; ``fn`` must pickle (a
        module-level function or a partial of one)."""
        return self.worker.call(self.key, fn)


class WorkerHandle:
    """One worker process and its pipe."""

    def __init__(self, index: int, pool: StepWorkerPool) -> None:
        self.index = index
        self.pool = pool
        self.lanes: dict[str, RemoteLane] = {}
        self.process: BaseProcess | None = None
        self.link: PipeLink[msg.FrontToWorker, msg.WorkerToFront] | None = None
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self.closing = False
        self.alive = False  # its process runs (False from its death until it is started again)
        self.started = asyncio.Event()  # its process serves its pipe (cleared at each start)
        self.history = RestartHistory()  # its deaths, under serve's restart policy
        self.name = f"scheduler-worker-{index}"

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        front_end, worker_end = ctx.Pipe(duplex=True)
        pool = self.pool
        process = ctx.Process(
            target=run_step_worker,
            args=(worker_end, pool.spec, pool.lane_settings, pool.log_level, pool.json_logs),
            name=f"npuserve-{self.name}",
            daemon=True,
        )
        process.start()
        worker_end.close()
        assert pool.loop is not None, "the pool starts workers once it has the engine's loop"
        # NOTE: a batch from the worker is handled in turn (`WorkerInbox`), on the event loop.
        link: PipeLink[msg.FrontToWorker, msg.WorkerToFront] = PipeLink(
            front_end, lambda batch: pool.inbox.put(self, batch), lambda: self._closed(link), pool.loop
        )
        self.process, self.link = process, link
        self.alive = True
        self.started.clear()  # NOTE: the same event, so a wait that outlives a death sees the restart
        link.start()
        log.info("scheduler worker started", worker=self.index, pid=process.pid)

    def send(self, command: msg.FrontToWorker) -> None:
        if self.link is not None:
            self.link.send(command)

    def call(self, lane_key: str, fn: Callable[[Scheduler], T]) -> Future[T]:
        future: Future[T] = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self.send(msg.CallLane(call_id, lane_key, fn))
        return future

    def _handle(self, message: msg.WorkerToFront) -> None:
        match message:
            case LaneReport():
                self.pool.on_report(self, message)
            case msg.CallReturned(call_id=call_id, value=value):
                future = self._calls.pop(call_id, None)
                if future is not None:
                    future.set_result(value)
            case msg.CallRaised(call_id=call_id, message=text, assertion=assertion):
                future = self._calls.pop(call_id, None)
                if future is not None:
                    future.set_exception(AssertionError(text) if assertion else RuntimeError(text))
            case msg.WorkerStarted():
                self.started.set()
            case _:
                unknown_message("the scheduler front", message)

    def _closed(self, link: PipeLink[msg.FrontToWorker, msg.WorkerToFront]) -> None:
        if link is not self.link:
            return  # an earlier incarnation's pipe
        self.alive = False
        for future in self._calls.values():
            future.set_exception(RuntimeError(f"{self.name} exited"))
        self._calls.clear()
        if not self.closing:
            self.pool.inbox.flush()  # what it sent before it died counts first
            code = self.process.exitcode if self.process is not None else None
            log.error("scheduler worker died", worker=self.index, exit_code=code, lanes=len(self.lanes))
            self.pool.on_lost(self)

    def close(self) -> None:
        self.closing = True
        if self.link is not None:
            self.link.send(msg.ExitWorker())
            self.link.close()
        join_or_kill(self.process, WORKER_EXIT_TIMEOUT_S)


class StepWorkerPool:
    """The scheduler's worker processes; `open_lane` places an executor on the least-loaded one."""

    def __init__(
        self, count: int, spec: ClientSpec, log_level: str = "info", json_logs: bool = False
    ) -> None:
        if count < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {count}")
        self.spec = spec
        self.log_level = log_level
        self.json_logs = json_logs
        self.lane_settings = LaneSettings()  # the engine's, given to `start`
        self.workers = [WorkerHandle(i, self) for i in range(count)]
        self._lane_keys = itertools.count()
        self.on_report: Callable[[WorkerHandle, LaneReport], None] = lambda w, r: None
        self.on_reports_handled: Callable[[WorkerHandle], None] = lambda w: None
        self.on_lost: Callable[[WorkerHandle], None] = lambda w: None
        self.loop: asyncio.AbstractEventLoop | None = None  # the engine's, which serves the pipes
        self._inbox: WorkerInbox[WorkerHandle, msg.WorkerToFront] | None = None

    def start(
        self,
        settings: LaneSettings,
        on_report: Callable[[WorkerHandle, LaneReport], None],
        on_reports_handled: Callable[[WorkerHandle], None],
        on_lost: Callable[[WorkerHandle], None],
    ) -> None:
        """Starts every worker with the engine's lane settings (on the engine's event loop, which
        serves the workers' pipes and runs the callbacks). ``on_report`` takes each lane report,
        ``on_reports_handled`` follows the last of each message of them."""
        self.loop = asyncio.get_running_loop()
        self.lane_settings, self.on_lost = settings, on_lost
        self.on_report, self.on_reports_handled = on_report, on_reports_handled
        self._inbox = WorkerInbox(self.loop, WorkerHandle._handle, self._handled)
        for worker in self.workers:
            worker.start()

    async def wait_started(self) -> None:
        """Returns once every worker's process has started (imported what it runs)."""
        await asyncio.gather(*(worker.started.wait() for worker in self.workers))

    def open_lane(self, executor_id: str, client: AioExecutorClient, info: ExecutorInfo) -> RemoteLane:
        """A lane on the running worker with the fewest; ValueError while none runs."""
        running = [w for w in self.workers if w.alive]
        if not running:
            raise ValueError("no scheduler worker is running (one is restarting)")
        worker = min(running, key=lambda w: (len(w.lanes), w.index))
        key = f"{executor_id}#{next(self._lane_keys)}"
        lane = RemoteLane(key, executor_id, client, info, worker)
        worker.lanes[key] = lane
        return lane

    def restart(self, worker: WorkerHandle) -> None:
        """Starts a dead worker again, with no lanes (blocking: call off the event loop)."""
        worker.lanes.clear()
        if worker.process is not None:
            worker.process.join(WORKER_EXIT_TIMEOUT_S)
        worker.start()
        worker.history.started()

    @property
    def inbox(self) -> WorkerInbox[WorkerHandle, msg.WorkerToFront]:
        assert self._inbox is not None, "the workers' messages come once the pool has started"
        return self._inbox

    def _handled(self, worker: WorkerHandle, items: list[msg.WorkerToFront]) -> None:
        if carries_reports(items):
            self.on_reports_handled(worker)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
        if self._inbox is not None:
            self._inbox.close()
