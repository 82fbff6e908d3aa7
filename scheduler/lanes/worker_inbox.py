"""What the scheduler workers send the front, handled in the order it came, a slice at a time.

A worker's message carries the reports of all its lanes' steps since its last one: at 16
executors x 1,024 streams on 2 cores, one read of a worker's pipe held the front's event loop for
22 ms on average (p90 42 ms), and every other callback waited behind it: a client's new request
being read, a response being written, the other worker's reports. A first token crosses the
loop four or five times on its way, so each of those waits came back in every client's TTFT.

`WorkerInbox` keeps the messages in one queue, in arrival order over all workers, and handles
their items until `SLICE_S` has passed; the rest waits for the loop's next turn (`call_soon`),
behind whatever became ready meanwhile. No item overtakes another (a call's result never comes
before the reports the worker sent ahead of it), and a message is done (``on_done``: the front
acknowledges it) only once all its items are.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

SLICE_S = 0.002  # the longest the loop spends on the workers' messages before serving the rest

Source = TypeVar("Source")
Item = TypeVar("Item")


class _Message(Generic[Source, Item]):
    __slots__ = ("items", "next", "source")

    def __init__(self, source: Source, items: list[Item]) -> None:
        self.source = source
        self.items = items
        self.next = 0  # the first item not handled yet


class WorkerInbox(Generic[Source, Item]):
    """``on_item(source, item)`` handles one item, ``on_done(source, items)`` ends a message;
    both run on ``loop``'s thread, which calls `put`. ``slice_s``: 0 handles one item a turn."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_item: Callable[[Source, Item], object],
        on_done: Callable[[Source, list[Item]], object],
        slice_s: float = SLICE_S,
    ) -> None:
        self._loop = loop
        self._on_item = on_item
        self._on_done = on_done
        self.slice_s = slice_s
        self._messages: deque[_Message[Source, Item]] = deque()
        self._resume: asyncio.Handle | None = None  # the next turn's slice, when one waits
        self._handling = False  # an item is being handled (what it puts waits its turn)

    def __len__(self) -> int:
        """Messages not done yet."""
        return len(self._messages)

    def put(self, source: Source, items: list[Item]) -> None:
        """A message from ``source``: handled now if nothing waits ahead of it (up to the slice)."""
        self._messages.append(_Message(source, items))
        if self._resume is None and not self._handling:
            self._handle(time.perf_counter() + self.slice_s)

    def flush(self) -> None:
        """Handles everything waiting, now (a worker died: what it sent before comes first)."""
        if self._handling:
            return  # NOTE: from an item's handler: the slice under way goes on with the rest
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._handle(None)

    def close(self) -> None:
        """Drops what waits (the workers are stopping)."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._messages.clear()

    def _next_slice(self) -> None:
        self._resume = None
        self._handle(time.perf_counter() + self.slice_s)

    def _handle(self, deadline: float | None) -> None:
        messages = self._messages
        handled = 0
        self._handling = True
        try:
            while messages:
                message = messages[0]
                items = message.items
                while message.next < len(items):
                    if deadline is not None and handled and time.perf_counter() >= deadline:
                        return  # the rest in the next turn's slice (below)
                    item = items[message.next]
                    message.next += 1
                    handled += 1
                    self._on_item(message.source, item)
                messages.popleft()
                self._on_done(message.source, items)
        finally:
            self._handling = False
            # NOTE: an item that raised is not handled again; the rest still are, next turn
            # (the workers wait for the acknowledgements at its end).
            if messages and self._resume is None:
                self._resume = self._loop.call_soon(self._next_slice)
