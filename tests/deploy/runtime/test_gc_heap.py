"""The start-up heap, frozen once a process is ready, is out of every later collection; what is
made after it is collected once the young generation fills, not at every burst of short-lived
objects."""

from __future__ import annotations

import subprocess
import sys
import textwrap


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
