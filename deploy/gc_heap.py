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
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collects what start-up left behind, then keeps the rest out of every later collection.
    Call it once the process is ready to serve; objects made after it are collected as usual."""
    gc.collect()
    gc.freeze()
