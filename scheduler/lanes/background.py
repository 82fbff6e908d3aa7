"""Tasks started and not awaited by anyone (a restart, a worker's start, a lane's close).

The event loop keeps only a weak reference to a task: one nobody holds may be collected before it
ends. `BackgroundTasks` holds each until it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Runs ``work`` on the running loop."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
