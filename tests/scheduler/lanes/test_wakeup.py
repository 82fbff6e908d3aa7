"""`Wakeup`: a lane's task waits until it is woken, what it waits for is done, or a timeout; a wake
that came before the wait ends it at once, and stays seen until the task clears it."""

from __future__ import annotations

import asyncio

from npuserve.scheduler.lanes.wakeup import Wakeup


def test_a_wait_ends_at_a_wake_at_what_it_waits_for_or_at_its_timeout() -> None:
    async def run() -> None:
        wakeup = Wakeup()
        waiting = asyncio.ensure_future(wakeup.until(None))
        await asyncio.sleep(0)
        assert not waiting.done()
        wakeup.wake()
        await asyncio.wait_for(waiting, 10)
        assert wakeup.woken  # left for the task to clear
        await wakeup.until(None)  # woken already: at once
        wakeup.woken = False

        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(wakeup.until(None, done))
        await asyncio.sleep(0)
        assert not waiting.done()
        done.set_result(None)
        await asyncio.wait_for(waiting, 10)
        assert not wakeup.woken

        await asyncio.wait_for(wakeup.until(0.01), 10)  # its timeout
        assert not wakeup.woken

    asyncio.run(run())


def test_sleep_clears_the_wake_that_ended_it() -> None:
    async def run() -> None:
        wakeup = Wakeup()
        wakeup.wake()
        await asyncio.wait_for(wakeup.sleep(60), 10)
        assert not wakeup.woken
        await asyncio.wait_for(wakeup.sleep(0.01), 10)
        assert not wakeup.woken

    asyncio.run(run())
