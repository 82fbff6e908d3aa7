"""An `ExecutorLane` driven by an event loop: how a scheduler worker runs its executors' step
loops, all of them on one thread.

The lane's logic is `ExecutorLane`'s (commands between steps, async scheduling, an executor
going down, a refused step); only the waiting differs: a task instead of a thread, steps awaited
on an `AioExecutorClient`, room in the worker's report window awaited. Commands come from the
same loop (the worker's pipe), so they wake the task through a future it waits on (`_wake`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import cast

from npuserve.proto.step_plan import StepPlan, StepResult
from npuserve.scheduler.core.scheduler import Scheduler, StepStats
from npuserve.scheduler.lanes.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lanes.executor_client import ExecutorError
from npuserve.scheduler.lanes.lane import (
    AsyncPendingStep,
    ExecutorLane,
    InFlightStep,
    LaneEvent,
    down_reason,
    executor_is_down,
)

IDLE_WAIT_S = 0.5  # a lane with nothing to do looks at its commands this often anyway
NOTHING_FITS_WAIT_S = 0.01  # after a schedule that fitted nothing (a stop on its way, say)
LAUNCH_LEAD_PASSES = 2  # a step after a multi-pass one is sent this many passes before it ends
# A step that joins another is sent while that one has this many passes left to start, at least
# (one that arrives after the last has begun runs on its own after it).
JOIN_MIN_PASSES_LEFT = 1.5
# Steps that join on their way at once, per executor: the requests that come meanwhile wait for
# one to land (they then join the next pass, or start in the next step). In the scale bench (16
# executors x 1,024 streams under auto, 2 cores, interleaved runs) two held back a third of the
# requests that came while two were on their way, and 8-12% of all went in a regular step, a
# pass or more later; with eight, 4-6% did. The streams without a first token: a mean of 54.3
# over six runs with two, 50.7 over five with eight, for the same tokens/s and CPU per token.
JOIN_MAX_IN_FLIGHT = 8


def _resolve(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _Refused:
    """A step the stream could not take: its result is that failure."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def result(self) -> StepResult:
        raise self.exc


class _Sending:
    """A step in flight while it is being sent: its answers are those of what the send gives."""

    def __init__(self) -> None:
        self.sent: asyncio.Future[AsyncPendingStep] = asyncio.get_running_loop().create_future()

    async def result(self) -> StepResult:
        return await (await self.sent).result()


class AsyncExecutorLane(ExecutorLane):
    def __init__(
        self,
        executor_id: str,
        executor: AioExecutorClient,
        scheduler: Scheduler,
        on_event: Callable[[ExecutorLane, LaneEvent], None],
        async_scheduling: bool,
        has_room: Callable[[], Awaitable[bool]],
        joins_steps: bool = False,
    ) -> None:
        """``has_room``: awaited before each new step; False holds it back for now (whoever
        takes this lane's events is behind). ``joins_steps``: the executor runs a step that
        joins the one it is running (`ExecutorInfo.joins_steps`); with async scheduling, the
        requests that come during a multi-pass step start in a step that joins its next pass."""
        super().__init__(executor_id, executor, scheduler, on_event)  # type: ignore[arg-type]
        self.client = executor
        self.async_scheduling = async_scheduling and executor.streams
        self.joins_steps = joins_steps and self.async_scheduling
        self._has_room = has_room
        self._woken = False  # a command came since the lane last looked (`_wake`)
        self._waiter: asyncio.Future[None] | None = None  # what `_wake` resolves while the task waits
        self._task: asyncio.Task[None] | None = None
        self._landing: InFlightStep | None = None  # the step whose answers are awaited now

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run_on_loop())

    async def aclose(self, timeout_s: float) -> None:
        """Ends the task (its requests still queued are handed back as evacuated) and the client."""
        self._stopping = True
        self._wake()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):  # NOTE: wait_for cancelled it
                await asyncio.wait_for(self._task, timeout_s)
        await self.client.close()

    def _wake(self) -> None:
        self._woken = True
        _resolve(self._waiter)

    async def _sleep(self, timeout_s: float) -> None:
        """Until a command comes, or ``timeout_s``."""
        await self._until_woken(timeout_s)
        self._woken = False

    async def _until_woken(
        self, timeout_s: float | None, landing: asyncio.Future[None] | None = None
    ) -> None:
        """Until a command wakes the lane (`_wake`), ``landing`` is done or ``timeout_s`` has
        passed, whichever comes first (at once if it was woken already): one future that each
        of them resolves, where `asyncio.wait` on an event's wait took a task of its own and
        two more turns of the worker's loop, which serves every lane."""
        if self._woken:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _resolve, waiter)

        def landed(_: asyncio.Future[None]) -> None:
            _resolve(waiter)

        if landing is not None:
            landing.add_done_callback(landed)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
            if landing is not None:
                landing.remove_done_callback(landed)

    async def _run_on_loop(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if not self.alive or not self.has_work:
                await self._sleep(IDLE_WAIT_S)
                continue
            try:
                await self._step_on_loop()
            except Exception:  # never let the lane die: fail what is running, keep serving
                self._crashed()
        self._apply_commands()

    async def _step_on_loop(self) -> None:
        """`ExecutorLane._step`, awaiting instead of blocking; a pipelined step that follows a
        multi-pass one is sent shortly before that one ends (`_launch_delay_s`)."""
        if not self._in_flight:
            if not await self._has_room():
                return
            if not await self._launch_on_loop():
                await self._sleep(NOTHING_FITS_WAIT_S)
                return
        running = [step for step in self._in_flight if not step.plan.joins_running]
        if not (self.async_scheduling and len(running) <= 1 and self.scheduler.has_work()):
            await self._land_watching(None)
            return
        delay_s = self._launch_delay_s(running[0]) if running else 0.0
        if delay_s <= 0:
            if await self._has_room():
                await self._launch_on_loop()
            await self._land_watching(None)
            return
        await self._land_watching(delay_s)

    async def _land_watching(self, launch_in_s: float | None) -> None:
        """Lands the next step in flight; with ``launch_in_s``, sends the next step after that
        long unless the landing came first. Where the executor `joins_steps`, the requests that
        come meanwhile start at once, in a step that joins the one it runs (`_join_running`):
        watched for only while a step in flight runs several passes (none else could host one)."""
        watch = self._may_be_joined()
        if launch_in_s is None and not watch:
            await self._land_on_loop()
            return
        # NOTE: a task of its own, never cancelled by the wait: a step stream's read must not be.
        landing = asyncio.ensure_future(self._land_on_loop())
        try:
            if watch:
                await self._join_until(landing, launch_in_s)
            else:
                await asyncio.wait({landing}, timeout=launch_in_s)
            if launch_in_s is not None and not landing.done():
                self._apply_commands()  # what came meanwhile (new requests) joins the next step
                if self.alive and not self._stopping and self.scheduler.has_work() and await self._has_room():
                    await self._launch_on_loop()
                # NOTE: what comes from here to the landing joins the step just sent; waiting for
                # the landing instead, it would reach the executor after that step had begun.
                if self._may_be_joined():
                    await self._join_until(landing, None)
        except asyncio.CancelledError:  # the lane is closing
            landing.cancel()
            raise
        await landing

    def _may_be_joined(self) -> bool:
        """Whether a step in flight could take a joining step: the executor `joins_steps` and
        the step runs several passes."""
        return self.joins_steps and any(step.plan.num_steps for step in self._in_flight)

    async def _join_until(self, landing: asyncio.Future[None], timeout_s: float | None) -> None:
        """Until ``landing`` is done or ``timeout_s`` has passed: the requests that come start
        in a step that joins the executor's (`_join_running`)."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while not landing.done():
            remaining_s = None if deadline is None else deadline - time.perf_counter()
            if remaining_s is not None and remaining_s <= 0:
                return
            await self._until_woken(remaining_s, landing)
            if landing.done() or not self._woken:
                continue
            self._woken = False
            self._apply_commands()
            if self.alive and not self._stopping:
                await self._join_running()

    async def _join_running(self) -> None:
        """Starts the waiting requests in a step that joins the next pass of the last step sent,
        while that one has passes enough left (`JOIN_MIN_PASSES_LEFT`) and fewer than
        `JOIN_MAX_IN_FLIGHT` such steps are on their way."""
        if not self.scheduler.waiting or not await self._has_room():
            return
        # NOTE: nothing else runs from here to the send: the steps in flight are as seen here (a
        # landing that failed meanwhile has taken them out and queued their requests again).
        steps = [s for s in (self._landing, *self._in_flight) if s is not None]
        if not self.alive or self._stopping or not steps:
            return
        if sum(s.plan.joins_running for s in steps) >= JOIN_MAX_IN_FLIGHT:
            return
        steps = [s for s in steps if not s.plan.joins_running]
        if not steps:
            return
        host = steps[-1]  # NOTE: the steps in flight, in the order sent
        if self._passes_left(host, queued=host is not steps[0]) < JOIN_MIN_PASSES_LEFT:
            return
        budget = self.scheduler.config.max_num_batched_tokens - len(host.plan.num_steps)
        scheduled = self.scheduler.schedule_joining(budget) if budget > 0 else None
        if scheduled is not None:
            await self._send_on_loop(*scheduled)

    def _passes_left(self, step: InFlightStep, queued: bool) -> float:
        """About how many of a step's passes the executor has yet to start (all of them while
        the step is ``queued`` behind another)."""
        if step.plan.num_passes <= 1 or not self.pass_seconds:
            return 0.0
        if queued:
            return float(step.plan.num_passes)
        elapsed_s = time.perf_counter() - max(step.sent_at, self._last_landed)
        return step.plan.num_passes - elapsed_s / self.pass_seconds

    def _launch_delay_s(self, running: InFlightStep) -> float:
        """How long to wait before sending the step after ``running``: none after a one-pass
        step (the next is sent at once, to hide the round trip); after a multi-pass step, until
        `LAUNCH_LEAD_PASSES` of its passes should be left. Sent at once, the next step would
        hold every request that arrives during ``running`` back by a whole further step of
        passes; sent then, their wait is about what it is without async scheduling, while the
        executor still has the next step before it needs it (should the step land first, the
        next goes out as it lands, as without async scheduling).

        NOTE: in the scale bench (16 executors x 1,024 streams, 8 passes a step, 2 cores, three
        interleaved runs each) this took the clients' TTFT p50 from 210-274 to 147-156 ms and
        the streams without a first token from 204-238 to 108-141, for the same tokens/s; a
        lead of one pass lost 6% of the tokens/s (one worker's loop serves many lanes: a
        launch can come late)."""
        passes = running.plan.num_passes
        if passes <= 1 or not self.pass_seconds:
            return 0.0
        elapsed_s = time.perf_counter() - max(running.sent_at, self._last_landed)
        return (passes - LAUNCH_LEAD_PASSES) * self.pass_seconds - elapsed_s

    async def _launch_on_loop(self) -> bool:
        scheduled = self._schedule()
        if scheduled is None:
            return False
        await self._send_on_loop(*scheduled)
        return True

    async def _send_on_loop(self, plan: StepPlan, stats: StepStats) -> None:
        # NOTE: in flight before it is sent: the step before it may fail while it is (a landing
        # runs beside a delayed launch), and that failure must count it among the steps after
        # it, planned from what the failure undoes.
        sending = _Sending()
        step = InFlightStep(plan, stats, sending, time.perf_counter())
        self._in_flight.append(step)
        pending: AsyncPendingStep
        try:
            pending = await self.client.submit(plan, early_results=self.scheduler.config.early_first_tokens)
        except Exception as exc:
            pending = _Refused(exc)
        step.pending = pending
        sending.sent.set_result(pending)

    async def _land_on_loop(self) -> None:
        step = self._landing = self._in_flight.popleft()
        try:
            await self._land_step(step)
        finally:
            self._landing = None

    async def _land_step(self, step: InFlightStep) -> None:
        pending = cast(AsyncPendingStep, step.pending)
        try:
            result = await pending.result()
            while result.partial or result.step_id != step.plan.step_id:
                if result.step_id != step.plan.step_id:  # a step that joined this one's passes
                    self._landed(self._take_joined(result.step_id), result, joined=True)
                    self._wake()  # NOTE: the requests that came meanwhile may join the next pass
                else:  # the first tokens of the requests it admitted, say
                    self._answered_early(step, result)
                result = await pending.result()
        except Exception as exc:
            answers = not executor_is_down(exc) and await self.client.health()
            later = self._failed(exc, down_reason(self.executor_id, exc, answers))
            for after in later:
                with contextlib.suppress(Exception):
                    await cast(AsyncPendingStep, after.pending).result()
            self._fail_steps([step, *later], exc)
            return
        self._landed(step, result)

    def _take_joined(self, step_id: int) -> InFlightStep:
        """The step in flight that an answer out of turn is for: one that joined the running one."""
        for step in self._in_flight:
            if step.plan.step_id == step_id and step.plan.joins_running:
                self._in_flight.remove(step)
                return step
        raise ExecutorError("INTERNAL", f"the executor answered step {step_id}, which is not in flight here")

    def _answered_early(self, step: InFlightStep, result: StepResult) -> None:
        """The tokens of the requests that ran only the step's first pass, before its result:
        reported now, with no step counted."""
        updates = self.scheduler.update_from_output(step.plan, result)
        self.on_event(self, LaneEvent(updates=updates))
