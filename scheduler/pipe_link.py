"""One end of a pipe between two of the scheduler's processes, with a thread each way.

Messages are lists (batches) of picklable items. `send` queues an item; the sender thread
(`step_worker.send_batches`) sends everything queued since its last send as one message, so a
busy side pays one pickle and one write per wake-up, not per item. The reader thread hands each
received batch to ``on_batch`` and, once the other end is gone, calls ``on_closed`` once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from npuserve.scheduler.step_worker import send_batches


class PipeLink:
    def __init__(
        self,
        conn: Connection,
        name: str,
        on_batch: Callable[[list[Any]], object],
        on_closed: Callable[[], object],
    ) -> None:
        self.conn = conn
        self.name = name
        self._on_batch = on_batch
        self._on_closed = on_closed
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._sender = threading.Thread(
            target=send_batches, args=(conn, self._outbox, lambda: None), name=f"{name}-send", daemon=True
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-read", daemon=True)

    def start(self) -> None:
        self._sender.start()
        self._reader.start()

    def send(self, item: Any) -> None:
        self._outbox.put(item)

    def send_many(self, items: list[Any]) -> None:
        for item in items:
            self._outbox.put(item)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued, then stops sending."""
        self._outbox.put(None)
        self._sender.join(timeout_s)

    def _read(self) -> None:
        while True:
            try:
                batch = self.conn.recv()
            except (EOFError, OSError):
                break
            self._on_batch(batch)
        self._on_closed()


def join_or_kill(process: BaseProcess | None, timeout_s: float) -> None:
    """Waits up to ``timeout_s`` for a child process told to exit, then kills it."""
    if process is not None:
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
