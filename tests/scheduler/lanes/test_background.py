"""`BackgroundTasks` holds a task nobody awaits until it ends, then lets it go."""

from __future__ import annotations

import asyncio
import gc

from npuserve.scheduler.lanes.background import BackgroundTasks


def test_a_spawned_task_is_held_while_it_runs_and_released_at_its_end() -> None:
    async def run() -> None:
        tasks, done = BackgroundTasks(), asyncio.Event()
        held: list[bool] = []

        async def work() -> None:
            for _ in range(3):
                gc.collect()  # a task only the loop referenced (weakly) could go here
                held.append(asyncio.current_task() in tasks._tasks)
                await asyncio.sleep(0)
            done.set()

        tasks.spawn(work())
        await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0)  # its done callback runs
        assert held == [True, True, True]
        assert not tasks._tasks

    asyncio.run(run())
