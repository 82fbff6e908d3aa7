"""One executor's step loop: a thread that schedules, calls the executor, and reports results.

Ownership: the lane's `Scheduler` (requests, block pool) is touched only by the lane thread.
Other threads talk to it through `submit` and `finish`, which queue commands the thread applies
between steps; results leave through the `on_event` callback, called on the lane thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

import structlog

from npuserve.proto.step_plan import ExecutorInfo, StepPlan, StepResult
from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.request import Request, RequestStatus
from npuserve.scheduler.core.scheduler import RequestUpdate, Scheduler, StepStats
from npuserve.scheduler.core.step_passes import PassController

log = structlog.get_logger(__name__)

T = TypeVar("T")


class StepExecutor(Protocol):
    """What a lane needs of an executor: the gRPC client, or an in-process runner."""

    def info(self) -> ExecutorInfo: ...

    def step(self, plan: StepPlan) -> StepResult: ...

    def health(self) -> bool: ...

    def close(self) -> None: ...


# Step failures that mean the executor itself is gone (hung past the step timeout, or refusing
# this scheduler), whatever it answers after. Any other (INVALID_ARGUMENT, INTERNAL, and
# UNAVAILABLE: a connection that broke, which a network blip does as well as a death) is asked
# of the executor: `down_reason`.
EXECUTOR_DOWN_CODES = frozenset({"DEADLINE_EXCEEDED", "CANCELLED", "UNKNOWN", "UNAUTHENTICATED"})


def executor_is_down(exc: Exception) -> bool:
    return getattr(exc, "code", None) in EXECUTOR_DOWN_CODES


def down_reason(executor_id: str, exc: Exception, answers_health: bool) -> str | None:
    """Why a failed step means its executor is gone (None: the executor still serves, and the
    step's requests run again: `Scheduler.fail_step`).

    The status alone can say "gone" (`EXECUTOR_DOWN_CODES`), but not always when it is, nor
    when it is not: a stream whose executor was killed can end as INTERNAL from gRPC's own
    client (a write after the connection broke replaces the stream's status:
    `generate_many.LOST_STATUS_DETAILS`), and one whose connection reset under a live executor
    ends UNAVAILABLE. So any other failure leaves the executor in only while the same process
    still answers `Health` as serving (``answers_health``: asked after the failure, unless its
    status already says gone)."""
    if executor_is_down(exc):
        return f"executor {executor_id} is unreachable: {exc}"
    if not answers_health:
        return f"executor {executor_id} is unreachable (a step failed with {exc}, and it answers no health check)"
    return None


@dataclass(slots=True)
class LaneEvent:
    """Reported after every step, and when requests end or leave outside a step."""

    updates: list[RequestUpdate] = field(default_factory=list)
    ended: list[Request] = field(default_factory=list)  # aborted, stopped from outside, or failed
    error: str | None = None  # why `ended` requests failed (or why the executor went down)
    # Requests to place on another executor: this one went down (or was down when they came).
    evacuated: list[Request] = field(default_factory=list)
    lane_down: bool = False
    stats: StepStats | None = None
    step_seconds: float = 0.0
    executor_draining: bool = False  # the executor said so in its step's answer
    failed_step: bool = False  # a step failed while the executor still served (`_fail_steps`)
    joined_step: bool = False  # a step that ran inside another's pass landed (`StepPlan.joins_running`)


class Lane(Protocol):
    """What the engine and the router use of a lane: an `ExecutorLane` (a thread of this process)
    or a `RemoteLane` (one in a scheduler worker process, seen through its reports)."""

    executor_id: str
    alive: bool
    draining: bool  # set by the engine: no new requests, its own finish here
    queued_requests: int  # placed here without a token yet (kept by the engine)
    queued_blocks: int  # their prompts' blocks
    queued_prefill_blocks: int  # of those, the blocks not cached here when they were placed

    @property
    def executor(self) -> StepExecutor: ...

    @property
    def load(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def has_work(self) -> bool:
        """A step to send: requests, or finished ones the executor must still drop."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_scheduler_steps(self) -> int:
        """The passes its steps run now (`--num-scheduler-steps`; under auto, the last choice)."""
        ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def kv_usage(self) -> float: ...

    @property
    def prefix_stats(self) -> tuple[int, int]:
        """(prompt tokens looked up, of them found in the prefix cache)."""
        ...

    def has_cached(self, block_hash: BlockHash) -> bool: ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 5.0) -> None: ...

    def take_down(self, reason: str) -> None: ...

    def submit(self, requests: list[Request]) -> None: ...

    def finish(self, req_ids: list[str], status: RequestStatus) -> None: ...

    def call(self, fn: Callable[[Scheduler], T]) -> Future[T]: ...


class ExecutorLane:
    def __init__(
        self,
        executor_id: str,
        executor: StepExecutor,
        scheduler: Scheduler,
        on_event: Callable[[ExecutorLane, LaneEvent], None],
        async_scheduling: bool = False,
        may_step: Callable[[], bool] | None = None,
    ) -> None:
        """``async_scheduling``: schedule and send each step while the executor runs the one
        before (only with an executor that pipelines steps: the streaming gRPC client).
        ``may_step``: asked before each new step; False holds it back for now (flow control:
        whoever takes this lane's events is behind)."""
        self.executor_id = executor_id
        self.executor = executor
        self.scheduler = scheduler
        self.on_event = on_event
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self.alive = True
        self.down_reason: str | None = None
        self.draining = False  # set on the event loop: no new requests, its own finish here
        # Placed here but without a token yet; kept by the engine on the event loop thread.
        self.queued_requests = 0
        self.queued_blocks = 0
        self.queued_prefill_blocks = 0
        self._thread: threading.Thread | None = None  # `start` (a lane on an event loop has none)
        self.num_steps = 0
        self.async_scheduling = async_scheduling and callable(getattr(executor, "submit", None))
        self._in_flight: deque[InFlightStep] = deque()
        self._may_step = may_step or (lambda: True)
        self._last_landed = 0.0
        # The executor's seconds per forward pass, over the multi-pass steps that landed back
        # to back (an average that moves with the batch): when their next step is due.
        self.pass_seconds = 0.0
        # `--num-scheduler-steps auto`: the passes per step, from how long the executor waits.
        self.pass_controller = PassController() if scheduler.config.auto_passes else None
        self._had_work = False  # the lane had work when its last step landed

    # -- called from any thread -----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"lane-{self.executor_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Ends the thread; requests still queued to it are handed back as evacuated."""
        self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    def take_down(self, reason: str) -> None:
        """The executor left (its registration expired, say): hand every request back."""
        self._command("down", reason)

    def submit(self, requests: list[Request]) -> None:
        self._command("add", requests)

    def finish(self, req_ids: list[str], status: RequestStatus) -> None:
        self._command("finish", (req_ids, status))

    def call(self, fn: Callable[[Scheduler], T]) -> Future[T]:
        """Runs ``fn(scheduler)`` on the lane thread between steps (e.g. an integrity check)."""
        future: Future[T] = Future()
        self._command("call", (fn, future))
        return future

    def _wake(self) -> None:
        """Ends the driver's wait for work or commands (this lane's thread)."""
        self._wakeup.set()

    def _command(self, kind: str, payload: object) -> None:
        self._commands.put((kind, payload))
        self._wake()

    # NOTE: read without locking from the event loop thread: hints for routing and gauges.

    @property
    def load(self) -> int:
        """Requests this lane holds."""
        return self.scheduler.num_unfinished

    @property
    def has_work(self) -> bool:
        return bool(self._in_flight) or self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_scheduler_steps(self) -> int:
        return self.scheduler.config.num_scheduler_steps

    @property
    def num_used_blocks(self) -> int:
        pool = self.scheduler.kv.pool
        return pool.num_blocks - 1 - pool.num_free_blocks

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv.usage

    @property
    def prefix_stats(self) -> tuple[int, int]:
        stats = self.scheduler.kv.stats
        return stats.queries, stats.hits

    def has_cached(self, block_hash: BlockHash) -> bool:
        return block_hash in self.scheduler.kv.pool.cached_blocks

    # -- the lane thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self.alive or not self.has_work:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                self._step()
            except Exception:  # never let the lane die: fail what is running, keep serving
                self._crashed()
        self._apply_commands()

    def _crashed(self) -> None:
        log.exception("lane step crashed", executor=self.executor_id)
        self._in_flight.clear()
        ended = self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ERROR)
        self.on_event(self, LaneEvent(ended=ended, error="internal scheduler error"))

    def _go_down(self, reason: str) -> None:
        """Marks the executor lost and hands every request back for another executor."""
        if not self.alive:
            return
        self.alive, self.down_reason = False, reason
        evacuated = self.scheduler.evacuate()
        log.warning("executor down", executor=self.executor_id, reason=reason, requests_moved=len(evacuated))
        self.on_event(self, LaneEvent(evacuated=evacuated, error=reason, lane_down=True))

    def _apply_commands(self) -> None:
        # NOTE: `empty` first: this runs before every step, and most find no command (cheaper
        # than raising queue.Empty). Only this thread takes commands, so none goes missing.
        while not self._commands.empty():
            kind, payload = self._commands.get_nowait()
            if kind == "add":
                requests = cast(list[Request], payload)
                if not self.alive:  # raced with the executor going down: send them elsewhere
                    self.on_event(self, LaneEvent(evacuated=list(requests), error=self.down_reason))
                    continue
                for request in requests:
                    self.scheduler.add_request(request)
            elif kind == "down":
                self._go_down(str(payload))
            elif kind == "call":
                fn, future = cast(tuple[Callable[[Scheduler], object], Future[object]], payload)
                try:
                    future.set_result(fn(self.scheduler))
                except Exception as exc:
                    future.set_exception(exc)
            else:
                req_ids, status = cast(tuple[list[str], RequestStatus], payload)
                ended = self.scheduler.finish_requests(req_ids, status)
                if ended:
                    self.on_event(self, LaneEvent(ended=ended))

    # -- steps: scheduled, sent, landed ---------------------------------------------------------

    def _step(self) -> None:
        """One step lands. With async scheduling the next one is scheduled and sent first, so
        the executor starts on it as soon as this one is done, not after this lane has handled
        its result (the scheduler counts the tokens in flight: `num_pending_tokens`)."""
        if not self._in_flight:
            if not self._may_step():
                return  # the events' consumer is behind: commands first, then ask again
            if not self._launch():
                self._wakeup.wait(timeout=0.01)  # nothing fits now (e.g. waiting on a stop to land)
                self._wakeup.clear()
                return
        if (
            self.async_scheduling
            and len(self._in_flight) == 1
            and self.scheduler.has_work()
            and self._may_step()
        ):
            self._launch()
        self._land()

    def _launch(self) -> bool:
        scheduled = self._schedule()
        if scheduled is None:
            return False
        plan, stats = scheduled
        pending = (
            cast(PipelinedExecutor, self.executor).submit(plan)
            if self.async_scheduling
            else _Deferred(self.executor, plan)
        )
        self._in_flight.append(InFlightStep(plan, stats, pending, time.perf_counter()))
        return True

    def _schedule(self) -> tuple[StepPlan, StepStats] | None:
        """The next step's plan; None when it would carry nothing."""
        plan, stats = self.scheduler.schedule()
        if not plan.num_scheduled_tokens and not plan.finished_req_ids:
            return None
        return plan, stats

    def _land(self) -> None:
        step = self._in_flight.popleft()
        try:
            result = cast(PendingStep, step.pending).result()
        except Exception as exc:
            answers = not executor_is_down(exc) and _answers_health(self.executor)
            later = self._failed(exc, down_reason(self.executor_id, exc, answers))
            for after in later:
                with contextlib.suppress(Exception):
                    cast(PendingStep, after.pending).result()
            self._fail_steps([step, *later], exc)
            return
        self._landed(step, result)

    def _failed(self, exc: Exception, down: str | None) -> list[InFlightStep]:
        """A step failed: the steps sent after it (to drain before `_fail_steps`), or none
        when its executor is ``down`` (why: `down_reason`; the lane went down with every request)."""
        later = list(self._in_flight)
        self._in_flight.clear()
        self._had_work = False  # NOTE: the next step to land does not follow one that landed
        if down is not None:
            self._go_down(down)
            return []
        return later

    def _fail_steps(self, steps: list[InFlightStep], exc: Exception) -> None:
        """A step the executor failed while it still serves: its requests run again (once:
        `Scheduler.fail_step`), with those of the steps sent after it (it may have refused them
        with it); those that ran again already end with the error."""
        if not self.alive:
            return
        failed: list[Request] = []
        retried: list[Request] = []
        for step in steps:
            ended, again = self.scheduler.fail_step(step.plan)
            failed += ended
            retried += again
        (log.error if failed else log.warning)(
            "step failed",
            executor=self.executor_id,
            step_id=steps[0].plan.step_id,
            error=str(exc),
            requests_run_again=len(retried),
            requests_failed=len(failed),
        )
        self.on_event(
            self,
            LaneEvent(ended=failed, error=f"executor {self.executor_id} failed: {exc}", failed_step=True),
        )

    def _landed(self, step: InFlightStep, result: StepResult, joined: bool = False) -> None:
        """A step's result: its tokens, and its time; ``joined``: it ran inside another's pass."""
        updates = self.scheduler.update_from_output(step.plan, result)
        self.num_steps += 1
        now = time.perf_counter()
        # NOTE: a pipelined step was sent while the one before it ran: it took since that landed.
        seconds = now - max(step.sent_at, self._last_landed)
        if step.plan.joins_running:  # ran in another's pass, or alone: timings of no step of its own
            event = LaneEvent(updates=updates, stats=step.stats, step_seconds=seconds, joined_step=joined)
            self.on_event(self, event)
            return
        if self.pass_controller is not None:
            if self._had_work:  # landed right after the one before: the executor's time between
                chosen = self.pass_controller.observe(result.timings.total_s, now - self._last_landed, now)
                if chosen != self.scheduler.config.num_scheduler_steps:
                    log.debug("passes per step", executor=self.executor_id, passes=chosen)
                    self.scheduler.config.num_scheduler_steps = chosen
            self._had_work = self.scheduler.has_work()
        self._last_landed = now
        passes = step.plan.num_passes
        if passes > 1:
            per_pass = seconds / passes
            self.pass_seconds = (
                per_pass if not self.pass_seconds else 0.8 * self.pass_seconds + 0.2 * per_pass
            )
        self.on_event(
            self,
            LaneEvent(
                updates=updates, stats=step.stats, step_seconds=seconds, executor_draining=result.draining
            ),
        )


def _answers_health(executor: StepExecutor) -> bool:
    try:
        return executor.health()
    except Exception:
        return False


class PendingStep(Protocol):
    def result(self) -> StepResult: ...


class PipelinedExecutor(StepExecutor, Protocol):
    """An executor that takes the next step before the last one's result is read."""

    def submit(self, plan: StepPlan) -> PendingStep: ...


@dataclass(slots=True)
class _Deferred:
    """A step of an executor that does not pipeline: it runs when its result is asked for."""

    executor: StepExecutor
    plan: StepPlan

    def result(self) -> StepResult:
        return self.executor.step(self.plan)


class AsyncPendingStep(Protocol):
    async def result(self) -> StepResult: ...


@dataclass(slots=True)
class InFlightStep:
    plan: StepPlan
    stats: StepStats
    pending: PendingStep | AsyncPendingStep  # the second on a lane of an event loop (`async_lane`)
    sent_at: float
