"""`AsyncExecutorLane`, the lane a scheduler worker runs on its event loop: commands reach the
scheduler between steps (a call answers through its future), and an executor that cannot be
reached takes the lane down with every request handed back (evacuated) for another executor.
Its steps over a live executor are the scenarios' (`test_step_workers`, `test_failover`)."""

from __future__ import annotations

import asyncio

from npuserve.scheduler.aio_executor_client import AioExecutorClient
from npuserve.scheduler.async_lane import AsyncExecutorLane
from npuserve.scheduler.lane import ExecutorLane, LaneEvent
from npuserve.scheduler.request import Request, SamplingParams
from npuserve.scheduler.scheduler import Scheduler, SchedulerConfig


def _request(req_id: str) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    return Request(req_id, [1, 5, 6, 7], params, params.to_options((2,)), (2,), 64, 4)


def test_an_unreachable_executor_takes_the_lane_down_with_its_requests_handed_back() -> None:
    async def run() -> None:
        events: list[LaneEvent] = []
        down = asyncio.Event()

        def on_event(lane: ExecutorLane, event: LaneEvent) -> None:
            events.append(event)
            if event.lane_down:
                down.set()

        async def room() -> bool:
            return True

        client = AioExecutorClient("127.0.0.1:1", "", True, 5)
        scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
        lane = AsyncExecutorLane("e0", client, scheduler, on_event, True, room)
        lane.start()
        assert await asyncio.wrap_future(lane.call(lambda s: s.num_unfinished)) == 0
        lane.submit([_request("r1"), _request("r2")])
        await asyncio.wait_for(down.wait(), 30)
        (event,) = [e for e in events if e.lane_down]
        assert sorted(r.req_id for r in event.evacuated) == ["r1", "r2"]
        assert "unreachable" in (event.error or "") and not lane.alive
        # Requests that come after it went down go straight back too.
        lane.submit([_request("r3")])
        for _ in range(1000):  # NOTE: bounded: the lane's task takes its commands on its next turn
            if [r.req_id for r in events[-1].evacuated] == ["r3"]:
                break
            await asyncio.sleep(0.01)
        assert [r.req_id for r in events[-1].evacuated] == ["r3"]
        await lane.aclose(5)
        assert lane._task is not None and lane._task.done()

    asyncio.run(run())
