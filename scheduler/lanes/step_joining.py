"""A lane's side of joining steps: the requests that come while its executor runs a multi-pass
step start at once, in a step that joins that step's next pass (`StepPlan.joins_running`).

`ExecutorLane` holds a `StepJoining` only where its executor `joins_steps` and it schedules
asynchronously (steps go over a stream); the lane's step loop hands it the wait for each landing
while a step in flight could take a joining one (`may_join`). It is a part of the lane: it runs
on the lane's task and reads the lane's steps in flight, commands and wake-ups.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

from npuserve.scheduler.lanes.executor_client import ExecutorError

if TYPE_CHECKING:
    from npuserve.scheduler.lanes.async_lane import ExecutorLane, InFlightStep

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


class StepJoining:
    """Sends the steps that join the executor's running multi-pass step, on ``lane``'s task."""

    def __init__(self, lane: ExecutorLane) -> None:
        self._lane = lane

    def may_join(self) -> bool:
        """Whether a step in flight could take a joining step: it runs several passes."""
        return any(step.plan.num_steps for step in self._lane._in_flight)

    async def join_until(self, landing: asyncio.Future[None], timeout_s: float | None) -> None:
        """Until ``landing`` is done or ``timeout_s`` has passed: the lane's commands are applied
        as they come, and the requests they bring start in a step that joins the executor's
        (`_join_running`)."""
        lane = self._lane
        wakeup = lane._wakeup
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while not landing.done():
            remaining_s = None if deadline is None else deadline - time.perf_counter()
            if remaining_s is not None and remaining_s <= 0:
                return
            await wakeup.until(remaining_s, landing)
            if landing.done() or not wakeup.woken:
                continue
            wakeup.woken = False
            lane._apply_commands()
            if lane.alive and not lane._stopping:
                await self._join_running()

    async def _join_running(self) -> None:
        """Starts the waiting requests in a step that joins the next pass of the last step sent,
        while that one has passes enough left (`JOIN_MIN_PASSES_LEFT`) and fewer than
        `JOIN_MAX_IN_FLIGHT` such steps are on their way."""
        lane = self._lane
        scheduler = lane.scheduler
        if not scheduler.waiting or not await lane._has_room():
            return
        # NOTE: nothing else runs from here to the send: the steps in flight are as seen here (a
        # landing that failed meanwhile has taken them out and queued their requests again).
        steps = [s for s in (lane._landing, *lane._in_flight) if s is not None]
        if not lane.alive or lane._stopping or sum(s.plan.joins_running for s in steps) >= JOIN_MAX_IN_FLIGHT:
            return
        steps = [s for s in steps if not s.plan.joins_running]
        if not steps:
            return
        host = steps[-1]  # NOTE: the steps in flight, in the order sent
        passes_left = lane.pacing.passes_left(host.plan.num_passes, host.sent_at, queued=host is not steps[0])
        if passes_left < JOIN_MIN_PASSES_LEFT:
            return
        budget = scheduler.config.max_num_batched_tokens - len(host.plan.num_steps)
        scheduled = scheduler.schedule_joining(budget) if budget > 0 else None
        if scheduled is not None:
            await lane._send(*scheduled)


def take_joined(in_flight: deque[InFlightStep], step_id: int) -> InFlightStep:
    """The step in flight that an answer out of turn is for (one that joined the running one),
    taken out of ``in_flight``."""
    for step in in_flight:
        if step.plan.step_id == step_id and step.plan.joins_running:
            in_flight.remove(step)
            return step
    raise ExecutorError("INTERNAL", f"the executor answered step {step_id}, which is not in flight here")
