"""Graceful shutdown, the same in every npuserve process: the first SIGTERM (or SIGINT) drains,
a second one stops at once.

Draining means: stop admitting (new requests get HTTP 503 with Retry-After or gRPC UNAVAILABLE,
and readiness fails), let the requests in flight finish for up to ``--shutdown-timeout`` seconds
(`add_shutdown_timeout_flag`, declared here once and forwarded by `npuserve serve`), then exit.
`Shutdown` records the signals; `drain_until` waits for a process's own idea of "idle".
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.05
# NOTE: the kernel may hand a process's signal to any of its threads (a tensor-parallel
# executor's monitor thread signals its own process, for one): Python's handler then runs only at
# the main thread's next bytecode, which a main thread blocked in a lock never reaches.
SIGNAL_WAKE_S = 0.5


def add_shutdown_timeout_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="seconds SIGTERM lets requests in flight finish, refusing new ones (a second signal stops at once)",
    )


class Shutdown:
    """SIGTERM/SIGINT as two events: ``drain`` at the first signal, ``now`` at the second."""

    def __init__(self) -> None:
        self.drain = threading.Event()
        self.now = threading.Event()
        self.signals = 0
        self._callbacks: list[Callable[[], None]] = []

    def on_signal(self, *_: Any) -> None:
        self.signals += 1
        (self.drain if self.signals == 1 else self.now).set()
        for callback in list(self._callbacks):
            callback()

    def on_each_signal(self, callback: Callable[[], None]) -> None:
        """Also runs ``callback`` at every signal (in the signal handler's thread or loop)."""
        self._callbacks.append(callback)

    def wait_for_drain(self) -> None:
        """Blocks the main thread until the first signal, waking every `SIGNAL_WAKE_S` so that
        a signal another thread received is handled."""
        while not self.drain.wait(SIGNAL_WAKE_S):
            pass

    def install(self) -> Callable[[], None]:
        """Handles the signals with `signal.signal` (main thread); returns what restores them."""
        previous = {sig: signal.signal(sig, self.on_signal) for sig in SIGNALS}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

    def install_on_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Handles the signals on an asyncio loop (its callbacks then run on the loop)."""
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.on_signal)

    def drain_until(self, idle: Callable[[], bool], timeout_s: float) -> bool:
        """Blocks until ``idle()`` (True), or ``timeout_s`` passes or a second signal comes (False)."""
        deadline = time.monotonic() + timeout_s
        while not idle():
            if self.now.is_set() or time.monotonic() >= deadline:
                return False
            self.now.wait(POLL_S)
        return True

    async def drain_until_async(self, idle: Callable[[], bool], timeout_s: float) -> bool:
        """`drain_until` on an event loop."""
        deadline = time.monotonic() + timeout_s
        while not idle():
            if self.now.is_set() or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True

    async def wait_drain_async(self) -> None:
        """Returns at the first signal (handled on this loop: `install_on_loop`)."""
        if self.drain.is_set():
            return
        signalled = asyncio.Event()
        self.on_each_signal(signalled.set)
        await signalled.wait()
