"""How a lane's task waits on its event loop: until it is woken (a command came), something it
waits for is done, or a timeout passes, whichever comes first.

One future that each of them resolves: `asyncio.wait` on an event's wait took a task of its own
and two more turns of the loop, which serves every lane.
"""

from __future__ import annotations

import asyncio


def _resolve(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class Wakeup:
    """One task's wake-ups (on its loop). ``woken`` stays set until the task clears it."""

    def __init__(self) -> None:
        self.woken = False  # woken since the task last looked
        self._waiter: asyncio.Future[None] | None = None  # what `wake` resolves while the task waits

    def wake(self) -> None:
        self.woken = True
        _resolve(self._waiter)

    async def sleep(self, timeout_s: float) -> None:
        """Until woken, or ``timeout_s``; clears ``woken``."""
        await self.until(timeout_s)
        self.woken = False

    async def until(self, timeout_s: float | None, done: asyncio.Future[None] | None = None) -> None:
        """Until woken, ``done`` is done or ``timeout_s`` has passed (at once if woken already);
        leaves ``woken`` as it is."""
        if self.woken:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, _resolve, waiter)

        def finished(_: asyncio.Future[None]) -> None:
            _resolve(waiter)

        if done is not None:
            done.add_done_callback(finished)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
            if done is not None:
                done.remove_done_callback(finished)
