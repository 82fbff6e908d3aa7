"""One end of a pipe between two of the scheduler's processes, served by an asyncio event loop.

Messages are lists (batches) of picklable items, framed as `multiprocessing.Connection` frames
them, so the other end may be a plain `Connection`. A link is typed by the items it sends and
those it receives (`PipeLink[Out, In]`: the two families of messages of its ends, such as
`worker_messages`'s). `send` queues an item; everything queued in one turn of the loop leaves as
one message at the end of that turn. Reading is the loop's too: a received batch goes to
``on_batch`` on the loop thread, and ``on_closed`` runs once when the other end is gone.

No threads: a message costs the loop one pickle and one write, not a wake-up of a sender thread
and, on the way in, a reader thread's hand-over (`call_soon_threadsafe`) under the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import select
import struct
import time
from asyncio.events import _get_running_loop
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Generic, TypeVar

READ_CHUNK = 1 << 20
SMALL_FRAME = struct.Struct("!i")  # `Connection`'s header: the payload's length
LARGE_FRAME = struct.Struct("!Q")  # after a -1 header, for payloads of 2 GiB and more

Out = TypeVar("Out")  # what a link sends
In = TypeVar("In")  # what it receives


def frame_header(size: int) -> bytes:
    """What `Connection.send_bytes` writes before a payload of ``size`` bytes."""
    if size > 0x7FFFFFFF:
        return SMALL_FRAME.pack(-1) + LARGE_FRAME.pack(size)
    return SMALL_FRAME.pack(size)


class FrameReader:
    """Cuts a byte stream into `Connection` frames' payloads."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        buffer = self.buffer
        buffer += data
        payloads, start = [], 0
        while len(buffer) - start >= 4:
            (size,) = SMALL_FRAME.unpack_from(buffer, start)
            header = 4
            if size == -1:
                if len(buffer) - start < 12:
                    break
                (size,) = LARGE_FRAME.unpack_from(buffer, start + 4)
                header = 12
            end = start + header + size
            if len(buffer) < end:
                break
            payloads.append(bytes(buffer[start + header : end]))
            start = end
        del buffer[:start]
        return payloads


class PipeLink(Generic[Out, In]):
    def __init__(
        self,
        conn: Connection,
        on_batch: Callable[[list[In]], object],
        on_closed: Callable[[], object],
        loop: asyncio.AbstractEventLoop,
        on_sent: Callable[[list[Out]], object] | None = None,
    ) -> None:
        """``on_sent``: told each batch as it leaves (a scheduler worker counts its reports)."""
        self.conn = conn
        self.loop = loop
        self._on_batch = on_batch
        self._on_closed = on_closed
        self._on_sent = on_sent
        self._fd = conn.fileno()
        self._pending: list[Out] = []
        self._out = bytearray()
        self._writing = False  # a writer callback waits for room in the pipe
        self._reading = False
        self._sending = True  # until `close`, or a write fails
        self._gone = False
        self._reader = FrameReader()
        # NOTE: read into one buffer kept for the link's life: `os.read` of READ_CHUNK bytes
        # allocates that much for every read (past malloc's mmap threshold: an mmap, a mremap to
        # the size read, and a munmap once handled, each a system call).
        self._read_view = memoryview(bytearray(READ_CHUNK))

    def _on_loop(self) -> bool:
        return _get_running_loop() is self.loop

    def start(self) -> None:
        """Starts reading; from any thread."""
        if not self._on_loop():
            self.loop.call_soon_threadsafe(self.start)
            return
        os.set_blocking(self._fd, False)
        self.loop.add_reader(self._fd, self._readable)
        self._reading = True

    def send(self, item: Out) -> None:
        """Queues ``item`` for the end of this loop turn's message; from any thread."""
        if not self._on_loop():
            if self.loop.is_running():
                self.loop.call_soon_threadsafe(self.send, item)
            else:
                self._pending.append(item)  # the loop is over: `close` sends it
            return
        self._flush_at_turn_end()
        self._pending.append(item)

    def send_many(self, items: list[Out]) -> None:
        """Queues ``items`` (on the loop thread)."""
        if items:
            self._flush_at_turn_end()
            self._pending += items

    def _flush_at_turn_end(self) -> None:
        if not self._pending:  # the first item of this turn
            self.loop.call_soon(self._flush)

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued (waiting up to ``timeout_s`` for room in the pipe), then stops
        sending; reading goes on until the other end closes. From any thread."""
        if self._on_loop() or not self.loop.is_running():
            self._close_now(timeout_s)
            return
        done: Future[None] = Future()

        def close_on_loop() -> None:
            try:
                self._close_now(timeout_s)
            finally:
                done.set_result(None)

        self.loop.call_soon_threadsafe(close_on_loop)
        with contextlib.suppress(TimeoutError):
            done.result(timeout_s + 1.0)

    # -- the loop's side ---------------------------------------------------------------------------

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if not batch or not self._sending:
            return
        if self._on_sent is not None:
            self._on_sent(batch)
        payload = pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)
        self._out += frame_header(len(payload))
        self._out += payload
        if not self._writing:
            self._write()

    def _write(self) -> None:
        try:
            written = os.write(self._fd, self._out)
        except BlockingIOError:
            written = 0
        except OSError:
            self._stop_sending()
            return
        del self._out[:written]
        if self._out and not self._writing:
            self._writing = True
            self.loop.add_writer(self._fd, self._write)
        elif not self._out and self._writing:
            self._writing = False
            self.loop.remove_writer(self._fd)

    def _stop_sending(self) -> None:
        self._sending = False
        self._out.clear()
        if self._writing:
            self._writing = False
            self.loop.remove_writer(self._fd)

    def _close_now(self, timeout_s: float) -> None:
        if not self._sending:
            return
        self._flush()
        deadline = time.monotonic() + timeout_s
        while self._out and self._sending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                select.select([], [self._fd], [], left)
                del self._out[: os.write(self._fd, self._out)]
            except BlockingIOError:
                continue
            except (OSError, ValueError):
                break
        self._stop_sending()

    def _readable(self) -> None:
        view = self._read_view
        try:
            size = os.readv(self._fd, [view])
        except BlockingIOError:
            return
        except OSError:
            size = 0
        if not size:
            self._closed()
            return
        for payload in self._reader.feed(view[:size]):
            self._on_batch(pickle.loads(payload))
            if self._gone:
                return

    def _closed(self) -> None:
        if self._gone:
            return
        self._gone = True
        if self._reading:
            self._reading = False
            self.loop.remove_reader(self._fd)
        self._stop_sending()
        self._on_closed()


def join_or_kill(process: BaseProcess | None, timeout_s: float) -> None:
    """Waits up to ``timeout_s`` for a child process told to exit, then kills it."""
    if process is not None:
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
