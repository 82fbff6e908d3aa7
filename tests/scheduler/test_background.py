"""`BackgroundTasks` holds a task nobody awaits until it ends, then lets it go."""

from __future__ import annotations

import asyncio
import gc

from npuserve.scheduler.background import BackgroundTasks


def test_a_spawned_task_runs_to_its_end_though_nobody_holds_it() -> None:
    async def run() -> None:
        tasks, done = BackgroundTasks(), asyncio.Event()

        async def work() -> None:
            for _ in range(3):
                gc.collect()  # a task only the loop referenced (weakly) could go here
                await asyncio.sleep(0)
            done.set()

        tasks.spawn(work())
        await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0)  # its done callback runs
        assert not tasks._tasks

    asyncio.run(run())
