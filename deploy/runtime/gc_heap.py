"""The garbage collector in a long-running server process: what it built while starting is
frozen out of the collections that follow.

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
"""

from __future__ import annotations

import gc

YOUNG_GENERATION_THRESHOLD = 50_000  # net allocations of tracked objects between young collections


def settle_heap_for_serving() -> None:
    """Collects what start-up left behind, keeps the rest out of every later collection, and
    lets bursts of short-lived objects pass without a collection. Call it once the process is
    ready to serve; objects made after it are collected as usual, in fewer, larger batches."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)
