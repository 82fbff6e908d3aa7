"""What one kind of KV transfer moved since a step's timings last took it: bytes, and seconds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from npuserve.proto.step_plan import KvTransfer


class TransferTally:
    def __init__(self, kind: str) -> None:
        self.kind = kind  # one of `KV_TRANSFER_KINDS`
        self.num_bytes = 0
        self.seconds = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Counts the time of the transfer inside, whether it ends or fails."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started

    def take(self) -> KvTransfer:
        """What was moved since the last call (a step's, for its timings), and start again."""
        taken = KvTransfer(self.kind, self.num_bytes, self.seconds)
        self.num_bytes, self.seconds = 0, 0.0
        return taken
