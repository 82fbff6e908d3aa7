"""What one kind of KV transfer moved since a step's timings last took it: bytes, and seconds.

Thread-safe: the pulls that run beside the steps (`pulls_beside_steps`) count on their own
thread, and a step takes the tally on its.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from npuserve.proto.step_plan import KvTransfer


class TransferTally:
    def __init__(self, kind: str) -> None:
        self.kind = kind  # one of `KV_TRANSFER_KINDS`
        self.num_bytes = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Counts the time of the transfer inside, whether it ends or fails."""
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self.seconds += elapsed

    def add(self, num_bytes: int) -> None:
        """Counts ``num_bytes`` moved."""
        with self._lock:
            self.num_bytes += num_bytes

    def take(self) -> KvTransfer:
        """What was moved since the last call (a step's, for its timings), and start again."""
        with self._lock:
            taken = KvTransfer(self.kind, self.num_bytes, self.seconds)
            self.num_bytes, self.seconds = 0, 0.0
        return taken
