"""The loop-served pipe end: `Connection`-compatible frames both ways, a turn's items as one
message, the other end's exit seen once, and sends that wait for room in a full pipe."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from typing import Any

from npuserve.scheduler.lanes.pipe_link import FrameReader, PipeLink, frame_header
from npuserve.scheduler.lanes.worker_messages import ExitWorker, FrontToWorker, WorkerToFront


def test_frames_are_cut_as_connection_writes_them_whatever_the_chunks() -> None:
    payloads = [b"", b"x" * 3, b"y" * 70000]
    stream = b"".join(frame_header(len(p)) + p for p in payloads)
    for chunk in (1, 5, 4096, len(stream)):
        reader = FrameReader()
        got = []
        for start in range(0, len(stream), chunk):
            got += reader.feed(stream[start : start + chunk])
        assert got == payloads and not reader.buffer
    assert frame_header(1 << 31)[:4] == b"\xff\xff\xff\xff"  # the large-frame marker


def test_a_pipe_link_talks_to_a_plain_connection_both_ways() -> None:
    """Against a thread that echoes with `Connection.recv`/`send`, as a scheduler worker does:
    one message per loop turn, big messages that fill the pipe arrive whole, and the other
    end's close is reported once."""
    ours, theirs = multiprocessing.Pipe()

    def echo() -> None:
        while True:
            try:
                batch = theirs.recv()
            except EOFError:
                return
            if batch == ["bye"]:
                theirs.close()
                return
            theirs.send(batch)

    thread = threading.Thread(target=echo)
    thread.start()

    async def scenario() -> tuple[list[list[Any]], int]:
        loop = asyncio.get_running_loop()
        received: list[list[Any]] = []
        closed: list[bool] = []
        got = asyncio.Event()
        gone = asyncio.Event()

        def on_batch(batch: list[Any]) -> None:
            received.append(batch)
            got.set()

        def on_closed() -> None:
            closed.append(True)
            gone.set()

        link = PipeLink(ours, on_batch, on_closed, loop)
        link.start()
        link.send(1)
        link.send_many([2, 3])
        await got.wait()
        got.clear()
        big = ["z" * 1_000_000, list(range(100_000))]  # larger than the pipe holds at once
        link.send_many(big)
        await got.wait()
        got.clear()
        await asyncio.to_thread(link.send, 4)  # from another thread
        await got.wait()
        link.send("bye")
        await asyncio.wait_for(gone.wait(), 30)
        link.send(5)  # after the other end left: dropped, no error
        await asyncio.sleep(0.05)
        return received, len(closed)

    received, closes = asyncio.run(scenario())
    thread.join(10)
    assert received == [[1, 2, 3], ["z" * 1_000_000, list(range(100_000))], [4]]
    assert closes == 1


def test_close_sends_what_is_queued_first() -> None:
    ours, theirs = multiprocessing.Pipe()

    received: list[Any] = []
    reader = threading.Thread(target=lambda: received.append(theirs.recv()))
    reader.start()

    async def scenario() -> None:
        link = PipeLink(ours, lambda batch: None, lambda: None, asyncio.get_running_loop())
        link.start()
        link.send_many(list(range(300_000)))  # more than the pipe holds: close waits for room
        await asyncio.to_thread(link.close)  # from a thread, while the loop runs
        link.send("late")  # not sent: the link no longer sends
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    reader.join(10)
    assert received == [list(range(300_000))]
    assert not theirs.poll(0.1)


def test_a_link_whose_loop_is_over_still_sends_at_close() -> None:
    """An engine stopped after its loop ended (a shutdown path) still tells its workers to exit."""
    ours, theirs = multiprocessing.Pipe()
    loop = asyncio.new_event_loop()
    link: PipeLink[FrontToWorker, WorkerToFront] = PipeLink(ours, lambda batch: None, lambda: None, loop)
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    link.send(ExitWorker())
    link.close()
    assert theirs.recv() == [ExitWorker()]
