"""The heap of a long-running server process: what it built while starting is frozen out of the
collections that follow, and what its work freed goes back to the system once it is idle.

A full collection walks every tracked object, and nothing else runs in the process meanwhile;
most of them are the start-up heap (modules, torch and the model, the tokenizer, protobuf and gRPC
descriptors). An executor of the demo model tracks 194k objects: a full collection stalled a step
93-98 ms. In the scale bench at 16 executors x 1,024 streams the scheduler's front held its event
loop 85 ms (up to 105) per full collection, every few seconds; after `gc.freeze()` (as vLLM's
engine core does once started), 45 ms: what the requests in flight hold.

The youngest generation is then collected after `YOUNG_GENERATION_THRESHOLD` net allocations
instead of Python's 700: a step's or a report's burst of short-lived containers (token lists,
updates, protobuf wrappers), which reference counting frees anyway, started a collection that
walked them all. At 16 x 1,024 the front made ~30 young collections a second and a worker 20,
about 5% and 6% of their CPU; with the higher threshold, one or none in a 20 s run (a saving
within the bench's run-to-run spread on 2 cores). Only cyclic garbage waits longer.

glibc keeps what a large request freed for later allocations, returning only the top of its heap.
So a process idle for `IDLE_RELEASE_DELAY_S` after its work ended releases its heap
(`IdleHeapRelease`): a full collection, then `malloc_trim`, which hands every free page of its
arenas back. It holds the event loop 1-2 ms in a scheduler's front and 15-60 ms in a scheduler
worker (whose block pool it walks): only a request arriving at that moment waits. One completion
of 1,024 prompts of 471 tokens on the demo model grew the worker 101 -> 120 MB and the gateway
76 -> 92; the release took them back to 113 and 88. 128 prompts of 4,000 tokens below id 257
(shared ints: the prompts sit in glibc's heap) took the front 91 -> 114 -> 95 MB. No release
returns Python's small-object arenas (1 MiB, freed only once all their objects are): a large
request's token ids above 256 are objects of their own, and the next request reuses them.
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
