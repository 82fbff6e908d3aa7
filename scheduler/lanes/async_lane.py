"""One executor's step loop: a task on an event loop that schedules, sends steps to the executor
and reports what they produced.

Every lane runs so: a scheduler worker's lanes on the worker's loop, beside its pipe to the
front; the engine's own (`--scheduler-workers 0`, offline use) on the engine's loop. A lane, its
client's steps and whoever takes its events share one thread: a step costs no thread wake-ups (a
thread per lane, each with gRPC's threads behind it, spent most of a step's CPU handing the GIL
around).

Ownership: the lane's `Scheduler` (requests, block pool) is touched only by the lane's task.
Others reach it through `submit`, `finish`, `take_down` and `call`, which queue commands that the
task applies between steps (and, while a step is in flight, before it plans one that joins it);
they wake the task (`Wakeup`). Results leave through ``on_event``, called on the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import structlog

from npuserve.proto.step_plan import EXECUTOR_ROLE_MIXED, ExecutorInfo, StepPlan, StepResult
from npuserve.scheduler.core.block_hash import BlockHash
from npuserve.scheduler.core.request import Prefilled, Request, RequestStatus
from npuserve.scheduler.core.scheduler import Scheduler, StepStats
from npuserve.scheduler.core.scheduler_config import SchedulerConfig
from npuserve.scheduler.lanes.lane import LaneEvent, PendingStep, StepClient, down_reason, executor_is_down
from npuserve.scheduler.lanes.step_joining import StepJoining, take_joined
from npuserve.scheduler.lanes.step_pacing import StepPacing
from npuserve.scheduler.lanes.wakeup import Wakeup

log = structlog.get_logger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.5  # a lane with nothing to do looks at its commands this often anyway
NOTHING_FITS_WAIT_S = 0.01  # after a schedule that fitted nothing (a stop on its way, say)


async def always_room() -> bool:
    """``has_room`` for a lane whose events are taken on its own loop: never behind."""
    return True


def _run_call(fn: Callable[[Scheduler], T], scheduler: Scheduler, future: Future[T]) -> None:
    try:
        future.set_result(fn(scheduler))
    except Exception as exc:
        future.set_exception(exc)


class _Refused:
    """A step the client could not take: its result is that failure."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def result(self) -> StepResult:
        raise self.exc


class _Sending:
    """A step in flight while it is being sent: its answers are those of what the send gives."""

    def __init__(self) -> None:
        self.sent: asyncio.Future[PendingStep] = asyncio.get_running_loop().create_future()

    async def result(self) -> StepResult:
        return await (await self.sent).result()


@dataclass(slots=True)
class InFlightStep:
    plan: StepPlan
    stats: StepStats
    pending: PendingStep
    sent_at: float


class ExecutorLane:
    def __init__(
        self,
        executor_id: str,
        client: StepClient,
        scheduler: Scheduler,
        on_event: Callable[[ExecutorLane, LaneEvent], None],
        async_scheduling: bool,
        has_room: Callable[[], Awaitable[bool]],
        joins_steps: bool = False,
        on_idle: Callable[[], None] | None = None,
        role: str = EXECUTOR_ROLE_MIXED,
    ) -> None:
        """``async_scheduling``: schedule and send each step while the executor runs the one
        before. ``has_room``: awaited before each new step; False holds it back for now (whoever
        takes this lane's events is behind). ``joins_steps`` (`ExecutorInfo.joins_steps`): with
        async scheduling, the requests that come during a multi-pass step start in a step that
        joins its next pass (`joining`). ``on_idle``: called on the task each time the lane's work
        ends. ``role``: the executor's (`ExecutorInfo.role`)."""
        self.executor_id = executor_id
        self.client = client
        self.scheduler = scheduler
        self.role = role
        self.on_event = on_event
        self.async_scheduling = async_scheduling
        self.joining = StepJoining(self) if joins_steps and self.async_scheduling else None
        self._has_room = has_room
        self._on_idle = on_idle
        self.alive = True
        self.down_reason: str | None = None
        self.draining = False  # set by the engine: no new requests, its own finish here
        # Placed here but without a token yet; kept by the engine.
        self.queued_requests = 0
        self.queued_blocks = 0
        self.queued_prefill_blocks = 0
        self.num_steps = 0
        self.pacing = StepPacing(scheduler.config)
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._in_flight: deque[InFlightStep] = deque()
        self._landing: InFlightStep | None = None  # the step whose answers are awaited now
        self._wakeup = Wakeup()  # woken by each command
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_executor(
        cls,
        executor_id: str,
        client: StepClient,
        info: ExecutorInfo,
        on_event: Callable[[ExecutorLane, LaneEvent], None],
        has_room: Callable[[], Awaitable[bool]],
        *,
        enable_prefix_caching: bool,
        num_scheduler_steps: int,
        async_scheduling: bool,
        on_idle: Callable[[], None] | None = None,
    ) -> ExecutorLane:
        """A lane over an executor as it answered the capacity handshake (``info``), with a
        fresh block pool."""
        config = SchedulerConfig.for_executor(
            info, enable_prefix_caching, num_scheduler_steps, early_first_tokens=True
        )
        return cls(
            executor_id,
            client,
            Scheduler(config),
            on_event,
            async_scheduling,
            has_room,
            joins_steps=info.joins_steps,
            on_idle=on_idle,
            role=info.role,
        )

    # -- commands (any task of the loop) ---------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self, timeout_s: float) -> None:
        """Ends the task (the commands still queued are applied) and closes the client."""
        self._stopping = True
        self._wakeup.wake()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):  # NOTE: wait_for cancelled it
                await asyncio.wait_for(self._task, timeout_s)
        await self.client.close()

    def take_down(self, reason: str) -> None:
        self._command(partial(self._go_down, reason))

    def submit(self, requests: list[Request]) -> None:
        self._command(partial(self._add, requests))

    def finish(self, req_ids: list[str], status: RequestStatus) -> None:
        self._command(partial(self._finish, req_ids, status))

    def release_held(self, req_ids: list[str]) -> None:
        self._command(partial(self._release_held, req_ids))

    def start_decode(self, prefilled: Prefilled) -> None:
        self._command(partial(self.scheduler.start_decode, prefilled))

    def call(self, fn: Callable[[Scheduler], T]) -> Future[T]:
        future: Future[T] = Future()
        self._command(partial(_run_call, fn, self.scheduler, future))
        return future

    def _command(self, apply: Callable[[], None]) -> None:
        self._commands.append(apply)
        self._wakeup.wake()

    def _apply_commands(self) -> None:
        commands = self._commands
        while commands:
            commands.popleft()()

    def _add(self, requests: list[Request]) -> None:
        if not self.alive:  # raced with the executor going down: send them elsewhere
            self.on_event(self, LaneEvent(evacuated=list(requests), error=self.down_reason))
            return
        for request in requests:
            self.scheduler.add_request(request)

    def _release_held(self, req_ids: list[str]) -> None:
        had_work = self.has_work
        self.scheduler.release_held(req_ids)
        if had_work and not self.has_work:  # NOTE: reported: a draining executor may go now
            self.on_event(self, LaneEvent())

    def _finish(self, req_ids: list[str], status: RequestStatus) -> None:
        ended = self.scheduler.finish_requests(req_ids, status)
        if ended:
            self.on_event(self, LaneEvent(ended=ended))

    # -- what the engine and the router read ------------------------------------------------------

    @property
    def load(self) -> int:
        """Requests this lane holds."""
        return self.scheduler.num_unfinished

    @property
    def has_work(self) -> bool:
        """A step to send or in flight, or blocks it holds for others (`Scheduler.waits_on_others`)."""
        return self._steps_to_run or self.scheduler.waits_on_others()

    @property
    def _steps_to_run(self) -> bool:
        return bool(self._in_flight) or self.scheduler.has_work()

    @property
    def num_waiting(self) -> int:
        """Queued requests, and those reserved here while another executor computes their prompt
        (vLLM counts its WAITING_FOR_REMOTE_KVS requests as waiting too)."""
        scheduler = self.scheduler
        return len(scheduler.waiting) + scheduler.num_reserved

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
        return self.scheduler.kv.pool.usage

    @property
    def prefix_stats(self) -> tuple[int, int]:
        stats = self.scheduler.kv.stats
        return stats.queries, stats.hits

    def cached_tier(self, block_hash: BlockHash) -> int:
        return self.scheduler.kv.pool.tier_of(block_hash)

    # -- the task --------------------------------------------------------------------------------

    async def _run(self) -> None:
        busy = False
        while not self._stopping:
            self._apply_commands()
            if not self.alive or not self._steps_to_run:
                if busy and self._on_idle is not None:
                    self._on_idle()
                busy = False
                await self._wakeup.sleep(IDLE_WAIT_S)
                continue
            busy = True
            try:
                await self._step()
            except Exception:  # never let the lane die: fail what is running, keep serving
                log.exception("lane step crashed", executor=self.executor_id)
                self._in_flight.clear()
                scheduler = self.scheduler
                ended = scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ERROR)
                self.on_event(self, LaneEvent(ended=ended, error="internal scheduler error"))
        self._apply_commands()

    def _go_down(self, reason: str) -> None:
        """Marks the executor lost and hands every request back for another executor."""
        if not self.alive:
            return
        self.alive, self.down_reason = False, reason
        evacuated = self.scheduler.evacuate()
        log.warning("executor down", executor=self.executor_id, reason=reason, requests_moved=len(evacuated))
        self.on_event(self, LaneEvent(evacuated=evacuated, error=reason, lane_down=True))

    # -- steps: scheduled, sent, landed ---------------------------------------------------------

    async def _step(self) -> None:
        """One step lands. With async scheduling the next one is sent before it lands, so the
        executor starts on it as soon as this one is done, not after this lane has handled its
        result (the scheduler counts the tokens in flight: `num_pending_tokens`); after a
        multi-pass step, shortly before that one ends (`StepPacing.launch_delay_s`)."""
        if not self._in_flight:
            if not await self._has_room():
                return  # whoever takes the events is behind: commands first, then ask again
            if not await self._launch():
                await self._wakeup.sleep(NOTHING_FITS_WAIT_S)
                return
        running = [step for step in self._in_flight if not step.plan.joins_running]
        if not (self.async_scheduling and len(running) <= 1 and self.scheduler.has_work()):
            await self._land_watching(None)
            return
        delay_s = (
            self.pacing.launch_delay_s(running[0].plan.num_passes, running[0].sent_at) if running else 0.0
        )
        if delay_s <= 0:
            if await self._has_room():
                await self._launch()
            await self._land_watching(None)
            return
        await self._land_watching(delay_s)

    async def _land_watching(self, launch_in_s: float | None) -> None:
        """Lands the next step in flight; with ``launch_in_s``, sends the next step after that
        long unless the landing came first. Meanwhile the requests that come may join the step
        the executor runs (`_until_landed`)."""
        if launch_in_s is None and self._joinable() is None:
            await self._land()
            return
        # NOTE: a task of its own, never cancelled by the wait: a step stream's read must not be.
        landing = asyncio.ensure_future(self._land())
        try:
            await self._until_landed(landing, launch_in_s)
            if launch_in_s is not None and not landing.done():
                self._apply_commands()  # what came meanwhile (new requests) joins the next step
                if self.alive and not self._stopping and self.scheduler.has_work() and await self._has_room():
                    await self._launch()
                # NOTE: what comes from here to the landing joins the step just sent; waiting for
                # the landing instead, it would reach the executor after that step had begun.
                await self._until_landed(landing, None)
        except asyncio.CancelledError:  # the lane is closing
            landing.cancel()
            raise
        await landing

    def _joinable(self) -> StepJoining | None:
        """The lane's `joining` while a step in flight could take a joining step, else None."""
        joining = self.joining
        return joining if joining is not None and joining.may_join() else None

    async def _until_landed(self, landing: asyncio.Future[None], timeout_s: float | None) -> None:
        """Waits until ``landing`` is done or ``timeout_s`` has passed; where a step in flight
        could be joined, the requests that come meanwhile start in a step that joins it."""
        joining = self._joinable()
        if joining is not None:
            await joining.join_until(landing, timeout_s)
        else:
            await asyncio.wait({landing}, timeout=timeout_s)

    async def _launch(self) -> bool:
        """Schedules and sends the next step; False when it would carry nothing. A step that
        only waits for pulls to land (`Scheduler.worth_sending`) goes while no other is in flight."""
        may_poll = not self._in_flight
        plan, stats = self.scheduler.schedule(may_poll)
        if not self.scheduler.worth_sending(plan, may_poll):
            return False
        await self._send(plan, stats)
        return True

    async def _send(self, plan: StepPlan, stats: StepStats) -> None:
        # NOTE: in flight before it is sent: the step before it may fail while it is (a landing
        # runs beside a delayed launch), and that failure must count it among the steps after
        # it, planned from what the failure undoes.
        sending = _Sending()
        step = InFlightStep(plan, stats, sending, time.perf_counter())
        self._in_flight.append(step)
        pending: PendingStep
        try:
            pending = await self.client.submit(plan, early_results=self.scheduler.config.early_first_tokens)
        except Exception as exc:
            pending = _Refused(exc)
        step.pending = pending
        sending.sent.set_result(pending)

    async def _land(self) -> None:
        step = self._landing = self._in_flight.popleft()
        pending = step.pending
        try:
            result = await pending.result()
            while result.partial or result.step_id != step.plan.step_id:
                if result.step_id != step.plan.step_id:  # a step that joined this one's passes
                    self._landed(take_joined(self._in_flight, result.step_id), result, joined=True)
                    self._wakeup.wake()  # NOTE: the requests that came meanwhile may join the next pass
                else:  # the first tokens of the requests it admitted, say: reported now, no step counted
                    updates = self.scheduler.update_from_output(step.plan, result)
                    self.on_event(self, LaneEvent(updates=updates))
                result = await pending.result()
        except Exception as exc:
            answers = not executor_is_down(exc) and await self.client.health()
            down = down_reason(self.executor_id, exc, answers)
            # NOTE: the steps sent after it are drained, then fail with it; none where its
            # executor is down (the lane went down with every request).
            later = [] if down is not None else list(self._in_flight)
            self._in_flight.clear()
            self.pacing.interrupted()
            if down is not None:
                self._go_down(down)
            for after in later:
                with contextlib.suppress(Exception):
                    await after.pending.result()
            self._fail_steps([step, *later], exc)
        else:
            self._landed(step, result)
        finally:
            self._landing = None

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
        error = f"executor {self.executor_id} failed: {exc}"
        self.on_event(self, LaneEvent(ended=failed, error=error, failed_step=True))

    def _landed(self, step: InFlightStep, result: StepResult, joined: bool = False) -> None:
        """A step's result: its tokens, and its time; ``joined``: it ran inside another's pass."""
        updates = self.scheduler.update_from_output(step.plan, result)
        self.num_steps += 1
        now = time.perf_counter()
        seconds = self.pacing.elapsed_s(step.sent_at, now)
        event = LaneEvent(updates=updates, stats=step.stats, step_seconds=seconds, joined_step=joined)
        # NOTE: a step that joins another ran in that one's pass, or alone: no timings of its own
        if not step.plan.joins_running:
            passes = self.pacing.landed(
                step.plan.num_passes, result.timings.total_s, seconds, now, self.scheduler.has_work()
            )
            if passes is not None:
                log.debug("passes per step", executor=self.executor_id, passes=passes)
            event.executor_draining, event.timings = result.draining, result.timings
        self.on_event(self, event)
