"""The workers' messages on the front's loop: handled in the order they came, a slice of the
loop's time at a time, with the loop's other callbacks served between slices; a message ends
once all its items are handled; a worker's death handles what waits at once."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from npuserve.scheduler.lanes.worker_inbox import WorkerInbox


class Log:
    def __init__(self) -> None:
        self.entries: list[Any] = []

    def item(self, source: str, item: Any) -> None:
        if item == "boom":
            raise RuntimeError("a handler failed")
        self.entries.append((source, item))

    def done(self, source: str, items: list[Any]) -> None:
        self.entries.append((source, "done", len(items)))


def on_loop(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


async def turns(count: int = 5) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


@on_loop
async def test_an_idle_inbox_handles_a_message_at_once_and_ends_it() -> None:
    log = Log()
    inbox: WorkerInbox[str] = WorkerInbox(asyncio.get_running_loop(), log.item, log.done)
    inbox.put("w0", ["a", "b"])
    assert log.entries == [("w0", "a"), ("w0", "b"), ("w0", "done", 2)]
    assert len(inbox) == 0


@on_loop
async def test_past_its_slice_the_rest_waits_behind_what_became_ready_and_nothing_overtakes() -> None:
    """With a zero slice: one item per turn. A callback made ready after the first item runs
    after the next slice, before the one after it (items of the same message), and a later
    message (another worker's) waits for the first."""
    loop = asyncio.get_running_loop()
    log = Log()
    inbox: WorkerInbox[str] = WorkerInbox(loop, log.item, log.done, slice_s=0.0)
    inbox.put("w0", ["a", "b", "c"])
    loop.call_soon(log.entries.append, "other callback")
    inbox.put("w1", ["x"])
    assert log.entries == [("w0", "a")]  # the rest waits for the next turn
    await turns()
    assert log.entries == [
        ("w0", "a"),
        ("w0", "b"),
        "other callback",
        ("w0", "c"),
        ("w0", "done", 3),
        ("w1", "x"),
        ("w1", "done", 1),
    ]
    assert len(inbox) == 0


@on_loop
async def test_a_slice_handles_many_items_within_its_time() -> None:
    log = Log()
    inbox: WorkerInbox[str] = WorkerInbox(asyncio.get_running_loop(), log.item, log.done, slice_s=60.0)
    inbox.put("w0", list(range(1000)))
    assert len(log.entries) == 1001  # all of it in one turn


@on_loop
async def test_flush_handles_everything_now_as_a_dying_worker_needs() -> None:
    loop = asyncio.get_running_loop()
    log = Log()
    inbox: WorkerInbox[str] = WorkerInbox(loop, log.item, log.done, slice_s=0.0)
    inbox.put("w0", ["a", "b"])
    inbox.put("w1", ["x"])
    inbox.flush()
    assert log.entries == [("w0", "a"), ("w0", "b"), ("w0", "done", 2), ("w1", "x"), ("w1", "done", 1)]
    await turns()
    assert len(log.entries) == 5  # the slice that was due does nothing twice


@on_loop
async def test_what_a_handler_puts_waits_its_turn_instead_of_nesting() -> None:
    log = Log()
    inbox: WorkerInbox[str]

    def item(source: str, value: Any) -> None:
        log.entries.append((source, value))
        if value == "a":
            inbox.put("w1", ["nested"])
            inbox.flush()  # no effect from inside a handler: the slice under way goes on

    inbox = WorkerInbox(asyncio.get_running_loop(), item, log.done, slice_s=60.0)
    inbox.put("w0", ["a", "b"])
    assert log.entries == [("w0", "a"), ("w0", "b"), ("w0", "done", 2), ("w1", "nested"), ("w1", "done", 1)]


@on_loop
async def test_a_failing_item_is_not_retried_and_the_rest_still_come() -> None:
    """The error reaches the loop (as an exception in a reader callback does); the message
    still ends, so the worker is still acknowledged."""
    log = Log()
    inbox: WorkerInbox[str] = WorkerInbox(asyncio.get_running_loop(), log.item, log.done)
    with pytest.raises(RuntimeError, match="a handler failed"):
        inbox.put("w0", ["a", "boom", "b"])
    assert log.entries == [("w0", "a")]
    await turns()
    assert log.entries == [("w0", "a"), ("w0", "b"), ("w0", "done", 3)]
    assert len(inbox) == 0


@on_loop
async def test_close_drops_what_waits() -> None:
    log = Log()
    inbox: WorkerInbox[str] = WorkerInbox(asyncio.get_running_loop(), log.item, log.done, slice_s=0.0)
    inbox.put("w0", ["a", "b"])
    inbox.close()
    await turns()
    assert log.entries == [("w0", "a")] and len(inbox) == 0
