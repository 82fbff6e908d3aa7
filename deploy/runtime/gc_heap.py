"""The heap of a long-running server process: what it built while starting is frozen out of the
collections that follow, and what its work freed goes back to the system once it is idle.

A full collection walks every object the collector tracks, and nothing else runs in the process
meanwhile. Most of those objects are the start-up heap (modules, torch's and the model's, the
tokenizer, protobuf and gRPC descriptors), which lives as long as the process:
* an executor of the demo model tracks 194k objects once warmed up; a full collection took
  93-98 ms, a step's stall each time one came (after the freeze: nothing to walk);
* in the scale bench at 16 executors x 1,024 streams the scheduler's front made a full
  collection every few seconds, each holding its event loop 85 ms on average (up to 105 ms),
  so every stream's next token and every new request waited that long; after the freeze,
  45 ms (what the requests in flight hold).
`gc.freeze()` moves the start-up heap to a generation the collector never walks (as vLLM's engine
core does once it has started).

The youngest generation is then collected after `YOUNG_GENERATION_THRESHOLD` net allocations
instead of Python's 700. A step's or a report's handling makes a burst of short-lived containers
(token lists, updates, protobuf wrappers) that reference counting frees as soon as the burst is
done; 700 of them alive at once started a collection that walked every one, token lists element
by element, and every tenth of those walked what had survived before. In the scale bench at
16 executors x 1,024 streams the front made about 30 young collections a second and a worker 20:
660-680 ms of the front's CPU and 450-520 ms of a worker's in a 20 s run (about 5% and 6% of
what each spent) went to collections; with the higher threshold, one collection or none in the
same run. What that saves is smaller than the bench's run-to-run spread on a 2-core machine:
over four interleaved pairs the scheduler's CPU per output token at 16 x 1,024 changed by +1%
to -24%. Only what is garbage and in a reference cycle at once waits longer: up to that many
objects.

Once a process has served a large request, what it allocated for it is free but stays the
process's: glibc's allocator keeps freed memory for later allocations, and returns to the system
only what lies at the top of its heap. So a process that has gone idle, and stays so for
`IDLE_RELEASE_DELAY_S`, releases its heap (`IdleHeapRelease`): a full collection, then glibc's
`malloc_trim`, which hands every free page of its arenas back to the system. That happens once
each time the process's work ends, never while it has any. It holds the event loop 1-2 ms in a
scheduler's front and 15-60 ms in a scheduler worker (whose collection walks its block pool of
100k-200k blocks): only a request that comes at that moment waits for it.
* One completion of 1,024 prompts of 471 tokens on the demo model (the largest it takes) grew
  the scheduler worker from 101 to 120 MB, the front from 92 to 112 and the gateway from 76 to
  92, for as long as they ran; with the release, the worker went back to 113 MB and the gateway
  to 88, the front to 110.
* 128 prompts of 4,000 tokens whose ids are all below 257 (ints Python shares, so the prompts
  sit in glibc's heap), over a simulated executor: the front 91 -> 114 -> 95 MB, the worker
  81 -> 92 -> 84.
What no release gives back is memory Python's own small-object allocator holds: an arena of it
(1 MiB) goes back only once every object in it is freed, and a few objects that live on keep
theirs. A prompt's token ids above 256 are objects of their own, hundreds of thousands in a
large request: most of what stays in the front above. The next request reuses those arenas.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import sys
from collections.abc import Callable, Iterator

YOUNG_GENERATION_THRESHOLD = 50_000  # net allocations of tracked objects between young collections
IDLE_RELEASE_DELAY_S = 2.0  # a process idle this long after its work ended releases its heap


def settle_heap_for_serving() -> None:
    """Collects what start-up left behind, keeps the rest out of every later collection, and
    lets bursts of short-lived objects pass without a collection. Call it once the process is
    ready to serve; objects made after it are collected as usual, in fewer, larger batches."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``; None under another C library (or none reachable)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, its C library's among them
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc's alone (musl's malloc_trim does nothing)
        return None
    trim = libc.malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_MALLOC_TRIM = _glibc_malloc_trim()


def release_heap() -> None:
    """Frees the garbage only the collector frees (reference cycles), then hands the allocator's
    free memory back to the system (glibc only; elsewhere the collection alone)."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)  # 0: keep no padding at the top of the heap


class IdleHeapRelease:
    """Releases the process's heap (`release_heap`) once it has stayed idle ``delay_s`` after its
    work ended. ``is_idle`` says whether the process holds work that outlives a call (requests in
    flight, say); work done within one call (a request checked and tokenized, then refused or
    handed on) runs under `working`. Whoever ends work calls `work_ended`. On the process's event
    loop."""

    def __init__(self, is_idle: Callable[[], bool], delay_s: float = IDLE_RELEASE_DELAY_S) -> None:
        self.is_idle = is_idle
        self.delay_s = delay_s
        self._working = 0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> bool:
        return not self._working and self.is_idle()

    def work_ended(self) -> None:
        """Work just ended: if none is left, the heap goes ``delay_s`` from now unless work came
        meanwhile (a later end moves that on)."""
        if not self.idle:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self.delay_s, self._release_if_idle)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Work the process does within this block (it may await)."""
        self._working += 1
        try:
            yield
        finally:
            self._working -= 1
            self.work_ended()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _release_if_idle(self) -> None:
        self._timer = None
        if self.idle:  # NOTE: else the work that came ends with a `work_ended` of its own
            release_heap()
