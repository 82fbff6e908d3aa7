"""The start-up heap, frozen once a process is ready, is out of every later collection; what is
made after it is collected once the young generation fills, not at every burst of short-lived
objects. A release gives the memory freed since back to the system, once a process has stayed
idle after its work (a scheduler's processes: tests/scheduler/test_idle_heap_release.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest

from npuserve.deploy.runtime import gc_heap
from npuserve.deploy.runtime.gc_heap import IdleHeapRelease


def test_settling_keeps_the_startup_heap_out_of_collections_and_collects_later_garbage() -> None:
    # NOTE: in a process of its own: a frozen heap stays frozen for the rest of the process.
    script = textwrap.dedent(
        """
        import gc, weakref
        from npuserve.deploy.runtime.gc_heap import YOUNG_GENERATION_THRESHOLD, settle_heap_for_serving

        class Node:
            pass

        kept = [Node() for _ in range(1000)]
        garbage = Node(); garbage.me = garbage; watch = weakref.ref(garbage); del garbage
        settle_heap_for_serving()
        assert watch() is None, "what start-up left behind is collected first"
        tracked = {id(o) for o in gc.get_objects()}
        assert gc.get_freeze_count() >= 1000 and not any(id(k) in tracked for k in kept)

        later = Node(); later.me = later; watch = weakref.ref(later); del later
        short_lived = [[Node() for _ in range(500)] for _ in range(10)]  # a burst above Python's 700
        del short_lived
        assert watch() is not None, "a burst of objects freed by reference counting starts no collection"
        more = [Node() for _ in range(YOUNG_GENERATION_THRESHOLD)]
        assert watch() is None, "a cycle made after the freeze is collected once the young generation fills"
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_releasing_the_heap_gives_freed_memory_back_to_the_system() -> None:
    # NOTE: in a process of its own, to read its RSS alone. Blocks of 4 KiB come from glibc's heap
    # (not Python's small-object arenas); one kept in every 64 pins the heap, so freeing the rest
    # leaves its pages with the process until they are trimmed.
    script = textwrap.dedent(
        """
        from npuserve.deploy.runtime import gc_heap

        def rss_mib():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * 4096 / 2**20

        if gc_heap._MALLOC_TRIM is None:
            print("no glibc")
            raise SystemExit
        before = rss_mib()
        blocks = [bytes(4096) for _ in range(64 * 256)]  # 64 MiB
        kept = blocks[::64]
        del blocks
        held = rss_mib()
        gc_heap.release_heap()
        released = rss_mib()
        assert held - before > 48, (before, held)
        assert released - before < (held - before) / 4, (before, held, released)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "no glibc":
        pytest.skip("the C library is not glibc: a release is the collection alone")
    assert done.stdout.strip() == "ok"


def test_a_release_comes_once_the_process_has_stayed_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[int] = []
    monkeypatch.setattr(gc_heap, "release_heap", lambda: released.append(1))

    async def run() -> None:
        requests = 0
        heap = IdleHeapRelease(lambda: requests == 0, delay_s=0.05)
        # NOTE: each wait is 4 delays long, and the loop runs timers in order: a release due by
        # then has come.
        heap.work_ended()
        heap.work_ended()  # work that ended again meanwhile: still one release
        await asyncio.sleep(0.2)
        assert released == [1]

        requests = 1
        heap.work_ended()  # work is left: nothing to release
        await asyncio.sleep(0.2)
        assert released == [1]

        requests = 0
        heap.work_ended()
        requests = 1  # came before the release: it waits for that work's own end
        await asyncio.sleep(0.2)
        assert released == [1]
        requests = 0

        with heap.working():  # a request checked, then refused: work, though it never queued
            heap.work_ended()  # another request's end meanwhile
            await asyncio.sleep(0.2)
            assert released == [1]
        await asyncio.sleep(0.2)
        assert released == [1, 1]

        heap.work_ended()
        heap.cancel()  # the process stops
        await asyncio.sleep(0.2)
        assert released == [1, 1]

    asyncio.run(run())
