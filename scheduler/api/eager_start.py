"""A coroutine started at once, on the caller's turn of the event loop, as Python 3.12's eager
tasks start (`asyncio.eager_task_factory`): one that ends before it first waits costs no task.

`GenerateMany` opens each generation in a coroutine of its own. Opening a prompt of token ids
(most generations) never waits: it is checked, queued and listened to in one go. As a task it cost
a task's creation, a turn of the event loop and a switch into it, per request; started eagerly it
costs none of those, and only a generation that waits (a chat template's render, a grammar's
compilation) goes on in a task.
"""

from __future__ import annotations

import asyncio
import contextvars
import types
from collections.abc import Coroutine, Generator
from typing import Any

import structlog

log = structlog.get_logger(__name__)


def start_eagerly(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Runs ``coro`` now, in a copy of the caller's context (as a task would), up to its first
    wait; returns the task that goes on from there, or None if it ended before (what it raised
    is logged, as a task's would be; a cancellation ends it quietly)."""
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except (StopIteration, asyncio.CancelledError):
        return None
    except Exception:
        log.exception("a coroutine started eagerly failed")
        return None
    # NOTE: made in that context, the task runs in a copy of it (`create_task(context=)`: 3.11).
    return context.run(asyncio.create_task, _go_on(coro, yielded))


@types.coroutine
def _wait(yielded: object) -> Generator[object, object, object]:
    """Awaited, it hands the task what the coroutine yielded (the future it waits for, or None
    for a bare turn of the loop) and gives back what the task sends on."""
    return (yield yielded)


async def _go_on(coro: Coroutine[Any, Any, None], yielded: object) -> None:
    """Drives ``coro`` from its first wait on, as the task that runs this one would have driven it
    from its start: what the task sends (or throws: a cancellation) goes into ``coro``."""
    while True:
        try:
            sent = await _wait(yielded)
        except BaseException as exc:  # NOTE: the task is cancelled: so is the coroutine's wait
            try:
                yielded = coro.throw(exc)
            except StopIteration:
                return
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration:
                return
