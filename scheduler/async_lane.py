"""An `ExecutorLane` driven by an event loop: how a scheduler worker runs its executors' step
loops, all of them on one thread.

The lane's logic is `ExecutorLane`'s (commands between steps, async scheduling, an executor
going down, a refused step); only the waiting differs: a task instead of a thread, steps awaited
on an `AioExecutorClient`, room in the worker's report window awaited. Commands come from the
same loop (the worker's pipe), so they wake the task with an `asyncio.Event`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import cast

from npuserve.proto.step_plan import StepResult
from npuserve.scheduler.aio_executor_client import AioExecutorClient
from npuserve.scheduler.lane import (
    AsyncPendingStep,
    ExecutorLane,
    InFlightStep,
    LaneEvent,
    down_reason,
    executor_is_down,
)
from npuserve.scheduler.scheduler import Scheduler

IDLE_WAIT_S = 0.5  # a lane with nothing to do looks at its commands this often anyway
NOTHING_FITS_WAIT_S = 0.01  # after a schedule that fitted nothing (a stop on its way, say)
LAUNCH_LEAD_PASSES = 2  # a step after a multi-pass one is sent this many passes before it ends


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
    ) -> None:
        """``has_room``: awaited before each new step; False holds it back for now (whoever
        takes this lane's events is behind)."""
        super().__init__(executor_id, executor, scheduler, on_event)  # type: ignore[arg-type]
        self.client = executor
        self.async_scheduling = async_scheduling and executor.streams
        self._has_room = has_room
        self._woken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

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
        self._woken.set()

    async def _sleep(self, timeout_s: float) -> None:
        """Until a command comes, or ``timeout_s``."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._woken.wait(), timeout_s)
        self._woken.clear()

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
        if not (self.async_scheduling and len(self._in_flight) == 1 and self.scheduler.has_work()):
            await self._land_on_loop()
            return
        delay_s = self._launch_delay_s(self._in_flight[0])
        if delay_s <= 0:
            if await self._has_room():
                await self._launch_on_loop()
            await self._land_on_loop()
            return
        # NOTE: a task of its own, never cancelled by the wait: a step stream's read must not be.
        landing = asyncio.ensure_future(self._land_on_loop())
        try:
            await asyncio.wait({landing}, timeout=delay_s)
            if not landing.done():
                self._apply_commands()  # what came meanwhile (new requests) joins the next step
                if self.alive and not self._stopping and self.scheduler.has_work() and await self._has_room():
                    await self._launch_on_loop()
        except asyncio.CancelledError:  # the lane is closing
            landing.cancel()
            raise
        await landing

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
        plan, stats = scheduled
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
        return True

    async def _land_on_loop(self) -> None:
        step = self._in_flight.popleft()
        pending = cast(AsyncPendingStep, step.pending)
        try:
            result = await pending.result()
            while result.partial:  # the first tokens of the requests it admitted, say
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

    def _answered_early(self, step: InFlightStep, result: StepResult) -> None:
        """The tokens of the requests that ran only the step's first pass, before its result:
        reported now, with no step counted."""
        updates = self.scheduler.update_from_output(step.plan, result)
        self.on_event(self, LaneEvent(updates=updates))
